"""The production kernel's build table: the only source of each build's figures.

One row per (precision, head dim): what was chosen (consumer warpgroups, K/V tile rows, ring
depth, Q buffers, where O is staged), each with its reason. The precision column: "bf16" (the
default kernel, stages.PRODUCTION) or "fp8" (the e4m3 build, attention(precision="fp8"):
the same kernel composed with -D PTXATTN_FP8, Q, K and V^T one byte an element, O still bf16). Everything else is derived here, once:
tile bytes, every shared-memory offset (Q, K, V, O, each mbarrier), TMA transaction bytes,
descriptor steps, shift amounts, named barrier IDs, register budgets and the dynamic
shared-memory size. Three readers take the figures from here:

  - the PTX, through ptx/sm90/production/layout.ptxh, which ptxattn/tools/ptxgen_layout.py writes
    from this table (literal numbers: the preprocessor does no arithmetic outside #if, and
    the golden fingerprints compare the operands' text);
  - the launcher, through stages.PRODUCTION_VARIANTS (block_n, ring depth, smem, threads);
  - the tests (tests/test_builds.py, test_production_builds.py, the schedule and sync replays).

A new head dim is one row of BUILDS (bf16) or FP8_BUILDS (and its per-score macros:
ptxattn/tools/ptxgen.py and ptxgen_fp8.py make them for every head dim and tile width the
table names).
"""

from __future__ import annotations

from dataclasses import dataclass

# Hopper facts the table is built on
REGISTERS_PER_SM = 65536
MAX_DYNAMIC_SMEM = 227 * 1024      # per CTA on sm_90
NAMED_BARRIERS = 16                # per CTA
WARPGROUP = 128                    # threads
WARP = 32                          # threads
KV_MULTICAST_CTAS = 2              # the K/V multicast build's cluster (kv_multicast.ptxh)
MAX_REGS_PER_THREAD = 256          # setmaxnreg's ceiling; budgets are multiples of 8
Q_BOX_ROWS = 64                    # a consumer warpgroup's query rows (the wgmma M)
SWIZZLE_ROW_BYTES = 128            # a 128-byte swizzled row: 64 bf16 of D
SWIZZLE_COLS = SWIZZLE_ROW_BYTES // 2
SMALL_SWIZZLE_ROW_BYTES = 64      # a 64-byte swizzled row (FP8 tiles of 64 bytes a row)
SMALLEST_SWIZZLE_ROW_BYTES = 32   # a 32-byte swizzled row (V^T of the 224-key FP8 variant)
DESC_UNIT = 16                     # wgmma descriptors address 16-byte units
MBAR_BYTES = 8                     # one mbarrier
BARRIER_ALIGN = 128                # the mbarriers' room is rounded up to this
SMEM_ALIGN = 1024                  # the kernel rounds the dynamic base up to a swizzle atom
BF16 = 2                           # bytes per element
PRECISIONS = {"bf16": 2, "fp8": 1}  # the precision column: bytes per Q, K, V element (O is bf16)
FP8_K_STEP = 32                    # keys (bytes) of one e4m3 wgmma k-step: FP8 BLOCK_N's unit
FP8_RING_DEFAULT = 2               # the FP8 rows' ring depth (a variant's FP8_KV_STAGES differs)
FP8_SCALE_BLOCK = 128              # rows a Q descale covers, keys a K descale covers (and V^T's
                                   # padding of Lk: fp8_reference.Q_BLOCK, V_BLOCK)
F32_BYTES = 4                      # a descale
PRODUCER_REGS = 24                 # the producer warpgroup keeps this many (one thread issues TMA)
# Registers a consumer thread needs besides its S, P and O tiles (addresses, loop state, the
# softmax's scalars): a row whose tiles leave less than this would spill
REGS_BESIDES_TILES = 32

DEFAULT_HEAD_DIM = 128             # the build the PTX expands to when HEAD_DIM is not defined


@dataclass(frozen=True)
class Build:
    """One row of the table: the choices, with their reasons; every other figure is derived."""
    head_dim: int
    consumers: int                 # consumer warpgroups, Q_BOX_ROWS query rows each
    block_n: int                   # key/value rows per K/V tile
    kv_stages: int                 # K/V ring depth (a power of two)
    q_buffers: int                 # 2: the next tile's Q loads a whole tile ahead
    o_staged_in_q: bool            # O leaves through the consumer's own Q rows (no O region)
    why: str                       # the reasons behind the choices above
    precision: str = "bf16"        # "bf16", or "fp8": e4m3 Q, K, V (the PTXATTN_FP8 build)
    # exponentials of every 8 on the FMA pipe (a polynomial) instead of MUFU: where MUFU binds
    # (the FP8 rate halves the GEMMs' time, not the softmax's); -D SW_EXP2_PER_8 overrides
    sw_exp2_per_8: int = 0
    # "": a row attention() runs; else a measurement variant of the row of its precision and
    # head dim (FP8_VARIANTS: -D FP8_BLOCK_N=...; BF16_VARIANTS: -D BF16_BLOCK_N=...), selected
    # by its defines, never by default
    variant: str = ""
    # the table's register estimate is over the budget by a few: ptxas's report decides
    registers_by_ptxas: bool = False

    @property
    def fp8(self) -> bool:
        return self.precision == "fp8"

    @property
    def element_bytes(self) -> int:
        """Bytes of one Q, K or V element (O is always bf16)."""
        return PRECISIONS[self.precision]

    # ---- tiles ---------------------------------------------------------------------------
    @property
    def block_m(self) -> int:
        return Q_BOX_ROWS * self.consumers

    @property
    def threads(self) -> int:
        return WARPGROUP * (self.consumers + 1)          # a producer warpgroup + the consumers

    @property
    def q_box_bytes(self) -> int:
        """One consumer's 64 rows of Q: Q_TILE_BYTES."""
        return Q_BOX_ROWS * self.head_dim * self.element_bytes

    @property
    def o_box_bytes(self) -> int:
        """One consumer's 64 rows of O (bf16 in every build): O_TILE_BYTES."""
        return Q_BOX_ROWS * self.head_dim * BF16

    @property
    def q_buffer_bytes(self) -> int:
        """One Q buffer: every consumer's rows."""
        return self.consumers * self.q_box_bytes

    @property
    def kv_tile_bytes(self) -> int:
        """A K tile (BLOCK_N rows of D), or a V tile: V (bf16, BLOCK_N rows of D) or V^T (fp8,
        D rows of BLOCK_N keys); the same bytes."""
        return self.block_n * self.head_dim * self.element_bytes

    # ---- the operands' shared-memory layouts (the TMA boxes and the wgmma descriptors) ------
    @property
    def qk_row_bytes(self) -> int:
        """Bytes of one swizzled row of a Q or K tile: 128 (tiles [D bytes / 128][rows][128]),
        or 64 where a row of D is only 64 bytes (FP8 at D = 64: 64-byte swizzle)."""
        row = self.head_dim * self.element_bytes
        return SMALL_SWIZZLE_ROW_BYTES if row == SMALL_SWIZZLE_ROW_BYTES else SWIZZLE_ROW_BYTES

    @property
    def vt_row_bytes(self) -> int:
        """FP8: bytes of one swizzled row of a V^T tile: BLOCK_N keys of one channel (128 or
        64), or, where BLOCK_N is not a swizzle width (the variants' 192, 224), the widest
        swizzle width that divides it (64, 32): the tile is then [BLOCK_N / row][D][row]."""
        for width in (SWIZZLE_ROW_BYTES, SMALL_SWIZZLE_ROW_BYTES, SMALLEST_SWIZZLE_ROW_BYTES):
            if self.block_n % width == 0:
                return width
        return self.block_n

    @property
    def vt_chunks(self) -> int:
        """FP8: V^T's row blocks a tile (one TMA box each): 1, or 3 at 192 keys, 7 at 224."""
        return self.block_n // self.vt_row_bytes

    @property
    def defines(self) -> dict[str, str]:
        """The preprocessor defines that select this row (a variant's; {} for a table row):
        FP8_BLOCK_N, FP8_KV_STAGES where the ring differs from its head dim's FP8 row, and
        FP8_CONSUMERS where the consumer warpgroups do; a bf16 variant's BF16_BLOCK_N."""
        if not self.variant:
            return {}
        if not self.fp8:
            return {"BF16_BLOCK_N": str(self.block_n)}
        out = {"FP8_BLOCK_N": str(self.block_n)}
        if self.kv_stages != FP8_RING_DEFAULT:
            out["FP8_KV_STAGES"] = str(self.kv_stages)
        if self.consumers != fp8_consumers_default(self.head_dim):
            out["FP8_CONSUMERS"] = str(self.consumers)
        return out

    @property
    def desc_qk_bits(self) -> str:
        """The layout bits (wgmma_desc.ptxh) of Q's and K's descriptors: K-major, swizzled by
        their rows."""
        return "DESC_KMAJOR_SW64" if self.qk_row_bytes == SMALL_SWIZZLE_ROW_BYTES \
            else "DESC_KMAJOR_SW128"

    @property
    def desc_v_bits(self) -> str:
        """... of V's: bf16 V is MN-major (read transposed; LBO: BLOCK_N rows * 128 B to the
        next 64 of D); FP8 wants both operands K-major, so V^T, D rows of BLOCK_N keys."""
        if not self.fp8:
            return f"DESC_MNMAJOR_SW128_{self.block_n}ROWS"
        return {SMALL_SWIZZLE_ROW_BYTES: "DESC_KMAJOR_SW64",
                SMALLEST_SWIZZLE_ROW_BYTES: "DESC_KMAJOR_SW32"}.get(self.vt_row_bytes,
                                                                    "DESC_KMAJOR_SW128")

    @property
    def kv_slot_desc(self) -> int:
        """A ring slot's step in descriptor units (16 bytes)."""
        return self.kv_tile_bytes // DESC_UNIT

    @property
    def o_blocks(self) -> int:
        """64-column blocks of D (the 128-byte swizzled TMA box's third dimension)."""
        return self.head_dim // SWIZZLE_COLS

    # ---- transaction bytes: what each mbarrier's expect_tx announces ----------------------
    @property
    def q_tx_bytes(self) -> int:
        return self.consumers * self.q_box_bytes         # one 64-row box a consumer

    @property
    def kv_tx_bytes(self) -> int:
        return self.kv_tile_bytes

    # ---- shifts (None where the figure is not a power of two: the PTX divides) -------------
    block_n_shift = property(lambda self: _log2(self.block_n))
    block_m_shift = property(lambda self: _log2(self.block_m))
    kv_stage_shift = property(lambda self: _log2(self.kv_stages))

    # ---- registers --------------------------------------------------------------------------
    @property
    def s_regs(self) -> int:
        return self.block_n // 2                         # 64 x BLOCK_N fp32 over 128 threads

    @property
    def p_regs(self) -> int:
        """P as PV's A fragments: bf16 pairs (BLOCK_N / 4) or e4m3 quadruples (BLOCK_N / 8)."""
        return self.block_n // 2 * self.element_bytes // 4

    @property
    def o_regs(self) -> int:
        return self.head_dim // 2                        # 64 x D fp32 over 128 threads

    @property
    def regs_besides_tiles(self) -> int:
        """REGS_BESIDES_TILES, and the FP8 build's descale scalars and addresses (~12)."""
        return REGS_BESIDES_TILES + (12 if self.fp8 else 0)

    @property
    def entry_regs(self) -> int:
        """Registers per thread at launch (before setmaxnreg), rounded down to 8."""
        return REGISTERS_PER_SM // self.threads // 8 * 8

    @property
    def consumer_regs(self) -> int:
        """setmaxnreg budget of a consumer: what the producer's PRODUCER_REGS leave of the SM's
        registers, shared by the consumers, rounded down to 8 (at most 256)."""
        left = REGISTERS_PER_SM - PRODUCER_REGS * WARPGROUP
        return min(MAX_REGS_PER_THREAD, left // (WARPGROUP * self.consumers) // 8 * 8)

    # ---- named barriers: 0 the CTA, then a turn per consumer, then an O barrier per consumer --
    bar_cta = 0

    def bar_turn(self, consumer: int) -> int:
        return 1 + consumer

    def bar_o(self, consumer: int) -> int:
        return 1 + self.consumers + consumer

    @property
    def cluster_kv_empty_arrivals(self) -> int:
        """The K/V multicast build's EMPTY count: one arrival a consumer warp, of every CTA of
        the cluster (kv_multicast.ptxh)."""
        return KV_MULTICAST_CTAS * self.consumers * WARPGROUP // WARP

    @property
    def named_barriers(self) -> int:
        return 1 + 2 * self.consumers

    # ---- shared memory ------------------------------------------------------------------------
    @property
    def smem(self) -> dict[str, int]:
        """Byte offsets from the 1024-aligned base: Q buffers | K ring | V ring | O staging
        (unless O is staged in Q) | mbarriers (Q FULL, FULL_K[ring], FULL_V[ring], EMPTY_K[ring],
        EMPTY_V[ring], Q EMPTY, then Q FULL and Q EMPTY of buffer 1)."""
        at = {"SMEM_Q": 0}
        at["SMEM_K"] = at["SMEM_Q"] + self.q_buffers * self.q_buffer_bytes
        at["SMEM_V"] = at["SMEM_K"] + self.kv_stages * self.kv_tile_bytes
        end = at["SMEM_V"] + self.kv_stages * self.kv_tile_bytes
        if self.o_staged_in_q:
            at["SMEM_O"] = at["SMEM_Q"]
        else:
            at["SMEM_O"], end = end, end + self.consumers * self.o_box_bytes
        ring = self.kv_stages * MBAR_BYTES
        at["SMEM_BAR_Q"] = end
        at["SMEM_BAR_FULL_K"] = end + MBAR_BYTES
        at["SMEM_BAR_FULL_V"] = at["SMEM_BAR_FULL_K"] + ring
        at["SMEM_BAR_EMPTY_K"] = at["SMEM_BAR_FULL_V"] + ring
        at["SMEM_BAR_EMPTY_V"] = at["SMEM_BAR_EMPTY_K"] + ring
        at["SMEM_BAR_Q_EMPTY"] = at["SMEM_BAR_EMPTY_V"] + ring
        if self.q_buffers == 2:
            at["SMEM_BAR_Q_1"] = at["SMEM_BAR_Q_EMPTY"] + MBAR_BYTES
            at["SMEM_BAR_Q_EMPTY_1"] = at["SMEM_BAR_Q_1"] + MBAR_BYTES
        return at

    @property
    def mbarriers(self) -> int:
        return 2 * self.q_buffers + 4 * self.kv_stages

    @property
    def barrier_bytes(self) -> int:
        """The mbarriers' room after the tiles."""
        return -(-self.mbarriers * MBAR_BYTES // BARRIER_ALIGN) * BARRIER_ALIGN

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory per CTA: the carve-up, the barriers' room, and the slack the
        kernel's rounding of the base up to 1024 bytes may take."""
        return self.smem["SMEM_BAR_Q"] + self.barrier_bytes + SMEM_ALIGN

    def o_block_offset(self, block: int) -> int:
        """Byte offset of O's 64-column block `block` in a consumer's staging box."""
        return block * Q_BOX_ROWS * SWIZZLE_ROW_BYTES

    # ---- the generated macros this row uses (ptxattn/tools/ptxgen.py, ptxgen_fp8.py) --------
    @property
    def score_header(self) -> str:
        return f"gen_n{self.block_n}.ptxh"

    @property
    def output_header(self) -> str:
        return f"gen_d{self.head_dim}.ptxh"

    @property
    def headers(self) -> tuple[str, ...]:
        """Every generated header of the row: the scores', O's, and the FP8 k-steps'."""
        return (self.score_header, self.output_header) + (("gen_fp8.ptxh",) if self.fp8 else ())

    @property
    def label(self) -> str:
        """How messages name the row: "head dim 128", "fp8 head dim 128"."""
        return (f"{'fp8 ' if self.fp8 else ''}head dim {self.head_dim}"
                + (f" variant {self.variant}" if self.variant else ""))

    def check(self) -> None:
        """ValueError naming the figure when a row cannot be built."""
        def need(ok, what):
            if not ok:
                raise ValueError(f"build table, {self.label}: {what}")
        need(0 <= self.sw_exp2_per_8 <= 8, "sw_exp2_per_8: 0 to 8 of every 8 exponentials")
        need(self.precision in PRECISIONS, f"precision {self.precision!r} (takes "
             f"{', '.join(PRECISIONS)})")
        need(self.head_dim % SWIZZLE_COLS == 0, f"D must be a multiple of {SWIZZLE_COLS}")
        need(self.block_n % 16 == 0 and self.block_n <= 256, "BLOCK_N: a multiple of 16, <= 256")
        need(self.block_n_shift is not None or self.variant,
             "BLOCK_N must be a power of two (tile counts shift; a variant's divide)")
        need(self.kv_stage_shift is not None or self.variant,
             "the ring depth must be a power of two (a variant's divides)")
        need(self.q_buffers in (1, 2), "one or two Q buffers")
        need(not (self.o_staged_in_q and self.q_buffers == 2),
             "O staged in Q needs the one Q buffer (the next tile's Q would land on O)")
        need(not (self.o_staged_in_q and self.o_box_bytes > self.q_box_bytes),
             "O staged in Q needs Q's rows to hold O's (bf16 O is twice e4m3 Q)")
        if self.fp8:
            need(self.block_n % FP8_K_STEP == 0 and self.vt_row_bytes in
                 (SMALLEST_SWIZZLE_ROW_BYTES, SMALL_SWIZZLE_ROW_BYTES, SWIZZLE_ROW_BYTES)
                 and (self.vt_chunks == 1 or self.variant),
                 "FP8 BLOCK_N: 64 or 128 keys (V^T's swizzled rows; k-steps of 32)")
            # a variant whose tiles straddle K's 128-key blocks takes one K descale a head
            # (fp8_forward.prepare refuses per-block K descales for it)
            need(FP8_SCALE_BLOCK % self.block_n == 0 or self.variant,
                 f"FP8 BLOCK_N must divide the {FP8_SCALE_BLOCK} keys of a K descale")
            need(self.head_dim * self.element_bytes % SMALL_SWIZZLE_ROW_BYTES == 0 and
                 (self.head_dim * self.element_bytes == SMALL_SWIZZLE_ROW_BYTES or
                  self.head_dim * self.element_bytes % SWIZZLE_ROW_BYTES == 0),
                 "FP8 D: 64 bytes or a multiple of 128 (Q's and K's swizzled rows)")
        need(self.named_barriers <= NAMED_BARRIERS, f"{self.named_barriers} named barriers")
        need(self.s_regs + self.p_regs + self.o_regs + self.regs_besides_tiles
             <= self.consumer_regs or self.registers_by_ptxas,
             f"S {self.s_regs} + P {self.p_regs} + O {self.o_regs} registers do not fit a "
             f"consumer's {self.consumer_regs}")
        need(self.smem_bytes <= MAX_DYNAMIC_SMEM,
             f"{self.smem_bytes} bytes of shared memory (at most {MAX_DYNAMIC_SMEM})")
        for name, offset in self.smem.items():
            if not name.startswith("SMEM_BAR"):
                need(offset % SMEM_ALIGN == 0, f"{name} must sit on a 1024-byte swizzle atom")


def fp8_consumers_default(head_dim: int) -> int:
    """The consumer warpgroups of the FP8 row of a head dim (a variant's FP8_CONSUMERS
    differs); 2 where there is no such row."""
    row = {b.head_dim: b for b in FP8_BUILDS}.get(head_dim)
    return row.consumers if row is not None else 2


def _log2(n: int) -> int | None:
    return n.bit_length() - 1 if n > 0 and n & (n - 1) == 0 else None


BUILDS: tuple[Build, ...] = (
    Build(head_dim=64, consumers=3, block_n=128, kv_stages=2, q_buffers=2, o_staged_in_q=False,
          why="every GEMM is half as long as at D = 128 for the same softmax; with two consumers "
              "each one's softmax is as long as the other's GEMMs and they cannot cover each "
              "other: three consumers (192-row tiles, as FlashAttention-3 takes here) run two "
              "softmaxes under one consumer's GEMMs. BLOCK_N 128 keeps the softmax's per-tile "
              "overheads amortized"),
    Build(head_dim=128, consumers=2, block_n=128, kv_stages=2, q_buffers=2, o_staged_in_q=False,
          why="stage 14's tile (128 x 128, a 2-slot ring: 4 slots were no faster) with Q "
              "double-buffered, so a tile's Q loads while the tile before computes"),
    Build(head_dim=256, consumers=2, block_n=64, kv_stages=2, q_buffers=1, o_staged_in_q=True,
          why="O alone is 128 registers a thread: BLOCK_N 128 would add S 64 + P 32 and overflow "
              "a consumer's 240, BLOCK_N 64 leaves S 32 + P 16. Q (64 KiB) and the ring "
              "(128 KiB) leave no room for an own O staging (64 KiB) within 227 KiB: O is "
              "staged in the consumer's own Q rows, so Q is released after the O store has read "
              "them, and there is one Q buffer"),
)


# The FP8 builds (precision "fp8"): e4m3 halves every operand tile, so each head dim keeps the
# bf16 row's consumers and K/V tile and gains what the bytes freed allow.
FP8_BUILDS: tuple[Build, ...] = (
    Build(head_dim=64, consumers=3, block_n=128, kv_stages=2, q_buffers=2, o_staged_in_q=False,
          precision="fp8",
          why="the bf16 row's three consumers and 128-key tiles (the softmax binds twice as "
              "hard at the FP8 tensor rate); 64-byte rows of Q and K take the 64-byte swizzle"),
    Build(head_dim=128, consumers=2, block_n=128, kv_stages=2, q_buffers=2, o_staged_in_q=False,
          precision="fp8", sw_exp2_per_8=1,
          why="the bf16 row's tile: 128 x 128 with Q double-buffered; the e4m3 tiles leave 96 "
              "KiB free (a 3- or 4-deep ring is the measurement to try); 1 of 8 exponentials "
              "on the FMA pipe: MUFU binds at the FP8 rate (measured 1.09x the all-MUFU build, "
              "2 of 8 1.03x)"),
    Build(head_dim=256, consumers=2, block_n=128, kv_stages=2, q_buffers=1, o_staged_in_q=False,
          precision="fp8", registers_by_ptxas=True,
          why="FlashAttention-3's FP8 tile at D = 256 (128 x 128): twice the keys of the bf16 "
              "row's tile over the same per-tile costs (measured 1.16x the 128 x 64 tile, "
              "bench/notes.md, session 11). S 64 + P 16 + O 128 registers leave ~32 of 240 "
              "(the table's estimate is over: ptxas's report decides, no spills). Q (64 KiB), "
              "the ring (128 KiB) and O's own staging (64 KiB) fit 227 KiB only with one Q "
              "buffer"),
)

# Measurement variants of FP8 rows (never chosen by attention(); fp8_forward.prepare takes one
# through its defines, bench/fp8_bench.py --variant names them): wider key tiles at D = 128, as
# FlashAttention-3's FP8 tile there (128 x 224), to spread the softmax's per-tile fixed costs
# (row max/sum shuffles, the O rescale, barriers and waits) over more keys; and the D = 256
# row's former 128 x 64 tile. The 192- and 224-key ones are dense only (no PTXATTN_MASKED
# build: the masked walk shifts by BLOCK_N_SHIFT), and their tiles straddle K's 128-key
# descale blocks, so they take one K descale a head.
FP8_VARIANTS: dict[str, Build] = {
    "n192": Build(head_dim=128, consumers=2, block_n=192, kv_stages=2, q_buffers=2,
                  o_staged_in_q=False, precision="fp8", sw_exp2_per_8=1, variant="n192",
                  why="128 x 192 tiles: 1.5x the keys over the same per-tile fixed costs; S 96 + "
                      "P 24 + O 64 registers; V^T in three 64-byte swizzled row blocks"),
    "n224": Build(head_dim=128, consumers=2, block_n=224, kv_stages=2, q_buffers=2,
                  o_staged_in_q=False, precision="fp8", sw_exp2_per_8=1, variant="n224",
                  registers_by_ptxas=True,
                  why="FlashAttention-3's FP8 tile at D = 128 (128 x 224): S 112 + P 28 + O 64 "
                      "registers leave ~36 of 240 (the table's estimate wants 44: ptxas decides); "
                      "V^T in seven 32-byte swizzled row blocks"),
    "n192s3": Build(head_dim=128, consumers=2, block_n=192, kv_stages=3, q_buffers=2,
                    o_staged_in_q=False, precision="fp8", sw_exp2_per_8=1, variant="n192s3",
                    why="n192 with a 3-deep K/V ring (208 KiB of shared memory; 224 keys would "
                        "need 232): a tile's K and V land further ahead of the consumers"),
    "d256n64": Build(head_dim=256, consumers=2, block_n=64, kv_stages=2, q_buffers=2,
                     o_staged_in_q=False, precision="fp8", variant="d256n64",
                     why="the D = 256 FP8 row until session 12 (the bf16 row's 128 x 64 tile; "
                         "e4m3 Q, 32 KiB a buffer, and the ring, 64 KiB, leave room for two Q "
                         "buffers and an own O staging): kept to measure the default against"),
    "m3n96": Build(head_dim=128, consumers=3, block_n=96, kv_stages=2, q_buffers=2,
                   o_staged_in_q=False, precision="fp8", sw_exp2_per_8=0, variant="m3n96",
                   registers_by_ptxas=True,
                   why="three consumers (192-row tiles), as the FP8 and bf16 D = 64 rows: with "
                       "two, one consumer's softmax is longer than the other's GEMMs and the "
                       "tensor pipe idles; with three, two softmaxes run under one consumer's "
                       "GEMMs. A consumer's budget is 160 registers: at 128 keys (S 64 + P 16 + "
                       "O 64) ptxas spilled 240 bytes, at 96 keys S 48 + P 12 + O 64 (ptxas "
                       "decides); V^T in three 32-byte swizzled row blocks. Every exponential "
                       "on MUFU, as the other three-consumer rows (fewer issue slots; same rounds "
                       "against 1 of 8 on the FMA pipe: level at 16k, +2% at the Wan shape)"),
}

# The FP8 build attention(precision="fp8") runs, per head dim, for pre-quantized e4m3 inputs
# (FlashAttention-3's (batch, heads_kv) descales) without a mask: the fastest the H200
# measured in the same rounds against the table's row (bench/notes.md, "Session 12, FP8 with
# three consumers": m3n96 1.05x burst, 1.03x sustained at (2, 16, 16384, 128)). Not for bf16
# inputs, whose quantizer writes K descales per 128-key block (m3n96's 96-key tiles straddle
# them), nor masked calls (96 is no power of two: the masked walk shifts).
FP8_PREQUANTIZED_DENSE = {128: "m3n96"}

# Measurement variants of bf16 rows (never chosen by attention(); api.prepare(..., defines=
# bf16_variant_defines(name)), or a bench/experiments/variants.py variant such as
# n80=production:BF16_BLOCK_N=80, selects one by its -D BF16_BLOCK_N=...): FlashAttention-3's
# bf16 tile at D = 256, 128 x 80. 80 is no power of two: dense only (the masked walk shifts by
# BLOCK_N_SHIFT), the tile arithmetic divides.
BF16_VARIANTS: dict[str, Build] = {
    "d256n80": Build(head_dim=256, consumers=2, block_n=80, kv_stages=2, q_buffers=1,
                     o_staged_in_q=True, variant="d256n80",
                     why="FlashAttention-3's bf16 tile at D = 256 (128 x 80): 1.25x the keys of "
                         "the row's 128 x 64 over the same per-tile costs; S 40 + P 20 + O 128 "
                         "registers leave 52 of 240; Q (64 KiB) and the ring (2 x (40 + 40) KiB) "
                         "fill 224 KiB, O staged in Q as the row's"),
}

BY_HEAD_DIM: dict[int, Build] = {b.head_dim: b for b in BUILDS}
HEAD_DIMS: tuple[int, ...] = tuple(sorted(BY_HEAD_DIM))
FP8_BY_HEAD_DIM: dict[int, Build] = {b.head_dim: b for b in FP8_BUILDS}
FP8_HEAD_DIMS: tuple[int, ...] = tuple(sorted(FP8_BY_HEAD_DIM))
for _b in BUILDS + FP8_BUILDS + tuple(FP8_VARIANTS.values()) + tuple(BF16_VARIANTS.values()):
    _b.check()
if DEFAULT_HEAD_DIM not in BY_HEAD_DIM or len(BY_HEAD_DIM) != len(BUILDS):
    raise ValueError("build table: one row per head dim, the default among them")
if (len(FP8_BY_HEAD_DIM) != len(FP8_BUILDS) or any(b.precision != "bf16" for b in BUILDS)
        or any(not b.fp8 for b in FP8_BUILDS)):
    raise ValueError("build table: one row per (precision, head dim), each in its list")


def table(precision: str = "bf16") -> tuple[Build, ...]:
    """The rows of one precision."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}")
    return BUILDS if precision == "bf16" else FP8_BUILDS


def fp8_variant(head_dim: int, defines: dict | None = None) -> Build:
    """The FP8 row a build's defines select: a variant's (FP8_BLOCK_N=..., and FP8_KV_STAGES,
    FP8_CONSUMERS where they differ from the row's), else the table's row of the head dim;
    ValueError for defines no variant of that head dim has."""
    defines = defines or {}
    n = defines.get("FP8_BLOCK_N")
    if n is None and "FP8_KV_STAGES" not in defines and "FP8_CONSUMERS" not in defines:
        return get(head_dim, "fp8")
    stages = str(defines.get("FP8_KV_STAGES", FP8_RING_DEFAULT))
    consumers = str(defines.get("FP8_CONSUMERS", fp8_consumers_default(head_dim)))
    for b in FP8_VARIANTS.values():
        if (b.head_dim == head_dim and str(b.block_n) == str(n) and str(b.kv_stages) == stages
                and str(b.consumers) == consumers):
            return b
    raise ValueError(f"FP8_BLOCK_N={n}, FP8_KV_STAGES={stages}, FP8_CONSUMERS={consumers}: no "
                     f"FP8 variant at head dim {head_dim} (variants: " + ", ".join(
                         f"{k} (D {b.head_dim}, N {b.block_n}, ring {b.kv_stages}, "
                         f"{b.consumers} consumers)"
                         for k, b in FP8_VARIANTS.items()) + ")")


def bf16_variant(head_dim: int, defines: dict | None = None) -> Build:
    """The bf16 row a build's defines select: a variant's (BF16_BLOCK_N=...), else the table's
    row of the head dim; ValueError for a BF16_BLOCK_N no variant of that head dim has."""
    n = (defines or {}).get("BF16_BLOCK_N")
    if n is None:
        return get(head_dim)
    for b in BF16_VARIANTS.values():
        if b.head_dim == head_dim and str(b.block_n) == str(n):
            return b
    raise ValueError(f"BF16_BLOCK_N={n}: no bf16 variant at head dim {head_dim} (variants: "
                     + ", ".join(f"{k} (D {b.head_dim}, N {b.block_n})"
                                 for k, b in BF16_VARIANTS.items()) + ")")


def bf16_variant_defines(name: str) -> dict[str, str]:
    """The defines of a bf16 measurement variant by name (BF16_VARIANTS), with its HEAD_DIM
    left to the call's; "default": none."""
    if name == "default":
        return {}
    try:
        return dict(BF16_VARIANTS[name].defines)
    except KeyError:
        raise ValueError(f"bf16 variant {name!r}: expected default or one of "
                         f"{', '.join(BF16_VARIANTS)}") from None


def get(head_dim: int, precision: str = "bf16") -> Build:
    """The row of a head dim (of a precision), or ValueError naming the ones there are."""
    rows = {b.head_dim: b for b in table(precision)}
    try:
        return rows[head_dim]
    except KeyError:
        what = "the production kernel" if precision == "bf16" else "the FP8 build"
        raise ValueError(f"head dim {head_dim}: {what} is built for "
                         f"{', '.join(map(str, sorted(rows)))}") from None

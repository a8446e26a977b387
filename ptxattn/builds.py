"""The production kernel's build table: the only source of each build's figures.

One row per head dim: what was chosen (consumer warpgroups, K/V tile rows, ring depth, Q
buffers, where O is staged), each with its reason. Everything else is derived here, once:
tile bytes, every shared-memory offset (Q, K, V, O, each mbarrier), TMA transaction bytes,
descriptor steps, shift amounts, named barrier IDs, register budgets and the dynamic
shared-memory size. Three readers take the figures from here:

  - the PTX, through ptx/sm90/production/layout.ptxh, which ptxattn/tools/ptxgen_layout.py writes
    from this table (literal numbers: the preprocessor does no arithmetic outside #if, and
    the golden fingerprints compare the operands' text);
  - the launcher, through stages.PRODUCTION_VARIANTS (block_n, ring depth, smem, threads);
  - the tests (tests/test_builds.py, test_production_builds.py, the schedule and sync replays).

A new head dim is one row of BUILDS (and its per-score macros: ptxattn/ptxgen.py makes them
for every head dim and tile width the table names).
"""

from __future__ import annotations

from dataclasses import dataclass

# Hopper facts the table is built on
REGISTERS_PER_SM = 65536
MAX_DYNAMIC_SMEM = 227 * 1024      # per CTA on sm_90
NAMED_BARRIERS = 16                # per CTA
WARPGROUP = 128                    # threads
MAX_REGS_PER_THREAD = 256          # setmaxnreg's ceiling; budgets are multiples of 8
Q_BOX_ROWS = 64                    # a consumer warpgroup's query rows (the wgmma M)
SWIZZLE_ROW_BYTES = 128            # a 128-byte swizzled row: 64 bf16 of D
SWIZZLE_COLS = SWIZZLE_ROW_BYTES // 2
DESC_UNIT = 16                     # wgmma descriptors address 16-byte units
MBAR_BYTES = 8                     # one mbarrier
BARRIER_ALIGN = 128                # the mbarriers' room is rounded up to this
SMEM_ALIGN = 1024                  # the kernel rounds the dynamic base up to a swizzle atom
BF16 = 2                           # bytes per element
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

    # ---- tiles ---------------------------------------------------------------------------
    @property
    def block_m(self) -> int:
        return Q_BOX_ROWS * self.consumers

    @property
    def threads(self) -> int:
        return WARPGROUP * (self.consumers + 1)          # a producer warpgroup + the consumers

    @property
    def q_box_bytes(self) -> int:
        """One consumer's 64 rows of Q (and of O): Q_TILE_BYTES."""
        return Q_BOX_ROWS * self.head_dim * BF16

    @property
    def q_buffer_bytes(self) -> int:
        """One Q buffer: every consumer's rows."""
        return self.consumers * self.q_box_bytes

    @property
    def kv_tile_bytes(self) -> int:
        return self.block_n * self.head_dim * BF16

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
        return self.block_n // 4                         # the same as bf16 pairs

    @property
    def o_regs(self) -> int:
        return self.head_dim // 2                        # 64 x D fp32 over 128 threads

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
            at["SMEM_O"], end = end, end + self.consumers * self.q_box_bytes
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

    # ---- the generated macros this row uses (ptxattn/ptxgen.py) ----------------------------
    @property
    def score_header(self) -> str:
        return f"gen_n{self.block_n}.ptxh"

    @property
    def output_header(self) -> str:
        return f"gen_d{self.head_dim}.ptxh"

    def check(self) -> None:
        """ValueError naming the figure when a row cannot be built."""
        def need(ok, what):
            if not ok:
                raise ValueError(f"build table, head dim {self.head_dim}: {what}")
        need(self.head_dim % SWIZZLE_COLS == 0, f"D must be a multiple of {SWIZZLE_COLS}")
        need(self.block_n % 16 == 0 and self.block_n <= 256, "BLOCK_N: a multiple of 16, <= 256")
        need(self.block_n_shift is not None, "BLOCK_N must be a power of two (tile counts shift)")
        need(self.kv_stage_shift is not None, "the ring depth must be a power of two")
        need(self.q_buffers in (1, 2), "one or two Q buffers")
        need(not (self.o_staged_in_q and self.q_buffers == 2),
             "O staged in Q needs the one Q buffer (the next tile's Q would land on O)")
        need(self.named_barriers <= NAMED_BARRIERS, f"{self.named_barriers} named barriers")
        need(self.s_regs + self.p_regs + self.o_regs + REGS_BESIDES_TILES <= self.consumer_regs,
             f"S {self.s_regs} + P {self.p_regs} + O {self.o_regs} registers do not fit a "
             f"consumer's {self.consumer_regs}")
        need(self.smem_bytes <= MAX_DYNAMIC_SMEM,
             f"{self.smem_bytes} bytes of shared memory (at most {MAX_DYNAMIC_SMEM})")
        for name, offset in self.smem.items():
            if not name.startswith("SMEM_BAR"):
                need(offset % SMEM_ALIGN == 0, f"{name} must sit on a 1024-byte swizzle atom")


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

BY_HEAD_DIM: dict[int, Build] = {b.head_dim: b for b in BUILDS}
HEAD_DIMS: tuple[int, ...] = tuple(sorted(BY_HEAD_DIM))
for _b in BUILDS:
    _b.check()
if DEFAULT_HEAD_DIM not in BY_HEAD_DIM or len(BY_HEAD_DIM) != len(BUILDS):
    raise ValueError("build table: one row per head dim, the default among them")


def get(head_dim: int) -> Build:
    """The row of a head dim, or ValueError naming the ones there are."""
    try:
        return BY_HEAD_DIM[head_dim]
    except KeyError:
        raise ValueError(f"head dim {head_dim}: the production kernel is built for "
                         f"{', '.join(map(str, HEAD_DIMS))}") from None

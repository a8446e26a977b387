"""The backward's build table: tiles per head dim, and every shared-memory offset derived from it.

One CTA owns BLOCK_N keys of one (batch, K/V head) and walks the query blocks (BLOCK_M rows
each) of every query head of its group, keeping dK and dV in fp32 registers. Two consumer
warpgroups share the work in one of two ways (`key_split`):

  - key split (D = 64, 128): consumer c owns keys 64c..64c+63 and all of D for dK and dV;
    S^T = K Q^T and dP^T = V dO^T are computed once, each consumer for its own keys.
  - D split (D = 256): both consumers own the same 64 keys; consumer c accumulates columns
    128c..128c+127 of dK and dV. S^T and dP^T are computed by both (two of the five GEMMs run
    twice) because 64 keys x 256 columns of dK plus dV are 256 fp32 registers a thread in one
    warpgroup, more than the 240 setmaxnreg leaves a consumer. FlashAttention-3 keeps all five
    GEMMs single at D = 256 by computing dK^T and dV^T (A = dO^T, Q^T from shared memory,
    P and dS written to shared memory), 64 x 80 tiles.

Variants (VARIANTS: a build per head dim it applies to, picked by name at launch, so that one
process can time today's build against them; `defines` selects a row in bwd.ptx):

  - query_split ("qsplit", D = 256): no GEMM runs twice. Consumer c computes S^T and dP^T of
    its 32 queries of the block (m64n32: the 64 keys x queries 32c..32c+31), P^T and dS^T of
    them, and writes both halves to shared memory; dV and dK keep the D split (64 keys x 128
    columns each) and take their 4 k-steps of queries half from the consumer's own registers
    (RS) and half from the other consumer's tile (SS, after a barrier). Five GEMM units a
    block instead of seven, and half the exponentials a consumer.
  - qsplit_dqred (D = 256): qsplit with dQ added from the consumers' registers
    (red.global.add.v2.f32 into the accumulator, in its layout) instead of through the 64 KiB
    staging tile and the dQ warp; the freed shared memory holds a second Q / dO stage. No
    deterministic order (prepare_backward refuses deterministic=True on it).
  - dqred (D = 64, 128): today's tiles, dQ added from the consumers' registers as in
    qsplit_dqred; the staging tile's 64 KiB a block of stores and bulk reads leave shared
    memory. Not deterministic either.
  - st_ahead (D = 64, 128): the next block's S^T is issued as soon as this block's dV and dK
    are done, so that it runs under this block's dQ and the dQ hand-off to the dQ warp; dP^T
    follows at the top of the next block. The Q / dO stage is released before dQ finishes
    (dQ reads dS^T and K only; qsplit releases it there too).
  - m80 (D = 128): st_ahead's schedule on 80-row query blocks (FlashAttention-3's non-causal
    D = 128 tile): S^T and dP^T are m64n80 (40 registers each), dV and dK take 5 k-steps.
    80 rows do not split into m64 tiles, so dQ is computed transposed (`dq_t`): dQ^T = K^T
    dS^T, each consumer its 64 columns of D x the block's 80 queries (m64n80, A = K read
    MN-major, B = the dS tile K-major), and dS^T is stored transposed (stmatrix .trans:
    query rows, keys contiguous). No early dV (S^T, dP^T, dV, dK and the packed P^T would be
    228 registers), and dQ^T is issued once dV and dK retired (their A fragments beside dQ^T
    and the next S^T: ptxas serializes every wgmma). The per-block costs (hand-offs, barriers, the loop's top) spread over 25%
    more rows, and the SS GEMMs read 115 B per tensor cycle instead of 128.
  - m80_edv (D = 128): m80 with early dV. dS^T = P^T (dP^T - delta) takes P^T from its packed
    bf16 pairs (`ds_from_pt`: the RS A fragments of dV, unpacked by a shift or a mask) instead
    of the fp32 S^T registers, which die at the packing: dV, dK, dP^T and the packed P^T are
    188 registers where m80's early dV would hold 228. dV is issued before dP^T is waited on,
    so the exponentials run under dP^T (m80's SASS waits for dP^T after 5 of its 40: ptxas
    hoists the wait, nothing orders the softmax before it) and the dS^T math under dV. dV is
    then done when dQ^T is issued, so dQ^T waits for dV only and is queued behind dK (with
    dK, dV and both packed halves in flight ptxas serialized every wgmma). dS^T sees P rounded
    to bf16 (the value dV already multiplies by).

dQ = dS K (64 x D per consumer pair) is split between the consumers by its rows when a query
block has 128 rows (D = 64) and by its columns otherwise (a consumer's 64 rows x D / 2; with
dq_t its BLOCK_M rows x D / 2, computed as their transpose).

`python -m ptxattn.tools.ptxgen_bwd` writes this table into ptx/sm90/include/gen_bwd_layout.ptxh;
the launcher (ptxattn/backward.py) reads the same rows, so a tile, an offset or a byte count
lives in one place. tests/test_backward_builds.py checks the header against the table.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

THREADS = 384                # a producer warpgroup (a load warp, a dQ warp) + 2 consumers
CONSUMERS = 2
CONSUMER_ROWS = 64           # rows of a wgmma accumulator: one consumer's keys
PRODUCER_REGS = 24           # setmaxnreg: 24 * 128 + 240 * 256 = 64512 <= 65536
CONSUMER_REGS = 240
SLACK = 1024                 # the launcher's dynamic shared memory covers aligning the base
MAX_SMEM = 227 * 1024        # per CTA on an H100/H200 (opt-in)
LEAD_ALIGN = 1024            # 128-byte swizzle atoms are 8 rows x 128 B: tiles 1024-aligned


@dataclass(frozen=True)
class Build:
    """One head dim's tiles; everything else (register counts, offsets) is derived."""
    head_dim: int
    block_m: int             # query rows per step: the N of S^T = K Q^T
    block_n: int             # keys per CTA
    key_split: bool          # see the module docstring
    q_stages: int            # depth of the Q / dO (+ LSE, delta) ring
    why: str
    # dV += P^T dO issued before dS^T is computed (it runs under that math), which keeps the
    # packed P^T live beside S^T and dP^T; off where that does not fit the registers (D = 64)
    early_dv: bool = True
    query_split: bool = False  # D split only: S^T and dP^T split by queries (module docstring)
    st_ahead: bool = False     # the next block's S^T issued under this block's dQ
    dq_red: bool = False       # dQ added from the consumers' registers: no staging tile
    dq_t: bool = False         # dQ^T = K^T dS^T (D in M), dS^T stored transposed (m80)
    ds_from_pt: bool = False   # dS^T from the packed bf16 P^T, not the fp32 S^T (m80_edv)
    variant: str = "default"   # the build table's name for this row (VARIANTS)

    @property
    def layout_defines(self) -> dict[str, str]:
        """The -D switches that select this build's block of gen_bwd_layout.ptxh beside
        HEAD_DIM (the ones that change tiles, offsets or the block's macros: EARLY_DV and
        DS_TILE with ds_from_pt; {} for today's builds)."""
        return {**({"PTXATTN_BWD_QSPLIT": "1"} if self.query_split else {}),
                **({"PTXATTN_BWD_DQRED": "1"} if self.dq_red else {}),
                **({"PTXATTN_BWD_DQT": "1"} if self.dq_t else {}),
                **({"PTXATTN_BWD_DSPT": "1"} if self.ds_from_pt else {})}

    @property
    def postprocess_defines(self) -> dict[str, str]:
        """The postprocess's -D switches for this build's accumulator layout ({} for every
        build whose layout the postprocess reads from its shift parameters)."""
        return {"PTXATTN_BWD_DQT": "1", "BWD_BLOCK_M": str(self.block_m)} if self.dq_t else {}

    @property
    def defines(self) -> dict[str, str]:
        """Every -D switch of this build beside HEAD_DIM (and PTXATTN_MASKED): its layout's, and
        the schedule's that bwd.ptx reads alone."""
        return {**self.layout_defines,
                **({"PTXATTN_BWD_ST_AHEAD": "1"} if self.st_ahead else {})}

    @property
    def deterministic(self) -> bool:
        """Whether deterministic=True can run on this build: the dQ warp orders the adds of the
        staging tile; adds from the consumers' registers (dq_red) have no order."""
        return not self.dq_red

    # ---- the split of the work between the two consumers
    @property
    def score_cols(self) -> int:
        """Query columns of one consumer's S^T and dP^T: the block's, or half of it."""
        return self.block_m // 2 if self.query_split else self.block_m

    @property
    def dkv_cols(self) -> int:
        """Columns of dK and dV in one consumer's accumulators (its 64 keys)."""
        return self.head_dim if self.key_split else self.head_dim // 2

    @property
    def dq_split_rows(self) -> bool:
        """dQ split by rows (each consumer 64 query rows x D) rather than by columns."""
        return self.block_m == 2 * CONSUMER_ROWS

    @property
    def dq_cols(self) -> int:
        """Columns of one consumer's dQ slice (its rows: 64)."""
        return self.head_dim if self.dq_split_rows else self.head_dim // 2

    @property
    def slice_rows(self) -> int:
        """Rows of one consumer's slice of the dQ accumulator: 64, or the block's with dq_t."""
        return self.block_m if self.dq_t else CONSUMER_ROWS

    @property
    def ds_keys(self) -> int:
        """Keys in the dS tile that dQ = dS K reduces over."""
        return self.block_n

    # ---- registers per consumer thread (fp32 accumulators and bf16 pairs)
    @property
    def registers(self) -> dict[str, int]:
        s = CONSUMER_ROWS * self.score_cols // 128
        return {"S^T (then P^T)": s, "dP^T (then dS^T)": s,
                "P^T packed": s // 2, "dS^T packed": s // 2,
                "dV": CONSUMER_ROWS * self.dkv_cols // 128,
                "dK": CONSUMER_ROWS * self.dkv_cols // 128,
                "dQ": (self.slice_rows if self.dq_t else CONSUMER_ROWS) * self.dq_cols // 128}

    @property
    def peak_registers(self) -> int:
        """The most that is live at once, by the schedule (production's consumer): dV, dK, S^T
        (P^T), dP^T (dS^T), and with early_dv the packed P^T that the in-flight dV GEMM reads;
        dQ lives once S^T and dP^T are dead (with query_split beside both packed halves, the
        A fragments of the RS k-steps); with st_ahead the next block's S^T beside dQ; with
        ds_from_pt the fp32 S^T is dead at dS^T (P^T read from its packed pairs)."""
        r = self.registers
        at_ds = r["dV"] + r["dK"] + r["dP^T (then dS^T)"] + \
            (0 if self.ds_from_pt else r["S^T (then P^T)"]) + \
            (r["P^T packed"] if self.early_dv or self.ds_from_pt else 0)
        at_dq = r["dV"] + r["dK"] + r["dS^T packed"] + r["dQ"] + \
            (r["P^T packed"] if self.query_split else 0)
        ahead = r["dV"] + r["dK"] + r["dQ"] + r["S^T (then P^T)"] if self.st_ahead else 0
        return max(at_ds, at_dq, ahead)

    # ---- shared memory
    @property
    def tile_bytes(self) -> dict[str, int]:
        d = self.head_dim
        return {"K": self.block_n * d * 2, "V": self.block_n * d * 2,
                "Q": self.block_m * d * 2, "dO": self.block_m * d * 2,
                "dS": self.ds_keys * self.block_m * 2, "dQ": self.block_m * d * 4,
                "LSE": self.block_m * 4, "delta": self.block_m * 4}

    def layout(self) -> dict[str, int]:
        """Offset of every region from the 1024-aligned base, the barriers last; "end" is the
        end of the barriers, "smem_bytes" what a launch asks for (end + SLACK)."""
        t = self.tile_bytes
        p = [("P", 2 * t["dS"])] if self.query_split else []   # P^T beside dS^T, two buffers
        dq = [] if self.dq_red else [("dQ", t["dQ"])]           # the dQ staging tile
        return place([("K", t["K"]), ("V", t["V"]), ("Q", self.q_stages * t["Q"]),
                      ("dO", self.q_stages * t["dO"]), ("dS", 2 * t["dS"]), *p, *dq,
                      ("LSE", self.q_stages * t["LSE"]), ("delta", self.q_stages * t["delta"])],
                     [("BAR_KV_FULL", 1), ("BAR_Q_FULL", self.q_stages),
                      ("BAR_Q_EMPTY", self.q_stages)])

    @property
    def smem_bytes(self) -> int:
        return self.layout()["smem_bytes"]

    @property
    def q_stage_tx(self) -> int:
        """Bytes one Q FULL barrier expects: Q, dO, and the LSE and delta of its rows."""
        t = self.tile_bytes
        return t["Q"] + t["dO"] + t["LSE"] + t["delta"]


def place(regions, barriers) -> dict[str, int]:
    """Offsets of (name, bytes) regions in order, tiles 1024-aligned (128-byte swizzle atoms;
    LSE and delta rows 16-aligned for bulk copies), then (name, count) mbarriers of 8 bytes;
    "end" past the last barrier, "smem_bytes" = end + SLACK."""
    out, at = {}, 0
    for name, size in regions:
        align = 16 if name in ("LSE", "delta") else LEAD_ALIGN
        at = -(-at // align) * align
        out[name] = at
        at += size
    at = -(-at // 8) * 8
    for name, count in barriers:
        out[name] = at
        at += 8 * count
    out["end"] = at
    out["smem_bytes"] = at + SLACK
    return out


BUILDS: dict[int, Build] = {b.head_dim: b for b in (
    Build(64, block_m=128, block_n=128, key_split=True, q_stages=2, early_dv=False,
          why="128 x 128 (FlashAttention-3's D = 64 tile): S^T and dP^T are 64 registers each, "
              "dK and dV 32; 128 query rows a step halve the K/V-side work per Q load; dV is "
              "issued after dS^T is packed (S^T, dP^T and a packed P^T would not fit)"),
    Build(128, block_m=64, block_n=128, key_split=True, q_stages=2,
          why="64 query rows a step: dK and dV (64 + 64) with S^T and dP^T (32 + 32) and the "
              "packed P^T fit a consumer's 240 registers; FlashAttention-3 runs 80 rows when "
              "unmasked (m64n80 wgmma), a power of two keeps tile counts to shifts here"),
    Build(256, block_m=64, block_n=64, key_split=False, q_stages=1,
          why="dK and dV are 64 x 256 each: the two consumers split D (128 columns each, 64 + "
              "64 registers); one Q/dO stage, since K, V, Q, dO (32 KiB each), dS and a 64 KiB "
              "fp32 dQ staging tile fill 208 KiB"),
)}

HEAD_DIMS = tuple(sorted(BUILDS))

DEFAULT_VARIANT = "default"
_QSPLIT_WHY = ("the D = 256 tiles; S^T and dP^T split by queries (m64n32: 32 of the block's 64 "
               "queries a consumer), P^T and dS^T halves through shared memory (two 8 KiB "
               "buffers more), dV and dK half RS, half SS: 5 GEMM units a block, not 7")
_AHEAD_WHY = "; the next block's S^T issued under this block's dQ and its hand-off"
_DQRED_WHY = ("; dQ added from the consumers' registers (red.global.add, FlashAttention-3's D = "
              "256 path): the 64 KiB staging tile pays for a second Q/dO stage, so the next "
              "block loads under this one (no deterministic order)")
VARIANTS: dict[str, dict[int, Build]] = {
    # (D = 256 has its st_ahead in qsplit_st_ahead: its own D-split build would hold dV, dK,
    # dQ (64 each) and the next S^T (32) at once, 224 registers before any address)
    "st_ahead": {d: replace(BUILDS[d], st_ahead=True, variant="st_ahead",
                            why=BUILDS[d].why + _AHEAD_WHY) for d in (64, 128)},
    "qsplit": {256: replace(BUILDS[256], query_split=True, variant="qsplit", why=_QSPLIT_WHY)},
    "qsplit_dqred": {256: replace(BUILDS[256], query_split=True, dq_red=True, q_stages=2,
                                  variant="qsplit_dqred", why=_QSPLIT_WHY + _DQRED_WHY)},
    # (the 32 KiB staging tile would not pay for a stage more at D = 64, 128: Q_STAGES is a
    # power of two and 4 do not fit; what goes is its 64 KiB of shared-memory traffic a block)
    "dqred": {d: replace(BUILDS[d], dq_red=True, variant="dqred",
                         why=BUILDS[d].why + "; dQ added from the consumers' registers "
                         "(red.global.add): no staging tile, no hand-off to the dQ warp")
              for d in (64, 128)},
    "m80": {128: replace(BUILDS[128], block_m=80, early_dv=False, st_ahead=True, dq_t=True,
                         variant="m80",
                         why="80 query rows a step (FlashAttention-3's non-causal D = 128 tile): "
                             "S^T, dP^T m64n80 (40 registers each), dV and dK 5 k-steps; dQ^T = "
                             "K^T dS^T with D in M (80 rows are no m64 tiles), dS^T stored "
                             "transposed; no early dV (228 registers with it), dQ^T after dV and "
                             "dK; st_ahead's schedule")},
}
# m80 with early dV: dS^T from the packed P^T, so that the fp32 S^T dies at the packing
VARIANTS["m80_edv"] = {128: replace(
    VARIANTS["m80"][128], early_dv=True, ds_from_pt=True, variant="m80_edv",
    why="m80's 80-row tiles and schedule with early dV: dS^T = P^T (dP^T - delta) from the packed "
        "bf16 P^T (dV's A fragments), so S^T's 40 fp32 registers die at the packing (188 live "
        "at dS^T, not 228); dV issued before dP^T is waited on: the exponentials run under dP^T, "
        "the dS^T math under dV; dQ^T queued behind dK (it waits for dV only)")}
VARIANT_NAMES = (DEFAULT_VARIANT, *VARIANTS)


# The build attention_backward runs when no variant is named, per head dim: the fastest the
# H200 measured in the same rounds against today's rows (bench/notes.md, "backward variants
# on the device", "Session 8"): st_ahead at D 64, the 80-row query blocks at D 128, the query
# split at D 256. Deterministic calls keep today's rows (st_ahead measured slower there; m80's
# and the query split's deterministic modes are measured once, not yet decided on).
# variant="default" names today's row of any head dim.
MEASURED_DEFAULTS = {64: "st_ahead", 128: "m80", 256: "qsplit"}


def chosen_variant(head_dim: int, deterministic: bool, variant: str | None) -> str | None:
    """The variant a production backward call runs: the one named (None for "default":
    today's row), else MEASURED_DEFAULTS' for a non-deterministic call, else today's."""
    if variant is not None:
        return None if variant == DEFAULT_VARIANT else variant
    if deterministic:
        return None
    return MEASURED_DEFAULTS.get(head_dim)


def all_builds() -> list[Build]:
    """Every build the production backward can be launched with: today's per head dim, then
    each variant's."""
    return [BUILDS[d] for d in HEAD_DIMS] + [b for rows in VARIANTS.values()
                                             for _, b in sorted(rows.items())]


def variants_for(head_dim: int) -> tuple[str, ...]:
    """The variant names that have a build at this head dim (today's first)."""
    return tuple(v for v in VARIANT_NAMES if v == DEFAULT_VARIANT or head_dim in VARIANTS[v])


def build(head_dim: int, variant: str | None = None) -> Build:
    """The build of a head dim: today's (variant None or "default"), or a variant's."""
    if variant is None or variant == DEFAULT_VARIANT:
        try:
            return BUILDS[head_dim]
        except KeyError:
            raise ValueError(f"q: head dim {head_dim} has no backward build (takes "
                             f"{', '.join(map(str, HEAD_DIMS))})") from None
    if not isinstance(variant, str) or variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {', '.join(map(repr, VARIANT_NAMES))} (or "
                         f"None, today's build), got {variant!r}")
    rows = VARIANTS[variant]
    if head_dim not in rows:
        raise ValueError(f"variant: {variant!r} has no build at head dim {head_dim} (it has "
                         f"{', '.join(map(str, sorted(rows)))})")
    return rows[head_dim]


def dq_row_swizzle(r, dq_t: bool = False):
    """The XOR of a slice row's 8-float chunks: the row mod 8, or with dq_t a bit permutation
    of it (rows 2q + e -> q + 4e) that keeps the transposed dQ^T stores conflict-free."""
    r8 = r % 8
    return (r8 >> 1) + 4 * (r8 & 1) if dq_t else r8


def dq_accum_offset(row, col, head_dim: int, block_m: int, dq_cols: int, dq_t: bool = False):
    """Float offset of dQ element (row, col) inside one head's fp32 accumulator (NumPy arrays
    or ints). The accumulator is (Lq rounded up to block_m) x D floats per (batch, head), laid
    out per query block as the consumers' slices one after the other ([slice][64 rows]
    [dq_cols]), and in each slice row the 8-float chunks are permuted by XOR with the row's
    position mod 8: the consumers' stores to shared memory (and the red.global adds of the
    lineage) hit every bank once, and a slice is one contiguous bulk reduce-add. The
    postprocess kernel reads it back with the same formula. dq_t (the m80 build): a slice is
    the block's rows x dq_cols (split by columns only) and the chunks' XOR is dq_row_swizzle's
    permutation of the row."""
    m, r = row // block_m, row % block_m
    if dq_t:
        slice_, cc = col // dq_cols, col % dq_cols
        chunk = cc // 8
        phys = (chunk // 8) * 8 + ((chunk % 8) ^ dq_row_swizzle(r, True))
        return m * block_m * head_dim + (slice_ * block_m + r) * dq_cols + phys * 8 + cc % 8
    slice_ = (r // CONSUMER_ROWS) * (head_dim // dq_cols) + col // dq_cols
    r64, cc = r % CONSUMER_ROWS, col % dq_cols
    chunk = cc // 8
    phys = (chunk // 8) * 8 + ((chunk % 8) ^ (r64 % 8))
    return m * block_m * head_dim + (slice_ * CONSUMER_ROWS + r64) * dq_cols + phys * 8 + cc % 8


def padded_rows(seq_q: int, block_m: int) -> int:
    """Query rows of the workspaces: Lq rounded up to the query block."""
    return -(-seq_q // block_m) * block_m


# ---- the backward lineage and its production kernel ------------------------------------------

@dataclass(frozen=True)
class Stage:
    """A backward kernel: a lineage stage (D = 128, no mask, no GQA, lengths multiples of the
    tiles, heads equal) or the production kernel (everything, one build per head dim)."""
    number: int              # 1, 2, 3 for b1..b3; 0 for the production kernel
    name: str
    idea: str
    file: str                # relative to ptx/
    threads: int
    smem_bytes: int          # the lineage's; the production kernel's is per build
    production: bool = False

    @property
    def label(self) -> str:
        return "bwd_production" if self.production else f"b{self.number}"

    @property
    def title(self) -> str:
        return self.label if self.production else f"{self.label} ({self.name})"

    @property
    def predecessor(self) -> int | None:
        return self.number - 1 if self.number > 1 else None

    def smem_for(self, head_dim: int, variant: str | None = None) -> int:
        return build(head_dim, variant).smem_bytes if self.production else self.smem_bytes

    def unsupported(self, head_dim: int, seq_q: int, seq_k: int, *, gqa: bool, masked: bool,
                    deterministic: bool) -> tuple[str, str] | None:
        """(argument, why) this kernel cannot take the call, or None."""
        if self.production:
            if head_dim not in BUILDS:
                return "q", f"head dim {head_dim} (takes {', '.join(map(str, HEAD_DIMS))})"
            return None
        if head_dim != LINEAGE_HEAD_DIM:
            return "q", f"head dim {head_dim} (the lineage takes {LINEAGE_HEAD_DIM})"
        if gqa:
            return "k", "k/v with fewer heads than q (GQA/MQA)"
        if masked:
            return "causal", "causal or window masks"
        if deterministic:
            return "deterministic", "deterministic=True"
        if seq_q % LINEAGE_BLOCK_M:
            return "q", f"query length {seq_q} (takes multiples of {LINEAGE_BLOCK_M})"
        if seq_k % LINEAGE_BLOCK_N:
            return "k", f"key length {seq_k} (takes multiples of {LINEAGE_BLOCK_N})"
        return None


# The lineage's tiles are the production build's at D = 128 (checked in the tests).
LINEAGE_HEAD_DIM, LINEAGE_BLOCK_M, LINEAGE_BLOCK_N = 128, 64, 128
_KV, _Q, _STAT = 128 * 128 * 2, 64 * 128 * 2, 64 * 4
# Each lineage stage's shared memory, region by region (its .ptx spells the offsets out as
# literals; tests/test_backward_builds.py checks them against this).
LINEAGE_LAYOUTS: dict[int, dict[str, int]] = {
    # b1: K, V | Q, dO | dS^T (128 keys x 64 queries) | neg_lse, delta | 2 mbarriers
    1: place([("K", _KV), ("V", _KV), ("Q", _Q), ("dO", _Q), ("dS", 128 * 64 * 2),
              ("LSE", _STAT), ("delta", _STAT)], [("BAR_KV", 1), ("BAR_Q", 1)]),
}
# b2: the Q / dO / neg_lse / delta ring of 2 stages, K/V FULL, Q FULL[2], Q EMPTY[2]
LINEAGE_LAYOUTS[2] = place([("K", _KV), ("V", _KV), ("Q", 2 * _Q), ("dO", 2 * _Q),
                            ("dS", 128 * 64 * 2), ("LSE", 2 * _STAT), ("delta", 2 * _STAT)],
                           [("BAR_KV_FULL", 1), ("BAR_Q_FULL", 2), ("BAR_Q_EMPTY", 2)])
# b3: the production layout at D = 128 (two dS^T buffers, the fp32 dQ staging tile)
LINEAGE_LAYOUTS[3] = BUILDS[LINEAGE_HEAD_DIM].layout()

STAGES: tuple[Stage, ...] = (
    Stage(1, "baseline",
          "one CTA per 128 keys keeps dK, dV in registers over every query block; scores "
          "transposed so P^T and dS^T feed RS GEMMs; dQ through shared memory and "
          "red.global.add; every step waited on",
          "sm90/backward/01_baseline.ptx", threads=256,
          smem_bytes=LINEAGE_LAYOUTS[1]["smem_bytes"]),
    Stage(2, "warp_specialized",
          "a producer warp loads Q, dO, neg_lse and delta through a 2-stage mbarrier ring; "
          "setmaxnreg gives its registers to the consumers",
          "sm90/backward/02_warp_specialized.ptx", threads=THREADS,
          smem_bytes=LINEAGE_LAYOUTS[2]["smem_bytes"]),
    Stage(3, "dq_reduce",
          "dQ staged in shared memory and added by a dQ warp with one bulk reduce-add a block; "
          "the production schedule: S^T and dP^T back to back, dV under the dS^T math, dK "
          "under the dS^T stores, two dS^T buffers",
          "sm90/backward/03_dq_reduce.ptx", threads=THREADS,
          smem_bytes=LINEAGE_LAYOUTS[3]["smem_bytes"]),
)

PRODUCTION = Stage(0, "production", "the production backward", "sm90/production/bwd.ptx",
                   threads=THREADS, smem_bytes=0, production=True)


def get_stage(key) -> Stage:
    """A backward kernel by label ("b1", 1, "baseline", "production") or as it is."""
    if isinstance(key, Stage):
        return key
    text = str(key).strip().lower()
    if text in ("production", "bwd_production", "prod"):
        return PRODUCTION
    for stage in STAGES:
        if text in (stage.label, str(stage.number), stage.name, f"stage{stage.number}"):
            return stage
    raise ValueError(f"stage: unknown backward kernel {key!r}; kernels are production (the "
                     f"default) and the lineage "
                     f"{', '.join(s.label for s in STAGES)}")

"""The lineage registry: one entry per hand-written kernel in ptx/.

Every stage exports the same entry point with the same parameter list (see
ptx/sm90/README.md, "Kernel ABI"), so the launcher is generic: what differs
between stages is the launch geometry and the shape of the TMA boxes, which
live here next to the file they describe.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from . import builds, stages_sm100

ENTRY = "ptxattn_fwd"

# The lineages, by the arch their PTX is written for. Hopper's is the measured one and every
# function here defaults to it; Blackwell's (stages_sm100.py) is assembled and SASS-checked only.
HOPPER = "sm_90a"
BLACKWELL = "sm_100a"
ARCHES = (HOPPER, BLACKWELL)
# What a user may type for a lineage (CLI --arch, get_stage(arch=...)), lower case.
_ARCH_NAMES = {HOPPER: ("sm_90a", "sm90a", "sm90", "hopper"),
               BLACKWELL: ("sm_100a", "sm100a", "sm100", "blackwell")}
# A key that names its lineage: "sm100_stage05", "sm100:5", "sm_100a/baseline".
_QUALIFIED = re.compile(r"(sm_?(?:90|100)a?)[_:/](.+)")

SWIZZLE_NONE = "none"
SWIZZLE_128B = "128B"


@dataclass(frozen=True)
class Stage:
    number: int
    name: str
    idea: str
    arch: str                  # "sm_90a" or "sm_100a"
    file: str                  # path relative to ptx/
    threads: int               # threads per CTA
    block_m: int               # query rows per CTA tile
    block_n: int               # key/value rows per pipeline tile
    smem_bytes: int            # dynamic shared memory per CTA
    swizzle: str = SWIZZLE_NONE
    cluster: tuple[int, int, int] = (1, 1, 1)
    persistent: bool = False   # grid = SM count, tiles scheduled in-kernel
    dynamic_tiles: bool = False  # tiles taken from a global counter: one more kernel parameter
    head_dims: tuple[int, ...] = (128,)
    q_box_rows: int = 64       # rows of one Q (and O) TMA box: one consumer warpgroup's share
    production: bool = False   # the production kernel: any lengths, GQA/MQA, LSE out; its ABI
                               # adds heads_per_kv (u32) and lse_ptr (u64) after the lineage's
    defines: tuple[tuple[str, str], ...] = ()   # preprocessor defines of this build (a variant)
    built_on: int | None = None  # the lineage stage whose diff to this one is its idea
                                 # (None: the one numbered before it)

    @property
    def predecessor(self) -> int | None:
        """Number of the stage this one changes by one idea (None for the first stage)."""
        if self.built_on is not None:
            return self.built_on
        return self.number - 1 if self.number > 1 else None

    @property
    def label(self) -> str:
        """"stage05", "production"; a stage of another lineage than Hopper's says its arch,
        "sm100_stage05", since the two lineages' numbers collide (get_stage reads it back)."""
        if self.production:
            return self.name
        prefix = "" if self.arch == HOPPER else f"{_short_arch(self.arch)}_"
        return f"{prefix}stage{self.number:02d}"

    @property
    def title(self) -> str:
        """How messages name it: "stage05 (two_q_tiles)", or "production"."""
        return self.label if self.production else f"{self.label} ({self.name})"

    # What a kernel takes beyond the lineage's shapes: today exactly the production kernel's
    # features, one name each so that the callers' checks read as what they ask.
    any_length = property(lambda self: self.production,
                          doc="Takes lengths that are not multiples of its tiles.")
    gqa = property(lambda self: self.production,
                   doc="Takes k/v with fewer heads than q (GQA and MQA).")
    lse = property(lambda self: self.production,
                   doc="Can write the log-sum-exp of each query row.")
    masks = property(lambda self: self.production,
                     doc="Takes causal and sliding-window masks.")

    @property
    def varlen(self) -> bool:
        """The production kernel's packed-sequence build (flash_attn_varlen_func): its ABI adds
        launch.VARLEN_PARAMS."""
        return ("PTXATTN_VARLEN", "1") in self.defines

    @property
    def paged(self) -> bool:
        """The varlen build over a paged K/V cache (flash_attn_varlen_func's block_table=): its
        ABI adds launch.PAGED_PARAMS after the varlen ones."""
        return ("PTXATTN_PAGED", "1") in self.defines

    @property
    def tma_chunk(self) -> int:
        """Elements of D per innermost TMA box dimension.

        A TMA box is 5-D, (chunk, rows, D // chunk, 1, 1) over the global
        dims (d_inner, row, d_outer, head, batch), so the tile lands in shared
        memory as [d_outer][row][chunk]: 16-byte columns of core matrices
        without swizzle, 128-byte swizzle atoms with it.
        """
        return 8 if self.swizzle == SWIZZLE_NONE else 64

    def specialize(self, head_dim: int, masked: bool = False, varlen: bool = False,
                   paged: bool = False) -> "Stage":
        """The build that runs one call. A lineage stage has one build: itself. The production
        kernel has one per (head dim, masked) in PRODUCTION_VARIANTS, selected by preprocessor
        defines, with the tile shape and shared memory of that row of the table; varlen
        (flash_attn_varlen_func: packed sequences, PTXATTN_VARLEN) is the masked build of the
        head dim on a tile table (scheduler.ptxh), with the same figures; paged (its
        block_table=, PTXATTN_PAGED) the varlen build reading K/V through a block table
        (kv_paged.ptxh), with the same figures again."""
        if not self.production:
            return self
        masked = masked or varlen
        v = PRODUCTION_VARIANTS.get((head_dim, masked))
        if v is None:
            raise ValueError(f"{self.label}: no build for head dim {head_dim}"
                             f"{' with a mask' if masked else ''}")
        defines = (("HEAD_DIM", str(head_dim)),) + ((("PTXATTN_MASKED", "1"),) if masked else ()) \
            + ((("PTXATTN_VARLEN", "1"),) if varlen else ()) \
            + ((("PTXATTN_PAGED", "1"),) if paged else ())
        if paged and not varlen:
            raise ValueError(f"{self.label}: the paged build is the varlen build's")
        return dataclasses.replace(self, head_dims=(head_dim,), block_m=v.block_m,
                                   block_n=v.block_n, threads=v.threads,
                                   smem_bytes=v.smem_bytes, defines=defines)

    def with_defines(self, defines: dict | None) -> "Stage":
        """The production build that a call's defines select: a bf16 measurement variant
        (BF16_BLOCK_N=..., builds.BF16_VARIANTS) runs with its own tile, threads and shared
        memory instead of its head dim's row (the grid, the TMA boxes, the walk's tile counts
        read them from here); any other stage or defines: this stage. ValueError for a
        variant that names no row, or a masked call of a variant whose BLOCK_N is no power of
        two (the masked walk shifts by log2 BLOCK_N)."""
        if not self.production or not defines or "BF16_BLOCK_N" not in defines:
            return self
        own = dict(self.defines)
        head_dim = int(own.get("HEAD_DIM", self.head_dims[0]))
        b = builds.bf16_variant(head_dim, defines)
        if ("PTXATTN_MASKED" in own or "PTXATTN_VARLEN" in own
                or "PTXATTN_MASKED" in defines) and b.block_n_shift is None:
            raise ValueError(f"bf16 variant {b.variant}: dense only (its {b.block_n}-key tiles: "
                             "the masked walk shifts by log2 BLOCK_N); no causal or window call")
        return dataclasses.replace(self, block_m=b.block_m, block_n=b.block_n,
                                   threads=b.threads, smem_bytes=b.smem_bytes)

    def unsupported(self, head_dim: int, seq_q: int, seq_k: int) -> str | None:
        """Why this stage cannot run the shape, or None when it can."""
        if head_dim not in self.head_dims:
            return f"head dim {head_dim} (takes {', '.join(map(str, self.head_dims))})"
        if self.any_length:
            if seq_q <= 0:
                return f"query length {seq_q} (takes lengths >= 1)"
            if seq_k <= 0:
                return f"key length {seq_k} (takes lengths >= 1)"
            return None
        if seq_q <= 0 or seq_q % self.block_m:
            return f"query length {seq_q} (takes positive multiples of {self.block_m})"
        if seq_k <= 0 or seq_k % self.block_n:
            return f"key length {seq_k} (takes positive multiples of {self.block_n})"
        return None

    def grid(self, batch: int, heads: int, seq_q: int, sm_count: int) -> tuple[int, int, int]:
        tiles = -(-seq_q // self.block_m)      # a ragged last tile is a tile
        if self.persistent:
            return (min(sm_count, tiles * heads * batch), 1, 1)
        return (tiles, heads, batch)


def _sm90(number: int, name: str, idea: str, **geometry) -> Stage:
    """A Hopper stage: ptx/sm90/NN_name.ptx, built for sm_90a."""
    return Stage(number=number, name=name, idea=idea, arch="sm_90a",
                 file=f"sm90/{number:02d}_{name}.ptx", **geometry)


# Stages 5 on: a producer warpgroup and two consumer warpgroups of 64 query rows each.
_TWO_CONSUMERS = dict(threads=384, block_m=128, swizzle=SWIZZLE_128B)
_KV16 = 16384                  # one 64-row bf16 tile of D = 128 (Q, K or V)

STAGES: tuple[Stage, ...] = (
    _sm90(1, "baseline",
          "one warpgroup, 64 query rows; TMA without swizzle; wgmma SS for QK^T and PV; "
          "P through shared memory; every step waited on",
          threads=128, block_m=64, block_n=64,
          # Q, K, V 16 KiB each + P 8 KiB + 2 mbarriers (64 B) + 1 KiB slack to align the base
          smem_bytes=3 * _KV16 + 8192 + 64 + 1024),
    _sm90(2, "p_in_registers", "PV as wgmma RS: P stays in registers as the A fragments",
          threads=128, block_m=64, block_n=64, smem_bytes=3 * _KV16 + 64 + 1024),
    _sm90(3, "swizzle", "128-byte swizzled TMA boxes and wgmma descriptors",
          threads=128, block_m=64, block_n=64, swizzle=SWIZZLE_128B,
          smem_bytes=3 * _KV16 + 64 + 1024),
    _sm90(4, "warp_specialization",
          "a producer warpgroup issues TMA, a consumer warpgroup computes; "
          "mbarrier FULL/EMPTY; setmaxnreg",
          threads=256, block_m=64, block_n=64, swizzle=SWIZZLE_128B,
          smem_bytes=3 * _KV16 + 64 + 1024),
    _sm90(5, "two_q_tiles", "two consumer warpgroups (128 query rows) share every K/V tile",
          block_n=64, smem_bytes=4 * _KV16 + 64 + 1024, **_TWO_CONSUMERS),
    _sm90(6, "load_pipeline", "2-stage K/V ring, K and V on separate FULL/EMPTY barriers",
          block_n=64, smem_bytes=6 * _KV16 + 128 + 1024, **_TWO_CONSUMERS),
    _sm90(7, "compute_pipeline",
          "QK^T of tile i in flight during PV of tile i-1 and the softmax; "
          "inter-warpgroup pingpong on named barriers",
          block_n=64, smem_bytes=6 * _KV16 + 128 + 1024, **_TWO_CONSUMERS),
    _sm90(8, "hardware_exp2", "log2-domain softmax: scale folded into one FFMA, ex2.approx.ftz",
          block_n=64, smem_bytes=6 * _KV16 + 128 + 1024, **_TWO_CONSUMERS),
    _sm90(9, "software_exp2",
          "a share of the exponentials as a degree-3 polynomial on the FMA pipe",
          block_n=64, smem_bytes=6 * _KV16 + 128 + 1024, **_TWO_CONSUMERS),
    _sm90(10, "register_budget",
          "128-row K/V tiles: S 64 x 128 per consumer in the freed register budget",
          block_n=128, smem_bytes=10 * _KV16 + 128 + 1024, **_TWO_CONSUMERS),
    _sm90(11, "skip_o_rescale",
          "rebase the running max only when it grows by more than 2^8; skip the O rescale",
          block_n=128, smem_bytes=10 * _KV16 + 128 + 1024, **_TWO_CONSUMERS),
    _sm90(12, "tma_store_epilogue",
          "O leaves through stmatrix -> shared (the dead Q tile) -> one TMA store",
          block_n=128, smem_bytes=10 * _KV16 + 128 + 1024, **_TWO_CONSUMERS),
    _sm90(13, "uniform_descriptors",
          "descriptors stepped in fresh registers, warpgroup index shuffled: all descriptor "
          "math on the uniform datapath (replaces early PV, see bench/README.md)",
          block_n=128, smem_bytes=10 * _KV16 + 128 + 1024, **_TWO_CONSUMERS),
    _sm90(14, "persistent",
          "grid = SM count, static tile scheduler, next tile's Q loaded under the epilogue",
          block_n=128, persistent=True,
          # Q 32 KiB + K/V ring 128 KiB + O staging 32 KiB + 10 mbarriers + alignment slack
          smem_bytes=12 * _KV16 + 128 + 1024, **_TWO_CONSUMERS),
    _sm90(15, "dynamic_scheduler",
          "persistent CTAs take tiles from a global counter (atom.add), fetched a tile ahead",
          block_n=128, persistent=True, dynamic_tiles=True,
          smem_bytes=12 * _KV16 + 128 + 1024, **_TWO_CONSUMERS),
    # Past the peers (issue 13): each stage one idea on stage 14, measured against it.
    _sm90(16, "rowsum_mma",
          "row sums of P on the tensor cores (P times a tile of ones, beside PV): no FADD "
          "per score",
          built_on=14, block_n=128, persistent=True,
          # stage 14's layout + the mbarriers' atom rounded up to 1 KiB + 2 KiB of ones
          smem_bytes=12 * _KV16 + 1024 + 2048 + 1024, **_TWO_CONSUMERS),
    _sm90(17, "tiles_back_to_back",
          "a persistent CTA's K/V steps run on across tiles: the next tile's first S beside "
          "this tile's last PV; Q double-buffered",
          built_on=14, block_n=128, persistent=True,
          # Q 2 x 32 KiB + K/V ring 128 KiB + O staging 32 KiB + 12 mbarriers + alignment slack
          smem_bytes=14 * _KV16 + 128 + 1024, **_TWO_CONSUMERS),
    _sm90(18, "q_tile_ahead",
          "Q double-buffered: the producer loads a tile's Q a whole tile ahead, not after the "
          "tile before's last S (stage 17's second buffer without its boundary step)",
          built_on=14, block_n=128, persistent=True,
          smem_bytes=14 * _KV16 + 128 + 1024, **_TWO_CONSUMERS),
)


@dataclass(frozen=True)
class Variant:
    """One build of the production kernel as the launcher needs it: what the preprocessor
    defines select in the PTX (ptx/sm90/production/forward.ptx reads HEAD_DIM and
    PTXATTN_MASKED), its figures taken from the build table (ptxattn/builds.py)."""
    block_n: int               # key/value rows per tile
    kv_stages: int             # K/V ring depth
    smem_bytes: int            # dynamic shared memory per CTA
    block_m: int = 128         # query rows per tile: 64 per consumer warpgroup
    threads: int = 384         # a producer warpgroup and block_m / 64 consumers

    @classmethod
    def of(cls, build: builds.Build) -> "Variant":
        return cls(block_n=build.block_n, kv_stages=build.kv_stages, smem_bytes=build.smem_bytes,
                   block_m=build.block_m, threads=build.threads)


# (head dim, masked) -> the build. masked: causal or sliding-window (the mask code is compiled
# in only where it is used; the tiles and shared memory are the head dim's either way). Derived
# from the build table, the one place each build's figures are written.
PRODUCTION_VARIANTS: dict[tuple[int, bool], Variant] = {
    (b.head_dim, masked): Variant.of(b) for b in builds.BUILDS for masked in (False, True)}

# The production kernel: stage 14 grown to the shapes real models send (ptx/sm90/production/,
# composed by forward.ptx). attention() uses it by default; stage= picks a lineage stage instead.
# Its geometry here is the default build's; specialize() gives each call's.
_DEFAULT_BUILD = builds.get(builds.DEFAULT_HEAD_DIM)
PRODUCTION = Stage(number=0, name="production", arch="sm_90a", file="sm90/production/forward.ptx",
                   idea="stage 14 + any lengths (ragged tiles masked), Lq != Lk, GQA/MQA, "
                        "log-sum-exp out, causal and sliding-window masks, Q loaded a tile "
                        "ahead; three consumer warpgroups at D = 64",
                   threads=_DEFAULT_BUILD.threads, block_m=_DEFAULT_BUILD.block_m,
                   block_n=_DEFAULT_BUILD.block_n, smem_bytes=_DEFAULT_BUILD.smem_bytes,
                   swizzle=SWIZZLE_128B, persistent=True, production=True,
                   head_dims=builds.HEAD_DIMS)


# Fastest first, as measured on the H200 (bench/README.md, the latest results file): the order
# in which attention(stage=None) tries stages. A later stage is not always a faster one (4 and 5
# trade the free inter-CTA overlap of 3 for structure that pays off from 6 on), so the default
# follows measurement, not numbering. Stages missing here come last, highest number first.
# tests/test_bench.py checks this order against the newest results JSON in bench/results: no
# stage may be slower than one listed after it by more than 2% (geometric mean over shapes).
FASTEST_FIRST: tuple[int, ...] = (17, 18, 14, 15, 13, 12, 16, 11, 10, 8, 9, 7, 3, 6, 4, 5, 2, 1)


def _short_arch(arch: str) -> str:
    """"sm_100a" -> "sm100": the prefix of a label."""
    return arch.replace("_", "").rstrip("af")


def lineage(arch: str | None) -> str | None:
    """The lineage (HOPPER or BLACKWELL) that `arch` names ("sm_100a", "sm100", "blackwell",
    any case), or None when it names none (e.g. "sm_89": a ptxas target, not a lineage)."""
    if arch is None:
        return None
    text = str(arch).strip().lower()
    for name, spellings in _ARCH_NAMES.items():
        if text in spellings:
            return name
    return None


def check_arch(arch: str | None) -> str:
    """`arch` as a lineage (None: Hopper's), or ValueError naming the argument."""
    if arch is None:
        return HOPPER
    found = lineage(arch)
    if found is None:
        raise ValueError(f"arch: expected {HOPPER} (the Hopper lineage) or {BLACKWELL} (the "
                         f"Blackwell lineage), got {arch!r}")
    return found


def lineage_for(cc: tuple[int, int]) -> str | None:
    """The lineage whose kernels a device of compute capability `cc` runs: 9.0 Hopper's, 10.0
    Blackwell's (sm_100a code runs on 10.0 alone, like sm_90a on 9.0); None for any other."""
    return {(9, 0): HOPPER, (10, 0): BLACKWELL}.get(tuple(cc))


# The Blackwell lineage (assembled and SASS-checked, never run here): stages_sm100's rows as
# records. That module holds plain data and imports nothing of ours, so no import runs back.
SM100_STAGES: tuple[Stage, ...] = tuple(Stage(**row) for row in stages_sm100.SM100_ROWS)


def all_stages(arch: str | None = HOPPER) -> tuple[Stage, ...]:
    """A lineage (the textbook), in order: Hopper's by default, arch="sm_100a" Blackwell's."""
    arch = check_arch(arch)
    return STAGES if arch == HOPPER else tuple(SM100_STAGES)


def all_kernels(arch: str | None = HOPPER) -> tuple[Stage, ...]:
    """Every registered kernel of a lineage: Hopper's production kernel, then its lineage;
    Blackwell's lineage alone (it has no production kernel)."""
    arch = check_arch(arch)
    return (PRODUCTION,) + STAGES if arch == HOPPER else all_stages(arch)


def by_speed(arch: str | None = HOPPER) -> tuple[Stage, ...]:
    """A lineage's stages, fastest first. Hopper's: FASTEST_FIRST (measured), then the rest by
    falling number. Blackwell's has never been timed: its FASTEST_FIRST when stages_sm100
    defines one (a prediction), else by falling number, as the published lineage got faster
    step by step."""
    arch = check_arch(arch)
    order = FASTEST_FIRST if arch == HOPPER else getattr(stages_sm100, "FASTEST_FIRST", ())
    rank = {n: i for i, n in enumerate(order)}
    return tuple(sorted(all_stages(arch), key=lambda s: (rank.get(s.number, len(rank)),
                                                          -s.number)))


def get_stage(key: str | int | Stage, arch: str | None = None) -> Stage:
    """Look a stage up by number (1, "1", "01", "stage1", "stage01") or name ("baseline").

    The lineages' numbers collide: a plain key is Hopper's unless `arch` names another lineage
    ("sm_100a"), or the key names its own: "sm100_stage05" (the stage's label), "sm100:5",
    "sm_100a/baseline". A Stage is returned as it is."""
    if isinstance(key, Stage):
        if arch is not None and key.arch != check_arch(arch):
            raise ValueError(f"stage: {key.title} is a {key.arch} kernel, not {check_arch(arch)}")
        return key
    wanted = check_arch(arch)
    text = str(key).strip().lower()
    qualified = _QUALIFIED.fullmatch(text)
    if qualified and lineage(qualified.group(1)):
        named = lineage(qualified.group(1))
        if arch is not None and named != wanted:
            raise ValueError(f"stage: {key!r} names a {named} stage, but arch {wanted} was "
                             f"asked for")
        wanted, text = named, qualified.group(2)
    if text in (PRODUCTION.name, "prod"):
        if wanted == HOPPER:
            return PRODUCTION
        raise ValueError(f"stage: there is no production kernel for {wanted} (only the Hopper "
                         f"lineage has one); name a {wanted} lineage stage, see `ptxattn list`")
    match = re.fullmatch(r"(?:stage)?0*(\d+)", text)
    lineage_stages = all_stages(wanted)
    for stage in lineage_stages:
        if match and int(match.group(1)) == stage.number:
            return stage
        if text in (stage.name, f"{stage.number:02d}_{stage.name}"):
            return stage
    if wanted != HOPPER:
        if not lineage_stages:
            raise ValueError(f"stage: no {wanted} stage is registered yet (got {key!r}); "
                             f"see `ptxattn list`")
        first, last = lineage_stages[0], lineage_stages[-1]
        raise ValueError(f"stage: unknown {wanted} stage {key!r}; its lineage is {first.title} "
                         f"to {last.title}, by number (1, 01, stage1) or by name; see "
                         f"`ptxattn list`")
    first, last = STAGES[0], STAGES[-1]   # a range, not every name: errors stay one short line
    raise ValueError(f"stage: unknown stage {key!r}; kernels are production (the default) and "
                     f"the lineage {first.label} ({first.name}) to {last.label} ({last.name}), "
                     f"by number (1, 01, stage1) or by name; see `ptxattn list`")


def ptx_root() -> Path:
    """The kernels' folder: the package's own copy where ptxattn was installed from a wheel
    (`pip install .`, `pip install git+...`: ptx/ is package data, ptxattn/_ptx), else the
    checkout's ptx/ beside the package (a source tree, `pip install -e .`)."""
    package = Path(__file__).resolve().parent
    installed = package / "_ptx"
    return installed if installed.is_dir() else package.parent / "ptx"

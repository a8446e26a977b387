"""The decode kernels' build table: one row per head dim, the only source of their tiles.

ptx/sm90/production/decode.ptx (split-KV decode with packed GQA) and combine.ptx read these
figures from a generated header, ptx/sm90/include/gen_decode.ptxh (ptxattn/tools/decode_gen.py
writes it; tests/test_decode_cpu.py checks the committed header equals its output), and the
launcher (ptxattn/decode.py) reads them from here: block_n, ring depth, shared memory.

A decode CTA is one consumer warpgroup (64 packed query rows: the g = H / Hkv query heads of
one K/V head x the Lq query positions) and one producer warp (TMA loads of K and V tiles into
an mbarrier ring): 160 threads, no setmaxnreg.

Shared memory, in this order from a 1024-aligned base (every tile 128-byte swizzled,
[D / 64][rows][64 elements]):
    Q     64 rows x D x 2 bytes
    K     kv_stages slots of block_n x D x 2 bytes
    V     kv_stages slots of the same
    mbarriers: FULL_K, FULL_V, EMPTY_K, EMPTY_V, kv_stages each (8 bytes)
    the sequence's length (one word, 8 bytes of room)
plus ALIGN_SLACK to round the dynamic base up to 1024.
"""

from __future__ import annotations

from dataclasses import dataclass

ROWS = 64                    # packed query rows per CTA: one wgmma M
THREADS = 160                # consumer warpgroup (warps 0-3) + producer warp (warp 4)
MAX_QUERIES = 16             # Lq per call; longer query blocks go to attention()
MAX_SPLITS = 128             # the combine reads at most 4 x 32 split LSEs per row
ALIGN_SLACK = 1024           # the kernel rounds the dynamic base up to 1024
SMEM_PER_SM = 228 * 1024     # sm_90: shared memory of an SM
SMEM_PER_CTA_MAX = 227 * 1024
SMEM_RESERVED_PER_CTA = 1024  # the system's share of each resident CTA
REGISTERS_PER_SM = 65536
MIN_PAGE_SIZE = 16           # a paged cache's page: 16 .. 256 rows, a power of two (a
MAX_PAGE_SIZE = 256          # multiple of the 8-row swizzle pattern; at most a TMA box)
COMBINE_THREADS = 256        # one warp per output row, 8 rows a CTA
APPEND_THREADS = 256         # one thread per 16 bytes of a new key or value row


@dataclass(frozen=True)
class DecodeBuild:
    """One build of the decode kernel (a head dim): what the #defines of gen_decode.ptxh say."""
    head_dim: int
    block_n: int             # keys per K/V tile (the N of S = Q K^T)
    kv_stages: int           # ring depth: K/V tile pairs in shared memory
    ctas_per_sm: int         # resident CTAs the table is sized for (.minnctapersm)
    combine_batch: int       # splits whose partial O the combine loads at once
    why: str                 # the reason for this row, one line

    @property
    def q_bytes(self) -> int:
        return ROWS * self.head_dim * 2

    @property
    def kv_tile_bytes(self) -> int:
        return self.block_n * self.head_dim * 2

    @property
    def smem_q(self) -> int:
        return 0

    @property
    def smem_k(self) -> int:
        return self.smem_q + self.q_bytes

    @property
    def smem_v(self) -> int:
        return self.smem_k + self.kv_stages * self.kv_tile_bytes

    @property
    def smem_barriers(self) -> int:
        return self.smem_v + self.kv_stages * self.kv_tile_bytes

    def barrier(self, kind: str) -> int:
        """Offset of the first barrier of a kind: FULL_K, FULL_V, EMPTY_K, EMPTY_V."""
        order = ("FULL_K", "FULL_V", "EMPTY_K", "EMPTY_V")
        return self.smem_barriers + order.index(kind) * 8 * self.kv_stages

    @property
    def smem_seq_len(self) -> int:
        """The word the producer's leader stores the sequence's raw length in (read once per
        CTA, so every thread of it sees the same length)."""
        return self.smem_barriers + 4 * 8 * self.kv_stages

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory per CTA: the carve-up, its barriers, the length word and the
        alignment slack."""
        return self.smem_seq_len + 8 + ALIGN_SLACK

    @property
    def s_regs(self) -> int:
        return self.block_n // 2

    @property
    def o_regs(self) -> int:
        return self.head_dim // 2

    @property
    def max_pages_per_tile(self) -> int:
        """Pages a K/V tile spans at the smallest page size (the paged build's boxes a tile)."""
        return max(1, self.block_n // MIN_PAGE_SIZE)

    @property
    def combine_cols(self) -> int:
        """fp32 columns of a row that one lane of the combine's warp handles."""
        return self.head_dim // 32

    def check(self) -> None:
        """The constraints the PTX relies on; ValueError naming the broken one."""
        d, n = self.head_dim, self.block_n
        if d not in (64, 128, 256):
            raise ValueError(f"head dim {d}: the decode kernel is built for 64, 128 and 256")
        if n not in (64, 128):
            raise ValueError(f"block_n {n}: the score fragments are generated for 64 and 128")
        if self.kv_stages < 2:
            raise ValueError(f"kv_stages {self.kv_stages}: the ring needs two slots at least")
        if self.smem_bytes > SMEM_PER_CTA_MAX:
            raise ValueError(f"D {d}: {self.smem_bytes} bytes of shared memory per CTA exceed "
                             f"{SMEM_PER_CTA_MAX}")
        if self.ctas_per_sm * (self.smem_bytes + SMEM_RESERVED_PER_CTA) > SMEM_PER_SM:
            raise ValueError(f"D {d}: {self.ctas_per_sm} CTAs of {self.smem_bytes} bytes do not "
                             f"fit an SM's {SMEM_PER_SM}")
        if self.s_regs + self.o_regs + self.block_n // 4 > 230:
            raise ValueError(f"D {d}: S, P and O need {self.s_regs + self.o_regs + n // 4} "
                             "registers a thread")
        if self.combine_cols not in (2, 4, 8):
            raise ValueError(f"D {d}: the combine loads 2, 4 or 8 floats a lane")


# One row per head dim: the tile and ring each needs, with its reason.
DECODE_BUILDS: dict[int, DecodeBuild] = {
    64: DecodeBuild(64, block_n=128, kv_stages=3, ctas_per_sm=2, combine_batch=16,
                    why="K/V tiles of 16 KiB: 104 KiB a CTA, so two CTAs share an SM and "
                        "one's start and end hide under the other's stream"),
    128: DecodeBuild(128, block_n=128, kv_stages=3, ctas_per_sm=1, combine_batch=16,
                     why="production's 128-key tiles (32 KiB each of K and V): three slots "
                         "keep 128 KiB in flight while one is computed"),
    256: DecodeBuild(256, block_n=64, kv_stages=3, ctas_per_sm=1, combine_batch=8,
                     why="O is 128 registers a thread: 64-key tiles keep S at 32; three "
                         "32 KiB slot pairs fill 224 KiB"),
}

for _build in DECODE_BUILDS.values():
    _build.check()


# ---- the paged build's variants (issue 25: paged decode at small pages) ---------------------
#
# Below a page of BLOCK_N keys a K or V tile comes from several pages. How the producer turns a
# tile's block-table entries into TMA loads is a variant of the paged build, chosen per call
# (PTXATTN_PAGED_VARIANT=name, else DEFAULT_PAGED_VARIANT) so that one process can time them
# all; each is its own JIT build (its defines below, read by decode_kv_address.ptxh).


@dataclass(frozen=True)
class PagedVariant:
    """One way of loading a paged cache's K/V tiles (decode_kv_address.ptxh)."""
    name: str
    row_group: bool = False   # (a) tiles laid out [BLOCK_N / 8][D / 64][8][64]: one TMA box per
    #                           page over all of D, instead of one per page and 64 columns of D
    table_ahead: int = 0      # (b) the page numbers of tile t + 1 read while tile t's boxes go
    #                           out (0: a tile's own, before its ring wait); implies batched
    batched_reads: bool = False  # (e) a tile's table reads issued together, then used (today:
    #                           read, check, read, check: ptxas serializes them)
    warp: bool = False        # (e) the producer's whole warp runs its loop: lane j reads page j,
    #                           a shuffle shares the pages (warp-uniform, so the boxes' operands
    #                           stay on the uniform datapath) and one elected lane issues
    split_factor: int = 1     # (d) the split heuristic's count x this, at pages below a tile
    why: str = ""

    @property
    def defines(self) -> dict[str, int]:
        """The decode kernel's defines of this variant (none for today's build)."""
        out = {}
        if self.row_group:
            out["PTXATTN_PAGED_ROW_GROUP"] = 1
        if self.table_ahead:
            out["PTXATTN_PAGED_TABLE_AHEAD"] = self.table_ahead
        elif self.batched_reads:
            out["PTXATTN_PAGED_BATCHED_READS"] = 1
        if self.warp:
            out["PTXATTN_PAGED_WARP"] = 1
        return out


PAGED_VARIANTS: dict[str, PagedVariant] = {v.name: v for v in (
    PagedVariant("today", why="a box per page and 64 columns of D (16 of 2 KiB a 128-key tile "
                              "at D 128, page 16); a tile's table entries read one by one"),
    PagedVariant("batched", batched_reads=True,
                 why="the tile's entries loaded together (one round trip, not eight), then "
                     "checked"),
    PagedVariant("ahead", table_ahead=1,
                 why="tile t + 1's entries in flight while tile t's boxes are issued: no "
                     "table latency before a tile's first box"),
    PagedVariant("warp", warp=True,
                 why="the SASS: today's single issuing thread pays ~28 instructions a box "
                     "(a per-lane loop around each box, its operands moved to uniform "
                     "registers); the warp's uniform pages cut that to ~4"),
    PagedVariant("warp_ahead", warp=True, table_ahead=1,
                 why="the warp's reads, one tile ahead"),
    PagedVariant("rowgroup", row_group=True,
                 why="one box per page over all of D (8 of 4 KiB a tile at D 128, page 16): "
                     "half the boxes; the consumer's descriptors follow the layout"),
    PagedVariant("rowgroup_ahead", row_group=True, table_ahead=1,
                 why="both: half the boxes, and no table latency before them"),
    PagedVariant("rowgroup_warp", row_group=True, warp=True,
                 why="half the boxes, each a few uniform instructions"),
    PagedVariant("rowgroup_warp_ahead", row_group=True, warp=True, table_ahead=1,
                 why="every candidate at once: half the boxes, uniform issue, reads ahead"),
    PagedVariant("splits2x", split_factor=2,
                 why="twice the heuristic's splits at pages below a tile: shorter CTAs, more of "
                     "them per wave"),
)}
# the measured default: warp_ahead was the fastest at pages 16 and 32 on the H200 and within
# 1% of today's at 64 (paged / contiguous 1.007 / 0.972 at 16, 0.994 / 0.984 at 64; the
# notes, "paged variants on the device"), its output bit for bit the contiguous cache's
DEFAULT_PAGED_VARIANT = "warp_ahead"
FALLBACK_PAGED_VARIANT = "today"         # where a row-group variant's layout cannot read the
#                                          caches (pages not packed page_size rows apart)
PAGED_VARIANT_ENV = "PTXATTN_PAGED_VARIANT"


def paged_variant(name: str | None = None) -> PagedVariant:
    """The variant named (else PTXATTN_PAGED_VARIANT, else the default); ValueError naming the
    knob for an unknown name."""
    import os
    if name is None:
        name = os.environ.get(PAGED_VARIANT_ENV, "").strip() or DEFAULT_PAGED_VARIANT
    variant = PAGED_VARIANTS.get(name)
    if variant is None:
        raise ValueError(f"{PAGED_VARIANT_ENV}: {name!r} is not a paged build variant (one of "
                         f"{', '.join(PAGED_VARIANTS)})")
    return variant


def build_for(head_dim: int) -> DecodeBuild:
    """The row for a head dim, or ValueError naming q's head dim."""
    build = DECODE_BUILDS.get(head_dim)
    if build is None:
        raise ValueError(f"q: head dim {head_dim} is not one the decode kernel is built for "
                         f"({', '.join(map(str, sorted(DECODE_BUILDS)))})")
    return build

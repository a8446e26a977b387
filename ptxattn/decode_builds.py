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


def build_for(head_dim: int) -> DecodeBuild:
    """The row for a head dim, or ValueError naming q's head dim."""
    build = DECODE_BUILDS.get(head_dim)
    if build is None:
        raise ValueError(f"q: head dim {head_dim} is not one the decode kernel is built for "
                         f"({', '.join(map(str, sorted(DECODE_BUILDS)))})")
    return build

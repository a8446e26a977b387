"""The Blackwell (sm_100a) lineage: one entry per hand-written kernel in ptx/sm100/.

The B200 steps of the published kernel, written in PTX with tcgen05 MMAs accumulating in tensor
memory. No B200 is lent to this project: these kernels are assembled with ptxas for sm_100a and
their SASS is checked in CI (tests/test_sm100_ptx.py), but none has run here. ptx/sm100/README.md
says what each stage is expected to do on a B200.

Kept apart from stages.py (the Hopper lineage and the production kernel) so that the two
lineages grow independently; stages.py's registry functions take an arch to reach these.
The rows here are plain data, the fields of a stages.Stage; stages.py makes them the records
(stages.SM100_STAGES). So this module imports nothing of ptxattn, and the registry, which
imports it, is never imported back.
"""

from __future__ import annotations

SWIZZLE_128B = "128B"          # stages.SWIZZLE_128B (a Stage's swizzle is this string)


def _sm100(number: int, name: str, idea: str, **geometry) -> dict:
    """A Blackwell stage's fields: ptx/sm100/NN_name.ptx, built for sm_100a."""
    return dict(number=number, name=name, idea=idea, arch="sm_100a",
                file=f"sm100/{number:02d}_{name}.ptx", **geometry)


# Every stage: D = 128, BLOCK_N = 128 key rows a step, Q (and O) TMA boxes of 128 rows (one
# tcgen05.mma M = 128 tile, one TMEM lane a query row). Stages 5 on hold two Q tiles per CTA.
_TILE = 32768                  # one 128-row bf16 tile of D = 128 (Q, K or V)
_SLACK = 1024                  # the kernels align the dynamic shared memory base to 1024 bytes
_ONE_Q = dict(block_m=128, block_n=128, q_box_rows=128)
_TWO_Q = dict(threads=384, block_m=256, block_n=128, q_box_rows=128, swizzle=SWIZZLE_128B)
# Stage 12 on: two softmax warpgroups, a correction warpgroup and the issue warpgroup.
_FOUR_WG = dict(_TWO_Q, threads=512)

# In lineage order; a stage's diff from the one before it is its idea. stages.SM100_STAGES holds
# them as Stage records.
SM100_ROWS: tuple[dict, ...] = (
    _sm100(1, "baseline",
           "one warpgroup, 128 query rows (a TMEM lane each); TMA without swizzle; tcgen05.mma "
           "into TMEM; P through shared memory; every step waited on",
           threads=128, **_ONE_Q,
           # Q, K, V, P 32 KiB each + 3 mbarriers and the TMEM address slot
           smem_bytes=4 * _TILE + 64 + _SLACK),
    _sm100(2, "p_in_tmem", "P to tensor memory over S (tcgen05.st); PV reads A from TMEM",
           threads=128, **_ONE_Q, smem_bytes=3 * _TILE + 64 + _SLACK),
    _sm100(3, "swizzle", "128-byte swizzled TMA boxes and tcgen05 descriptors",
           threads=128, **_ONE_Q, swizzle=SWIZZLE_128B, smem_bytes=3 * _TILE + 64 + _SLACK),
    _sm100(4, "warp_specialization",
           "a load warp, an MMA warp and the softmax warpgroup meet only at mbarriers",
           threads=192, **_ONE_Q, swizzle=SWIZZLE_128B, smem_bytes=3 * _TILE + 64 + _SLACK),
    _sm100(5, "two_q_tiles",
           "two softmax warpgroups (256 query rows) share every K/V tile; setmaxnreg",
           **_TWO_Q, smem_bytes=4 * _TILE + 128 + _SLACK),
    _sm100(6, "load_pipeline", "2-slot K/V ring, K and V on separate FULL/EMPTY barriers",
           **_TWO_Q, smem_bytes=6 * _TILE + 256 + _SLACK),
    _sm100(7, "compute_pipeline",
           "QK^T of a Q tile's next K tile issued right after its PV: the softmax warpgroups "
           "alternate",
           **_TWO_Q, smem_bytes=6 * _TILE + 256 + _SLACK),
    _sm100(8, "hardware_exp2", "log2-domain softmax: scale folded into one FFMA, ex2.approx.ftz",
           **_TWO_Q, smem_bytes=6 * _TILE + 256 + _SLACK),
    _sm100(9, "software_exp2",
           "a share of the exponentials (SW_EXP2_PER_8, default 2 of 8) as a degree-3 "
           "polynomial on the FMA pipe",
           **_TWO_Q, smem_bytes=6 * _TILE + 256 + _SLACK),
    _sm100(10, "register_caching",
           "each score used once from the register it landed in: exponential, row sum and bf16 "
           "pair in one pass; P stored in two halves as each is ready",
           **_TWO_Q, smem_bytes=6 * _TILE + 256 + _SLACK),
    _sm100(11, "skip_o_rescale",
           "rebase a row's running max only when it grows by more than 2^8; a warp with no "
           "rebased row leaves O in TMEM alone",
           **_TWO_Q, smem_bytes=6 * _TILE + 256 + _SLACK),
    _sm100(12, "split_correction",
           "a correction warpgroup rescales O in TMEM (and runs the epilogue) while the softmax "
           "warpgroups compute the exponentials",
           **_FOUR_WG, smem_bytes=6 * _TILE + 2048 + 256 + _SLACK),
    _sm100(13, "early_pv",
           "PV starts on the first half of P (keys 0-63) while the softmax computes the second",
           **_FOUR_WG, smem_bytes=6 * _TILE + 2048 + 256 + _SLACK),
    _sm100(14, "persistent",
           "grid = SM count, static tile scheduler; the next tile's Q and S under the epilogue",
           **_FOUR_WG, persistent=True, smem_bytes=6 * _TILE + 2048 + 256 + _SLACK),
    # Minor steps. The published lineage's own were not found; these are our Hopper lineage's
    # steps past its stage 14 that apply to Blackwell (ptx/sm100/README.md says why these two).
    _sm100(15, "dynamic_scheduler",
           "persistent CTAs take tiles from a global counter (atom.add), fetched a tile ahead; "
           "the load warp hands each tile index to the other roles through shared memory",
           **_FOUR_WG, persistent=True, dynamic_tiles=True,
           # stage 14's layout + 4 mbarriers and 2 tile index slots past its 256 bytes
           smem_bytes=6 * _TILE + 2048 + 512 + _SLACK),
    _sm100(16, "tma_store_epilogue",
           "O leaves through a 128-byte swizzled staging tile in shared memory and one TMA "
           "store per Q tile",
           built_on=14, **_FOUR_WG, persistent=True,
           # Q, K, V 6 tiles + CORR 1 KiB + mbarriers 1 KiB + one O staging tile (the row sums
           # over its first KiB): 227 KiB with the slack, the most a CTA may have
           smem_bytes=7 * _TILE + 2048 + _SLACK),
)

# The order attention() tries these stages in on a B200 (stages.by_speed), the rest after them
# by falling number. Never timed: a prediction from the same ideas on the H200, where the
# TMA-store epilogue was a gain and the dynamic scheduler was slower than the static list.
FASTEST_FIRST: tuple[int, ...] = (16, 14, 15)

# The Hopper stage of the same idea, where its number is not the Blackwell stage's own (each
# sm100 header says how it differs from it): the TMA-store epilogue was Hopper's stage 12.
HOPPER_SAME_IDEA: dict[int, int] = {16: 12}

# What each stage's SASS must hold for its idea to be there (opcode names as nvdisasm prints
# them for sm_100a, checked against ptxas 13.0), checked by tests/test_sm100_ptx.py: stage
# number -> opcode prefixes.
#   UTCHMMA     tcgen05.mma .kind::f16            UTCBAR      tcgen05.commit to an mbarrier
#   LDTM / STTM tcgen05.ld / tcgen05.st           UTCATOMSWS  tcgen05.alloc / dealloc
#   UTMALDG     TMA tensor load                   SYNCS       mbarrier wait / arrive
#   USETMAXREG  setmaxnreg                        STS         P to shared memory (stage 1)
#   MUFU.EX2    ex2.approx                        FADD.RM     the polynomial exp2's floor (stage 9)
#   VOTE.ANY    the warp's rescale-or-skip vote (stage 11)
#   LDS         the correction factors handed to the correction warpgroup (stage 12)
#   ATOMG.E.ADD the dynamic scheduler's atom.add on the tile counter (stage 15)
#   UTMASTG     TMA tensor store (stage 16)
_EVERY = ("UTCHMMA", "UTCBAR", "LDTM", "STTM", "UTCATOMSWS", "UTMALDG", "SYNCS")
SASS_NEEDS: dict[int, tuple[str, ...]] = {
    1: _EVERY + ("STS.128",),
    2: _EVERY,
    3: _EVERY,
    4: _EVERY,
    5: _EVERY + ("USETMAXREG",),
    6: _EVERY + ("USETMAXREG",),
    7: _EVERY + ("USETMAXREG",),
    8: _EVERY + ("USETMAXREG", "MUFU.EX2"),
    9: _EVERY + ("USETMAXREG", "MUFU.EX2", "FADD.RM"),
    10: _EVERY + ("USETMAXREG", "MUFU.EX2", "FADD.RM"),
    11: _EVERY + ("USETMAXREG", "MUFU.EX2", "FADD.RM", "VOTE.ANY"),
    12: _EVERY + ("USETMAXREG", "MUFU.EX2", "FADD.RM", "VOTE.ANY", "LDS"),
    13: _EVERY + ("USETMAXREG", "MUFU.EX2", "FADD.RM", "VOTE.ANY", "LDS"),
    14: _EVERY + ("USETMAXREG", "MUFU.EX2", "FADD.RM", "VOTE.ANY", "LDS"),
    15: _EVERY + ("USETMAXREG", "MUFU.EX2", "FADD.RM", "VOTE.ANY", "LDS", "ATOMG.E.ADD"),
    16: _EVERY + ("USETMAXREG", "MUFU.EX2", "FADD.RM", "VOTE.ANY", "LDS", "UTMASTG"),
}

"""The register fragments the FP8 path assumes (ptxattn/fp8_reference.py), checked against
machine-readable sources rather than the ISA's figures (CPU only, no GPU).

The FP8 forward packs P (e4m3) from the S accumulator's registers straight into the A
fragments of the P V wgmma (PACK_P_FP8, gen_fp8.ptxh), and the quantizer permutes the keys of
each group of 32 in V^T to match (fp8_reference.PV_KEY_ORDER). The fragment maps came from the
PTX ISA's mma.m16n8k32 text and the wgmma per-warp convention, since the ISA's wgmma k32 figure
is an image. Here they are checked against:

  - CUTLASS's cute MMA traits for SM90 GMMA (NVIDIA/cutlass, include/cute/atom/
    mma_traits_sm90_gmma.hpp), transcribed below as data: the accumulator layout
    CLayout_64xN<N> and the 8-bit register-source layout ALayout_64x32 of every 64xNx32 e4m3
    RS atom (MMA_64xNx32_F32E4M3E4M3_RS_TN in include/cute/arch/mma_sm90_gmma.hpp: ARegisters
    uint32_t[4], so A value e is byte e % 4 of register e // 4, the recast<uint32_t> of a
    16-byte fragment). A cute layout is a (shape, stride) pair mapping (thread, value) to an
    index into the M x N (or M x K) tile, M fastest;
  - FlashAttention-3's FP8 P path (Dao-AILab/flash-attention, hopper/utils.h):
    permute_Cregs_fp8 swaps, per 16 accumulator columns, the register pairs (0, 1, 2i) and
    (0, 0, 2i + 1) of the ((1, 2, N/8)) uint2 view, then convert_layout_acc_Aregs (FP8) reads
    A value e of k-step t from register 16t + e of the result.
"""

from __future__ import annotations

import numpy as np
import pytest

from ptxattn import fp8_reference as model

WARPGROUP = 128


# ---- a cute layout, evaluated ----------------------------------------------------------------

def _flatten(shape, stride):
    if isinstance(shape, tuple):
        out = []
        for s, d in zip(shape, stride):
            out += _flatten(s, d)
        return out
    return [(shape, stride)]


def cute_eval(layout, *coords) -> int:
    """layout = ((shape modes...), (stride modes...)) of rank len(coords); each coordinate an
    integer, split colexicographically over its mode's (nested) shape, as cute does."""
    shape, stride = layout
    assert len(shape) == len(coords)
    offset = 0
    for mode_shape, mode_stride, x in zip(shape, stride, coords):
        for size, step in _flatten(mode_shape, mode_stride):
            offset += (x % size) * step
            x //= size
        assert x == 0, "coordinate out of the mode's shape"
    return offset


def size(mode) -> int:
    return int(np.prod([s for s, _ in _flatten(mode, mode)]))


# ---- CUTLASS's layouts, as data (include/cute/atom/mma_traits_sm90_gmma.hpp) ---------------

def CLayout_64xN(n: int):
    # Layout<Shape <Shape <  _4,_8, _4>,Shape < _2,_2,Int<N/8>>>,
    #        Stride<Stride<_128,_1,_16>,Stride<_64,_8,   _512>>>
    return (((4, 8, 4), (2, 2, n // 8)), ((128, 1, 16), (64, 8, 512)))


# Register source layout for 8-bit value types
ALayout_64x32 = (((4, 8, 4), (4, 2, 2)), ((256, 1, 16), (64, 8, 1024)))
# ... and for 16-bit ones (the bf16 path's P: the same as the accumulator's)
ALayout_64x16 = (((4, 8, 4), (2, 2, 2)), ((128, 1, 16), (64, 8, 512)))
M = 64


def cute_coords(layout, values: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols), each (128, values): where (thread, value) sits, the index m + 64 k."""
    idx = np.array([[cute_eval(layout, t, v) for v in range(values)] for t in range(WARPGROUP)])
    return idx % M, idx // M


# ---- FlashAttention-3's P permutation, as data (hopper/utils.h) ------------------------------

def fa3_permute_cregs_fp8(n: int) -> np.ndarray:
    """permuted[j] = the accumulator register that permute_Cregs_fp8 moves to register j: in
    the uint2 view ((1, 2, N/8)), pair (0, 1, 2i) <-> pair (0, 0, 2i + 1), i.e. registers
    8i + {2, 3} <-> 8i + {4, 5}."""
    regs = np.arange(n // 2)
    pairs = regs.reshape(n // 8, 2, 2)           # [chunk v2][row half v1][column v0]
    out = pairs.copy()
    for i in range(n // 16):
        out[2 * i, 1], out[2 * i + 1, 0] = pairs[2 * i + 1, 0], pairs[2 * i, 1]
    return out.reshape(-1)


def fa3_a_register(step: int, e: int, n: int) -> int:
    """The accumulator register whose value FA3 hands the tensor core as A value e of k-step
    `step`: convert_layout_acc_Aregs (FP8: ((4, 2, 2), MMA_M, N/32) with strides (1, 4, 8) and
    16 per k-step) reads register 16 step + e of the permuted fragment."""
    return int(fa3_permute_cregs_fp8(n)[16 * step + e])


# ---- the checks ------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [64, 128, 256])
def test_the_accumulator_map_is_cutlass_clayout(n):
    rows, cols = model.accumulator_coords(n)
    c_rows, c_cols = cute_coords(CLayout_64xN(n), size(CLayout_64xN(n)[0][1]))
    assert np.array_equal(rows, c_rows) and np.array_equal(cols, c_cols)


def test_the_e4m3_a_fragment_map_is_cutlass_alayout_64x32():
    rows, cols = model.a_fragment_coords()
    c_rows, c_cols = cute_coords(ALayout_64x32, 16)
    assert np.array_equal(rows, c_rows) and np.array_equal(cols, c_cols)
    # and it covers the 64 x 32 k-step once: every (row, col) held by exactly one byte
    cells = rows * 32 + cols
    assert sorted(cells.ravel().tolist()) == list(range(64 * 32))


def test_the_transcription_is_not_vacuous():
    """The evaluator reads CUTLASS's layouts as cute does: the bf16 A layout equals the
    accumulator's for 16 columns (ALayout_64x16 = CLayout_64x16 in CUTLASS), and a changed
    stride is seen."""
    for ours, theirs in zip(cute_coords(ALayout_64x16, 8), cute_coords(CLayout_64xN(16), 8)):
        assert np.array_equal(ours, theirs)
    wrong = (ALayout_64x32[0], ((256, 1, 16), (64, 16, 1024)))
    assert not np.array_equal(cute_coords(wrong, 16)[0], model.a_fragment_coords()[0])


@pytest.mark.parametrize("n", [64, 128])
def test_pack_p_takes_the_registers_fa3_takes(n):
    """p_source_register (what PACK_P_FP8 packs into A byte e of k-step t) is FA3's
    permute_Cregs_fp8 + convert_layout_acc_Aregs, register for register."""
    for step in range(n // 32):
        ours = model.p_source_register(step, np.arange(16))
        theirs = [fa3_a_register(step, e, n) for e in range(16)]
        assert ours.tolist() == theirs, step


@pytest.mark.parametrize("n", [64, 128])
def test_v_t_key_order_follows_from_cutlass_layouts(n):
    """With CUTLASS's two layouts alone: A value e of thread t in k-step s sits at A column k
    (ALayout_64x32) and holds S register p_source_register(s, e) of the same thread, which
    CLayout puts at the same row and at key 32 s + PV_KEY_ORDER[k]: V^T position k of each
    group must hold that key, as the quantizer writes it (permute_vt)."""
    a_rows, a_cols = cute_coords(ALayout_64x32, 16)
    c_rows, c_cols = cute_coords(CLayout_64xN(n), n // 2)
    for step in range(n // 32):
        src = model.p_source_register(step, np.arange(16))
        assert np.array_equal(c_rows[:, src], a_rows), "P changes rows: not the thread's own"
        keys = c_cols[:, src] - 32 * step
        assert np.array_equal(keys, model.PV_KEY_ORDER[a_cols]), step
    # and permute_vt stores V's key PV_KEY_ORDER[k] at position k
    v = np.arange(64 * 2).reshape(64, 2).astype(np.float32)
    vt = model.permute_vt(v, 64)
    assert np.array_equal(vt[0, :32], v[model.PV_KEY_ORDER, 0])


def test_the_whole_pv_step_with_cutlass_layouts():
    """O = P V computed the way the tensor core reads the registers (the A tile assembled by
    ALayout_64x32 from each thread's packed S registers, B from the permuted V^T) equals P V."""
    rng = np.random.default_rng(3)
    n, d = 128, 64
    p = rng.standard_normal((64, n))
    v = rng.standard_normal((n, d))
    vt = model.permute_vt(v, n)                                     # (D, N), keys permuted
    c_rows, c_cols = cute_coords(CLayout_64xN(n), n // 2)
    a_rows, a_cols = cute_coords(ALayout_64x32, 16)
    regs = p[c_rows, c_cols]                                        # the S accumulator
    out = np.zeros((64, d))
    for step in range(n // 32):
        a = np.full((64, 32), np.nan)
        a[a_rows, a_cols] = regs[:, model.p_source_register(step, np.arange(16))]
        out += a @ vt[:, 32 * step:32 * (step + 1)].T
    np.testing.assert_allclose(out, p @ v, rtol=1e-12, atol=1e-12)

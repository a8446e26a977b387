"""The production backward on the GPU against the float64 reference gradients (skipped without
a GPU; PTXATTN_REQUIRE_GPU=1 makes a skip a failure).

First each piece alone, so that a failure names it: the preprocess (delta, neg_lse, the zeroed
accumulator) and the postprocess (the accumulator's layout) of every build. Then the production
kernel over what models send: any lengths (ragged query and key tiles), Lq != Lk both ways,
GQA 1/2/4/8 and MQA, causal (both diagonals) and windows, rows that see no key (dq exactly 0)
and keys no query sees (dk, dv exactly 0), head dims 64/128/256, both layouts, scale; the
deterministic mode bit for bit over 10 runs; the NumPy and DLPack entries.

Inputs are fresh standard normals with a random dout; the forward's out and lse come from our
forward kernel (what a model hands the backward); every output and workspace is poisoned with
NaN before the launches. The bar (bwd_checks): per gradient, relative L2 <= 2 x PyTorch's bf16
math backend's + 1e-3 against the same float64 reference, no NaN/Inf.
"""

from __future__ import annotations

import numpy as np
import pytest

import ptxattn
from bwd_checks import check_grads, inputs, no_key_rows, prepared, run
from ptxattn import bwd_builds, driver, tensors
from ptxattn.reference import BF16

pytestmark = pytest.mark.gpu


def _prepared(q, k, v, out, lse, dout, layout="bhld", stage="b1", **kw):
    return prepared(q, k, v, out, lse, dout, layout=layout, stage=stage, **kw)


def _f32(x):
    return x.to_numpy().astype(np.float64)


# --------------------------------------------------------------------------- the pieces alone

# The kernels whose pre/postprocess layout the piece tests cover: (stage, head dim)
PIECES = [("b1", 128), ("production", 64), ("production", 128), ("production", 256)]


@pytest.mark.parametrize("stage,head_dim", PIECES)
@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_preprocess_alone_delta_lse_and_zeroed_accumulator(stage, head_dim, layout):
    """delta = rowsum(dO * O) of the bf16 inputs, neg_lse = -lse log2 e (rows with no key,
    lse -inf, and padding rows: -inf, padding delta 0), every accumulator float 0 (all were
    NaN before)."""
    Lq, Lk = (192, 256) if stage != "production" else (100, 300)
    q, k, v, out, lse, dout = inputs(2, 3, 3, Lq, Lk, head_dim, layout, seed=1)
    lse = lse.copy()
    lse[:, :, 5::7] = -np.inf                    # as the forward writes for rows with no key
    p, keep = _prepared(q, k, v, out, lse, dout, layout,
                        stage=None if stage == "production" else stage)
    p.launch_preprocess()
    delta, neg, acc = _f32(p.delta), _f32(p.neg_lse), _f32(p.dq_accum)
    o = out.astype(np.float32).astype(np.float64)
    do = dout.astype(np.float32).astype(np.float64)
    if layout == "bshd":
        o, do = o.transpose(0, 2, 1, 3), do.transpose(0, 2, 1, 3)
    want = (o * do).sum(-1)
    assert np.isfinite(delta).all(), f"{int((~np.isfinite(delta)).sum())} delta values unwritten"
    err = np.abs(delta[:, :, :Lq] - want).max()
    assert err <= 1e-4 * max(1.0, np.abs(want).max()), f"delta max abs error {err:.3e}"
    assert (delta[:, :, Lq:] == 0).all(), "padding rows' delta must be 0"
    want_neg = np.where(np.isneginf(lse), -np.inf, -lse.astype(np.float64) * np.log2(np.e))
    fin = np.isfinite(want_neg)
    assert (np.isneginf(neg[:, :, :Lq]) == ~fin).all(), "rows with no key: neg_lse must be -inf"
    err = np.abs(neg[:, :, :Lq][fin] - want_neg[fin]).max()
    assert err <= 1e-5 * np.abs(want_neg[fin]).max(), f"neg_lse max abs error {err:.3e}"
    assert np.isneginf(neg[:, :, Lq:]).all(), "padding rows' neg_lse must be -inf"
    assert (acc == 0).all(), f"{int((acc != 0).sum())} accumulator floats not zeroed " \
                             f"({int(np.isnan(acc).sum())} still NaN)"
    p.close()


@pytest.mark.parametrize("stage,head_dim", PIECES)
def test_postprocess_alone_reads_the_accumulator_layout(stage, head_dim):
    """Distinct values at known accumulator offsets (bwd_builds.dq_accum_offset); dq must be
    bf16(scale * value) at the matching (row, column); padding rows are never read (NaN)."""
    B, H = 2, 2
    Lq = 192 if stage != "production" else 200
    rng = np.random.default_rng(head_dim)
    q = rng.standard_normal((B, H, Lq, head_dim)).astype(BF16)
    kv = rng.standard_normal((B, H, 256, head_dim)).astype(BF16)
    lse = np.zeros((B, H, Lq), np.float32)
    p, keep = _prepared(q, kv, kv, q, lse, q, stage=None if stage == "production" else stage)
    plan = p.plan
    values = rng.standard_normal((B, H, Lq, head_dim)).astype(np.float32)
    acc = np.full((B, H, plan.seq_q_pad * head_dim), np.nan, np.float32)
    rows, cols = np.meshgrid(np.arange(Lq), np.arange(head_dim), indexing="ij")
    off = bwd_builds.dq_accum_offset(rows, cols, head_dim, plan.block_m, plan.dq_cols,
                                     plan.tiles.dq_t)       # m80 (D 128's default): dQ^T
    assert len(np.unique(off)) == off.size, "dq_accum_offset is not one-to-one"
    acc[:, :, off] = values
    driver.memcpy_htod(p.dq_accum.ptr, acc)
    p.launch_postprocess()
    got = p.dq.to_numpy().astype(np.float32)
    want = (values * plan.scale).astype(BF16).astype(np.float32)
    bad = got != want
    assert not bad.any(), (f"{int(bad.sum())} of {bad.size} dq values wrong "
                           f"({int(np.isnan(got).sum())} NaN: a padding float read?); first at "
                           f"(b, h, row, col) {tuple(int(x[0]) for x in np.nonzero(bad))}")
    p.close()




# --------------------------------------------------------------------------- production

BUILDS = [(d, masked) for d in bwd_builds.HEAD_DIMS for masked in (False, True)]


@pytest.mark.parametrize("D,masked", BUILDS)
def test_smoke_every_build_launches_and_writes_every_element(D, masked):
    """The first thing to read when the matrix below fails: each build's one launch at a small
    ragged shape writes every element of dq, dk, dv (all were NaN) and nothing non-finite."""
    mask = {"causal": True} if masked else {}
    q, k, v, out, lse, dout = inputs(1, 2, 2, 70, 150, D, seed=D + masked, **mask)
    grads = run(q, k, v, out, lse, dout, **mask)
    bad = {n: int((~np.isfinite(g.astype(np.float32))).sum())
           for n, g in zip(("dq", "dk", "dv"), grads)}
    assert not any(bad.values()), f"non-finite (unwritten?) values per gradient: {bad}"


def case(B, H, Hkv, Lq, Lk, D=128, layout="bhld", seed=None, scale=None, deterministic=False,
         variant=None, **mask):
    """Inputs, one backward (today's build, or a build-table variant), the bar; also rows with
    no key (dq exactly 0) and keys no query sees (dk, dv exactly 0). Returns the gradients."""
    seed = seed if seed is not None else (B * 131 + H * 17 + Hkv * 7 + Lq * 3 + Lk + D)
    q, k, v, out, lse, dout = inputs(B, H, Hkv, Lq, Lk, D, layout, seed=seed, scale=scale,
                                     **mask)
    grads = run(q, k, v, out, lse, dout, layout=layout, scale=scale,
                deterministic=deterministic, variant=variant, **mask)
    check_grads(grads, q, k, v, dout, layout=layout, scale=scale, **mask)
    dq, dk, dv = (g.astype(np.float32) for g in grads)
    ax = 2 if layout == "bhld" else 1
    empty = no_key_rows(Lq, Lk, causal=mask.get("causal", False), window=mask.get("window"),
                        diagonal=mask.get("diagonal", "bottom_right"))
    if len(empty):
        rows = np.take(dq, empty, axis=ax)
        assert (rows == 0).all(), (f"rows {empty[:8].tolist()}... see no key: dq must be 0, "
                                   f"max |dq| there {np.abs(rows).max():.3e}")
    # keys that no query sees
    from ptxattn import reference
    bounds = reference._window(mask.get("causal", False), mask.get("window"))
    if bounds is not None:
        keep = reference.key_mask(np.arange(Lq), Lq, Lk, bounds,
                                  mask.get("diagonal", "bottom_right"))
        unseen = np.nonzero(~keep.any(axis=0))[0]
        if len(unseen):
            for name, g in (("dk", dk), ("dv", dv)):
                part = np.take(g, unseen, axis=ax)
                assert (part == 0).all(), (f"keys {unseen[:8].tolist()}... are seen by no "
                                           f"query: {name} must be 0, max {np.abs(part).max()}")
    return grads


LENGTHS = [(1, 1), (63, 65), (129, 200), (300, 517), (1000, 77), (77, 1000)]


@pytest.mark.parametrize("Lq,Lk", LENGTHS)
@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_any_length(Lq, Lk, layout):
    case(2, 3, 3, Lq, Lk, layout=layout)


@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("Lq,Lk", [(100, 300), (257, 129)])
def test_head_dims(D, Lq, Lk):
    case(2, 2, 2, Lq, Lk, D=D)


@pytest.mark.parametrize("D", [64, 128, 256])
def test_head_dims_bshd_gqa(D):
    case(1, 4, 2, 190, 250, D=D, layout="bshd")


@pytest.mark.parametrize("H,Hkv", [(8, 8), (8, 4), (8, 2), (8, 1), (6, 1)])
def test_gqa_and_mqa(H, Hkv):
    case(1, H, Hkv, 200, 333)


def test_gqa_sums_the_right_heads():
    """K/V heads far apart: a kernel summing the wrong group (or reading head h, not
    h // g) lands outside the bar. The offset puts a common mode into K that every fused
    backward carries into dq (check_grads' peer bound: cuDNN's error on the same inputs)."""
    q, k, v, out, lse, dout = inputs(1, 8, 2, 128, 256, 128, seed=3)
    k = (k.astype(np.float32) + np.array([0.0, 2.0])[None, :, None, None]).astype(BF16)
    out, lse = ptxattn.attention(q, k, v, return_lse=True)
    grads = run(q, k, v, out, lse, dout)
    check_grads(grads, q, k, v, dout, peer=True)


def test_gqa_without_offset_meets_the_issue_bar():
    """The same grouping, heads not offset: the bar of 2 x math + 1e-3 alone."""
    q, k, v, out, lse, dout = inputs(1, 8, 2, 128, 256, 128, seed=4)
    grads = run(q, k, v, out, lse, dout)
    check_grads(grads, q, k, v, dout)


@pytest.mark.parametrize("L", [1, 127, 300])
@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_causal_square(L, layout):
    case(2, 2, 2, L, L, layout=layout, causal=True)


@pytest.mark.parametrize("Lq,Lk", [(100, 300), (300, 100), (65, 640)])
@pytest.mark.parametrize("diagonal", ["bottom_right", "top_left"])
def test_causal_cross(Lq, Lk, diagonal):
    """bottom-right with Lq > Lk: rows that see no key; top-left with Lk > Lq: keys no query
    sees (their CTAs walk no block and store zeros)."""
    case(1, 3, 3, Lq, Lk, causal=True, diagonal=diagonal)


@pytest.mark.parametrize("window", [(16, 0), (32, 8), (0, 0), (-1, 16), (50, -1)])
def test_windows(window):
    case(1, 2, 2, 257, 300, window=window)


@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("mask", [dict(causal=True), dict(window=(40, 3))])
def test_masks_at_other_head_dims(D, mask):
    case(1, 2, 1, 230, 260, D=D, **mask)


def test_gqa_causal_top_left_bshd():
    case(2, 8, 2, 333, 257, layout="bshd", causal=True, diagonal="top_left")


def test_scale():
    case(1, 2, 2, 200, 150, scale=0.3)
    case(1, 2, 2, 200, 150, scale=0.3, causal=True)


@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window=(64, 0))])
def test_deterministic_is_bitwise_over_ten_runs(mask):
    q, k, v, out, lse, dout = inputs(2, 4, 2, 500, 700, 128, seed=17, **mask)
    first = run(q, k, v, out, lse, dout, deterministic=True, **mask)
    check_grads(first, q, k, v, dout, **mask)
    for i in range(9):
        again = run(q, k, v, out, lse, dout, deterministic=True, **mask)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            diff = a.view(np.uint16) != b.view(np.uint16)
            assert not diff.any(), f"run {i + 2}: {name} differs in {int(diff.sum())} values"


@pytest.mark.parametrize("D", [64, 256])
def test_deterministic_other_head_dims(D):
    q, k, v, out, lse, dout = inputs(1, 4, 4, 300, 300, D, seed=19, causal=True)
    first = run(q, k, v, out, lse, dout, deterministic=True, causal=True)
    check_grads(first, q, k, v, dout, causal=True)
    for i in range(3):
        again = run(q, k, v, out, lse, dout, deterministic=True, causal=True)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), f"{name} moved"


def test_numpy_entry():
    q, k, v, out, lse, dout = inputs(1, 4, 2, 129, 300, 128, seed=23, causal=True)
    dq, dk, dv = ptxattn.attention_backward(q, k, v, out, lse, dout, causal=True)
    assert all(isinstance(x, np.ndarray) and x.dtype == BF16 for x in (dq, dk, dv))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    check_grads((dq, dk, dv), q, k, v, dout, causal=True)


def test_dlpack_entry():
    from gpu_checks import import_or_skip
    torch = import_or_skip("torch")
    q, k, v, out, lse, dout = inputs(2, 4, 4, 200, 200, 64, "bshd", seed=29)
    t = [torch.from_numpy(x.astype(np.float32)).to("cuda", torch.bfloat16)
         for x in (q, k, v, out, dout)]
    tl = torch.from_numpy(lse).to("cuda")
    dq, dk, dv = ptxattn.attention_backward(t[0], t[1], t[2], t[3], tl, t[4], layout="bshd")
    assert all(isinstance(x, tensors.DeviceArray) for x in (dq, dk, dv))
    back = [torch.from_dlpack(x).float().cpu().numpy().astype(BF16) for x in (dq, dk, dv)]
    check_grads(tuple(back), q, k, v, dout, layout="bshd")

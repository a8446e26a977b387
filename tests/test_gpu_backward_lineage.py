"""The backward's preprocess, postprocess and lineage stages on the GPU (skipped without one).

Small tests first, each of one part, so that a failure names it: the preprocess alone (delta,
neg_lse, the zeroed accumulator), the postprocess alone (the accumulator's layout), then each
gradient of stage b1 alone (dV needs only P and dO; dK adds dS; dQ adds the dS tile in shared
memory, the accumulator and the postprocess), the raw accumulator against the reference (main
kernel or postprocess?), then the stages over shapes and layouts. Every output and workspace
is poisoned with NaN before the launches; inputs are fresh standard normals.
"""

from __future__ import annotations

import numpy as np
import pytest

from bwd_checks import check_grads, inputs, poison, run
from ptxattn import backward, bwd_builds, driver, tensors
from ptxattn.reference import BF16
from ptxattn.reference_backward import attention_backward_reference

pytestmark = pytest.mark.gpu

LINEAGE = [s.label for s in bwd_builds.STAGES]
D = 128


def _prepared(q, k, v, out, lse, dout, layout="bhld", stage="b1", **kw):
    dev = [tensors.from_numpy(x) for x in (q, k, v, out, dout)]
    lse_d = tensors.empty(lse.shape, dtype=np.float32)
    driver.memcpy_htod(lse_d.ptr, np.ascontiguousarray(lse, np.float32))
    p = backward.prepare_backward(dev[0], dev[1], dev[2], dev[3], lse_d, dev[4], stage=stage,
                                  layout=layout, **kw)
    poison(p)
    return p, dev + [lse_d]


def _f32(x):
    return x.to_numpy().astype(np.float64)


# --------------------------------------------------------------------------- the pieces alone

# The kernels whose pre/postprocess layout the piece tests cover: (stage, head dim)
PIECES = [("b1", 128)]


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
    off = bwd_builds.dq_accum_offset(rows, cols, head_dim, plan.block_m, plan.dq_cols)
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


# --------------------------------------------------------------------------- b1, one gradient each

@pytest.fixture(scope="module")
def b1_case():
    case = inputs(1, 4, 4, 256, 384, D, "bhld", seed=2)
    grads, p, keep = run(*case, stage="b1", keep=True)
    yield case, grads, p
    p.close()


@pytest.mark.parametrize("name", ["dv", "dk", "dq"])
def test_b1_each_gradient_alone(b1_case, name):
    case, grads, _ = b1_case
    q, k, v, out, lse, dout = case
    check_grads(grads, q, k, v, dout, only=(name,))


def test_b1_raw_accumulator_against_the_reference(b1_case):
    """dq_accum before the postprocess = dq / scale in the accumulator's layout: tells a wrong
    main kernel from a wrong postprocess."""
    case, grads, p = b1_case
    q, k, v, out, lse, dout = case
    dq_ref = attention_backward_reference(q, k, v, dout)[0]
    B, H, Lq, Dh = q.shape
    acc = p.dq_accum.to_numpy().reshape(B, H, -1).astype(np.float64)
    rows, cols = np.meshgrid(np.arange(Lq), np.arange(Dh), indexing="ij")
    off = bwd_builds.dq_accum_offset(rows, cols, Dh, p.plan.block_m, p.plan.dq_cols)
    got = acc[:, :, off] * p.plan.scale
    err = np.linalg.norm(got - dq_ref) / np.linalg.norm(dq_ref)
    assert np.isfinite(got).all() and err < 1e-2, (
        f"raw accumulator rel L2 {err:.3e}, NaN {int((~np.isfinite(got)).sum())}; the "
        f"postprocessed dq is checked by test_b1_each_gradient_alone[dq]")


# --------------------------------------------------------------------------- the lineage

SHAPES = [(1, 2, 64, 128), (2, 3, 192, 256), (1, 2, 512, 640), (2, 1, 1024, 128)]


@pytest.mark.parametrize("stage", LINEAGE)
@pytest.mark.parametrize("B,H,Lq,Lk", SHAPES)
@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_lineage_stage(stage, B, H, Lq, Lk, layout):
    case = inputs(B, H, H, Lq, Lk, D, layout, seed=B * 7 + Lq + Lk)
    grads = run(*case, stage=stage, layout=layout)
    q, k, v, out, lse, dout = case
    check_grads(grads, q, k, v, dout, layout=layout)


@pytest.mark.parametrize("stage", LINEAGE)
def test_lineage_scale(stage):
    case = inputs(1, 2, 2, 128, 256, D, seed=5, scale=0.3)
    grads = run(*case, stage=stage, scale=0.3)
    q, k, v, out, lse, dout = case
    check_grads(grads, q, k, v, dout, scale=0.3)


@pytest.mark.parametrize("stage", LINEAGE)
def test_lineage_repeated_launches_are_equal(stage):
    """A race shows as an error that moves: three runs on the same inputs, dk and dv bit-equal
    (their sums have a fixed order); dq within the atomic order's rounding."""
    case = inputs(1, 2, 2, 256, 256, D, seed=6)
    first = run(*case, stage=stage)
    for _ in range(2):
        again = run(*case, stage=stage)
        for name, a, b in zip(("dk", "dv"), first[1:], again[1:]):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), f"{name} moved"
        d = np.abs(first[0].astype(np.float32) - again[0].astype(np.float32)).max()
        assert d <= 2e-2 * np.abs(first[0].astype(np.float32)).max(), f"dq moved by {d:.3e}"

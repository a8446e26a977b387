"""The backward's preprocess, postprocess and lineage stages on the GPU (skipped without one).

Small tests first, each of one part, so that a failure names it: each gradient of stage b1
alone (dV needs only P and dO; dK adds dS; dQ adds the dS tile in shared memory, the
accumulator and the postprocess), the raw accumulator against the reference (main kernel or
postprocess?), then every stage over shapes and layouts. The preprocess and postprocess alone
are in test_gpu_backward.py. Every output and workspace is poisoned with NaN before the
launches; inputs are fresh standard normals.
"""

from __future__ import annotations

import numpy as np
import pytest

from bwd_checks import check_grads, inputs, run
from ptxattn import bwd_builds
from ptxattn.reference_backward import attention_backward_reference

pytestmark = pytest.mark.gpu

LINEAGE = [s.label for s in bwd_builds.STAGES]
D = 128


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

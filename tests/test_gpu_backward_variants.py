"""The production backward's build-table variants (ptxattn/bwd_builds.py VARIANTS) on the GPU
against the float64 reference gradients, beside today's build (skipped without a GPU;
PTXATTN_REQUIRE_GPU=1 makes a skip a failure).

Each variant is what a device run A/Bs against today's build (bench/backward_bench.py
--variants), so before it is timed it must pass what today's build passes on what it changes:
  - every build of the variant (masked or not) launches and writes every element;
  - odd lengths, Lq != Lk both ways, several query blocks a CTA and several CTAs a head;
  - GQA and MQA (the group walk; dK, dV summed in registers), both layouts, scale;
  - causal (both diagonals) and windows, rows that see no key, keys no query sees;
  - deterministic=True bit for bit over 10 runs, where the variant keeps the order
    (qsplit_dqred refuses it: tested on the CPU);
  - the variant's gradients against today's on the same inputs (both near the reference: a
    line that says which of the two moved when one fails);
  - a build that takes dS^T's P from the packed bf16 pairs (m80_edv) against m80: dV bit for
    bit, dQ and dK within 1.4x m80's error.
Messages (bwd_checks.describe): which variant and gradient, relative L2 against its bound,
the worst (batch, head) and rows, NaN/Inf counts.
"""

from __future__ import annotations

import numpy as np
import pytest

from bwd_checks import check_grads, inputs, rel_l2, run
from ptxattn import bwd_builds
from test_gpu_backward import case

pytestmark = pytest.mark.gpu

VARIANT_BUILDS = [(b.head_dim, b.variant, masked) for b in bwd_builds.all_builds()
                  if b.variant != bwd_builds.DEFAULT_VARIANT for masked in (False, True)]


def _named(label, fn, /, *args, **kw):
    """fn(...) with the variant's name and the call in front of any failure message."""
    try:
        return fn(*args, **kw)
    except AssertionError as exc:
        shape = [a.shape if hasattr(a, "shape") else a for a in args]
        raise AssertionError(f"variant {label!r}, {fn.__name__}{tuple(shape)} {kw}:\n"
                             f"{exc}") from None


@pytest.mark.parametrize("D,variant,masked", VARIANT_BUILDS,
                         ids=[f"d{d}-{v}{'-masked' if m else ''}" for d, v, m in VARIANT_BUILDS])
def test_smoke_every_variant_build_writes_every_element(D, variant, masked):
    """The first thing to read when the cases below fail: one launch at a small ragged shape
    (3 query blocks, 2 key blocks) writes every element of dq, dk, dv (all were NaN)."""
    mask = {"causal": True} if masked else {}
    q, k, v, out, lse, dout = inputs(1, 2, 1, 150, 150, D, seed=D + masked, **mask)
    grads = run(q, k, v, out, lse, dout, variant=variant, **mask)
    bad = {n: int((~np.isfinite(g.astype(np.float32))).sum())
           for n, g in zip(("dq", "dk", "dv"), grads)}
    assert not any(bad.values()), f"{variant} D={D}: non-finite (unwritten?) values {bad}"


def _variants(d):
    return [v for v in bwd_builds.variants_for(d) if v != bwd_builds.DEFAULT_VARIANT]


# (B, H, Hkv, Lq, Lk, layout, mask): the matrix each variant runs at each of its head dims
MATRIX = [
    (2, 3, 3, 63, 65, "bhld", {}),
    (1, 4, 2, 300, 517, "bshd", {}),                 # Lq < Lk, GQA 2, ragged both
    (1, 2, 2, 1000, 77, "bhld", {}),                 # many query blocks, one key block
    (1, 8, 1, 200, 333, "bhld", {}),                 # MQA
    (2, 2, 2, 300, 300, "bshd", {"causal": True}),
    (1, 3, 3, 300, 100, "bhld", {"causal": True}),   # bottom-right, Lq > Lk: rows see no key
    (1, 3, 3, 65, 640, "bhld", {"causal": True, "diagonal": "top_left"}),  # keys none see
    (1, 2, 1, 257, 300, "bhld", {"window": (32, 8)}),
    (1, 2, 2, 200, 150, "bhld", {"scale": 0.3}),
]
CASES = [(d, v, *row) for d in bwd_builds.HEAD_DIMS for v in _variants(d) for row in MATRIX]


@pytest.mark.parametrize("D,variant,B,H,Hkv,Lq,Lk,layout,mask", CASES,
                         ids=[f"d{c[0]}-{c[1]}-{c[2]}x{c[3]}:{c[4]}-{c[5]}x{c[6]}-{c[7]}"
                              + "".join(f"-{k}{v}" for k, v in c[8].items()) for c in CASES])
def test_variant_matrix(D, variant, B, H, Hkv, Lq, Lk, layout, mask):
    mask = dict(mask)
    scale = mask.pop("scale", None)
    _named(variant, case, B, H, Hkv, Lq, Lk, D=D, layout=layout, scale=scale, variant=variant,
           **mask)


@pytest.mark.parametrize("D,variant", [(d, v) for d in bwd_builds.HEAD_DIMS for v in _variants(d)])
def test_variant_against_todays_build_on_the_same_inputs(D, variant):
    """Long enough for the steady state (16 query blocks a CTA at D 128, 8 CTAs a head, GQA
    2:1): the variant under the bar, and within 2x the larger of the two builds' errors of
    today's build (a schedule change moves no value by more than rounding)."""
    from ptxattn.reference_backward import attention_backward_reference
    mask = {"causal": True} if D == 128 else {}
    q, k, v, out, lse, dout = inputs(1, 2, 1, 1024, 1024, D, seed=41 + D, **mask)
    today = run(q, k, v, out, lse, dout, variant=bwd_builds.DEFAULT_VARIANT, **mask)
    theirs = run(q, k, v, out, lse, dout, variant=variant, **mask)
    lines = _named(variant, check_grads, theirs, q, k, v, dout, **mask)
    ref = attention_backward_reference(q, k, v, dout, **mask)
    for name, a, b, r in zip(("dq", "dk", "dv"), theirs, today, ref):
        between = rel_l2(a, b.astype(np.float32).astype(np.float64))
        err_a, err_b = rel_l2(a, r), rel_l2(b, r)
        assert np.isfinite(b.astype(np.float32)).all(), f"today's build: {name} not finite"
        assert between <= 2 * max(err_a, err_b), (
            f"{variant} D={D} {name}: variant vs today's build rel {between:.3e}, their errors "
            f"against float64 {err_a:.3e} (variant) and {err_b:.3e} (today)\n"
            + "\n".join(lines))


@pytest.mark.parametrize("D,variant", [(d, v) for d in bwd_builds.HEAD_DIMS for v in _variants(d)
                                       if bwd_builds.build(d, v).deterministic])
@pytest.mark.parametrize("mask", [dict(), dict(causal=True)], ids=["dense", "causal"])
def test_variant_deterministic_is_bitwise_over_ten_runs(D, variant, mask):
    q, k, v, out, lse, dout = inputs(2, 4, 2, 500, 700, D, seed=17 + D, **mask)
    first = run(q, k, v, out, lse, dout, deterministic=True, variant=variant, **mask)
    _named(variant, check_grads, first, q, k, v, dout, **mask)
    for i in range(9):
        again = run(q, k, v, out, lse, dout, deterministic=True, variant=variant, **mask)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            diff = a.view(np.uint16) != b.view(np.uint16)
            where = np.argwhere(diff)[:4].tolist()
            assert not diff.any(), (f"{variant} D={D} run {i + 2}: {name} differs in "
                                    f"{int(diff.sum())} values, first at {where}")


@pytest.mark.parametrize("mask", [dict(), dict(causal=True)], ids=["dense", "causal"])
@pytest.mark.parametrize("variant", [b.variant for b in bwd_builds.all_builds() if b.ds_from_pt])
def test_ds_from_packed_p_costs_dq_dk_one_rounding_and_leaves_dv_alone(variant, mask):
    """A build that takes dS^T's P from its packed bf16 pairs (ds_from_pt: m80_edv) against the
    same tiles with the fp32 P (m80): dV bit for bit (the same GEMM on the same P^T pairs, in
    registers), dQ and dK within 1.4x m80's error against float64 (the extra rounding of P:
    1.24x on the emulator at a smaller shape)."""
    from ptxattn.reference_backward import attention_backward_reference
    q, k, v, out, lse, dout = inputs(1, 4, 2, 1000, 777, 128, seed=29, **mask)
    ref = attention_backward_reference(q, k, v, dout, **mask)
    ours = run(q, k, v, out, lse, dout, variant=variant, **mask)
    base = run(q, k, v, out, lse, dout, variant="m80", **mask)
    _named(variant, check_grads, ours, q, k, v, dout, **mask)
    diff = ours[2].view(np.uint16) != base[2].view(np.uint16)
    assert not diff.any(), f"{variant}: dv differs from m80's in {int(diff.sum())} values"
    for name, a, b, r in zip(("dq", "dk"), ours[:2], base[:2], ref[:2]):
        ea, eb = rel_l2(a, r), rel_l2(b, r)
        assert ea <= 1.4 * eb, f"{variant} {name}: rel L2 {ea:.3e} against m80's {eb:.3e}"

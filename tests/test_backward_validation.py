"""attention_backward refuses every bad argument before any driver call, naming it (CPU only).

The `no_driver` fixture fails a test that reaches the CUDA driver; device inputs are fakes
(tests/fakes.py) that describe CUDA memory and are never read.
"""

from __future__ import annotations

import numpy as np
import pytest
from fakes import FAKE_BASE, FakeCAI, FakeDLPack
from test_validation import raises       # the forward's: pytest.raises + words in the message

import ptxattn
from ptxattn import bwd_builds, backward
from ptxattn.tensors import BF16

pytestmark = pytest.mark.usefixtures("no_driver")

B, H, L, D = 2, 4, 128, 128
MiB = 1 << 20


def host(shape=(B, H, L, D), dtype=BF16):
    return np.ones(shape, np.float32).astype(dtype)


def args(**over):
    a = dict(q=host(), k=host(), v=host(), out=host(), lse=np.zeros((B, H, L), np.float32),
             dout=host())
    a.update(over)
    return a


def dev(shape=(B, H, L, D), slot=0, **kw):
    return FakeDLPack(shape, ptr=FAKE_BASE + slot * 64 * MiB, **kw)


def dev_args(**over):
    a = dict(q=dev(slot=0), k=dev(slot=1), v=dev(slot=2), out=dev(slot=3),
             lse=dev((B, H, L), slot=4, dtype="float32"), dout=dev(slot=5))
    a.update(over)
    return a


def call(a, **kw):
    return ptxattn.attention_backward(a["q"], a["k"], a["v"], a["out"], a["lse"], a["dout"],
                                      **kw)


def plan(a, **kw):
    kw.setdefault("scale", None)
    kw.setdefault("layout", "bhld")
    for name, value in (("causal", False), ("window", None), ("diagonal", "bottom_right"),
                        ("deterministic", False), ("stream", None), ("stage", None)):
        kw.setdefault(name, value)
    return backward._validate(a["q"], a["k"], a["v"], a["out"], a["lse"], a["dout"], **kw)


def test_a_valid_call_plans_without_the_driver():
    p = plan(args())
    assert p.stage.production and p.host and (p.batch, p.heads, p.seq_q) == (B, H, L)
    p = plan(dev_args(), stage="b1")
    assert not p.host and p.stage.label == "b1" and p.seq_q_pad == L


@pytest.mark.parametrize("name", ["q", "k", "v", "out", "dout"])
def test_wrong_dtypes_are_named(name):
    with raises(TypeError, f"{name}:", "int32"):
        call(args(**{name: np.ones((B, H, L, D), np.int32)}))


def test_lse_dtype_shape_and_kind():
    with raises(TypeError, "lse:", "float32"):
        call(args(lse=np.zeros((B, H, L), BF16)))
    with raises(ValueError, "lse:", "expected shape", str((B, H, L))):
        call(args(lse=np.zeros((B, H, L + 1), np.float32)))
    with raises(ValueError, "lse:", "device"):
        call(dev_args(lse=np.zeros((B, H, L), np.float32)))
    with raises(TypeError, "lse:", "float32"):
        call(dev_args(lse=dev((B, H, L), slot=4)))            # a bf16 device array


def test_host_and_device_do_not_mix():
    with raises(ValueError, "q, k, v, out, dout", "dout is a device array"):
        call(args(dout=dev(slot=5)))


@pytest.mark.parametrize("name", ["out", "dout"])
def test_out_and_dout_have_qs_shape(name):
    with raises(ValueError, f"{name}:", "q's shape"):
        call(args(**{name: host((B, H, L + 1, D))}))


def test_kv_shapes():
    with raises(ValueError, "v:", "same shape as k"):
        call(args(v=host((B, H, L + 1, D))))
    with raises(ValueError, "k:", "divide"):
        call(args(k=host((B, 3, L, D)), v=host((B, 3, L, D))))
    with raises(ValueError, "k:", "head dim"):
        call(args(k=host((B, H, L, 64)), v=host((B, H, L, 64))))
    with raises(ValueError, "k:", "key length is 0"):
        call(args(k=host((B, H, 0, D)), v=host((B, H, 0, D))))


def test_rank_and_layout():
    with raises(ValueError, "q:", "rank-4"):
        call(args(q=host((B, H, L))))
    with raises(ValueError, "layout"):
        call(args(), layout="bhsd")


@pytest.mark.parametrize("kw,exc,words", [
    (dict(causal=1), TypeError, ("causal",)),
    (dict(window=(1, 2, 3)), TypeError, ("window",)),
    (dict(window=(-2, 0)), ValueError, ("window",)),
    (dict(causal=True, window=(4, 3)), ValueError, ("window", "right")),
    (dict(diagonal="bottom"), ValueError, ("diagonal",)),
    (dict(scale=-1.0), ValueError, ("scale",)),
    (dict(scale="x"), TypeError, ("scale",)),
    (dict(deterministic=1), TypeError, ("deterministic",)),
])
def test_flags_are_named(kw, exc, words):
    with raises(exc, *words):
        call(args(), **kw)


def test_head_dims_without_a_build():
    with raises(ValueError, "q:", "head dim 96"):
        call(args(**{n: host((B, H, L, 96)) for n in ("q", "k", "v", "out", "dout")}))


@pytest.mark.parametrize("over,kw,words", [
    (dict(), dict(causal=True), ("causal:", "b1", "masks")),
    (dict(), dict(deterministic=True), ("deterministic:",)),
    (dict(k=host((B, 2, L, D)), v=host((B, 2, L, D))), dict(), ("k:", "GQA")),
    (dict(q=host((B, H, 100, D)), out=host((B, H, 100, D)), dout=host((B, H, 100, D)),
          lse=np.zeros((B, H, 100), np.float32)), dict(), ("q:", "query length 100")),
    (dict(k=host((B, H, 64, D)), v=host((B, H, 64, D))), dict(), ("k:", "key length 64")),
])
def test_the_lineage_says_what_it_does_not_take(over, kw, words):
    with raises(ValueError, *words, "production kernel"):
        plan(args(**over), stage="b1", **kw)


def test_unknown_stage():
    with raises(ValueError, "stage:", "b1"):
        plan(args(), stage="b9")


def test_device_geometry_is_checked_for_tma():
    strided = dev((B, H, L, D), slot=0, strides=(H * L * D, L * D, D, 2))
    with raises(ValueError, "q:", "stride"):
        call(dev_args(q=strided))
    odd = dev((B, H, L, D), slot=5, strides=(H * L * 136 + 4, L * 136, 136, 1))
    with raises(ValueError, "dout:"):
        call(dev_args(dout=odd))
    with raises(ValueError, "q, k, v, out, lse, dout", "one device"):
        call(dev_args(v=dev(slot=2, device=1)))


def test_cuda_array_interface_lse():
    lse = FakeCAI((B, H, L), ptr=FAKE_BASE + 4 * 64 * MiB, typestr="<f4")
    p = plan(dev_args(lse=lse), stage="b1")
    assert p.lse.dtype == np.float32 and p.lse.shape == (B, H, L)
    with raises(TypeError, "lse:", "float32"):
        plan(dev_args(lse=FakeCAI((B, H, L), ptr=FAKE_BASE, typestr="<f8")), stage="b1")


def test_empty_queries_plan_an_empty_call():
    a = args(q=host((B, H, 0, D)), out=host((B, H, 0, D)), dout=host((B, H, 0, D)),
             lse=np.zeros((B, H, 0), np.float32))
    dq, dk, dv = call(a)
    assert dq.shape == (B, H, 0, D) and (dk == 0).all() and (dv == 0).all()
    assert dk.shape == (B, H, L, D) and dk.dtype == BF16


# --------------------------------------------------------------------------- build variants

def d256(**over):
    return args(**{n: host((B, H, L, 256)) for n in ("q", "k", "v", "out", "dout")}, **over)


def test_a_variant_plans_its_build():
    p = plan(d256(), variant="qsplit")
    assert p.variant == "qsplit" and p.tiles.query_split and not p.tiles.dq_red
    assert backward.defines_for(p) == {"HEAD_DIM": "256", "PTXATTN_BWD_QSPLIT": "1"}
    # "default" names today's row; a call naming none runs the measured default of its head
    # dim (80-row blocks at D 128, the query split at D 256), and today's row when
    # deterministic
    assert plan(args(), variant="default").variant is None
    assert plan(args(), variant="default").tiles is bwd_builds.build(128)
    assert plan(args()).variant == "m80" and plan(d256()).variant == "qsplit"
    assert plan(args(), deterministic=True).variant is None
    assert plan(args()).tiles is bwd_builds.build(128, "m80")
    assert backward.defines_for(plan(args(), variant="st_ahead", causal=True)) == {
        "HEAD_DIM": "128", "PTXATTN_MASKED": "1", "PTXATTN_BWD_ST_AHEAD": "1"}


@pytest.mark.parametrize("kw,words", [
    (dict(variant="fast"), ("variant:", "'fast'", "qsplit", "st_ahead")),
    (dict(variant=3), ("variant:", "3")),
    (dict(variant="qsplit"), ("variant:", "'qsplit'", "head dim 128", "256")),
    (dict(variant="st_ahead", stage="b3"), ("variant:", "b3", "production")),
])
def test_a_variant_that_does_not_apply_is_named(kw, words):
    with raises(ValueError, *words):
        plan(args(), **kw)


def test_dqred_refuses_the_deterministic_order():
    with raises(ValueError, "variant:", "qsplit_dqred", "deterministic"):
        plan(d256(), variant="qsplit_dqred", deterministic=True)
    assert plan(d256(), variant="qsplit", deterministic=True).deterministic
    with raises(ValueError, "variant:", "deterministic"):     # the public prepare, too
        backward.prepare_backward(*(d256()[n] for n in ("q", "k", "v", "out", "lse", "dout")),
                                  variant="qsplit_dqred", deterministic=True)

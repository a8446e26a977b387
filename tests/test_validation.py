"""Every bad argument is refused before any driver call, naming the argument (CPU only).

The `no_driver` fixture makes any driver call fail the test, so these also prove
that validation runs on a machine without a GPU. Device inputs are fakes that
describe CUDA memory (DLPack capsules or __cuda_array_interface__) never read.
"""

import contextlib
import dataclasses

import ml_dtypes
import numpy as np
import pytest
from fakes import FAKE_BASE, FakeCAI, FakeDLPack, LegacyDLPack

from ptxattn import api as attn
from ptxattn import stages
from ptxattn.plan import validate
from ptxattn.tensors import BF16, DeviceArray

pytestmark = pytest.mark.usefixtures("no_driver")

B, H, L, D = 2, 3, 128, 128
MiB = 1 << 20


def host(shape=(B, H, L, D), dtype=BF16):
    return np.ones(shape, np.float32).astype(dtype)


def dev(shape=(B, H, L, D), slot=0, **kw):
    """A fake CUDA array at its own 16-byte aligned address (slot MiB apart)."""
    return FakeDLPack(shape, ptr=FAKE_BASE + slot * 64 * MiB, **kw)


def qkv_dev(shape=(B, H, L, D), kv_shape=None, **kw):
    kv_shape = kv_shape or shape
    return dev(shape, 0, **kw), dev(kv_shape, 1, **kw), dev(kv_shape, 2, **kw)


def call(q, k, v, **kw):
    return attn.attention(q, k, v, **kw)


@contextlib.contextmanager
def raises(exc, *words):
    """pytest.raises that also checks every word appears in the message."""
    with pytest.raises(exc) as info:
        yield info
    for w in words:
        assert w in str(info.value), f"{w!r} not in {str(info.value)!r}"


# --------------------------------------------------------------------------- kinds and dtypes

def test_non_arrays_are_type_errors():
    with raises(TypeError, "q:", "list"):
        call([[1.0]], host(), host())
    with raises(TypeError, "v:", "NoneType"):
        call(host(), host(), None)


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.int8, np.complex64])
def test_numpy_dtypes_other_than_bf16_f32_f64_are_type_errors(dtype):
    with raises(TypeError, "k:", "bfloat16", np.dtype(dtype).name):
        call(host(), host(dtype=dtype), host())


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16])
def test_float_numpy_inputs_are_accepted(dtype):
    plan = validate(host(dtype=dtype), host(dtype=dtype), host(dtype=dtype), stage=None,
                    scale=None, layout="bhld", out=None, stream=None)
    assert plan.host and plan.seq_q == L and plan.head_dim == D


@pytest.mark.parametrize("dtype", ["float16", "float32", "int32"])
def test_device_dtype_is_read_from_the_capsule(dtype):
    with raises(TypeError, "q:", "bfloat16", dtype):
        call(dev(dtype=dtype), dev(slot=1), dev(slot=2))


def test_cai_dtype_is_read_from_typestr():
    with raises(TypeError, "k:", "bfloat16", "float16"):
        call(FakeCAI((B, H, L, D)), FakeCAI((B, H, L, D), typestr="<f2"), FakeCAI((B, H, L, D)))


def test_host_dlpack_devices_are_refused():
    cpu = dev(device_type=1)
    with raises(TypeError, "q:", "CPU"):
        call(cpu, dev(slot=1), dev(slot=2))


def test_host_device_mix():
    with raises(ValueError, "q is a NumPy (host) array", "k is a device array"):
        call(host(), dev(), host())


def test_different_devices():
    with raises(ValueError, "device 0", "device 1"):
        call(dev(slot=0, device=0), dev(slot=1, device=1), dev(slot=2, device=0))


# --------------------------------------------------------------------------- shapes

@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_rank(layout):
    with raises(ValueError, "q:", "rank-4", "rank 3", layout):
        call(host((H, L, D)), host(), host(), layout=layout)


def test_layout_name():
    with raises(ValueError, "layout:", "'bhld'", "'bshd'", "'blhd'"):
        call(host(), host(), host(), layout="blhd")


def test_batch_heads_and_head_dim_must_match():
    with raises(ValueError, "k:", "batch 1", "batch 2"):
        call(host(), host((1, H, L, D)), host((1, H, L, D)))
    with raises(ValueError, "k:", "heads 4", "heads 3", "divide"):
        call(host(), host((B, 4, L, D)), host((B, 4, L, D)))
    with raises(ValueError, "k:", "head dim 64", "head dim 128"):
        call(host(), host((B, H, L, 64)), host((B, H, L, 64)))


def test_bshd_reads_heads_from_axis_2():
    # (B, L, H, D): k has 4 heads on axis 2, q has 3
    with raises(ValueError, "k:", "heads 4"):
        call(host((B, L, H, D)), host((B, L, 4, D)), host((B, L, 4, D)), layout="bshd")


def test_k_and_v_shapes_must_match():
    with raises(ValueError, "v:", "same shape as k", str((B, H, 64, D))):
        call(host(), host(), host((B, H, 64, D)))


def test_head_dim_not_supported():
    with raises(ValueError, "q:", "head dim 96", "takes 64, 128, 256", "takes 128",
                "no registered stage"):
        call(host((B, H, L, 96)), host((B, H, L, 96)), host((B, H, L, 96)))


def test_query_length_not_supported_names_what_the_stage_takes():
    with raises(ValueError, "q:", "query length 100", "multiples of 64", "production"):
        call(host((B, H, 100, D)), host(), host(), stage=1)
    with raises(ValueError, "q:", "stage05", "query length 64", "multiples of 128",
                "production and 4 other stages would take it"):
        call(host((B, H, 64, D)), host(), host(), stage=5)


def test_key_length_not_supported():
    with raises(ValueError, "k:", "key length 100", "multiples of 64"):
        call(host(), host((B, H, 100, D)), host((B, H, 100, D)), stage=1)


def test_another_stage_that_would_take_it_is_named(monkeypatch):
    base = stages.get_stage(1)
    small = dataclasses.replace(base, number=2, name="small_tiles", block_m=32, block_n=32)
    monkeypatch.setattr(stages, "STAGES", (base, small))
    # the production kernel out of the way (as if it took no head dim of this call)
    monkeypatch.setattr(stages, "PRODUCTION", dataclasses.replace(stages.PRODUCTION,
                                                                 head_dims=(64,)))
    with raises(ValueError, "q:", "stage01 (baseline)", "query length 96",
                "stage02 (small_tiles) would take it"):
        call(host((B, H, 96, D)), host(), host(), stage=1)
    plan = validate(host((B, H, 96, D)), host(), host(), stage=None, scale=None,
                    layout="bhld", out=None, stream=None)
    assert plan.stage is small            # stage=None: the only one that takes it


def test_default_is_the_production_kernel():
    for lq, lk in ((L, L), (100, 37), (1, 4095)):
        plan = validate(host((B, H, lq, D)), host((B, H, lk, D)), host((B, H, lk, D)),
                        stage=None, scale=None, layout="bhld", out=None, stream=None)
        assert plan.stage is stages.PRODUCTION, (lq, lk)


def test_default_falls_back_to_the_fastest_lineage_stage(monkeypatch):
    monkeypatch.setattr(stages, "PRODUCTION", dataclasses.replace(stages.PRODUCTION,
                                                                 head_dims=(64,)))
    plan = validate(host(), host(), host(), stage=None, scale=None, layout="bhld",
                    out=None, stream=None)
    takers = [s for s in stages.by_speed() if s.unsupported(D, L, L) is None]
    assert plan.stage == takers[0]


def test_gqa_heads_must_divide():
    for hq, hk in ((8, 3), (4, 8), (6, 4)):
        with raises(ValueError, "k:", f"heads {hk}", f"heads {hq}", "divid"):
            call(host((B, hq, L, D)), host((B, hk, L, D)), host((B, hk, L, D)))
    for hq, hk in ((8, 2), (8, 1), (6, 3)):     # GQA and MQA are accepted by the default kernel
        plan = validate(host((B, hq, L, D)), host((B, hk, L, D)), host((B, hk, L, D)),
                        stage=None, scale=None, layout="bhld", out=None, stream=None)
        assert plan.stage is stages.PRODUCTION and plan.heads_kv == hk and plan.heads == hq


def test_gqa_and_lse_need_the_production_kernel():
    with raises(ValueError, "stage14", "GQA", "production"):
        call(host((B, 4, L, D)), host((B, 2, L, D)), host((B, 2, L, D)), stage=14)
    with raises(ValueError, "return_lse", "stage14", "production"):
        call(host(), host(), host(), stage=14, return_lse=True)
    with raises(TypeError, "return_lse", "True or False"):
        call(host(), host(), host(), return_lse=1)


def test_speed_order_lists_every_stage_once():
    order = [s.number for s in stages.by_speed()]
    assert sorted(order) == sorted(s.number for s in stages.all_stages())
    assert order[0] == stages.FASTEST_FIRST[0]


def test_unknown_stage():
    with raises(ValueError, "stage:", "unknown stage", "'fastest'"):
        call(host(), host(), host(), stage="fastest")


def test_empty_keys_are_an_error():
    with raises(ValueError, "k:", "key length is 0"):
        call(host(), host((B, H, 0, D)), host((B, H, 0, D)))


def test_empty_queries_give_an_empty_output_without_a_launch():
    out = call(host((B, H, 0, D)), host(), host())
    assert isinstance(out, np.ndarray) and out.shape == (B, H, 0, D) and out.dtype == BF16
    out = call(host((B, 0, H, D)), host((B, L, H, D)), host((B, L, H, D)), layout="bshd")
    assert out.shape == (B, 0, H, D)
    q, k, v = qkv_dev((B, H, 0, D), (B, H, L, D))
    out = call(q, k, v)
    assert isinstance(out, DeviceArray) and out.shape == (B, H, 0, D)


# --------------------------------------------------------------------------- scale, stream

def test_scale():
    with raises(ValueError, "scale:", "finite", "nan"):
        call(host(), host(), host(), scale=float("nan"))
    with raises(TypeError, "scale:", "str"):
        call(host(), host(), host(), scale="0.1")
    plan = validate(host(), host(), host(), stage=None, scale=None, layout="bhld",
                    out=None, stream=None)
    assert plan.scale == pytest.approx(1 / np.sqrt(D))
    plan = validate(host(), host(), host(), stage=None, scale=np.float32(0.25),
                    layout="bhld", out=None, stream=None)
    assert plan.scale == 0.25


def test_stream():
    with raises(TypeError, "stream:"):
        call(host(), host(), host(), stream="default")

    class TorchLike:
        cuda_stream = 0xABC0
    q, k, v = qkv_dev()
    validate(q, k, v, stage=None, scale=None, layout="bhld", out=None, stream=TorchLike())
    # the stream goes to the producer, as DLPack wants; the legacy default stream is 1
    assert q.calls[-1]["stream"] == 0xABC0
    q, k, v = qkv_dev()
    validate(q, k, v, stage=None, scale=None, layout="bhld", out=None, stream=None)
    assert q.calls[-1] == {"stream": 1, "max_version": (1, 0)}


# --------------------------------------------------------------------------- strides and alignment

def test_device_inputs_validate_without_a_gpu():
    for make in (lambda s, i: dev(s, i), lambda s, i: LegacyDLPack(s, ptr=FAKE_BASE + i * 64 * MiB),
                 lambda s, i: FakeCAI(s, ptr=FAKE_BASE + i * 64 * MiB)):
        q, k, v = make((B, H, L, D), 0), make((B, H, 256, D), 1), make((B, H, 256, D), 2)
        plan = validate(q, k, v, stage=1, scale=None, layout="bhld", out=None, stream=None)
        assert not plan.host and (plan.seq_q, plan.seq_k) == (L, 256)


def test_last_dim_stride_must_be_one():
    shape = (B, H, L, D)
    strided = dev(shape, strides=(H * L * D * 2, L * D * 2, D * 2, 2))
    with raises(ValueError, "q:", "stride 1", "stride 2"):
        call(strided, dev(slot=1), dev(slot=2))


def test_base_address_must_be_16_byte_aligned():
    with raises(ValueError, "v:", "16-byte aligned", hex(FAKE_BASE + 2 * 64 * MiB + 8)):
        call(dev(slot=0), dev(slot=1), FakeDLPack((B, H, L, D), ptr=FAKE_BASE + 2 * 64 * MiB + 8))


def test_strides_must_be_multiples_of_16_bytes():
    # rows 132 elements apart = 264 bytes
    strides = (H * L * 132, L * 132, 132, 1)
    with raises(ValueError, "k:", "row stride", "264 bytes", "multiple of 16"):
        call(dev(slot=0), dev(slot=1, strides=strides), dev(slot=2))
    cai = FakeCAI((B, H, L, D), strides_bytes=(H * L * 264, L * 264, 264, 2))
    with raises(ValueError, "q:", "row stride"):
        call(cai, dev(slot=1), dev(slot=2))


def test_strided_views_and_size_one_dims_are_fine():
    # a head-dim slice of a wider tensor (rows 256 elements apart), and a batch of 1 whose
    # batch stride is garbage (frameworks report anything for size-1 dims)
    q = dev((1, H, L, D), strides=(7, L * 256, 256, 1))
    k = dev((1, H, L, D), slot=1, strides=(3, L * 256, 256, 1))
    v = dev((1, H, L, D), slot=2)
    validate(q, k, v, stage=None, scale=None, layout="bhld", out=None, stream=None)


# --------------------------------------------------------------------------- out=

def test_out_host_checks_and_untouched_on_error():
    sentinel = np.full((B, H, L, D), 7, np.float32).astype(BF16)
    out = sentinel.copy()
    with raises(ValueError, "out:", "expected shape", str((B, H, L, D)), str((B, L, H, D))):
        call(host(), host(), host(), out=host((B, L, H, D)))    # bshd-shaped out for bhld
    with raises(TypeError, "out:", "bfloat16", "float32"):
        call(host(), host(), host(), out=host(dtype=np.float32))
    ro = host()
    ro.flags.writeable = False
    with raises(ValueError, "out:", "read-only"):
        call(host(), host(), host(), out=ro)
    with raises(ValueError, "out:", "must be a NumPy array"):
        call(host(), host(), host(), out=dev())
    # an error elsewhere leaves out alone
    with raises(ValueError, "q:", "query length 100"):
        call(host((B, H, 100, D)), host(), host(), stage=1, out=out)
    np.testing.assert_array_equal(out.view(np.uint16), sentinel.view(np.uint16))


def test_out_must_not_alias_inputs():
    q, k, v = host(), host(), host()
    with raises(ValueError, "out:", "overlaps q"):
        call(q, k, v, out=q)
    big = host((B, H, 2 * L, D))
    with raises(ValueError, "out:", "overlaps v"):
        call(q, k, big[:, :, :L], out=big[:, :, L:])   # conservative: same buffer
    dq, dk, dv = qkv_dev()
    with raises(ValueError, "out:", "overlaps k"):
        call(dq, dk, dv, out=FakeDLPack((B, H, L, D), ptr=dk.ptr + 4096))


def test_out_device_checks():
    q, k, v = qkv_dev()
    with raises(ValueError, "out:", "expected shape"):
        call(q, k, v, out=dev((B, H, L, 64), slot=3))
    with raises(TypeError, "out:", "bfloat16", "float32"):
        call(*qkv_dev(), out=dev(slot=3, dtype="float32"))
    with raises(ValueError, "out:", "device 1", "device 0"):
        call(*qkv_dev(), out=dev(slot=3, device=1))
    with raises(ValueError, "out:", "must be a device array"):
        call(*qkv_dev(), out=host())
    with raises(ValueError, "out:", "read-only"):
        call(*qkv_dev(), out=dev(slot=3, readonly=True))
    with raises(ValueError, "out:", "16-byte aligned"):
        call(*qkv_dev(), out=FakeDLPack((B, H, L, D), ptr=FAKE_BASE + 3 * 64 * MiB + 2))
    with raises(ValueError, "out:", "overlap"):
        call(*qkv_dev(), out=dev(slot=3, strides=(0, 0, D, 1)))
    with raises(ValueError, "out:", "stride 1"):
        call(*qkv_dev(), out=dev(slot=3, strides=(H * L * D * 2, L * D * 2, D * 2, 2)))


def test_out_layout_bshd():
    q, k, v = (dev((B, L, H, D), slot=i) for i in range(3))
    with raises(ValueError, "out:", str((B, L, H, D)), "'bshd'"):
        call(q, k, v, layout="bshd", out=dev((B, H, L, D), slot=3))


# --------------------------------------------------------------------------- nothing written

def _sentinel(shape=(B, H, L, D)):
    return np.full(shape, 7, np.float32).astype(BF16)


BAD_CALLS = {
    "dtype": lambda out: call(host(), host(dtype=np.float16), host(), out=out),
    "rank": lambda out: call(host(), host((H, L, D)), host(), out=out),
    "head dim": lambda out: call(host(), host((B, H, L, 64)), host((B, H, L, 64)), out=out),
    "batch": lambda out: call(host(), host((1, H, L, D)), host((1, H, L, D)), out=out),
    "heads": lambda out: call(host(), host((B, 2, L, D)), host((B, 2, L, D)), out=out),
    "gqa on a lineage stage": lambda out: call(host(), host((B, 1, L, D)), host((B, 1, L, D)),
                                               stage=14, out=out),
    "lse on a lineage stage": lambda out: call(host(), host(), host(), stage=14,
                                               return_lse=True, out=out),
    "return_lse type": lambda out: call(host(), host(), host(), return_lse="yes", out=out),
    "kv shapes": lambda out: call(host(), host(), host((B, H, 64, D)), out=out),
    "key length": lambda out: call(host(), host((B, H, 100, D)), host((B, H, 100, D)), stage=1,
                                   out=out),
    "no keys": lambda out: call(host(), host((B, H, 0, D)), host((B, H, 0, D)), out=out),
    "host/device mix": lambda out: call(host(), dev(), host(), out=out),
    "layout": lambda out: call(host(), host(), host(), layout="lbhd", out=out),
    "stage": lambda out: call(host(), host(), host(), stage="fastest", out=out),
    "scale": lambda out: call(host(), host(), host(), scale=float("inf"), out=out),
    "stream": lambda out: call(host(), host(), host(), stream=-3, out=out),
    "out aliases q": lambda out: call(out, host(), host(), out=out),
}


@pytest.mark.parametrize("what", sorted(BAD_CALLS))
def test_nothing_is_written_to_out_on_any_error(what):
    out = _sentinel()
    with pytest.raises((ValueError, TypeError)):
        BAD_CALLS[what](out)
    np.testing.assert_array_equal(out.view(np.uint16), _sentinel().view(np.uint16))


def test_persistent_grid_knob_is_checked_before_anything_runs(monkeypatch):
    persistent = next(s for s in stages.all_stages() if s.persistent)
    out = _sentinel((B, H, 256, D))
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", bad)
        with raises(ValueError, "PTXATTN_PERSISTENT_CTAS", repr(bad)):
            call(host((B, H, 256, D)), host(), host(), stage=persistent.number, out=out)
    np.testing.assert_array_equal(out.view(np.uint16), _sentinel((B, H, 256, D)).view(np.uint16))


# --------------------------------------------------------------------------- empty outputs

@pytest.mark.parametrize("shape", [(0, H, L, D), (B, 0, L, D), (B, H, 0, D)])
def test_any_empty_output_comes_back_without_a_launch(shape):
    b, h, _, d = shape
    kv = (b, h, L, d)
    out = call(host(shape), host(kv), host(kv))
    assert isinstance(out, np.ndarray) and out.shape == shape and out.dtype == BF16
    q, k, v = dev(shape, 0), dev(kv, 1), dev(kv, 2)
    out = call(q, k, v)
    assert isinstance(out, DeviceArray) and out.shape == shape and out.size == 0
    given = dev(shape, 3)
    assert call(dev(shape, 0), dev(kv, 1), dev(kv, 2), out=given) is given
    # an unsupported query length does not matter when there is nothing to compute
    call(host((0, H, 100, D)), host((0, H, L, D)), host((0, H, L, D)), stage=1)


# --------------------------------------------------------------------------- producers

class RefusingProducer(FakeDLPack):
    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        raise RuntimeError("Can't export tensors that require gradient, use tensor.detach()")


def test_a_producer_that_refuses_to_export_is_named():
    with raises(ValueError, "k:", "refused", "RuntimeError", "detach()"):
        call(dev(), RefusingProducer((B, H, L, D), ptr=FAKE_BASE + 64 * MiB), dev(slot=2))


def test_device_dtype_errors_say_that_nothing_is_converted():
    with raises(TypeError, "q:", "expected dtype bfloat16, got float32", "cast to bfloat16"):
        call(dev(dtype="float32"), dev(slot=1), dev(slot=2))
    with raises(TypeError, "v:", "got float16", "cast to bfloat16"):
        call(FakeCAI((B, H, L, D)), FakeCAI((B, H, L, D)), FakeCAI((B, H, L, D), typestr="<f2"))


# --------------------------------------------------------------------------- the caller's stream

def _framework(monkeypatch, package: str, handle: int):
    """A stand-in for torch or cupy in sys.modules, whose current stream is `handle`."""
    import sys
    import types

    stream = types.SimpleNamespace(cuda_stream=handle, ptr=handle)
    module = types.ModuleType(package)
    if package == "torch":
        module.cuda = types.SimpleNamespace(current_stream=lambda device=None: stream)
    else:
        module.cuda = types.SimpleNamespace(get_current_stream=lambda: stream)
    monkeypatch.setitem(sys.modules, package, module)

    class Tensor(FakeDLPack):
        is_cuda = True
        device = "cuda:0"
    Tensor.__module__ = package
    return Tensor


@pytest.mark.parametrize("package", ["torch", "cupy"])
def test_stream_none_is_the_frameworks_current_stream(monkeypatch, package):
    Tensor = _framework(monkeypatch, package, 0x7A00)
    q, k, v = (Tensor((B, H, L, D), ptr=FAKE_BASE + i * 64 * MiB) for i in range(3))
    plan = validate(q, k, v, stage=None, scale=None, layout="bhld", out=None, stream=None)
    assert plan.stream == 0x7A00
    assert [a.calls[-1]["stream"] for a in (q, k, v)] == [0x7A00] * 3   # producers sync there
    # a given stream wins; other producers (jax, fakes) keep the legacy default stream
    plan = validate(*(Tensor((B, H, L, D), ptr=FAKE_BASE + i * 64 * MiB) for i in range(3)),
                    stage=None, scale=None, layout="bhld", out=None, stream=0x5100)
    assert plan.stream == 0x5100
    plan = validate(*qkv_dev(), stage=None, scale=None, layout="bhld", out=None,
                    stream=None)
    assert plan.stream == 0


def test_mask_arguments_are_checked():
    for bad, words in (((-2, 0), ("window", "left", ">= -1")), ((0, 1.5), ("window", "right")),
                       ((True, 0), ("window", "left"))):
        with raises(ValueError, *words):
            call(host(), host(), host(), window=bad)
    with raises(TypeError, "window", "pair"):
        call(host(), host(), host(), window=5)
    with raises(TypeError, "causal", "True or False"):
        call(host(), host(), host(), causal="yes")
    with raises(ValueError, "diagonal", "bottom_right", "top_left"):
        call(host(), host(), host(), causal=True, diagonal="upper")
    with raises(ValueError, "window", "causal=True", "right edge"):
        call(host(), host(), host(), causal=True, window=(8, 4))
    with raises(ValueError, "causal", "stage14", "production"):
        call(host(), host(), host(), causal=True, stage=14)


@pytest.mark.parametrize("right", [1, 2, 64])
def test_causal_refuses_every_right_edge_past_the_diagonal(right):
    with raises(ValueError, "window", "causal=True", "right edge", f"got {right}"):
        call(host(), host(), host(), causal=True, window=(8, right))


@pytest.mark.parametrize("right", [0, -1])
def test_causal_takes_a_right_edge_of_0_or_unbounded(right):
    # an empty query validates in full and returns without the driver
    out = call(host((B, H, 0, D)), host(), host(), causal=True, window=(8, right))
    assert out.shape == (B, H, 0, D)


def test_masks_pick_the_masked_build():
    plan = validate(host((B, H, 100, D)), host((B, H, 300, D)), host((B, H, 300, D)),
                    stage=None, scale=None, layout="bhld", out=None, stream=None,
                    causal=True)
    assert plan.masked and plan.window == (-1, 0) and plan.diag_offset == 200
    build = plan.stage.specialize(D, plan.masked)
    assert ("PTXATTN_MASKED", "1") in build.defines
    plan = validate(host(), host(), host(), stage=None, scale=None, layout="bhld",
                    out=None, stream=None, window=(-1, -1))
    assert not plan.masked                       # (-1, -1) hides nothing: the unmasked build
    plan = validate(host((B, H, 100, D)), host((B, H, 300, D)), host((B, H, 300, D)),
                    stage=None, scale=None, layout="bhld", out=None, stream=None,
                    causal=True, window=(64, -1), diagonal="top_left")
    assert plan.window == (64, 0) and plan.diag_offset == 0


def test_scale_must_be_positive():
    for bad in (0.0, -0.125):
        with raises(ValueError, "scale", "positive"):
            call(host(), host(), host(), scale=bad)

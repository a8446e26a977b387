"""attention(q, k, v, precision="fp8"): every bad argument refused before any driver call,
naming the argument (CPU only; the no_driver fixture fails a test that reaches the driver).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from fakes import FAKE_BASE, FakeDLPack

import ptxattn
from ptxattn import fp8, fp8_quantize
from ptxattn.tensors import BF16, E4M3, DeviceArray

pytestmark = pytest.mark.usefixtures("no_driver")

B, H, HKV, L, D = 2, 4, 2, 256, 128
MiB = 1 << 20


@contextlib.contextmanager
def raises(exc, *words):
    with pytest.raises(exc) as info:
        yield info
    for w in words:
        assert w in str(info.value), f"{w!r} not in {str(info.value)!r}"


def e4m3_host(shape):
    return np.ones(shape, np.float32).astype(E4M3)


def e4m3_dev(shape, slot, strides=None, ptr=None):
    return DeviceArray(FAKE_BASE + slot * 64 * MiB if ptr is None else ptr, shape, strides,
                       device=0, dtype=E4M3)


def fp8_inputs(host=True, layout="bhld"):
    q_shape = (B, H, L, D) if layout == "bhld" else (B, L, H, D)
    kv_shape = (B, HKV, L, D) if layout == "bhld" else (B, L, HKV, D)
    if host:
        return e4m3_host(q_shape), e4m3_host(kv_shape), e4m3_host(kv_shape)
    return e4m3_dev(q_shape, 0), e4m3_dev(kv_shape, 1), e4m3_dev(kv_shape, 2)


def descale(shape=(B, HKV), dtype=np.float32):
    return np.ones(shape, dtype)


def call(q, k, v, **kw):
    return ptxattn.attention(q, k, v, **{"precision": "fp8", **kw})


def test_precision_names():
    q, k, v = fp8_inputs()
    with raises(ValueError, "precision", "'fp8'"):
        call(q, k, v, precision="int8")
    with raises(ValueError, "q_descale", "precision='fp8'"):
        ptxattn.attention(q, k, v, q_descale=descale())


def test_lse_out_is_not_for_fp8():
    """lse_out= (the bf16 path's caller-owned LSE) is refused by name on the FP8 path."""
    q, k, v = fp8_inputs()
    with raises(ValueError, "lse_out", "FP8"):
        call(q, k, v, return_lse=True, lse_out=np.zeros((B, H, L), np.float32))


def test_stage_is_not_for_fp8():
    with raises(ValueError, "stage"):
        call(*fp8_inputs(), stage=14)


def test_bf16_and_e4m3_do_not_mix():
    q, k, v = fp8_inputs()
    with raises(TypeError, "q, k, v", "float8_e4m3fn"):
        call(q.astype(np.float32).astype(BF16), k, v)


def test_descales_go_with_e4m3_inputs():
    q = np.ones((B, H, L, D), np.float32).astype(BF16)
    k = v = np.ones((B, HKV, L, D), np.float32).astype(BF16)
    with raises(ValueError, "k_descale", "float8_e4m3fn"):
        call(q, k, v, k_descale=descale())


@pytest.mark.parametrize("name", ["q_descale", "k_descale", "v_descale"])
def test_descale_shape_and_dtype(name):
    q, k, v = fp8_inputs()
    with raises(ValueError, name, "(batch, heads_kv)", str((B, HKV)), str((B, H))):
        call(q, k, v, **{name: descale((B, H))})
    with raises(TypeError, name, "float32", "float16"):
        call(q, k, v, **{name: descale(dtype=np.float16)})
    with raises(TypeError, name, "float32"):
        call(*fp8_inputs(host=False), **{name: "one"})


def test_descale_side_matches_the_inputs():
    with raises(ValueError, "v_descale", "device"):
        call(*fp8_inputs(host=False), v_descale=descale())
    dev_scale = DeviceArray(FAKE_BASE + 9 * 64 * MiB, (B, HKV), device=0, dtype=np.float32)
    with raises(ValueError, "q_descale", "NumPy"):
        call(*fp8_inputs(), q_descale=dev_scale)


def test_smooth_k():
    with raises(ValueError, "smooth_k", "bfloat16"):
        call(*fp8_inputs(), smooth_k=True)
    with raises(TypeError, "smooth_k"):
        call(*fp8_inputs(), smooth_k=1)
    q = np.ones((B, H, L, D), np.float32).astype(BF16)
    k = v = np.ones((B, HKV, L, D), np.float32).astype(BF16)
    with raises(ValueError, "return_lse", "smooth_k"):
        call(q, k, v, smooth_k=True, return_lse=True)


def test_e4m3_shapes():
    q, k, v = fp8_inputs()
    with raises(ValueError, "v", "same shape as k"):
        call(q, k, v[:, :, :100])
    with raises(ValueError, "k", "heads 3"):
        call(q, e4m3_host((B, 3, L, D)), e4m3_host((B, 3, L, D)))
    with raises(ValueError, "head dim 96"):
        call(e4m3_host((B, H, L, 96)), e4m3_host((B, HKV, L, 96)), e4m3_host((B, HKV, L, 96)))
    with raises(ValueError, "k", "key length is 0"):
        call(q, e4m3_host((B, HKV, 0, D)), e4m3_host((B, HKV, 0, D)))
    with raises(ValueError, "layout"):
        call(q, k, v, layout="hbld")
    with raises(ValueError, "rank-4"):
        call(q[0], k, v)


def test_e4m3_device_geometry():
    q, k, v = fp8_inputs(host=False)
    with raises(ValueError, "q", "aligned"):
        call(e4m3_dev(q.shape, 0, ptr=FAKE_BASE + 8), k, v)
    bad = e4m3_dev((B, HKV, L, D), 1, strides=(HKV * L * 136, L * 136, 136, 1))
    with raises(ValueError, "k", "row stride", "16 bytes"):
        call(q, bad, v)
    bad = e4m3_dev((B, HKV, L, D), 2, strides=(HKV * L * D, L * D, 1, L))
    with raises(ValueError, "v", "stride 1"):
        call(q, k, bad)


def test_e4m3_other_arguments():
    q, k, v = fp8_inputs()
    with raises(ValueError, "scale"):
        call(q, k, v, scale=-1.0)
    with raises(TypeError, "scale"):
        call(q, k, v, scale="big")
    with raises(ValueError, "window"):
        call(q, k, v, causal=True, window=(4, 2))
    with raises(TypeError, "return_lse"):
        call(q, k, v, return_lse=1)
    with raises(ValueError, "out", "shape"):
        call(q, k, v, out=np.zeros((B, H, L, 64), BF16))
    with raises(TypeError, "out", "bfloat16"):
        call(q, k, v, out=np.zeros((B, H, L, D), np.float32))


def test_bf16_inputs_get_the_bf16_paths_checks():
    q = FakeDLPack((B, H, L, D), ptr=FAKE_BASE)
    k = FakeDLPack((B, HKV, L, D), ptr=FAKE_BASE + 64 * MiB)
    v = FakeDLPack((B, HKV, L, D), ptr=FAKE_BASE + 128 * MiB, dtype="float16")
    with raises(TypeError, "v", "bfloat16"):
        call(q, k, v)
    with raises(ValueError, "head dim 96"):
        call(*(np.ones((1, 1, 8, 96), np.float32) for _ in range(3)))


def test_a_valid_call_reaches_the_fp8_forward(monkeypatch):
    """Validation passes and hands one plan to the forward (stubbed: no driver here)."""
    from ptxattn import fp8_forward
    seen = []
    monkeypatch.setattr(fp8_forward, "run", lambda plan: seen.append(plan) or "ran")
    q, k, v = fp8_inputs(layout="bshd")
    assert call(q, k, v, layout="bshd", causal=True, q_descale=descale(),
                v_descale=descale()[:, :1].repeat(HKV, axis=1)) == "ran"
    plan = seen[0]
    assert plan.quantized and plan.host and plan.layout == "bshd"
    assert (plan.batch, plan.heads, plan.heads_kv, plan.seq_q, plan.head_dim) == (B, H, HKV, L, D)
    assert plan.window == (-1, 0) and plan.descales["k_descale"] is None
    arr, strides = plan.descales["q_descale"]
    assert strides == (HKV, 1)
    bf = np.ones((B, H, L, D), np.float32).astype(BF16)
    assert call(bf, bf[:, :HKV], bf[:, :HKV], smooth_k=True) == "ran"
    assert not seen[1].quantized and seen[1].smooth_k and seen[1].heads_kv == HKV


def test_stats_chunks_cover_the_keys():
    for b, hkv, lk in [(1, 12, 32760), (2, 8, 16384), (1, 1, 1), (4, 32, 100), (1, 1, 1 << 20)]:
        chunks, rows = fp8_quantize.stats_chunks(b, hkv, lk)
        assert rows % fp8_quantize.STATS_ROWS == 0 and 1 <= chunks <= 64
        assert (chunks - 1) * rows < lk <= chunks * rows


requires_ptxas = pytest.mark.skipif(__import__("ptxattn.tools.sass").tools.sass.locate("ptxas") is None,
                                    reason="no ptxas anywhere (pip install 'ptxattn[tools]')")


@requires_ptxas
@pytest.mark.parametrize("d", fp8.HEAD_DIMS)
def test_the_quantizer_assembles_without_spills(d):
    """ptxas on quantize_fp8.ptx for each head dim: its three entries, no spills or stack, the
    e4m3 packing (F2FP) and TMA loads in the SASS; explicitly rounded arithmetic (no FFMA
    outside the div.rn subroutines: a contracted sub and mul would break the bit-exact model)."""
    from ptxattn.tools import sass
    built = sass.assemble_ptx(fp8_quantize.quantize_source(d), "sm_90a", name=f"quantize_fp8_d{d}")
    report = sass.parse_ptxas_log(built.log)["functions"]
    assert set(report) == {"ptxattn_fp8_kv_stats", "ptxattn_fp8_quantize",
                           "ptxattn_fp8_transpose_v"}
    for name, f in report.items():
        assert f["spill_stores"] == 0 and f["spill_loads"] == 0 and f["stack_frame"] == 0, (name, f)
    text = sass.disassemble(built.cubin)
    assert "F2FP.SATFINITE.E4M3.F32.PACK_AB" in text
    assert "UTMALDG.5D" in text and "UTMALDG.4D" in text


def test_the_fp8_benchmark_refuses_bad_arguments(capsys):
    """bench/fp8_bench.py parses its arguments before touching torch or the GPU."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "bench" / "fp8_bench.py"
    spec = importlib.util.spec_from_file_location("fp8_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for argv in (["--shapes", "nope"], ["--rounds", "3"], ["--define", "1x"]):
        with pytest.raises(SystemExit):
            module.main(argv)
    assert "unknown" in capsys.readouterr().err
    assert set(module.SHAPES) == {"16k-d128", "16k-d256", "wan", "causal-16k-d128",
                                  "causal-16k-d256"}


@pytest.mark.parametrize("scale", [True, 1e39, np.bool_(True)])
def test_fp8_scale_is_checked_as_the_bf16_path_checks_it(scale):
    """The FP8 path takes plan.scale_of, not a copy of it: a bool or a value float32 cannot
    hold is refused before any device work."""
    q = np.zeros((1, 1, 128, 64), BF16)
    with pytest.raises((TypeError, ValueError), match="scale"):
        ptxattn.attention(q, q, q, precision="fp8", scale=scale)

"""The library API on the GPU (skipped without one): errors on real device tensors, DLPack
both ways with PyTorch, CuPy and JAX, streams, NaN/Inf inputs, determinism, threads,
resource hygiene, and the README's framework examples run as written.

A framework that is not importable (or cannot hold bfloat16, for CuPy) skips its tests with
the reason, or fails them under PTXATTN_REQUIRE_GPU=1 (gpu_checks.skip_or_fail). conftest.py sets XLA_PYTHON_CLIENT_PREALLOCATE=false before JAX is imported.
"""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from gpu_checks import skip_or_fail
from readme_blocks import imported_packages, python_blocks

import ptxattn
from ptxattn import api as attn
from ptxattn import driver, launch, stages, tensors
from ptxattn.reference import attention_reference, error_metrics, passes, random_qkv
from ptxattn.tensors import BF16

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent
D = 128
ALL = stages.all_stages()
SLEEP_CYCLES = 200_000_000          # torch.cuda._sleep: ~0.1 s at 1.98 GHz, longer at idle clocks

_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))


# --------------------------------------------------------------------------- helpers

def _import(name: str):
    try:
        return __import__(name)
    except Exception as e:              # ImportError, or a broken CUDA setup under it
        skip_or_fail(f"{name} is not importable here: {type(e).__name__}: {e}")


def need_torch():
    torch = _import("torch")
    if not torch.cuda.is_available():
        skip_or_fail("PyTorch sees no CUDA device")
    return torch


def need_cupy():
    """CuPy that holds bfloat16 (v14+, ml_dtypes) and exports it through DLPack."""
    cupy = _import("cupy")
    try:
        probe = cupy.asarray(np.zeros(2, BF16))
    except Exception as e:
        skip_or_fail(f"this CuPy ({cupy.__version__}) cannot hold bfloat16: {type(e).__name__}: {e}")
    try:
        probe.__dlpack__()
    except Exception as e:
        skip_or_fail(f"this CuPy ({cupy.__version__}) cannot export bfloat16 through DLPack: "
                    f"{type(e).__name__}: {e}")
    return cupy


def need_jax():
    jax = _import("jax")
    import jax.dlpack  # noqa: F401  (a submodule: make sure it is loaded)
    try:
        jax.devices("gpu")
    except RuntimeError as e:
        skip_or_fail(f"JAX has no GPU backend here: {e}")
    return jax


def to_host(x) -> np.ndarray:
    """float32 NumPy copy of a torch tensor, CuPy/JAX array, DeviceArray or NumPy array."""
    if isinstance(x, tensors.DeviceArray):
        return x.to_numpy().astype(np.float32)
    if type(x).__module__.startswith("torch"):
        return x.float().cpu().numpy()
    if hasattr(x, "get") and type(x).__module__.startswith("cupy"):
        return x.get().astype(np.float32)
    return np.asarray(x).astype(np.float32)


def bits(x) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint16)


def assert_matches_reference(out, q, k, v, layout="bhld"):
    m = error_metrics(to_host(out), attention_reference(to_host(q), to_host(k), to_host(v),
                                                        layout=layout))
    assert passes(m), m


def skip_unless_supported(stage, Lq, Lk=None):
    why = stage.unsupported(D, Lq, Lq if Lk is None else Lk)
    if why:
        pytest.skip(f"{stage.label} cannot run {why}")


def device_qkv(B, H, L, seed=0, layout="bhld"):
    q, k, v = random_qkv(B, H, L, L, D, layout, seed=seed)
    return (q, k, v), tuple(tensors.from_numpy(x) for x in (q, k, v))


# --------------------------------------------------------------------------- 1. errors on the GPU

def test_device_errors_name_the_argument_and_leave_out_untouched(monkeypatch):
    torch = need_torch()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    q, k, v = randn(1, 2, 256, D), randn(1, 2, 256, D), randn(1, 2, 256, D)
    out = torch.full_like(q, 7.0)
    q_before = q.clone()
    misaligned = randn(1, 2, 256, D + 8)[..., 1:D + 1]        # base 2 bytes past 16-byte alignment
    head_dim_strided = randn(1, 2, D, 256).transpose(2, 3)    # last stride 256, not 1
    grad = randn(1, 2, 256, D).requires_grad_()
    persistent = next(s for s in ALL if s.persistent)
    attend = ptxattn.attention
    out192 = torch.full((1, 2, 192, D), 7.0, device="cuda", dtype=torch.bfloat16)
    short_out = torch.full((1, 2, 128, D), 7.0, device="cuda", dtype=torch.bfloat16)
    f32_out = torch.full_like(q, 7.0, dtype=torch.float32)
    cases = [
        (TypeError, ("k:", "bfloat16", "float16"), lambda: attend(q, k.half(), v, out=out)),
        (TypeError, ("q:", "bfloat16", "float32"), lambda: attend(q.float(), k, v, out=out)),
        (TypeError, ("v:", "CPU"), lambda: attend(q, k, v.cpu(), out=out)),
        (ValueError, ("v:", "16-byte aligned"), lambda: attend(q, k, misaligned, out=out)),
        (ValueError, ("k:", "stride 1"), lambda: attend(q, head_dim_strided, v, out=out)),
        (ValueError, ("q:", "query length 192"),
         lambda: attend(randn(1, 2, 192, D), k, v, stage=persistent.number, out=out192)),
        (ValueError, ("k:", "heads 3"),
         lambda: attend(q, randn(1, 3, 256, D), randn(1, 3, 256, D), out=out)),
        (ValueError, ("q:", "refused", "detach"), lambda: attend(grad, k, v, out=out)),
        (ValueError, ("out:", "overlaps q"), lambda: attend(q, k, v, out=q)),
        (ValueError, ("out:", "expected shape"), lambda: attend(q, k, v, out=short_out)),
        (TypeError, ("out:", "bfloat16", "float32"), lambda: attend(q, k, v, out=f32_out)),
        (ValueError, ("out:", "NumPy"),
         lambda: attend(q, k, v, out=np.zeros((1, 2, 256, D), BF16))),
        (ValueError, ("q, k, v:", "NumPy"),
         lambda: attend(q, k.float().cpu().numpy(), v, out=out)),
    ]
    for exc, words, bad in cases:
        with pytest.raises(exc) as info:
            bad()
        for w in words:
            assert w in str(info.value), (w, str(info.value))
    monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", "0")
    with pytest.raises(ValueError, match="PTXATTN_PERSISTENT_CTAS"):
        ptxattn.attention(q, k, v, stage=persistent.number, out=out)
    torch.cuda.synchronize()
    for buffer in (out, out192, short_out, f32_out):
        assert bool((buffer == 7.0).all()), "an error wrote into out"
    assert torch.equal(q, q_before)


def test_empty_output_on_the_gpu():
    (q, k, v), (qd, kd, vd) = device_qkv(1, 2, 256)
    out = ptxattn.attention(q[:, :, :0], k, v)
    assert isinstance(out, np.ndarray) and out.shape == (1, 2, 0, D)
    empty = tensors.from_numpy(q[:, :, :0])
    dev_out = ptxattn.attention(empty, kd, vd)
    assert dev_out.shape == (1, 2, 0, D) and dev_out.to_numpy().shape == (1, 2, 0, D)


# --------------------------------------------------------------------------- 1b. NaN and Inf

@pytest.mark.parametrize("stage", ALL, ids=lambda s: s.label)
def test_nan_and_inf_inputs_behave_like_the_reference(stage):
    """Head 0 clean; 1: a NaN query row; 2: +Inf in one query element; 3: a block of 16 NaN
    key rows; 4: one NaN value element. Non-finite outputs exactly where the reference has
    NaN; everything else within the usual bar."""
    L = 256
    skip_unless_supported(stage, L)
    q, k, v = (x.astype(np.float32) for x in random_qkv(1, 5, L, L, D, "bhld", seed=11))
    q[0, 1, 37, :] = np.nan
    q[0, 2, 100, 5] = np.inf
    k[0, 3, 64:80, :] = np.nan
    v[0, 4, 200, 17] = np.nan
    q, k, v = (x.astype(BF16) for x in (q, k, v))
    with np.errstate(all="ignore"):
        ref = attention_reference(q, k, v)
    out = tensors.empty(q.shape)
    out.fill_u16(0x7F80)            # +Inf poison: neither NaN nor a plausible value
    ptxattn.attention(*(tensors.from_numpy(x) for x in (q, k, v)), stage=stage, out=out)
    got = out.to_numpy().astype(np.float32)

    expected_bad = np.isnan(ref)
    assert expected_bad[0, 1, 37].all() and expected_bad[0, 3].all()       # the reference itself
    assert expected_bad[0, 4, :, 17].all() and not expected_bad[0, 0].any()
    bad = ~np.isfinite(got)
    where = np.argwhere(bad != expected_bad)
    assert not where.size, (f"{len(where)} positions differ from the reference's NaN pattern, "
                            f"first (b, h, row, col): {where[:5].tolist()}")
    finite = ~expected_bad
    diff = np.abs(got[finite] - ref[finite])
    assert diff.max() <= 2e-2, diff.max()
    assert passes(error_metrics(got[0, 0], ref[0, 0]))


# --------------------------------------------------------------------------- 2. DLPack in

def test_torch_import_is_zero_copy_with_both_protocols():
    torch = need_torch()
    q, k, v = (torch.randn(1, 2, 256, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    a = tensors.as_device_array(q, name="q")
    assert (a.ptr, a.shape, a.strides, a.device) == (q.data_ptr(), tuple(q.shape), q.stride(),
                                                     q.device.index)
    try:
        q.__dlpack__(max_version=(1, 0))
        versioned = True
    except TypeError:
        versioned = False
    name = b"used_dltensor_versioned" if versioned else b"used_dltensor"
    if isinstance(a.owner, torch.Tensor):
        assert a.owner is q                # read directly (the call path's torch fast path)
    else:
        assert _capsule_is_valid(a.owner.capsule, name)

    class Legacy:                       # a producer from before DLPack 1.0
        def __init__(self, t):
            self.t = t

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

        def __dlpack__(self, stream=None):
            return self.t.__dlpack__(stream=stream)
    b = tensors.as_device_array(Legacy(q), name="q")
    assert b.ptr == q.data_ptr() and _capsule_is_valid(b.owner.capsule, b"used_dltensor")
    direct = torch.from_dlpack(ptxattn.attention(q, k, v))
    legacy = torch.from_dlpack(ptxattn.attention(Legacy(q), Legacy(k), Legacy(v)))
    assert torch.equal(direct, legacy)
    assert_matches_reference(direct, q, k, v)


def test_torch_out_is_written_in_place_through_any_strides():
    torch = need_torch()
    q, k, v = (torch.randn(2, 4, 256, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    storage = torch.full((2, 256, 4, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = storage.transpose(1, 2)                 # a BHLD view of BSHD memory
    assert ptxattn.attention(q, k, v, out=out) is out
    assert_matches_reference(out, q, k, v)
    assert torch.equal(out, torch.from_dlpack(ptxattn.attention(q, k, v)))


def test_cupy_import_is_zero_copy_and_float32_is_refused():
    cupy = need_cupy()
    (q, k, v), _ = device_qkv(1, 2, 256, seed=4)
    cq, ck, cv = (cupy.asarray(x) for x in (q, k, v))
    a = tensors.as_device_array(cq, name="q")
    assert a.ptr == cq.data.ptr and a.strides == tuple(s // 2 for s in cq.strides)
    out = ptxattn.attention(cq, ck, cv)
    assert_matches_reference(out, q, k, v)
    with pytest.raises(TypeError, match="q: expected dtype bfloat16, got float32"):
        ptxattn.attention(cupy.asarray(q.astype(np.float32)), ck, cv)


def test_jax_import_is_zero_copy_and_float32_is_refused():
    jax = need_jax()
    jnp = jax.numpy
    (q, k, v), _ = device_qkv(1, 2, 256, seed=5)
    jq, jk, jv = (jnp.asarray(x) for x in (q, k, v))
    a = tensors.as_device_array(jq, name="q")
    assert a.ptr == jq.unsafe_buffer_pointer()
    out = ptxattn.attention(jq, jk, jv)
    assert_matches_reference(out, q, k, v)
    with pytest.raises(TypeError, match="q: expected dtype bfloat16, got float32"):
        ptxattn.attention(jq.astype(jnp.float32), jk, jv)


# --------------------------------------------------------------------------- 2. DLPack out

def test_torch_consumes_our_export_zero_copy_both_protocols():
    torch = need_torch()
    (q, k, v), qkv = device_qkv(1, 2, 256, seed=6)
    out = ptxattn.attention(*qkv)
    t = torch.from_dlpack(out)                    # torch asks for the versioned protocol
    assert t.data_ptr() == out.ptr and t.dtype == torch.bfloat16
    legacy = torch.utils.dlpack.from_dlpack(out.__dlpack__(stream=1))   # a legacy capsule
    assert legacy.data_ptr() == out.ptr
    np.testing.assert_array_equal(bits(t.cpu().view(torch.int16).numpy()), bits(out.to_numpy()))
    assert_matches_reference(t, q, k, v)


def test_cupy_consumes_our_export():
    cupy = need_cupy()
    (q, k, v), qkv = device_qkv(1, 2, 256, seed=7)
    out = ptxattn.attention(*qkv)
    c = cupy.from_dlpack(out)
    assert c.data.ptr == out.ptr and c.shape == out.shape
    np.testing.assert_array_equal(bits(c.get()), bits(out.to_numpy()))


def test_jax_consumes_our_export():
    jax = need_jax()
    (q, k, v), qkv = device_qkv(1, 2, 256, seed=8)
    out = ptxattn.attention(*qkv)
    j = jax.dlpack.from_dlpack(out)
    assert j.shape == out.shape and j.dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(bits(np.asarray(j)), bits(out.to_numpy()))


# --------------------------------------------------------------------------- 2. streams

def test_the_kernel_runs_on_the_callers_or_the_given_stream():
    torch = need_torch()
    q, k, v = (torch.randn(1, 2, 256, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    assert ptxattn.prepare(q, k, v).stream == torch.cuda.current_stream().cuda_stream
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        assert ptxattn.prepare(q, k, v).stream == s.cuda_stream      # torch's current stream
    ours = driver.Stream()
    assert ptxattn.prepare(q, k, v, stream=s).stream == s.cuda_stream
    assert ptxattn.prepare(q, k, v, stream=ours).stream == ours.handle
    assert ptxattn.prepare(q, k, v, stream=ours.handle).stream == ours.handle   # a raw int
    expected = torch.from_dlpack(ptxattn.attention(q, k, v))
    for stream in (s, ours, ours.handle):
        got = torch.from_dlpack(ptxattn.attention(q, k, v, stream=stream))
        assert torch.equal(got, expected)


def test_cupy_stream_object_and_current_stream():
    cupy = need_cupy()
    (q, k, v), _ = device_qkv(1, 2, 256, seed=9)
    cq, ck, cv = (cupy.asarray(x) for x in (q, k, v))
    s = cupy.cuda.Stream(non_blocking=True)
    s.wait_event(cupy.cuda.get_current_stream().record())
    assert ptxattn.prepare(cq, ck, cv, stream=s).stream == s.ptr
    with s:
        assert ptxattn.prepare(cq, ck, cv).stream == s.ptr               # CuPy's current stream
        out = ptxattn.attention(cq, ck, cv)
    assert_matches_reference(out, q, k, v)


def test_inputs_written_late_on_the_producers_stream_are_waited_for():
    torch = need_torch()
    q0, k0, v0 = (torch.randn(1, 2, 512, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    expected = torch.from_dlpack(ptxattn.attention(q0, k0, v0))
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    ours = driver.Stream()
    with torch.cuda.stream(s):
        q, k, v = (torch.full_like(q0, float("nan")) for _ in range(3))
        torch.cuda._sleep(SLEEP_CYCLES)                  # s is busy ...
        for dst, src in ((q, q0), (k, k0), (v, v0)):
            dst.copy_(src)                               # ... and writes the inputs late
        out = ptxattn.attention(q, k, v, stream=ours)    # torch makes `ours` wait for s
    assert torch.equal(torch.from_dlpack(out), expected), "the kernel read the inputs too early"


@pytest.mark.parametrize("consumer", ["torch", "cupy", "jax"])
def test_an_exported_result_is_safe_on_the_consumers_stream(consumer):
    torch = need_torch()                                  # its _sleep keeps our stream busy
    cupy = need_cupy() if consumer == "cupy" else None
    jax = need_jax() if consumer == "jax" else None
    (q, k, v), qkv = device_qkv(1, 2, 512, seed=10)
    expected = bits(ptxattn.attention(q, k, v))
    ours = driver.Stream()
    p = ptxattn.prepare(*qkv, stream=ours)
    p.out.fill_u16(0xFFFF, stream=ours)                   # NaN until the kernel has run
    with torch.cuda.stream(torch.cuda.ExternalStream(ours.handle)):
        torch.cuda._sleep(SLEEP_CYCLES)                   # the kernel waits behind this
    p.launch()
    if consumer == "torch":
        got = torch.from_dlpack(p.out).cpu().view(torch.int16).numpy()   # on torch's stream
    elif consumer == "cupy":
        with cupy.cuda.Stream(non_blocking=True):
            got = cupy.from_dlpack(p.out).get()           # on a stream that knows nothing of ours
    else:
        got = np.asarray(jax.dlpack.from_dlpack(p.out))
    np.testing.assert_array_equal(bits(got), expected)


# --------------------------------------------------------------------------- 5. determinism

@pytest.mark.parametrize("stage", ALL, ids=lambda s: s.label)
def test_bitwise_identical_across_calls_and_streams(stage):
    skip_unless_supported(stage, 512)
    (q, k, v), qkv = device_qkv(2, 4, 512, seed=3)
    s1, s2 = driver.Stream(), driver.Stream()
    results = []
    for stream in (None, s1, s2, s1.handle):
        out = tensors.empty(q.shape)
        out.fill_u16(0xFFFF, stream=stream)
        ptxattn.attention(*qkv, stage=stage, out=out, stream=stream)
        results.append(bits(out.to_numpy()))
    # two streams at once, launched back to back
    p1, p2 = (ptxattn.prepare(*qkv, stage=stage, stream=s) for s in (s1, s2))
    for p, s in ((p1, s1), (p2, s2)):
        p.out.fill_u16(0xFFFF, stream=s)
    p1.launch()
    p2.launch()
    results += [bits(p1.out.to_numpy()), bits(p2.out.to_numpy())]
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])
    assert passes(error_metrics(results[0].view(BF16), attention_reference(q, k, v)))


@pytest.mark.parametrize("stage", [s for s in ALL if s.persistent], ids=lambda s: s.label)
def test_persistent_grid_cap_gives_the_same_bits(stage, monkeypatch):
    for B, H, L in ((2, 2, 512), (1, 4, 2048)):
        (q, k, v), qkv = device_qkv(B, H, L, seed=12)
        first = tensors.empty(q.shape)
        first.fill_u16(0xFFFF)                            # NaN: unwritten tiles cannot pass
        ptxattn.attention(*qkv, stage=stage, out=first)
        expected = bits(first.to_numpy())
        assert passes(error_metrics(expected.view(BF16), attention_reference(q, k, v)))
        for ctas in (1, 2, 3, 7):
            monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", str(ctas))
            p = ptxattn.prepare(*qkv, stage=stage)
            assert p.grid == (ctas, 1, 1)
            p.out.fill_u16(0xFFFF)
            p.launch()
            np.testing.assert_array_equal(bits(p.out.to_numpy()), expected, err_msg=f"{ctas} CTAs")
            p.launch()                                    # the same prepared object again
            np.testing.assert_array_equal(bits(p.out.to_numpy()), expected)
        monkeypatch.delenv("PTXATTN_PERSISTENT_CTAS")


# --------------------------------------------------------------------------- 4. threads

def test_threads_calling_at_once_get_the_single_threaded_bits(monkeypatch):
    picked = [s for s in ALL if s.unsupported(D, 256, 256) is None]
    picked = sorted({picked[0], picked[len(picked) // 2], picked[-1]}, key=lambda s: s.number)
    cases = []
    for i, stage in enumerate(picked):
        (q, k, v), qkv = device_qkv(1, 2, 256, seed=20 + i)
        cases.append((stage, (q, k, v), qkv, bits(ptxattn.attention(*qkv, stage=stage).to_numpy())))
    # fresh caches, so that the threads also race to JIT-compile (each stage must load once)
    monkeypatch.setattr(launch, "_KERNELS", {})
    monkeypatch.setattr(driver, "_MODULES", {})
    loads = Counter()
    real_load = driver.load_module

    def counting_load(text, label, *args, **kwargs):
        loads[label] += 1
        return real_load(text, label, *args, **kwargs)
    monkeypatch.setattr(driver, "load_module", counting_load)

    n_threads, reps = 8, 4
    start = threading.Barrier(n_threads)
    errors = []

    def worker(t):
        try:
            own = driver.Stream() if t % 3 == 1 else None
            start.wait()
            for rep in range(reps):
                for stage, host_qkv, qkv, expected in cases:
                    if t % 3 == 2:                        # NumPy in, NumPy out
                        got = ptxattn.attention(*host_qkv, stage=stage)
                    else:
                        got = ptxattn.attention(*qkv, stage=stage, stream=own).to_numpy()
                    if not np.array_equal(bits(got), expected):
                        errors.append(f"thread {t} rep {rep} {stage.label}: different bits")
        except Exception as e:
            errors.append(f"thread {t}: {type(e).__name__}: {e}")
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    assert not errors, errors[:5]
    assert set(loads) == {s.label for s, *_ in cases} and set(loads.values()) == {1}, loads


# --------------------------------------------------------------------------- 4. resources

def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_ten_thousand_calls_do_not_grow_memory():
    torch = need_torch()
    q, k, v = (torch.randn(1, 2, 128, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def calls(n):
        for _ in range(n):
            t = torch.from_dlpack(ptxattn.attention(q, k, v))   # import 3, export 1, free 1
        torch.cuda.synchronize()
        return t

    calls(300)                               # warm-up: JIT, caches, allocator pools
    gc.collect()
    caches = (len(launch._KERNELS), len(driver._MODULES))
    free0, rss0, objects0 = driver.mem_get_info()[0], _rss_bytes(), len(gc.get_objects())
    last = calls(10_000)
    del last
    gc.collect()
    free1, rss1, objects1 = driver.mem_get_info()[0], _rss_bytes(), len(gc.get_objects())
    assert (len(launch._KERNELS), len(driver._MODULES)) == caches
    assert free0 - free1 <= 8 << 20, f"device memory fell by {(free0 - free1) >> 20} MiB"
    assert rss1 - rss0 <= 16 << 20, f"host RSS grew by {(rss1 - rss0) >> 20} MiB"
    assert objects1 - objects0 <= 2000, f"{objects1 - objects0} more Python objects"


_EXIT_SCRIPT = textwrap.dedent('''
    import sys
    import ptxattn
    from ptxattn import driver, reference, tensors

    q, k, v = reference.random_qkv(1, 2, 256, 256, 128, "bhld", seed=0)
    host = ptxattn.attention(q, k, v)                          # NumPy in and out
    dq = [tensors.from_numpy(x) for x in (q, k, v)]
    kept = ptxattn.attention(*dq)                              # a DeviceArray alive at exit
    s = driver.Stream()
    in_flight = [ptxattn.attention(*dq, stream=s) for _ in range(20)]   # maybe still running
    if sys.argv[1] == "torch":
        import torch
        tq = [torch.from_dlpack(x) for x in dq]                # torch views of our memory
        t = torch.from_dlpack(ptxattn.attention(*tq))          # torch holding our capsule
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            late = torch.from_dlpack(ptxattn.attention(*tq))
    print("done", flush=True)
''')


@pytest.mark.parametrize("framework", ["none", "torch"])
def test_a_process_exits_cleanly_with_everything_alive(framework):
    if framework == "torch":
        need_torch()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, framework], capture_output=True,
                            text=True, env=env, cwd=ROOT, timeout=300)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert "done" in result.stdout
    for bad in ("Traceback", "Exception ignored", "Segmentation fault"):
        assert bad not in result.stderr, result.stderr[-2000:]


# --------------------------------------------------------------------------- 6. README examples

def _readme_ids():
    return [next((p for p in imported_packages(b) if p in ("torch", "jax", "cupy")), str(i))
            for i, b in enumerate(python_blocks())]


@pytest.mark.parametrize("index", range(len(python_blocks())), ids=_readme_ids())
def test_readme_framework_example_runs_as_written(index):
    block = python_blocks()[index]
    packages = imported_packages(block)
    if "torch" in packages:
        need_torch()
    if "jax" in packages:
        need_jax()
    if "cupy" in packages:
        need_cupy()
    exec(compile(block, f"README.md (framework example {index + 1})", "exec"),
         {"__name__": "__readme__"})

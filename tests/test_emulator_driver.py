"""The emulated driver end to end: ptxattn's public entry points on the CPU emulator, through
ptxattn.driver and ptxattn.tma unchanged (contexts, device attributes, the JIT, tensor maps,
both parameter forms of cuLaunchKernelEx, stream-ordered memory, copies, streams, events)."""

from __future__ import annotations

import numpy as np
import pytest
from emulator_checks import qkv

import ptxattn
from ptxattn import driver, reference
from ptxattn.errors import JitError


def passes(out, q, k, v, **kw):
    m = reference.error_metrics(out, reference.attention_reference(q, k, v, **kw))
    assert reference.passes(m), m


def test_device_info_is_an_h200(emulated_gpu):
    info = ptxattn.device_info()
    assert info["compute_capability"] == (9, 0) and info["arch"] == "sm_90a"
    assert info["sm_count"] == 132 and info["max_smem_optin"] == 227 * 1024
    assert info["l2_bytes"] == 50 * 1024 * 1024 and "emulator" in info["name"]


def test_device_arrays_out_and_the_steady_call_path(emulated_gpu):
    """DLPack-style device arrays in and out, a caller's out=, and the remembered launch that
    replays a packed void*[] of parameters (the second form cuLaunchKernelEx gets)."""
    q, k, v = qkv(1, 2, 130, 130, 64)
    qd, kd, vd = (ptxattn.from_numpy(x) for x in (q, k, v))
    first = ptxattn.attention(qd, kd, vd, causal=True)
    passes(first.to_numpy(), q, k, v, causal=True)
    out = ptxattn.empty(first.shape)
    again = ptxattn.attention(qd, kd, vd, causal=True, out=out)
    assert again is out
    np.testing.assert_array_equal(out.to_numpy().view(np.uint16),
                                  first.to_numpy().view(np.uint16))
    third = ptxattn.attention(qd, kd, vd, causal=True, out=out)   # the steady path replays
    assert third is out and len(emulated_gpu.launches) == 3


def test_prepare_launch_twice_with_a_stream(emulated_gpu):
    """prepare() once, launch() twice: the first launch passes the tuple form of the
    parameters, the second a void*[] packed by ptxattn.driver (both decoded by the fake)."""
    q, k, v = qkv(1, 1, 64, 96, 128)
    stream = ptxattn.Stream()
    qd, kd, vd = (ptxattn.from_numpy(x, stream=stream) for x in (q, k, v))
    p = ptxattn.prepare(qd, kd, vd, stream=stream, return_lse=True)
    for _ in range(2):
        p.out.fill_u16(0xFFFF, stream=stream)           # poison, as the GPU tests do
        p.launch()
        driver.synchronize(stream)
        passes(p.out.to_numpy(), q, k, v)
        lse = p.lse.to_numpy()
        _, ref = reference.attention_reference(q, k, v, return_lse=True)
        assert np.abs(lse - ref).max() < 2e-3
    assert len(emulated_gpu.launches) == 2
    stream.close()


def test_parameter_sizes_are_checked_against_the_kernel(emulated_gpu):
    """An ABI mismatch (a u64 where the kernel declares u32) is reported by parameter name."""
    import ctypes
    q, k, v = qkv(1, 1, 64, 64, 128)
    qd, kd, vd = (ptxattn.from_numpy(x) for x in (q, k, v))
    p = ptxattn.prepare(qd, kd, vd, stage=1)
    values, types = p._spec.params
    types = types[:8] + (ctypes.c_uint64,) + types[9:]            # seq_q as 8 bytes
    p._spec.params = (values, types)
    with pytest.raises(Exception, match=r"parameter seq_q is \.u32 \(4 bytes\), the launch "
                                        r"passes c_u\w+ \(8 bytes\)"):
        p.launch()


def test_a_kernel_the_emulator_cannot_read_is_a_jit_error(emulated_gpu):
    """PTX the emulator rejects comes back as the driver JIT's error: a JitError with the log."""
    from ptxattn import ptx
    bad = "this is not PTX;"
    with pytest.raises(JitError, match="ptxattn emulator"):
        driver.load_module(bad, "bad")
    assert ptx                                           # (the real path annotates JIT logs)


def test_fresh_device_memory_is_poisoned(emulated_gpu):
    buf = ptxattn.empty((4, 8))
    assert np.isnan(buf.to_numpy().astype(np.float32)).all()


def test_the_runtime_is_back_on_the_real_driver_afterwards():
    """The fixture leaves no fake behind: the next test sees the real bindings (or none)."""
    assert driver._cu_module is None or type(driver._cu_module).__name__ != "FakeDriver"
    assert driver._CONTEXT is None or type(driver.cu()).__name__ != "FakeDriver"

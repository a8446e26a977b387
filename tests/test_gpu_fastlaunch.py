"""The ctypes launch and the ctypes tensor-map encoder on the H200 (ptxattn/fastlaunch.py,
tma.encode_tiled_ctypes): each against its cuda.bindings counterpart.

- a probe kernel (each thread writes a * index + b and %cluster_nctarank) launched through
  ctypes and through the binding, plain, with a cluster of 2 and with programmatic stream
  serialization: the same words (the cluster's size proves the attribute reached the driver);
- a LaunchSpec's later (ctypes) launches against its first (binding) one;
- PrefillPlan.run and DecodePlan.run (splits > 1: the combine's PDL launch, with an append)
  built under PTXATTN_LAUNCH=binding and without: bit-equal outputs, and each plan's
  launches of the kind asked for;
- cuTensorMapEncodeTiled through ctypes against the binding's: the same 128 bytes.
conftest skips these without a GPU (PTXATTN_REQUIRE_GPU=1: fails).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from gpu_checks import import_or_skip

from ptxattn import driver, fastlaunch, tma

pytestmark = pytest.mark.gpu

PROBE = r"""
.version 8.4
.target sm_90a
.address_size 64

.visible .entry fl_probe(.param .u64 out, .param .u32 a, .param .u32 b)
{
    .reg .b32 %r<10>;
    .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [out];
    ld.param.u32 %r1, [a];
    ld.param.u32 %r2, [b];
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %ctaid.x;
    mov.u32 %r5, %ntid.x;
    mad.lo.u32 %r6, %r4, %r5, %r3;
    mad.lo.u32 %r7, %r6, %r1, %r2;
    mov.u32 %r8, %cluster_nctarank;
    cvta.to.global.u64 %rd2, %rd1;
    mul.wide.u32 %rd3, %r6, 8;
    add.u64 %rd4, %rd2, %rd3;
    st.global.v2.u32 [%rd4], {%r7, %r8};
    ret;
}
"""
GRID, BLOCK = 4, 64


@pytest.fixture(scope="module")
def probe():
    return driver.load_module(PROBE, "fl_probe").function("fl_probe")


def _run_probe(probe, launch_of, a: int, b: int) -> np.ndarray:
    buf = driver.DeviceBuffer(GRID * BLOCK * 8)
    driver.memset_u8(buf.ptr, 0xFF, GRID * BLOCK * 8)
    address, holders = driver.pack_params(((buf.ptr, a, b), (driver.PTR, driver.U32,
                                                             driver.U32)))
    launch_of()(address)
    driver.synchronize()
    out = np.empty((GRID * BLOCK, 2), np.uint32)
    driver.memcpy_dtoh(out, buf.ptr)
    del holders
    return out


@pytest.mark.parametrize("kind", ["plain", "cluster", "pdl"])
def test_probe_kernel_ctypes_equals_binding(probe, kind):
    assert driver.launch_mode() == "ctypes", driver.launch_mode()
    if kind == "pdl":
        from ptxattn import decode_launch
        config = decode_launch._dependent_config((GRID, 1, 1), (BLOCK, 1, 1), 0)[0]
    else:
        config = driver._launch_config((GRID, 1, 1), (BLOCK, 1, 1), 0,
                                       (2, 1, 1) if kind == "cluster" else (1, 1, 1), 0)[0]
    fast = driver.kernel_launch(config, probe, "probe")
    assert isinstance(fast, driver.FastLaunch)
    got = _run_probe(probe, lambda: fast, 3, 11)
    want = _run_probe(probe, lambda: driver.BindingLaunch(config, probe, "probe"), 3, 11)
    assert np.array_equal(got, want)
    idx = np.arange(GRID * BLOCK, dtype=np.uint32)
    assert np.array_equal(got[:, 0], idx * 3 + 11)
    assert set(got[:, 1]) == {2 if kind == "cluster" else 1}


def test_a_driver_error_raises_cuda_error(probe):
    """A block of 2048 threads: the driver refuses; the ctypes path raises CudaError."""
    config = driver._launch_config((1, 1, 1), (2048, 1, 1), 0, (1, 1, 1), 0)[0]
    fast = driver.kernel_launch(config, probe, "cuLaunchKernelEx (too big)")
    address, holders = driver.pack_params(((0, 1, 1), (driver.PTR, driver.U32, driver.U32)))
    with pytest.raises(driver.CudaError, match="too big"):
        fast(address)
    with pytest.raises(driver.CudaError) as theirs:
        driver.BindingLaunch(config, probe, "cuLaunchKernelEx (too big)")(address)
    assert "too big" in str(theirs.value)
    del holders


def test_launch_spec_later_launches_equal_the_first(probe):
    buf = driver.DeviceBuffer(GRID * BLOCK * 8)
    spec = driver.LaunchSpec(probe, GRID, BLOCK, 0, ((buf.ptr, 5, 7), (driver.PTR, driver.U32,
                                                                       driver.U32)))
    outs = []
    for _ in range(3):
        driver.memset_u8(buf.ptr, 0xFF, GRID * BLOCK * 8)
        spec()
        driver.synchronize()
        out = np.empty((GRID * BLOCK, 2), np.uint32)
        driver.memcpy_dtoh(out, buf.ptr)
        outs.append(out)
    assert isinstance(spec._fast, driver.FastLaunch)
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[1], outs[2])


def _plans_both_ways(monkeypatch, make, run):
    """run(make()) with launches through ctypes, then through the binding (the knob read at
    the plan's first run, where its Launchers are built)."""
    out_fast, plan_fast = run(make())
    monkeypatch.setenv(fastlaunch.ENV, "binding")
    out_binding, plan_binding = run(make())
    monkeypatch.delenv(fastlaunch.ENV)
    return out_fast, plan_fast, out_binding, plan_binding


def test_prefill_plan_run_equals_the_binding_path(monkeypatch):
    torch = import_or_skip("torch")
    import ptxattn
    lens = np.array([0, 300, 301, 1200], np.int32)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1200, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1200, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1200, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)

    def make():
        return ptxattn.plan_varlen(lens, lens, heads=16, heads_kv=4, head_dim=128, causal=True)

    def run(plan):
        plan.run(q, k, v)
        out = plan.run(q, k, v)             # the torch fast path (_run_torch)
        torch.cuda.synchronize()
        return out, plan
    a, pa, b, pb = _plans_both_ways(monkeypatch, make, run)
    assert isinstance(pa._launcher._forward_launch, driver.FastLaunch)
    assert isinstance(pb._launcher._forward_launch, driver.BindingLaunch)
    assert torch.equal(a, b) and torch.isfinite(a.float()).all()


def test_decode_plan_run_equals_the_binding_path(monkeypatch):
    torch = import_or_skip("torch")
    import ptxattn
    B, H, HKV, D, L = 3, 16, 4, 128, 2048
    g = torch.Generator(device="cuda").manual_seed(1)
    kc = torch.randn(B, L, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(B, L, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kn = torch.randn(B, 1, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vn = torch.randn(B, 1, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    lengths = np.array([1500, 7, 2000], np.int32)

    def make():
        return ptxattn.plan_decode(batch=B, heads=H, heads_kv=HKV, head_dim=D,
                                   cache_seqlens=lengths, cache_len=L, seq_new=1,
                                   causal=True, num_splits=4)

    def run(plan):
        k_cache, v_cache = kc.clone(), vc.clone()       # the append writes the caches
        plan.run(q, k_cache, v_cache, k=kn, v=vn)
        out = plan.run(q, k_cache, v_cache, k=kn, v=vn)
        torch.cuda.synchronize()
        return (out, k_cache, v_cache), plan
    a, pa, b, pb = _plans_both_ways(monkeypatch, make, run)
    (launcher_a,), (launcher_b,) = ([h[1] for h in p._layers.values()] for p in (pa, pb))
    assert pa.splits > 1 and set(launcher_a.launches) == {"append", "decode", "combine"}
    assert all(isinstance(x, driver.FastLaunch) for x in launcher_a.launches.values())
    assert all(isinstance(x, driver.BindingLaunch) for x in launcher_b.launches.values())
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert torch.isfinite(a[0].float()).all()


@pytest.mark.parametrize("swizzle", ["128B", "none"])
def test_ctypes_tensor_map_bytes_equal_the_bindings(swizzle):
    from ptxattn.stages import SWIZZLE_NONE
    swizzle = SWIZZLE_NONE if swizzle == "none" else swizzle
    buf = driver.DeviceBuffer(1 << 20)
    g = tma.map_geometry("bshd", 1, 4, 512, 128, 64, 64)    # a K map's geometry: 512 KiB
    dims, strides, box = g["dims"], g["strides"], g["box"]
    theirs = tma._encode(buf.ptr, dims, strides, box, swizzle, 128, "t")
    ours = tma.encode_tiled_ctypes(buf.ptr, dims, strides, box, swizzle)
    assert ours.to_bytes() == ctypes.string_at(int(theirs.getPtr()), tma.TENSOR_MAP_BYTES)

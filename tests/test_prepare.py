"""prepare() -> launch() with the driver calls recorded instead of run (CPU only).

The real cuda.bindings structs (CUlaunchConfig, CUtensorMap, enums) are used;
only the functions that would reach libcuda are replaced. This checks what
would be sent to the GPU: kernel parameters in ABI order with the H200-proven
types, tensor-map arguments, launch geometry, smem opt-in, copies.
"""

import ctypes
import gc
import math
from collections import defaultdict

import numpy as np
import pytest
from fakes import FAKE_BASE, FakeCAI, FakeDLPack, at_once

from ptxattn import api as attn
from ptxattn import driver, launch, stages, tma
from ptxattn.tensors import BF16, DeviceArray

from cuda.bindings import driver as cu   # a hard dependency: missing, it fails (never skips)
OK = cu.CUresult.CUDA_SUCCESS
MiB = 1 << 20
PARAM_TYPES = (None,) * 4 + (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64,
                             ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32,
                             ctypes.c_float)


class FakeContext:
    ordinal = 0
    sm_count = 132
    max_smem_optin = 227 * 1024
    alive = True
    memory_pools = True

    def __init__(self, cc=(9, 0)):
        self.compute_capability = cc

    def make_current(self):
        pass


@pytest.fixture
def gpu(monkeypatch):
    calls = defaultdict(list)
    ctx = FakeContext()
    monkeypatch.setattr(driver, "context", lambda: ctx)
    monkeypatch.setattr(driver, "_MODULES", {})
    monkeypatch.setattr(launch, "_KERNELS", {})
    monkeypatch.setattr(tma, "_MAPS", {})              # every test sees its own encodes
    monkeypatch.setattr(driver, "_CONFIGS", {})
    heap = [0x7E00_0000_0000]

    def record(name, result):
        def fake(*args):
            calls[name].append(args)
            return result(*args) if callable(result) else result
        monkeypatch.setattr(cu, name, fake)

    def alloc(nbytes):
        ptr = heap[0]
        heap[0] += (nbytes + 255) // 256 * 256
        return (OK, cu.CUdeviceptr(ptr))

    record("cuMemAlloc", alloc)
    record("cuMemAllocAsync", lambda nbytes, stream: alloc(nbytes))
    for name in ("cuMemFree", "cuMemFreeAsync", "cuCtxSynchronize", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuStreamSynchronize",
                 "cuFuncSetAttribute", "cuLaunchKernelEx", "cuEventRecord", "cuStreamWaitEvent",
                 "cuEventDestroy", "cuMemsetD16", "cuMemsetD8", "cuMemsetD8Async"):
        record(name, (OK,))
    record("cuEventCreate", (OK, "event"))
    record("cuModuleLoadDataEx", (OK, "module"))
    record("cuModuleGetFunction", (OK, "function"))
    record("cuPointerGetAttribute", (OK, 0))
    record("cuTensorMapEncodeTiled", lambda *a: (OK, cu.CUtensorMap()))
    calls["ctx"] = ctx
    yield calls
    gc.collect()          # free fake buffers while cuMemFree is still the fake


def dev(shape, slot, **kw):
    return FakeDLPack(shape, ptr=FAKE_BASE + slot * 256 * MiB, **kw)


def launched(calls):
    (config, function, params, extra), = calls["cuLaunchKernelEx"]
    assert function == "function" and extra == 0
    return config, params


def maps(calls):
    """The cuTensorMapEncodeTiled calls as plain ints: (ptr, dims, strides, box, swizzle)."""
    out = []
    for a in calls["cuTensorMapEncodeTiled"]:
        dtype, rank, ptr, dims, strides, box, estr, interleave, swizzle, l2, oob = a
        assert dtype == cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 and rank == 5
        assert interleave == cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE
        assert l2 == cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B
        assert oob == cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE
        assert all(isinstance(x, cu.cuuint64_t) for x in list(dims) + list(strides))
        assert all(isinstance(x, cu.cuuint32_t) for x in list(box) + list(estr))
        assert [int(x) for x in estr] == [1] * 5
        out.append((ptr, tuple(int(x) for x in dims), tuple(int(x) for x in strides),
                    tuple(int(x) for x in box), swizzle))
    return out


def test_bhld_launch_is_assembled_in_abi_order(gpu):
    B, H, L, D = 2, 3, 256, 128
    q, k, v = (dev((B, H, L, D), i) for i in range(3))
    stage = stages.get_stage(1)
    p = attn.prepare(q, k, v, stage=1)
    assert p.stage is stage and p.grid == (L // 64, H, B) and p.block == (128, 1, 1)
    assert p.smem_bytes == stage.smem_bytes and p.out.shape == (B, H, L, D)
    # JIT once, smem opt-in once (> 48 KiB), nothing launched yet
    (image, n, options, values), = gpu["cuModuleLoadDataEx"]
    assert image.endswith(b"\0") and b".entry ptxattn_fwd" in image
    (func, attr, nbytes), = gpu["cuFuncSetAttribute"]
    assert attr == cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    assert nbytes == stage.smem_bytes and not gpu["cuLaunchKernelEx"]

    p.launch()
    config, (values, types) = launched(gpu)
    assert types == PARAM_TYPES
    assert all(isinstance(m, cu.CUtensorMap) for m in values[:4])
    o_ptr = p.out.ptr
    assert type(values[4]) is int and values[4] == o_ptr          # an int, never a CUdeviceptr
    assert values[5:8] == (D, L * D, H * L * D)                    # O strides in elements
    assert values[8:12] == (L, L, H, B)
    assert values[12] == pytest.approx(1 / math.sqrt(D))
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (L // 64, H, B)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ) == (128, 1, 1)
    assert config.sharedMemBytes == stage.smem_bytes and config.numAttrs == 0
    assert int(config.hStream) == 0

    mq, mk, mv, mo = maps(gpu)
    assert [m[0] for m in (mq, mk, mv, mo)] == [q.ptr, k.ptr, v.ptr, o_ptr]
    assert mq[1:4] == (tuple(tma.map_geometry("bhld", B, H, L, D, 64, 8)[x]
                             for x in ("dims", "strides", "box")))
    assert mq[2] == (D * 2, 16, L * D * 2, H * L * D * 2) and mq[3] == (8, 64, 16, 1, 1)
    assert mk[3] == (8, stage.block_n, 16, 1, 1) and mo[3] == (8, stage.q_box_rows, 16, 1, 1)
    assert all(m[4] == cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE for m in (mq, mk, mv, mo))

    # a second prepare reuses the compiled function and the opt-in
    attn.prepare(*(dev((B, H, L, D), i) for i in range(3)), stage=1)
    assert len(gpu["cuModuleLoadDataEx"]) == 1 and len(gpu["cuFuncSetAttribute"]) == 1


def test_bshd_uneven_lengths_swizzled_stage_and_scale(gpu):
    B, H, Lq, Lk, D = 1, 4, 128, 320, 128
    q = dev((B, Lq, H, D), 0)
    k, v = dev((B, Lk, H, D), 1), dev((B, Lk, H, D), 2)
    stage = stages.get_stage(3)
    assert stage.swizzle == stages.SWIZZLE_128B
    out = attn.attention(q, k, v, stage=3, layout="bshd", scale=0.125)
    assert isinstance(out, DeviceArray) and out.shape == (B, Lq, H, D)
    _, (values, _) = launched(gpu)
    assert values[5:8] == (H * D, D, Lq * H * D)                   # row, head, batch (bshd)
    assert values[8:13] == (Lq, Lk, H, B, 0.125)
    mq, mk, _, mo = maps(gpu)
    assert mq[1] == (64, Lq, 2, H, B) and mk[1] == (64, Lk, 2, H, B)
    assert mq[2] == (H * D * 2, 128, D * 2, Lq * H * D * 2)
    assert mk[3] == (64, 64, 2, 1, 1)
    assert mq[4] == cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B


def test_default_stage_depends_on_the_device(gpu, monkeypatch):
    q, k, v = (dev((1, 2, 256, 128), i) for i in range(3))
    p = attn.prepare(q, k, v)
    assert p.stage.production and p.stage.head_dims == (128,)   # the default kernel, D=128 build
    gpu["ctx"].compute_capability = (8, 0)
    with pytest.raises(ValueError, match="no registered stage runs on compute capability 8.0"):
        attn.prepare(*(dev((1, 2, 256, 128), i) for i in range(3)))
    gpu["ctx"].compute_capability = (10, 0)
    with pytest.raises(ValueError, match=r"stage: stage01 \(baseline\) is built for sm_90a"):
        attn.prepare(*(dev((1, 2, 256, 128), i) for i in range(3)), stage=1)


def test_stream_and_out_are_the_callers(gpu):
    class TorchStream:
        cuda_stream = 0x5150
    q, k, v = (dev((1, 1, 64, 128), i) for i in range(3))
    out = DeviceArray(FAKE_BASE + 3 * 256 * MiB, (1, 1, 64, 128))
    assert attn.attention(q, k, v, out=out, stream=TorchStream()) is out
    config, (values, _) = launched(gpu)
    assert int(config.hStream) == 0x5150 and values[4] == out.ptr
    assert out.stream == 0x5150                       # DLPack readers will wait for it
    assert q.calls[-1]["stream"] == 0x5150            # the producer syncs to our stream
    assert not gpu["cuMemAlloc"] and not gpu["cuMemAllocAsync"]   # nothing allocated


def test_numpy_inputs_are_copied_in_and_out_on_the_stream(gpu):
    q = np.ones((1, 2, 64, 128), np.float32)          # float32: rounded to bf16
    out = attn.attention(q, q, q, stage=1)
    assert isinstance(out, np.ndarray) and out.dtype == BF16 and out.shape == q.shape
    # q, k, v, out: stream-ordered on the launch stream, and freed there before returning
    assert len(gpu["cuMemAllocAsync"]) == 4 and not gpu["cuMemAlloc"]
    assert all(int(a[1]) == 0 for a in gpu["cuMemAllocAsync"])
    assert len(gpu["cuMemFreeAsync"]) == 4 and not gpu["cuMemFree"]
    copies = gpu["cuMemcpyHtoDAsync"]
    assert len(copies) == 3 and all(c[2] == q.size * 2 for c in copies)
    (dst, src, nbytes, stream), = gpu["cuMemcpyDtoHAsync"]
    assert nbytes == q.size * 2 and gpu["cuStreamSynchronize"]
    assert len(gpu["cuLaunchKernelEx"]) == 1


def test_cai_inputs_resolve_device_and_wait_for_the_producer_stream(gpu):
    q, k, v = (FakeCAI((1, 1, 64, 128), ptr=FAKE_BASE + i * 256 * MiB, stream=0x77)
               for i in range(3))
    attn.attention(q, k, v, stage=1, stream=0x99)
    assert len(gpu["cuPointerGetAttribute"]) == 3 and len(gpu["cuStreamWaitEvent"]) == 3
    (stream, event, flags) = gpu["cuStreamWaitEvent"][0]
    assert int(stream) == 0x99 and int(gpu["cuEventRecord"][0][1]) == 0x77


def test_arrays_on_another_device_are_refused(gpu):
    q, k, v = (dev((1, 1, 64, 128), i, device=1) for i in range(3))
    with pytest.raises(ValueError, match="q: on CUDA device 1, but ptxattn runs on device 0 "
                                         r"\(set PTXATTN_DEVICE=1\)"):
        attn.attention(q, k, v)
    assert not gpu["cuLaunchKernelEx"]


def test_own_arrays_written_on_another_stream_are_waited_for(gpu):
    q, k, v = (DeviceArray(FAKE_BASE + i * 256 * MiB, (1, 1, 64, 128), stream=0x31)
               for i in range(3))
    attn.attention(q, k, v, stage=1, stream=0x32)
    waits = gpu["cuStreamWaitEvent"]
    assert len(waits) == 3 and all(int(w[0]) == 0x32 for w in waits)
    assert all(int(r[1]) == 0x31 for r in gpu["cuEventRecord"])


def test_two_consumer_stages_use_64_row_q_and_o_boxes(gpu):
    stage = next(s for s in stages.all_stages() if s.block_m == 128)
    q, k, v = (dev((1, 2, 256, 128), i) for i in range(3))
    attn.prepare(q, k, v, stage=stage.number)
    mq, mk, mv, mo = maps(gpu)
    assert stage.q_box_rows == 64
    assert mq[3] == (64, 64, 2, 1, 1) and mo[3] == (64, 64, 2, 1, 1)
    assert mk[3] == (64, stage.block_n, 2, 1, 1) and mv[3] == mk[3]


def test_build_variants_get_defines_and_extra_params(gpu):
    q, k, v = (dev((1, 1, 64, 128), i) for i in range(3))
    attn.prepare(q, k, v, stage=1).launch()
    p = attn.prepare(*(dev((1, 1, 64, 128), i) for i in range(3)), stage=1,
                     defines={"PTXATTN_TRACE": 1}, extra_params=((0xCAFE00, ctypes.c_void_p),))
    p.launch()
    plain, traced = (call[0] for call in gpu["cuModuleLoadDataEx"])
    assert plain != traced                      # a second module for the variant
    assert b"trace_buf" in traced and b"trace_buf" not in plain
    config, function, (values, types), extra = gpu["cuLaunchKernelEx"][-1]
    assert values[-1] == 0xCAFE00 and types[-1] is ctypes.c_void_p and types[:-1] == PARAM_TYPES


# --------------------------------------------------------------------------- grid cap, threads

def test_persistent_grid_cap_for_testing(gpu, monkeypatch):
    stage = next(s for s in stages.all_stages() if s.persistent)
    tiles = (512 // stage.block_m) * 2 * 2
    q, k, v = (dev((2, 2, 512, 128), i) for i in range(3))
    assert attn.prepare(q, k, v, stage=stage.number).grid == (min(132, tiles), 1, 1)
    monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", "2")
    p = attn.prepare(*(dev((2, 2, 512, 128), i) for i in range(3)), stage=stage.number)
    assert p.grid == (2, 1, 1)
    p.launch()
    config, _ = launched(gpu)
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (2, 1, 1)
    # the knob leaves the other stages' grids alone
    p = attn.prepare(*(dev((2, 2, 512, 128), i) for i in range(3)), stage=1)
    assert p.grid == (512 // 64, 2, 2)


def test_threads_preparing_at_once_compile_each_stage_once(gpu, monkeypatch):
    import time

    real = cu.cuModuleLoadDataEx

    def slow_jit(*args):                     # widen the window in which threads could race
        time.sleep(0.05)
        return real(*args)
    monkeypatch.setattr(cu, "cuModuleLoadDataEx", slow_jit)

    def worker(i):
        q, k, v = (dev((1, 1, 128, 128), 3 * i + j) for j in range(3))
        attn.prepare(q, k, v, stage=1 + i % 2)
    errors = at_once(worker, 8)
    assert not errors, errors
    assert len(gpu["cuModuleLoadDataEx"]) == 2            # stages 1 and 2, once each
    assert len(gpu["cuFuncSetAttribute"]) == 2


def test_launch_from_another_thread_makes_the_context_current(gpu, monkeypatch):
    import threading

    p = attn.prepare(*(dev((1, 1, 64, 128), i) for i in range(3)), stage=1)
    made_current = []
    monkeypatch.setattr(driver, "context", lambda: made_current.append(1) or gpu["ctx"])
    p.launch()                                # same thread: no extra driver call
    assert made_current == []
    t = threading.Thread(target=p.launch)
    t.start()
    t.join()
    assert made_current == [1] and len(gpu["cuLaunchKernelEx"]) == 2


def test_the_output_keeps_the_callers_stream_object_alive(gpu):
    import weakref

    class Stream:
        cuda_stream = 0x4400
    s = Stream()
    ref = weakref.ref(s)
    out = attn.attention(*(dev((1, 1, 64, 128), i) for i in range(3)), stage=1, stream=s)
    del s
    gc.collect()
    assert ref() is not None and out.stream == 0x4400     # its handle stays valid for readers
    del out
    gc.collect()
    assert ref() is None


def test_close_frees_what_prepare_allocated_and_nothing_else(gpu):
    # NumPy inputs: the four device copies are ours; a caller's device arrays are not.
    q, k, v = (np.zeros((1, 1, 64, 128), np.float32) for _ in range(3))
    p = attn.prepare(q, k, v, stage=1)
    p.launch()
    freed_before = len(gpu["cuMemFreeAsync"])
    p.close()
    assert len(gpu["cuMemFreeAsync"]) - freed_before == 4
    assert p.out.ptr == 0
    p.close()                                  # idempotent
    assert len(gpu["cuMemFreeAsync"]) - freed_before == 4
    qd, kd, vd = (dev((1, 1, 64, 128), i) for i in range(3))
    with attn.prepare(qd, kd, vd, stage=1) as p2:
        p2.launch()
        theirs = qd.ptr
    assert qd.ptr == theirs                     # the caller's input untouched
    assert p2.out.ptr == 0                      # the output we made is freed


def test_a_failed_jit_allocates_nothing_and_leaves_out_as_it_was(gpu, monkeypatch):
    """The JIT comes before any allocation: NumPy inputs are not copied in, no output is
    made, and the caller's out= keeps its stream (nothing about it was changed)."""
    from ptxattn.errors import JitError
    monkeypatch.setattr(cu, "cuModuleLoadDataEx",
                        lambda *a: (cu.CUresult.CUDA_ERROR_INVALID_PTX, None))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 128, 128)).astype(np.float32) for _ in range(3))
    with pytest.raises(JitError):
        attn.attention(q, k, v)
    qd, kd, vd = (dev((1, 2, 128, 128), i) for i in range(3))
    out = DeviceArray(FAKE_BASE + 3 * 256 * MiB, (1, 2, 128, 128), stream=0x77)
    with pytest.raises(JitError):
        attn.attention(qd, kd, vd, out=out, stream=0x51)
    assert out.stream == 0x77
    for name in ("cuMemAlloc", "cuMemAllocAsync", "cuMemcpyHtoDAsync", "cuStreamWaitEvent"):
        assert not gpu[name], name


def test_a_failed_numpy_call_frees_its_device_copies_at_once(gpu, monkeypatch):
    """NumPy in: when the launch fails, the copies of q, k, v and the output are freed before
    the error reaches the caller (a traceback would otherwise hold them), and the error is
    the launch's own."""
    from ptxattn.errors import CudaError
    monkeypatch.setattr(cu, "cuLaunchKernelEx",
                        lambda *a: (cu.CUresult.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,))
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 128, 128)).astype(np.float32) for _ in range(3))
    with pytest.raises(CudaError, match="cuLaunchKernelEx") as info:
        attn.attention(q, k, v, return_lse=True)
    assert info.tb is not None                           # the traceback (and its frames) lives
    allocated = len(gpu["cuMemAlloc"]) + len(gpu["cuMemAllocAsync"])
    freed = len(gpu["cuMemFree"]) + len(gpu["cuMemFreeAsync"])
    assert allocated == 5 and freed == allocated         # q, k, v, out, lse


@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_the_lse_is_batch_heads_queries_on_every_path(gpu, layout):
    """The log-sum-exp comes out (B, H, Lq) float32, contiguous, in both layouts, from
    attention() (device and NumPy inputs, warm and cold), prepare(), and an empty query: the
    kernel writes row (b, h, i) at (b * H + h) * Lq + i, whatever the layout of q."""
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 7, 33, 128
    q_shape = (B, H, Lq, D) if layout == "bhld" else (B, Lq, H, D)
    kv_shape = (B, Hkv, Lk, D) if layout == "bhld" else (B, Lk, Hkv, D)
    want = (B, H, Lq)
    qd, kd, vd = dev(q_shape, 0), dev(kv_shape, 1), dev(kv_shape, 2)
    for _ in range(2):                                  # the full path, then a steady call
        out, lse = attn.attention(qd, kd, vd, layout=layout, return_lse=True)
        assert out.shape == q_shape
        assert (lse.shape, lse.strides, lse.dtype) == (want, (H * Lq, Lq, 1), np.float32)
        assert lse.nbytes == B * H * Lq * 4
    prepared = attn.prepare(qd, kd, vd, layout=layout, return_lse=True)
    assert prepared.lse.shape == want and prepared.lse.strides == (H * Lq, Lq, 1)
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(s).astype(np.float32) for s in (q_shape, kv_shape, kv_shape)]
    out, lse = attn.attention(*host, layout=layout, return_lse=True)
    assert isinstance(lse, np.ndarray) and lse.shape == want and lse.dtype == np.float32
    empty_q = (B, H, 0, D) if layout == "bhld" else (B, 0, H, D)
    _, lse = attn.attention(dev(empty_q, 3), kd, vd, layout=layout, return_lse=True)
    assert lse.shape == (B, H, 0)

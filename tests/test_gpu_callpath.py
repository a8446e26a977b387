"""The call path of issue 11 on the GPU: repeated calls stay correct whatever changes between
them (addresses, shapes, strides, streams: a stale tensor map would show as a wrong answer),
memory stays flat over 10,000 calls of each path, and a stream capture records one kernel
node and no synchronisation, whose replay gives the same bits. CPU side: test_callpath.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from gpu_checks import assert_passes, check_rows, import_or_skip, skip_or_fail

import ptxattn
from ptxattn import driver, fastpath, tensors
from ptxattn.reference import BF16

pytestmark = pytest.mark.gpu

SHAPE = (1, 2, 128, 128)
MiB = 1 << 20


def cuda_torch():
    """torch with CUDA, or skip (fail under PTXATTN_REQUIRE_GPU=1) saying why."""
    torch = import_or_skip("torch")
    if not torch.cuda.is_available():
        skip_or_fail("torch has no CUDA here")
    return torch


def torch_qkv(torch, seed: int):
    """Fresh random bf16 q, k, v of SHAPE on the GPU, from one seeded generator."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16, generator=g)
                 for _ in range(3))


def host_qkv(shape, seed):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape, dtype=np.float32).astype(BF16) for _ in range(3))


def device(arrays, stream=None):
    return tuple(tensors.from_numpy(x, stream=stream) for x in arrays)


def poisoned(shape, stream=None):
    out = tensors.empty(shape, stream=stream)
    out.fill_u16(0xFFFF, stream=stream)
    return out


def test_repeated_calls_with_new_addresses_shapes_strides_and_streams():
    a = host_qkv(SHAPE, 1)
    da = device(a)
    for _ in range(3):                                   # the same call again: cached maps
        out = ptxattn.attention(*da)
        assert_passes(check_rows(*a, out.to_numpy()), "same call")
    b = host_qkv(SHAPE, 2)                              # same geometry, new addresses, new data
    db = device(b)
    out_b = ptxattn.attention(*db)
    m = check_rows(*b, out_b.to_numpy())
    assert_passes(m, "new addresses")                   # maps of `a` would answer for a's data
    out_a = ptxattn.attention(*da)                      # back to the first addresses
    assert_passes(check_rows(*a, out_a.to_numpy()), "first addresses again")
    # out= at a new address each time, written in place
    for seed in (3, 4):
        o = poisoned(SHAPE)
        assert ptxattn.attention(*db, out=o) is o
        assert_passes(check_rows(*b, o.to_numpy()), "out= at a new address")
    # a longer query, then a strided view (heads 0 and 2 of a 4-head array) at an old address
    c = host_qkv((1, 2, 320, 128), 5)
    assert_passes(check_rows(*c, ptxattn.attention(*device(c)).to_numpy()), "new shape")
    wide = host_qkv((1, 4, 128, 128), 6)
    dw = device(wide)
    views = tuple(tensors.DeviceArray(x.ptr, SHAPE, (4 * 128 * 128, 2 * 128 * 128, 128, 1),
                                      owner=x) for x in dw)
    got = ptxattn.attention(*views).to_numpy()
    assert_passes(check_rows(*(x[:, ::2] for x in wide), got), "strided view")
    # streams: two of ours, and the legacy default stream, one after the other
    s1, s2 = driver.Stream(), driver.Stream()
    for s, (arrays, darrays) in ((s1, (a, da)), (s2, (b, db)), (None, (a, da)), (s1, (b, db))):
        out = ptxattn.attention(*darrays, stream=s)
        assert_passes(check_rows(*arrays, out.to_numpy()), f"stream {s}")


def test_an_output_read_on_another_stream_survives_its_free():
    """The output is freed (stream-ordered, on the legacy stream) while a copy of it is still
    queued on another stream behind long kernels. New allocations on the legacy stream then
    take the block back and a copy engine fills them with zeros (not a kernel: it runs while
    the SMs are busy). Without the free waiting for the reader's stream, the reader copies
    zeros; with it, the attention output."""
    a = host_qkv(SHAPE, 7)
    da = device(a)
    big = device(host_qkv((2, 16, 8192, 128), 8))
    reader = driver.Stream()
    slow = ptxattn.prepare(*big, stream=reader)          # ~2 ms per launch, all SMs
    slow.launch()
    reader.synchronize()                                 # JIT done before the timed part
    out = ptxattn.attention(*da)                         # legacy stream
    copy = tensors.empty(SHAPE, stream=reader)
    capsule = out.__dlpack__(stream=reader.handle)       # the reader waits for `out`
    for _ in range(5):
        slow.launch()
    d = driver.cu()
    driver.check(d.cuMemcpyDtoDAsync(d.CUdeviceptr(copy.ptr), d.CUdeviceptr(out.ptr),
                                     out.nbytes, d.CUstream(reader.handle)), "cuMemcpyDtoDAsync")
    freed = out.ptr
    del out, capsule                                     # freed now, in stream order
    zeros = np.zeros(SHAPE, BF16)
    taken = [tensors.from_numpy(zeros, stream=0) for _ in range(4)]
    assert freed in {t.ptr for t in taken}, "the pool did not hand the block back"
    assert_passes(check_rows(*a, copy.to_numpy()), "copy read after the free")


@pytest.mark.parametrize("path", ["attention", "attention_out", "launch"])
def test_memory_is_flat_over_10000_calls(path):
    q, k, v = device(host_qkv(SHAPE, 9))
    out = tensors.empty(SHAPE)
    prepared = ptxattn.prepare(q, k, v, out=out)
    call = {"attention": lambda: ptxattn.attention(q, k, v),
            "attention_out": lambda: ptxattn.attention(q, k, v, out=out),
            "launch": prepared.launch}[path]
    for _ in range(100):                                 # JIT, caches, pool warm
        call()
    driver.synchronize()
    free_before, _ = driver.mem_get_info()
    for i in range(10_000):
        call()
        if i % 1000 == 999:
            driver.synchronize()                         # bounded queue; pools trim at syncs
    driver.synchronize()
    free_after, _ = driver.mem_get_info()
    assert free_before - free_after <= 16 * MiB, (path, (free_before - free_after) / MiB)


def _graph_nodes(graph) -> list:
    d = driver.cu()
    _, count = driver.check(d.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
    nodes, _ = driver.check(d.cuGraphGetNodes(graph, count), "cuGraphGetNodes")
    return [driver.check(d.cuGraphNodeGetType(n), "cuGraphNodeGetType") for n in nodes]


def test_driver_stream_capture_records_one_kernel_node_and_replays_the_same_bits():
    d = driver.cu()
    a = host_qkv(SHAPE, 10)
    stream = driver.Stream()
    # everything written on the capture's stream: a wait on another stream (the legacy one)
    # is not something a global-mode capture allows, nor what this test is about
    q, k, v = device(a, stream)
    direct = poisoned(SHAPE, stream)
    ptxattn.attention(q, k, v, out=direct, stream=stream)   # JIT and caches before capturing
    captured_out = poisoned(SHAPE, stream)
    driver.synchronize()
    s = d.CUstream(stream.handle)
    mode = d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL   # any sync call would fail
    driver.check(d.cuStreamBeginCapture(s, mode), "cuStreamBeginCapture")
    try:
        ptxattn.attention(q, k, v, out=captured_out, stream=stream)
    finally:
        graph = driver.check(d.cuStreamEndCapture(s), "cuStreamEndCapture")
    kinds = _graph_nodes(graph)
    assert kinds == [d.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL], kinds
    assert np.isnan(captured_out.to_numpy().astype(np.float32)).all()   # nothing ran yet
    exe = driver.check(d.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    for _ in range(2):
        driver.check(d.cuGraphLaunch(exe, s), "cuGraphLaunch")
        stream.synchronize()
        captured_out.stream = stream.handle
        assert captured_out.to_numpy().tobytes() == direct.to_numpy().tobytes()
    driver.check(d.cuGraphExecDestroy(exe), "cuGraphExecDestroy")
    driver.check(d.cuGraphDestroy(graph), "cuGraphDestroy")


def test_torch_graph_capture_records_one_kernel_and_replays_the_same_bits():
    torch = cuda_torch()
    q, k, v = torch_qkv(torch, seed=11)
    out = torch.full_like(q, float("nan"))
    direct = ptxattn.attention(q, k, v, out=torch.empty_like(q))   # warm: JIT, maps, config
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ptxattn.attention(q, k, v, out=out)           # warm on the capture's stream too
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    out.fill_(float("nan"))
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        ptxattn.attention(q, k, v, out=out)
    assert torch.isnan(out).all()                       # captured, not run
    raw = getattr(graph, "raw_cuda_graph", None)
    if raw is not None:
        try:
            handle = raw()
        except Exception:                               # needs keep_graph=True on some torch
            handle = None
        if handle is not None:
            kinds = _graph_nodes(driver.cu().CUgraph(int(handle)))
            assert kinds.count(driver.cu().CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL) == 1
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), direct.view(torch.int16))


def test_torch_tensors_read_directly_match_their_dlpack_import():
    torch = cuda_torch()
    x = torch.randn(2, 64, 3, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)[:, 1:]
    fast = tensors.as_device_array(x, stream=torch.cuda.current_stream().cuda_stream)
    capsule = tensors._consume_capsule(x.__dlpack__(), x, "x")
    assert (fast.ptr, fast.shape, fast.strides, fast.device) == \
        (capsule.ptr, capsule.shape, capsule.strides, capsule.device)
    with pytest.raises(ValueError, match="q: its __dlpack__ refused to export it"):
        ptxattn.attention(x.new_empty(SHAPE).requires_grad_(), x.new_empty(SHAPE),
                          x.new_empty(SHAPE))


# --------------------------------------------------------------------------- the steady path

STEADY_CASES = {
    "plain": dict(),
    "out": dict(out=True),
    "lse": dict(return_lse=True),
    "causal": dict(causal=True),
    "window_top_left": dict(window=(40, 8), diagonal="top_left"),
    "bshd": dict(layout="bshd", shape=(1, 200, 2, 128)),
    "gqa_cross": dict(shape=(1, 4, 96, 128), kv_shape=(1, 2, 300, 128)),
    "lineage_stage": dict(stage=14),
}


@pytest.mark.parametrize("case", list(STEADY_CASES))
def test_remembered_calls_give_the_full_paths_bits(case):
    """attention()'s steady path (a call with the same metadata as an earlier one replays its
    launch) against prepare().launch() (the full path) on the same inputs: the same bits, for
    the first call (a miss) and for hits, with fresh outputs from the pool or the caller's."""
    from ptxattn import api as attn
    kw = dict(STEADY_CASES[case])
    shape = kw.pop("shape", SHAPE)
    kv_shape = kw.pop("kv_shape", shape)
    want_out = kw.pop("out", False)
    rng = np.random.default_rng(21)
    host = [rng.standard_normal(s, dtype=np.float32).astype(BF16)
            for s in (shape, kv_shape, kv_shape)]
    q, k, v = device(host)
    full = ptxattn.prepare(q, k, v, **kw)
    full.out.fill_u16(0xFFFF)
    full.launch()
    expected = full.out.to_numpy().tobytes()
    expected_lse = full.lse.to_numpy().tobytes() if full.lse is not None else None
    mask = {n: kw[n] for n in ("causal", "window", "diagonal") if n in kw}
    assert_passes(check_rows(*host, full.out.to_numpy(), layout=kw.get("layout", "bhld"),
                             **mask), case)
    fastpath.clear_steady_cache()
    for i in range(4):
        out = poisoned(shape) if want_out else None
        result = ptxattn.attention(q, k, v, out=out, **kw)
        got, lse = result if kw.get("return_lse") else (result, None)
        assert got.to_numpy().tobytes() == expected, f"{case}: call {i}"
        if lse is not None:
            assert lse.to_numpy().tobytes() == expected_lse, f"{case}: lse of call {i}"
        if want_out:
            assert got is out
    assert len(fastpath._STEADY) >= 1


def test_a_new_torch_tensor_at_a_remembered_address_is_read_afresh():
    """The key holds addresses, not objects: a new tensor that the caching allocator places
    where a freed one was, with the same geometry, hits the remembered launch. The maps
    describe that address, so the launch reads the new tensor's data."""
    torch = cuda_torch()
    g = torch.Generator(device="cuda").manual_seed(31)
    k, v = (torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    q = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16, generator=g)
    ptxattn.attention(q, k, v)
    old = q.data_ptr()
    del q
    q = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16, generator=g)
    reused = q.data_ptr() == old
    out = ptxattn.attention(q, k, v)
    host = [x.float().cpu().numpy().astype(BF16) for x in (q, k, v)]
    assert_passes(check_rows(*host, torch.from_dlpack(out).float().cpu().numpy().astype(BF16)),
                  f"new tensor (same address: {reused})")


def test_the_torch_op_eager_path_matches_the_dispatched_op():
    """ptxattn.torch.attention in plain eager mode calls the op's body directly; the
    dispatched op (torch.ops.ptxattn.attention) must give the same bits, and so must the SDPA
    wrapper, for a plain call and a causal one."""
    torch = cuda_torch()
    pt = import_or_skip("ptxattn.torch")
    from ptxattn.torch import _op
    q, k, v = torch_qkv(torch, seed=41)
    assert _op._eager(q, k, v)
    for causal in (False, True):
        scale = 1.0 / math.sqrt(128)                     # the op's default, bit for bit
        dispatched, _ = torch.ops.ptxattn.attention(q, k, v, scale, "bhld", causal, False)
        for _ in range(3):
            direct = pt.attention(q, k, v, is_causal=causal)
            wrapped = pt.scaled_dot_product_attention(q, k, v, is_causal=causal)
            assert torch.equal(direct.view(torch.int16), dispatched.view(torch.int16))
            assert torch.equal(wrapped.view(torch.int16), dispatched.view(torch.int16))
    assert pt.fallback_counts() == {}


def test_a_remembered_call_captured_in_a_torch_graph_is_one_kernel_node():
    """Warm on the capture's own stream, so the captured call is a hit of the steady path:
    it must record one kernel node and replay the same bits."""
    torch = cuda_torch()
    from ptxattn import api as attn
    q, k, v = torch_qkv(torch, seed=51)
    out = torch.empty_like(q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            ptxattn.attention(q, k, v, out=out)      # a miss, then hits on this stream
    side.synchronize()
    direct = out.clone()
    entries = len(fastpath._STEADY)
    out.fill_(float("nan"))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        ptxattn.attention(q, k, v, out=out)
    assert len(fastpath._STEADY) == entries                 # a hit: nothing new remembered
    assert torch.isnan(out).all()
    raw = getattr(graph, "raw_cuda_graph", None)
    if raw is not None:
        try:
            handle = raw()
        except Exception:
            handle = None
        if handle is not None:
            kinds = _graph_nodes(driver.cu().CUgraph(int(handle)))
            assert kinds.count(driver.cu().CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL) == 1
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), direct.view(torch.int16))

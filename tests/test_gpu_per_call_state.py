"""Per-call device state on the GPU (issue 28, defect 1): warm stage-15 calls from 4 threads at
once, each on its own stream, meet the bar; a captured stage-15 call gets its own counter.

Stage 15's CTAs take tiles from a device counter. Before the fix a remembered call replayed
the first call's counter, so calls with one key running at once (threads on the per-thread
default stream: one handle, one key, a stream per thread) took tiles from one word: each
skipped the tiles the others took, leaving those rows unwritten. PTXATTN_PERSISTENT_CTAS=8
keeps each launch to 8 CTAs walking 16 tiles each (~1 ms), so 4 launches truly overlap.
CPU side: tests/test_per_call_state.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from fakes import at_once
from gpu_checks import assert_passes, check_rows, rows_for

import ptxattn
from ptxattn import driver, launch, tensors
from ptxattn.reference import BF16, attention_reference

pytestmark = pytest.mark.gpu

SHAPE = (1, 8, 2048, 128)          # 128 tiles of 128 rows
THREADS = 4
PER_THREAD = 2                     # CU_STREAM_PER_THREAD


def host_qkv(seed):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(SHAPE, dtype=np.float32).astype(BF16) for _ in range(3))


def in_threads(worker) -> None:
    """worker(0) .. worker(THREADS - 1) on threads released together (fakes.at_once); the
    first error raised, named by its message (workers put their thread in it)."""
    errors = at_once(worker, THREADS, timeout=300)
    assert not errors, f"{len(errors)} thread(s) failed; first: {type(errors[0]).__name__}: " \
        f"{errors[0]}"


def test_gpu_stage15_warm_calls_of_one_key_from_4_per_thread_streams(monkeypatch):
    """One key shared by 4 threads (the same q, k, v; stream = the per-thread default stream;
    a fresh output per call): the case a remembered counter broke. New inputs each round, and
    every output of a round kept until it is checked, so stale memory cannot pass for an
    answer (no output of this round is handed back to the pool before the check)."""
    monkeypatch.setenv(launch.PERSISTENT_CTAS_ENV, "8")
    q, k, v = (tensors.empty(SHAPE) for _ in range(3))
    rows = rows_for(SHAPE[2])
    for rnd in range(3):
        a = host_qkv(100 + rnd)
        for dst, src in zip((q, k, v), a):
            driver.memcpy_htod(dst.ptr, src)
        driver.synchronize()
        ref = attention_reference(*a, rows=rows)
        ptxattn.attention(q, k, v, stage=15, stream=PER_THREAD)     # warm (JIT, key) first
        driver.synchronize()
        results = [[] for _ in range(THREADS)]

        def worker(i):
            for _ in range(4):
                results[i].append(ptxattn.attention(q, k, v, stage=15, stream=PER_THREAD))
            driver.synchronize(PER_THREAD)
        in_threads(worker)
        for i, outs in enumerate(results):
            for n, out in enumerate(outs):
                got = out.to_numpy()
                assert_passes(check_rows(*a, got, ref=ref),
                              f"round {rnd}, thread {i}, call {n} (per-thread stream, one key):")


def test_gpu_stage15_warm_calls_from_4_threads_each_on_its_own_stream(monkeypatch):
    """Each thread its own stream (driver.Stream), its own inputs and a poisoned out= per
    call, 6 warm calls each, all against the reference."""
    monkeypatch.setenv(launch.PERSISTENT_CTAS_ENV, "8")
    inputs = [host_qkv(200 + i) for i in range(THREADS)]
    rows = rows_for(SHAPE[2])
    refs = [attention_reference(*a, rows=rows) for a in inputs]
    streams = [driver.Stream() for _ in range(THREADS)]
    device = [tuple(tensors.from_numpy(x, stream=s) for x in a) for a, s in zip(inputs, streams)]
    outs = [[tensors.empty(SHAPE, stream=s) for _ in range(6)] for s in streams]
    got = [[None] * 6 for _ in range(THREADS)]
    for i in range(THREADS):                       # cold calls: JIT and keys, one thread
        for out in outs[i]:
            ptxattn.attention(*device[i], stage=15, out=out, stream=streams[i])
    driver.synchronize()

    def worker(i):
        s = streams[i]
        for rnd in range(2):
            for out in outs[i]:
                out.fill_u16(0xFFFF, stream=s)      # NaN: a tile nobody wrote shows
                ptxattn.attention(*device[i], stage=15, out=out, stream=s)
            for n, out in enumerate(outs[i]):
                got[i][n] = out.to_numpy()          # waits for this stream only
            for n in range(6):
                assert_passes(check_rows(*inputs[i], got[i][n], ref=refs[i]),
                              f"thread {i}, round {rnd}, out {n} (own stream):")
    in_threads(worker)


def _graph_node_types(graph) -> list:
    d = driver.cu()
    _, count = driver.check(d.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
    nodes, _ = driver.check(d.cuGraphGetNodes(graph, count), "cuGraphGetNodes")
    return [driver.check(d.cuGraphNodeGetType(n), "cuGraphNodeGetType") for n in nodes]


def test_gpu_a_captured_stage15_call_has_its_own_counter_and_replays_beside_eager_calls(
        monkeypatch):
    """A warm stage-15 call captured on stream S: the graph allocates, zeroes and frees its
    own counter (memory nodes). Replayed on stream R while warm eager calls of the same key
    run on S, every output meets the bar (a counter baked into the graph would be the one the
    eager calls take tiles from)."""
    monkeypatch.setenv(launch.PERSISTENT_CTAS_ENV, "8")
    d = driver.cu()
    a = host_qkv(300)
    rows = rows_for(SHAPE[2])
    ref = attention_reference(*a, rows=rows)
    s, r = driver.Stream(), driver.Stream()
    q, k, v = (tensors.from_numpy(x, stream=s) for x in a)
    captured = tensors.empty(SHAPE, stream=s)
    eager = [tensors.empty(SHAPE, stream=s) for _ in range(4)]
    ptxattn.attention(q, k, v, stage=15, out=captured, stream=s)      # JIT, key: warm
    driver.synchronize()
    cs = d.CUstream(s.handle)
    mode = d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
    driver.check(d.cuStreamBeginCapture(cs, mode), "cuStreamBeginCapture")
    try:
        ptxattn.attention(q, k, v, stage=15, out=captured, stream=s)
    finally:
        graph = driver.check(d.cuStreamEndCapture(cs), "cuStreamEndCapture")
    kinds = _graph_node_types(graph)
    T = d.CUgraphNodeType
    assert sorted(int(x) for x in kinds) == sorted(int(x) for x in (
        T.CU_GRAPH_NODE_TYPE_MEM_ALLOC, T.CU_GRAPH_NODE_TYPE_MEMSET, T.CU_GRAPH_NODE_TYPE_KERNEL,
        T.CU_GRAPH_NODE_TYPE_MEM_FREE)), f"graph nodes {kinds}"
    exe = driver.check(d.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    try:
        for rnd in range(3):
            captured.fill_u16(0xFFFF, stream=s)
            for out in eager:
                out.fill_u16(0xFFFF, stream=s)
            driver.synchronize()
            driver.check(d.cuGraphLaunch(exe, d.CUstream(r.handle)), "cuGraphLaunch")
            for out in eager:                      # beside the replay, on S
                ptxattn.attention(q, k, v, stage=15, out=out, stream=s)
            driver.synchronize()
            captured.stream = s.handle
            assert_passes(check_rows(*a, captured.to_numpy(), ref=ref),
                          f"round {rnd}, the graph's replay on another stream:")
            for n, out in enumerate(eager):
                assert_passes(check_rows(*a, out.to_numpy(), ref=ref),
                              f"round {rnd}, eager call {n} beside the replay:")
    finally:
        driver.check(d.cuGraphExecDestroy(exe), "cuGraphExecDestroy")
        driver.check(d.cuGraphDestroy(graph), "cuGraphDestroy")

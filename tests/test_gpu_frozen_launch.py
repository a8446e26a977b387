"""The plans' frozen launches on the H200 (serving.PrefillPlan / DecodePlan run() of torch
tensors at addresses seen before): every run, bit for bit, what the library's unplanned call
(flash_attn_varlen_func, flash_attn_with_kvcache) gives for the same inputs, across layers,
contents rewritten in place at the same addresses, new addresses, fresh and caller-given
(poisoned) outputs, LSE, device offsets (two launches) and split-KV with an append (three).
A frozen launch that kept a stale address would show here as a layer's or a step's answer.
conftest skips these without a GPU (PTXATTN_REQUIRE_GPU=1: fails)."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_checks import import_or_skip

pytestmark = pytest.mark.gpu

H, HKV, D = 16, 4, 128


def _poisoned(torch, like):
    return torch.full_like(like, float("nan"))


@pytest.mark.parametrize("device_offsets", [False, True])
def test_prefill_plan_runs_equal_the_unplanned_call(device_offsets):
    torch = import_or_skip("torch")
    import ptxattn
    lens = np.array([0, 300, 1, 129, 700], np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    total, longest = int(cu[-1]), int(lens.max())
    cu_dev = torch.from_numpy(cu).cuda()
    g = torch.Generator(device="cuda").manual_seed(11)

    def layer():
        return (torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16, generator=g),
                torch.randn(total, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g),
                torch.randn(total, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g))
    offsets = (cu_dev, cu_dev) if device_offsets else (cu, cu)
    extra = dict(total_q=total, total_k=total) if device_offsets else {}
    plan = ptxattn.plan_varlen(*offsets, heads=H, heads_kv=HKV, head_dim=D, causal=True,
                               return_lse=True, max_seqlen_q=longest, max_seqlen_k=longest,
                               **extra)
    layers = [layer() for _ in range(3)]
    for step in range(3):
        if step == 1:                              # new contents, the same addresses
            for t in layers:
                for x in t:
                    x.copy_(torch.randn(x.shape, device="cuda", generator=g))
        if step == 2:                              # new tensors, new addresses
            layers = [layer() for _ in range(3)]
        for i, (q, k, v) in enumerate(layers):
            want, want_lse = ptxattn.flash_attn_varlen_func(
                q, k, v, cu_dev, cu_dev, longest, longest, causal=True, return_lse=True)
            for given in (False, True, True):
                out = _poisoned(torch, q) if given else None
                got, lse = plan.run(q, k, v, out=out) if given else plan.run(q, k, v)
                torch.cuda.synchronize()
                what = f"step {step}, layer {i}, out given {given}"
                assert torch.equal(got, want), what
                assert torch.equal(lse, want_lse), what
                if given:
                    assert got is out
    assert plan._frozen, "no frozen launch was used"
    _assert_graphed(plan._frozen.values())


def test_decode_plan_runs_equal_the_unplanned_call():
    torch = import_or_skip("torch")
    import ptxattn
    B, L = 3, 2048
    lengths = np.array([1500, 7, 2000], np.int32)
    lens_dev = torch.from_numpy(lengths).cuda()
    g = torch.Generator(device="cuda").manual_seed(12)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    def layer():
        return rnd(B, 1, H, D), rnd(B, L, HKV, D), rnd(B, L, HKV, D), rnd(B, 1, HKV, D), \
            rnd(B, 1, HKV, D)
    plan = ptxattn.plan_decode(batch=B, heads=H, heads_kv=HKV, head_dim=D,
                               cache_seqlens=lens_dev, cache_len=L, seq_new=1, causal=True,
                               num_splits=4, return_lse=True, host_lengths=lengths)
    assert plan.splits == 4
    layers = [layer() for _ in range(3)]
    for step in range(3):
        if step == 1:
            for t in layers:
                for x in (t[0], t[3], t[4]):
                    x.copy_(torch.randn(x.shape, device="cuda", generator=g))
        if step == 2:
            layers = [layer() for _ in range(3)]
        for i, (q, kc, vc, kn, vn) in enumerate(layers):
            kc2, vc2 = kc.clone(), vc.clone()
            want, want_lse = ptxattn.flash_attn_with_kvcache(
                q, kc2, vc2, k=kn, v=vn, cache_seqlens=lens_dev, causal=True, num_splits=4,
                return_lse=True)
            for given in (False, True, True):
                out = _poisoned(torch, q) if given else None
                got, lse = plan.run(q, kc, vc, k=kn, v=vn, out=out)
                torch.cuda.synchronize()
                what = f"step {step}, layer {i}, out given {given}"
                assert torch.equal(got, want), what
                assert torch.equal(lse, want_lse), what
                assert torch.equal(kc, kc2) and torch.equal(vc, vc2), what + ": the append"
    assert plan._torch_layers and all(len(layer) > 1 for layer in plan._torch_layers.values())
    _assert_graphed(r for layer in plan._torch_layers.values()
                    for key, r in layer.items() if key is not None)


def _assert_graphed(replays):
    """Every frozen launch the runs used was replayed as a CUDA graph (replay.py)."""
    from ptxattn import replay
    replays = list(replays)
    assert replays and all(isinstance(r.graph, replay.Graph) for r in replays), \
        [r.graph for r in replays]


@pytest.mark.parametrize("graphs", ["1", "0"])
def test_a_plan_run_under_torch_graph_capture_is_captured_as_its_kernels(graphs, monkeypatch):
    """A steady run on a stream being captured launches its kernels (captured as nodes of
    the caller's graph), not its own graph; replays of the caller's graph give the unplanned
    call's answer for new contents; PTXATTN_GRAPH_RUNS=0 gives the same bits."""
    torch = import_or_skip("torch")
    import ptxattn
    from ptxattn import replay
    monkeypatch.setenv(replay.GRAPH_RUNS_ENV, graphs)
    cu = np.array([0, 100, 100, 613], np.int32)
    total = int(cu[-1])
    g = torch.Generator(device="cuda").manual_seed(13)
    q = torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(total, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(total, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    out = _poisoned(torch, q)
    cu_dev = torch.from_numpy(cu).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        plan = ptxattn.plan_varlen(cu, cu, heads=H, heads_kv=HKV, head_dim=D, causal=True)
        plan.run(q, k, v, out=out)                    # validated
        plan.run(q, k, v, out=out)                    # steady: frozen (and graphed)
        (r,) = plan._frozen.values()
        assert isinstance(r.graph, replay.Graph) if graphs == "1" else r.graph is False
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            plan.run(q, k, v, out=out)
        for _ in range(2):
            for x in (q, k, v):
                x.copy_(torch.randn(x.shape, device="cuda", generator=g))
            out.fill_(float("nan"))
            graph.replay()
            want = ptxattn.flash_attn_varlen_func(q, k, v, cu_dev, cu_dev, 513, 513,
                                                  causal=True)
            torch.cuda.synchronize()
            assert torch.equal(out, want)

"""attn_implementation="paged|ptxattn" on the H200: transformers' packed calls on the varlen and
paged kernels, then generate_batch against transformers' own SDPA path.

- Direct calls in transformers' contract (query (1, H, Tq, D) as a transpose of its
  projection, the gathered keys, device offsets): chunked prefill, empty and 1/127/128/129-row
  sequences, D 64/128/256, a sliding window; every row against the float64 reference of
  tests/packed_checks.py under DESIGN.md's bar.
- The per-step plan cache: two layers of one layout share one plan; the same offsets tensors
  rewritten in place (a later step of the same totals) give that step's answer.
- transformers 5.17's decode step on its own pages (page 256, 3001-key and 1-key
  sequences, NaN in the unused slots): the table read off read_index, the new keys written.
- A block-table decode (page sizes 16, 64, 256, shuffled pages padded with -1, NaN in every
  slot no key occupies): output and the appended keys in the pages.
- generate_batch on a tiny random-weight Llama (4 layers, 8:2 heads, D 128), 16 prompts of
  1..300 tokens, 12 greedy tokens, "paged|ptxattn" against "paged|sdpa" (5.17; "sdpa" on
  5.24): every attention call of the ptxattn run (varlen, and with 5.17 the decode steps on
  transformers' pages) is checked in the run against the float64 reference (the call index,
  sequence, row and head of the worst error in the message); the
  tokens agree except at near-ties: up to the first divergence of each request the chosen
  tokens' log-probabilities agree within LOGPROB_TOL (the divergence itself included: a
  flip is only accepted where both backends' choices were about equally likely), and at
  least 12 of the 16 requests agree over all their tokens.
- The same with use_cuda_graph=True (the varlen path captured and replayed) against the
  eager ptxattn run, same tolerance.
"""

from __future__ import annotations

import dataclasses

import pytest

import packed_checks as pc
from torch_gpu import pt, torch  # noqa: F401  (fixtures)

pytestmark = pytest.mark.gpu

LOGPROB_TOL = 0.05          # |log p(ours) - log p(sdpa)| of the chosen tokens, agreeing prefix
MIN_IDENTICAL = 12          # of 16 requests whose tokens agree over all 12


@pytest.fixture
def tp(pt):
    pytest.importorskip("transformers")
    from ptxattn.torch import transformers_paged
    pt.register_transformers()
    transformers_paged.clear_plans()
    yield transformers_paged
    transformers_paged.clear_plans()


class Module:
    """What the attention function reads of transformers' attention module."""

    def __init__(self, sliding_window=None, layer_idx=0):
        self.is_causal, self.layer_idx = True, layer_idx
        if sliding_window is not None:
            self.sliding_window = sliding_window


def packed(torch, gen, lens_q, lens_k, H, Hkv, D):
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(1, tq, H, D, generator=gen, device="cuda").bfloat16().transpose(1, 2)
    k = torch.randn(1, tk, Hkv, D, generator=gen, device="cuda").bfloat16().transpose(1, 2)
    v = torch.randn(1, tk, Hkv, D, generator=gen, device="cuda").bfloat16().transpose(1, 2)
    return q, k, v, pc.offsets(lens_q).cuda(), pc.offsets(lens_k).cuda()


def reference_of(q, k, v, cu_q, cu_k, **kw):
    to = (lambda x: x[0].transpose(0, 1).cpu())
    return pc.varlen_reference(to(q), to(k), to(v), cu_q.cpu(), cu_k.cpu(), **kw)


CASES = [   # lens_q, lens_k (past + new per sequence), H, Hkv, D, sliding window
    ((1, 127, 128, 129, 0, 300), (1, 127, 128, 129, 5, 300), 8, 2, 128, None),
    ((3, 1, 129, 64), (700, 1, 1000, 64), 8, 2, 128, None),           # chunked prefill
    ((1,) * 37, tuple(range(100, 137)), 8, 1, 128, None),           # a decode step, MQA
    ((200, 17), (900, 17), 4, 4, 64, None),
    ((130, 1), (260, 1), 4, 2, 256, None),
    ((300, 40), (1300, 40), 8, 2, 128, 256),                          # a sliding layer
]


@pytest.mark.parametrize("lens_q,lens_k,H,Hkv,D,window", CASES)
def test_packed_calls_meet_the_bar(torch, pt, tp, lens_q, lens_k, H, Hkv, D, window):
    gen = torch.Generator(device="cuda").manual_seed(sum(lens_q) + D)
    q, k, v, cu_q, cu_k = packed(torch, gen, lens_q, lens_k, H, Hkv, D)
    out, _ = tp.paged_attention_forward(
        Module(sliding_window=window), q, k, v, None, scaling=D ** -0.5, cu_seq_lens_q=cu_q,
        cu_seq_lens_k=cu_k, max_length_q=max(lens_q), max_length_k=max(lens_k),
        is_causal=True)
    torch.cuda.synchronize()
    assert pt.fallback_counts() == {}, f"fell back: {pt.fallback_counts()}"
    assert pt.packed_call_counts() == {"varlen": 1}
    assert out.shape == (1, sum(lens_q), H, D) and out.dtype == torch.bfloat16
    expect = reference_of(q, k, v, cu_q, cu_k,
                          window=(window - 1, 0) if window else (-1, -1))
    pc.check_packed(out[0].cpu(), expect, cu_q.cpu(),
                    f"varlen {lens_q} / {lens_k}, {H}:{Hkv} heads, D {D}, window {window}")


def test_heads_outermost_inputs_are_read_in_place(torch, pt, tp):
    """(1, heads, S, D) contiguous q, k, v (what RoPE's arithmetic or a cache may leave):
    views with a head stride of S x D, read in place."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    lens_q, lens_k = (129, 1, 64), (129, 300, 640)
    q, k, v, cu_q, cu_k = packed(torch, gen, lens_q, lens_k, 8, 2, 128)
    q, k, v = (x.contiguous() for x in (q, k, v))
    out, _ = tp.paged_attention_forward(Module(), q, k, v, None, cu_seq_lens_q=cu_q,
                                        cu_seq_lens_k=cu_k, max_length_q=129,
                                        max_length_k=640)
    torch.cuda.synchronize()
    assert pt.fallback_counts() == {} and pt.packed_call_counts() == {"varlen": 1}
    pc.check_packed(out[0].cpu(), reference_of(q, k, v, cu_q, cu_k), cu_q.cpu(),
                    "heads-outermost q, k, v")


def test_one_plan_serves_the_layers_and_follows_rewritten_offsets(torch, pt, tp):
    gen = torch.Generator(device="cuda").manual_seed(3)
    lens_q, lens_k = (40, 1, 90), (300, 77, 90)
    cu_q, cu_k = pc.offsets(lens_q).cuda(), pc.offsets(lens_k).cuda()
    for layer in range(3):
        q, k, v, _, _ = packed(torch, gen, lens_q, lens_k, 8, 2, 128)
        out, _ = tp.paged_attention_forward(Module(layer_idx=layer), q, k, v, None,
                                            cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k,
                                            max_length_q=90, max_length_k=300)
        pc.check_packed(out[0].cpu(), reference_of(q, k, v, cu_q, cu_k), cu_q.cpu(),
                        f"layer {layer}")
    assert len(tp._PLANS) == 1, f"one layout, {len(tp._PLANS)} plans"
    new_q, new_k = (1, 129, 1), (260, 129, 78)         # a later step: same totals
    cu_q.copy_(pc.offsets(new_q).cuda())
    cu_k.copy_(pc.offsets(new_k).cuda())
    q, k, v, _, _ = packed(torch, gen, lens_q, lens_k, 8, 2, 128)
    out, _ = tp.paged_attention_forward(Module(), q, k, v, None, cu_seq_lens_q=cu_q,
                                        cu_seq_lens_k=cu_k, max_length_q=129,
                                        max_length_k=260)
    assert len(tp._PLANS) == 1
    pc.check_packed(out[0].cpu(), reference_of(q, k, v, cu_q, cu_k), cu_q.cpu(),
                    "offsets rewritten in place")


@pytest.mark.parametrize("page", [16, 64, 256])
def test_a_block_table_decode_appends_and_attends(torch, pt, tp, page):
    import test_transformers_paged as cpu
    gen = torch.Generator().manual_seed(page)
    lengths = (700, 0, 255, 256, 1)
    batch, pages = len(lengths), 64
    max_pages = -(-1024 // page)
    pages = max(pages, batch * max_pages)
    kc = torch.randn(pages, page, 2, 128, generator=gen).bfloat16()
    vc = torch.randn(pages, page, 2, 128, generator=gen).bfloat16()
    table = pc.random_pages(gen, batch, [n + 1 for n in lengths], page, pages, max_pages)
    for cache in (kc, vc):          # NaN where no key is (a cache from torch.empty may hold it)
        cpu.poison_unreached(cache, table, lengths)
    q = torch.randn(1, batch, 8, 128, generator=gen).bfloat16().transpose(1, 2)
    k = torch.randn(1, batch, 2, 128, generator=gen).bfloat16().transpose(1, 2)
    v = torch.randn(1, batch, 2, 128, generator=gen).bfloat16().transpose(1, 2)
    expect_call = tp.Paged(q=q.permute(2, 0, 1, 3), k_cache=kc.clone(), v_cache=vc.clone(),
                           k=k.permute(2, 0, 1, 3), v=v.permute(2, 0, 1, 3),
                           cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                           block_table=table, causal=True, window=(-1, -1), scale=128 ** -0.5)
    expect = cpu.paged_independent(expect_call)
    kc_d, vc_d = kc.cuda(), vc.cuda()
    out, _ = tp.paged_attention_forward(
        Module(), q.cuda(), k.cuda(), v.cuda(), None,
        cu_seq_lens_q=pc.offsets([1] * batch).cuda(),
        cu_seq_lens_k=pc.offsets([n + 1 for n in lengths]).cuda(), block_table=table.cuda(),
        k_cache=kc_d, v_cache=vc_d, max_length_q=1, max_length_k=1, scaling=128 ** -0.5)
    torch.cuda.synchronize()
    assert pt.fallback_counts() == {} and pt.packed_call_counts() == {"paged": 1}
    pc.check_packed(out[0].cpu(), expect.reshape(batch, 8, 128), pc.offsets([1] * batch),
                    f"paged decode, page {page}")
    for name, got, want in (("k_cache", kc_d.cpu(), expect_call.k_cache),
                            ("v_cache", vc_d.cpu(), expect_call.v_cache)):
        same = (got == want) | (got.isnan() & want.isnan())
        wrong = (~same).any(dim=-1).any(dim=-1).nonzero().tolist()
        assert not wrong, f"{name}: (page, row) differing from the loops' appends: {wrong[:8]}"


def test_a_517_decode_step_on_transformers_pages(torch, pt, tp):
    """transformers 5.17's decode step (its cache handed to the function): the new keys
    written at write_index, the table read off read_index on the device, the decode kernel
    on the pages, whose unused slots hold NaN."""
    import test_transformers_paged as cpu
    gen = torch.Generator().manual_seed(14)
    page, pages, batch = 256, 40, 6
    cache = cpu.FakeCache(gen, pages, page, Hkv=2, D=128)
    cache.sliding_windows = {0: 1}
    past = (3000, 0, 255, 256, 1, 700)
    lengths = [n + 1 for n in past]
    table = pc.random_pages(gen, batch, lengths, page, pages, 16)
    for c in (cache.key_cache[0], cache.value_cache[0]):
        cpu.poison_unreached(c.view(pages, page, 2, 128), table, past)
    read = cpu.allocator_indices(table, lengths, page)
    write = torch.tensor([int(table[b, n // page]) * page + n % page
                          for b, n in enumerate(past)])
    q = torch.randn(1, batch, 8, 128, generator=gen).bfloat16().transpose(1, 2)
    k = torch.randn(1, batch, 2, 128, generator=gen).bfloat16().transpose(1, 2)
    v = torch.randn(1, batch, 2, 128, generator=gen).bfloat16().transpose(1, 2)
    kc, vc = cache.key_cache[0].clone(), cache.value_cache[0].clone()
    kc.index_copy_(0, write, k.transpose(1, 2)[0])
    vc.index_copy_(0, write, v.transpose(1, 2)[0])
    cu_k = pc.offsets(lengths)
    expect = pc.varlen_reference(q[0].transpose(0, 1), kc.index_select(0, read),
                                 vc.index_select(0, read), pc.offsets([1] * batch), cu_k)
    cache.key_cache = [t.cuda() for t in cache.key_cache]
    cache.value_cache = [t.cuda() for t in cache.value_cache]
    out, _ = tp.paged_attention_forward(
        Module(), q.cuda(), k.cuda(), v.cuda(), None, cache=cache,
        cu_seq_lens_q=pc.offsets([1] * batch).cuda(), cu_seq_lens_k=cu_k.cuda(),
        max_seqlen_q=1, max_seqlen_k=max(lengths), read_index=[read.cuda()],
        write_index=[write.cuda()], block_table=None, scaling=128 ** -0.5)
    torch.cuda.synchronize()
    assert cache.updates == [], "the keys were gathered"
    assert pt.fallback_counts() == {} and pt.packed_call_counts() == {"paged": 1}
    pc.check_packed(out[0].cpu(), expect, pc.offsets([1] * batch), "5.17 decode on pages")
    assert torch.equal(cache.key_cache[0].cpu()[write], kc[write]), "the new keys' rows"


# --------------------------------------------------------------------------- generate_batch

def tiny_llama(torch):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024,
                                   num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=2, head_dim=128,
                                   max_position_embeddings=1024)
    return transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


def prompts_of(torch, n=16):
    g = torch.Generator().manual_seed(11)
    lengths = [1, 300, 17, 128, 129, 64, 5, 250, 2, 90, 127, 33, 200, 8, 150, 45][:n]
    return [torch.randint(0, 512, (L,), generator=g).tolist() for L in lengths]


def run_batch(model, impl, prompts, cuda_graph=None):
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers import AttentionInterface
    if impl == "sdpa" and "paged|sdpa" in AttentionInterface._global_mapping:
        impl = "paged|sdpa"                                   # transformers 5.17's name
    model.set_attn_implementation(impl)
    extra = {} if cuda_graph is None else {"use_cuda_graph": cuda_graph}
    cb = ContinuousBatchingConfig(num_blocks=48, max_batch_tokens=512, block_size=64,
                                  return_logprobs=True, **extra)
    out = model.generate_batch(prompts, generation_config=GenerationConfig(
        max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0),
        continuous_batching_config=cb)
    assert len(out) == len(prompts), f"{impl}: {len(out)} of {len(prompts)} requests came back"
    for r in out.values():
        assert r.error is None, f"{impl}: request {r.request_id} failed: {r.error}"
    return [(list(r.generated_tokens), list(r.logprobs)) for r in out.values()]


def compare_runs(ours, theirs, what: str) -> None:
    """Tokens agree but at near-ties (see the module's docstring); a message per request."""
    identical, problems = 0, []
    for i, ((t_a, lp_a), (t_b, lp_b)) in enumerate(zip(ours, theirs)):
        assert len(t_a) == len(t_b) == 12, f"{what}: request {i} has {len(t_a)}/{len(t_b)}"
        assert len(lp_a) == len(lp_b) == 12, (f"{what}: request {i} has {len(lp_a)}/"
                                              f"{len(lp_b)} log-probabilities "
                                              "(return_logprobs=True)")
        first = next((j for j in range(12) if t_a[j] != t_b[j]), None)
        identical += first is None
        upto = 12 if first is None else first + 1
        for j in range(upto):
            if abs(lp_a[j] - lp_b[j]) > LOGPROB_TOL:
                problems.append(f"request {i} token {j}: ours {t_a[j]} (log p {lp_a[j]:.4f}) "
                                f"vs {t_b[j]} (log p {lp_b[j]:.4f})"
                                + (" at the divergence" if j == first else ""))
                break
    assert not problems and identical >= MIN_IDENTICAL, (
        f"{what}: {identical}/16 requests identical (need {MIN_IDENTICAL}); log-probability "
        f"gaps above {LOGPROB_TOL}: {problems}")


def test_generate_batch_matches_sdpa_with_every_call_checked(torch, pt, tp, monkeypatch):
    model = tiny_llama(torch)
    prompts = prompts_of(torch)
    theirs = run_batch(model, "sdpa", prompts)
    kernel = tp._varlen_kernel
    report = []

    def checked(call):
        out = kernel(call)
        snap = dataclasses.replace(call, cu_q=call.cu_q.cpu(), cu_k=call.cu_k.cpu())
        expect = pc.varlen_reference(call.q.cpu(), call.k.cpu(), call.v.cpu(), snap.cu_q,
                                     snap.cu_k, causal=call.causal, window=call.window,
                                     scale=call.scale)
        try:
            m = pc.check_packed(out.cpu(), expect, snap.cu_q, f"call {len(report)}")
        except AssertionError as e:
            m = {"error": str(e)}
        report.append((tuple(call.q.shape), tuple(call.k.shape), m))
        return out

    paged_kernel = tp._paged_kernel

    def checked_paged(call):
        # transformers 5.17's decode steps, on its own pages (the new keys written already)
        import test_transformers_paged as cpu
        snap = dataclasses.replace(
            call, q=call.q.cpu(), k_cache=call.k_cache.cpu(), v_cache=call.v_cache.cpu(),
            k=None if call.k is None else call.k.cpu(), v=None if call.v is None else call.v.cpu(),
            cache_seqlens=call.cache_seqlens.cpu(), block_table=call.block_table.cpu())
        out = paged_kernel(call)
        batch, _, heads, d = snap.q.shape
        expect = cpu.paged_independent(snap).reshape(batch, heads, d)
        one = pc.offsets([1] * batch)
        try:
            m = pc.check_packed(out.cpu().reshape(batch, heads, d), expect, one,
                                f"call {len(report)} (paged)")
        except AssertionError as e:
            m = {"error": str(e)}
        report.append((tuple(call.q.shape), tuple(call.block_table.shape), m))
        return out

    monkeypatch.setattr(tp, "_varlen_kernel", checked)
    monkeypatch.setattr(tp, "_paged_kernel", checked_paged)
    ours = run_batch(model, "paged|ptxattn", prompts)
    bad = [(i, r) for i, r in enumerate(report) if "error" in r[2]]
    assert report, "no attention call reached ptxattn's kernels"
    assert not bad, f"{len(bad)} of {len(report)} calls off the bar: {bad[:4]}"
    assert pt.fallback_counts() == {}, pt.fallback_counts()
    assert sum(pt.packed_call_counts().values()) == len(report), pt.packed_call_counts()
    assert len(report) % 4 == 0, f"{len(report)} calls for 4 layers"
    compare_runs(ours, theirs, "paged|ptxattn vs transformers' SDPA")


def test_generate_batch_under_cuda_graphs(torch, pt, tp):
    model = tiny_llama(torch)
    prompts = prompts_of(torch)
    eager = run_batch(model, "paged|ptxattn", prompts)
    pt.reset_fallback_counts()
    graphed = run_batch(model, "paged|ptxattn", prompts, cuda_graph=True)
    assert pt.fallback_counts() == {}, pt.fallback_counts()
    assert pt.packed_call_counts().get("varlen", 0) > 0, "nothing ran on the kernels"
    compare_runs(graphed, eager, "paged|ptxattn with CUDA graphs vs without")


def test_readme_serving_block_runs(torch, pt, tp):
    """The python block of README "Serving", as written."""
    from readme_blocks import python_blocks
    (block,) = python_blocks("## Serving: transformers continuous batching")
    pt.reset_fallback_counts()
    exec(compile(block, "README.md", "exec"), {})

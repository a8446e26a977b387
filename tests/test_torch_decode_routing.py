"""transformers' decode steps on the decode kernel, without a GPU (issue 24 item 5): the
dynamic cache (no mask) and the static cache (`cache_implementation="static"`: the whole
preallocated cache and a materialized mask), whose mask the "ptxattn" mask builder vouches
for when it is the plain causal mask of the cache's length, and refuses (a counted reason)
when padding hides keys or when it was built where its padding cannot be read.

The decode call (ptxattn.torch.kvcache.flash_attn_with_kvcache) is replaced by a torch
reference on CPU tensors that records its arguments (tests/torch_refs.py), the forward op's
kernel too, and the CUDA device check accepts CPU tensors. Logits are compared with
transformers' own "sdpa" implementation step by step. Skipped without torch or transformers.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pt = pytest.importorskip("ptxattn.torch")
transformers = pytest.importorskip("transformers")
import torch_refs  # noqa: E402

from ptxattn.torch import kvcache, sdpa  # noqa: E402
from ptxattn.torch import transformers_backend as tb  # noqa: E402
from transformers.masking_utils import (causal_mask_function, sdpa_mask,  # noqa: E402
                                        sliding_window_causal_mask_function)

BF = torch.bfloat16


@pytest.fixture
def routed(monkeypatch):
    calls = torch_refs.install(monkeypatch)
    monkeypatch.setattr(sdpa, "_device_reason", lambda q, k, v: None)
    monkeypatch.setattr(kvcache, "flash_attn_with_kvcache", torch_refs.kvcache)
    pt.register_transformers()
    pt.reset_fallback_counts()
    yield calls
    pt.reset_fallback_counts()


# --------------------------------------------------------------------------- the verdict

def verdict(q_length=1, kv_length=32, q_offset=9, kv_offset=0, mask_function=None,
            padding=None, local_size=None, batch=2):
    return tb.decode_verdict(q_length, kv_length, q_offset, kv_offset,
                             mask_function or causal_mask_function, padding, local_size, batch,
                             torch.device("cpu"))


@pytest.mark.parametrize("offset", [9, torch.tensor(9)], ids=["int", "tensor"])
@pytest.mark.parametrize("q_length", [1, 3, 16])
def test_plain_causal_masks_get_the_cache_lengths(offset, q_length):
    ones = torch.ones(2, 9 + q_length, dtype=torch.long)       # generate()'s mask: all valid
    for padding in (None, ones, torch.ones(2, 40, dtype=torch.bool)):
        lengths, reason = verdict(q_length=q_length, q_offset=offset, padding=padding)
        assert reason is None and lengths.dtype == torch.int32 and lengths.is_contiguous()
        assert lengths.tolist() == [9 + q_length] * 2


def test_padding_that_hides_keys_is_refused():
    left = torch.ones(2, 10, dtype=torch.long)
    left[1, :3] = 0                                            # left padding of sequence 1
    assert verdict(padding=left) == (None, "mask_padding")
    short = torch.ones(2, 5, dtype=torch.long)                  # keys 5..9 padded away
    assert verdict(padding=short) == (None, "mask_padding")
    assert verdict(q_offset=40, kv_length=32) == (None, "mask_padding")   # past the keys


def test_other_patterns_are_not_decode_masks():
    assert verdict(mask_function=sliding_window_causal_mask_function(4)) == (None, None)
    assert verdict(kv_offset=3) == (None, None)
    assert verdict(local_size=8) == (None, None)
    assert verdict(q_length=17) == (None, None)


def test_a_mask_built_while_compiling_is_unverified():
    def build(offset):
        return verdict(q_offset=offset, padding=torch.ones(2, 10, dtype=torch.long))[1]
    torch._dynamo.reset()
    try:
        assert torch.compile(build, backend="eager")(torch.tensor(9)) == "mask_unverified"
    finally:
        torch._dynamo.reset()


def test_the_verdict_survives_generates_contiguous_copy():
    """Without a padding mask, a batch's decode mask is an expanded view (batch stride 0);
    generate() (transformers >= 5.2x) passes mask.contiguous() on: the builder's mask is
    contiguous already, so that is the same object, verdict and all (a refusal too)."""
    kw = dict(batch_size=3, q_length=1, kv_length=24, q_offset=torch.tensor(6),
              mask_function=causal_mask_function, attention_mask=None,
              allow_is_causal_skip=False)
    assert not sdpa_mask(**kw).is_contiguous()             # what the builder starts from
    mask = tb.ptxattn_mask(**kw)
    assert mask.is_contiguous() and mask.contiguous() is mask
    assert getattr(mask.contiguous(), tb.CACHE_SEQLENS).tolist() == [7, 7, 7]
    assert torch.equal(mask, sdpa_mask(**kw))
    left = torch.ones(3, 7, dtype=torch.bool)
    left[2, 0] = False
    refused = tb.ptxattn_mask(**dict(kw, attention_mask=left))
    assert getattr(refused.contiguous(), tb.MASK_REASON) == "mask_padding"


def test_the_builder_returns_transformers_mask_with_its_verdict():
    kw = dict(batch_size=2, q_length=1, kv_length=24, q_offset=torch.tensor(6),
              mask_function=causal_mask_function,
              attention_mask=torch.ones(2, 7, dtype=torch.bool),
              allow_is_causal_skip=False)
    ours, theirs = tb.ptxattn_mask(**kw), sdpa_mask(**kw)
    assert torch.equal(ours, theirs)
    assert getattr(ours, tb.CACHE_SEQLENS).tolist() == [7, 7]
    padded = dict(kw, attention_mask=torch.tensor([[1] * 7, [0, 0] + [1] * 5]).bool())
    mask = tb.ptxattn_mask(**padded)
    assert torch.equal(mask, sdpa_mask(**padded))
    assert getattr(mask, tb.MASK_REASON) == "mask_padding"
    assert not hasattr(mask, tb.CACHE_SEQLENS)
    assert tb.ptxattn_mask(**dict(kw, q_offset=0, q_length=24, allow_is_causal_skip=True,
                                  attention_mask=None)) is None      # is_causal: no mask


def test_the_lengths_travel_into_a_compiled_forward_on_the_mask():
    """generate() builds static-cache masks eagerly and hands them to its compiled forward:
    the attribute is read there without a graph break (fullgraph=True)."""
    mask = tb.ptxattn_mask(batch_size=2, q_length=1, kv_length=16, q_offset=torch.tensor(3),
                           attention_mask=torch.ones(2, 4, dtype=torch.bool),
                           allow_is_causal_skip=False)
    query, key = torch.zeros(2, 4, 1, 64), torch.zeros(2, 2, 16, 64)

    def read(mask, query, key):
        lengths = tb.static_cache_lengths(mask, query, key)
        return query.sum() + (lengths.sum() if lengths is not None else -1)
    torch._dynamo.reset()
    try:
        assert torch.compile(read, fullgraph=True, backend="eager")(mask, query, key) == 8
    finally:
        torch._dynamo.reset()
    assert tb.static_cache_lengths(mask, query, torch.zeros(2, 2, 15, 64)) is None


# --------------------------------------------------------------------------- a tiny Llama

def tiny_llama(impl):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=128, attn_implementation=impl)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(BF).eval()


def decode_logits(impl, ids, steps, mask=None, max_cache_len=40):
    """Prefill, then `steps` teacher-forced decode steps through a StaticCache: the logits of
    each step (float)."""
    model = tiny_llama(impl)
    cache = transformers.StaticCache(config=model.config, max_cache_len=max_cache_len)
    b, n = ids.shape
    mask = torch.ones(b, n, dtype=torch.long) if mask is None else mask
    out = []
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        nxt = torch.randint(0, 64, (b, steps), generator=torch.Generator().manual_seed(9))
        for t in range(steps):
            mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype)], dim=1)
            step = model(nxt[:, t:t + 1], attention_mask=mask, past_key_values=cache,
                         use_cache=True)
            out.append(step.logits.float())
    return out


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_static_cache_decode_steps_run_on_the_decode_kernel(routed):
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    expect = decode_logits("sdpa", ids, 3)
    got = decode_logits("ptxattn", ids, 3)
    decode = [c for c in routed if c["kind"] == "kvcache"]
    assert [c["seqlens"] for c in decode] == [[21, 21]] * 2 + [[22, 22]] * 2 + [[23, 23]] * 2
    assert all(c["k_cache"] == (2, 40, 2, 64) and c["q"] == (2, 1, 4, 64) for c in decode)
    assert pt.fallback_counts() == {}
    for t, (g, e) in enumerate(zip(got, expect)):
        assert rel(g, e) < 2e-2, f"step {t}: rel L2 {rel(g, e):.3g}"


def test_static_cache_left_padding_falls_back_counted(routed):
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, :4] = 0
    expect = decode_logits("sdpa", ids, 2, mask=mask)
    with pytest.warns(RuntimeWarning, match="reason 'mask_padding'"):
        got = decode_logits("ptxattn", ids, 2, mask=mask)
    assert not [c for c in routed if c["kind"] == "kvcache"]
    assert pt.fallback_counts()["mask_padding"] == 4            # 2 steps x 2 layers
    for g, e in zip(got, expect):
        assert torch.equal(g, e)                                # transformers' own function


@pytest.mark.parametrize("batch", [1, 2])
def test_static_cache_generate_matches_sdpa(routed, batch):
    """generate(cache_implementation="static") on the CPU (no auto-compile there): the same
    greedy tokens as "sdpa", every decode step on the decode kernel. Batch 2: the mask is an
    expanded view, which newer transformers' generate() copies with .contiguous() (a copy
    that would lose the verdict the builder attached)."""
    ids = torch.randint(0, 64, (batch, 12), generator=torch.Generator().manual_seed(3))
    tokens = {}
    for impl in ("sdpa", "ptxattn"):
        model = tiny_llama(impl)
        model.generation_config.pad_token_id = 0
        tokens[impl] = model.generate(ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=5, do_sample=False,
                                      cache_implementation="static")
    calls = [c for c in routed if c["kind"] == "kvcache"]
    # the 12-token prefill is short enough for the decode kernel too (causal over 12 keys)
    assert [(c["q"][1], c["seqlens"]) for c in calls[:2]] == [(12, 12)] * 2, calls[:2]
    decode = calls[2:]
    assert len(decode) == 2 * 4, decode                         # 4 decode steps x 2 layers
    assert [c["seqlens"] for c in decode[::2]] == [[n] * batch for n in (13, 14, 15, 16)]
    assert torch.equal(tokens["ptxattn"], tokens["sdpa"]), tokens
    assert pt.fallback_counts() == {}


def test_dynamic_cache_decode_needs_no_mask(routed):
    model = tiny_llama("ptxattn")
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        model(ids[:, :1], past_key_values=out.past_key_values, use_cache=True)
    decode = [c for c in routed if c["kind"] == "kvcache" and c["q"][1] == 1]   # (a 10-token
    assert len(decode) == 2 and all(c["seqlens"] is None and c["k_cache"][1] == 11  # prefill too)
                                    for c in decode), decode
    assert pt.fallback_counts() == {}


# --------------------------------------------------------------------------- compiled decode

@pytest.fixture
def library_replaced(monkeypatch):
    """The torch-level wrapper and its op stay real; only the library call under the op's body
    is a torch reference (so what dynamo traces is what runs on the GPU)."""
    from ptxattn import decode as lib
    torch_refs.install(monkeypatch)
    monkeypatch.setattr(sdpa, "_device_reason", lambda q, k, v: None)
    seen = []

    def reference(q, k_cache, v_cache, *, return_lse=False, **kw):
        seen.append(tuple(t.data_ptr() % 16 for t in (q, k_cache, v_cache)))
        out, lse = torch_refs.kvcache(q, k_cache, v_cache, return_lse=True, **kw)
        return (out, lse) if return_lse else out
    monkeypatch.setattr(lib, "flash_attn_with_kvcache", reference)
    pt.register_transformers()
    pt.reset_fallback_counts()
    yield seen
    pt.reset_fallback_counts()


def test_a_static_cache_decode_forward_compiles_without_a_graph_break(library_replaced):
    """generate()'s compiled decode forward (the mask built eagerly, with its verdict): one
    graph (fullgraph=True), the decode op inside it, and the eager forward's logits. A graph
    break inside the attention function made dynamo compile every layer as its own frame and
    run the layers past its recompile limit eagerly (measured: 44 ms a step instead of ~20)."""
    model = tiny_llama("ptxattn")
    cache = transformers.StaticCache(config=model.config, max_cache_len=40)
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(3))
    ones = torch.ones(2, 21, dtype=torch.bool)
    nxt = torch.randint(0, 64, (2, 1), generator=torch.Generator().manual_seed(4))
    pos = torch.tensor([[20]])
    with torch.no_grad():
        model(ids, attention_mask=ones[:, :20].long(), past_key_values=cache, use_cache=True)
        mask = tb.ptxattn_mask(batch_size=2, q_length=1, kv_length=40,
                               q_offset=torch.tensor(20), attention_mask=ones,
                               allow_is_causal_skip=False)
        assert tb.static_cache_lengths(mask, torch.zeros(2, 4, 1, 64),
                                       torch.zeros(2, 2, 40, 64)).tolist() == [21, 21]
        eager = model(nxt, attention_mask=mask, past_key_values=cache, use_cache=True,
                      position_ids=pos).logits.float()
        calls = len(library_replaced)
        for layer in cache.layers:                 # the step again, from the same cache
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length.fill_(20)
        torch._dynamo.reset()
        try:
            compiled = torch.compile(model.forward, fullgraph=True, backend="eager")
            out = compiled(input_ids=nxt, attention_mask=mask, past_key_values=cache,
                           use_cache=True, position_ids=pos).logits.float()
        finally:
            torch._dynamo.reset()
    assert len(library_replaced) - calls == model.config.num_hidden_layers
    assert pt.fallback_counts() == {}
    assert rel(out, eager) < 1e-6


def test_the_read_op_reads_a_misaligned_operand_from_an_aligned_copy(library_replaced):
    """While compiling, decode_step cannot read storage offsets; the op's body copies an
    operand the kernel cannot read in place (not 16-byte aligned), keeping its strides."""
    q = torch.randn(2, 1, 4, 64 + 1, dtype=BF)[..., 1:]          # 2-byte offset: misaligned
    kc = torch.randn(2, 2, 16, 64, dtype=BF).transpose(1, 2)      # BHLD memory, BSHD view
    vc = torch.randn(2, 2, 16, 64, dtype=BF).transpose(1, 2)
    assert q.data_ptr() % 16 and not kc.data_ptr() % 16
    out, _ = kvcache._read_impl(q, kc, vc, None, -1, False, -1, -1, 0.125, 0, "bshd")
    assert library_replaced[-1] == (0, 0, 0)
    ref, _ = torch_refs.kvcache(q.contiguous(), kc, vc, softmax_scale=0.125, return_lse=True)
    assert torch.equal(out, ref)

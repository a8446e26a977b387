"""attn_implementation="paged|ptxattn" (transformers' continuous batching) without a GPU.

- Routing: generate_batch on tiny models on the CPU, with the CUDA device check accepting CPU
  tensors and the kernels replaced by the independent float64 references of
  tests/packed_checks.py that record what reached them: every call goes to the varlen kernel
  with transformers' offsets, causal, the layer's window (Mistral, a hybrid Qwen2), and the
  tokens equal those of transformers' own SDPA path ("paged|sdpa" in 5.17, "sdpa" in 5.24)
  on the same model. What falls back, counted with its reason: CPU tensors, fp32, a head dim
  the kernels lack, softcap, attention sinks, an explicit mask, grad, an odd page size.
- Translation: direct calls in both transformers contracts (5.17 updates the cache in the
  attention function and hands per-layer-type dicts; 5.24 hands the gathered keys, or
  k_cache / v_cache with a block table), checked field by field, and the block-table path's
  appends landing in the pages.
- The torch reference (the fallback) against the independent loops.
- Through the real kernels on the CPU emulator (emulated_gpu): a chunked-prefill varlen call
  and a paged decode call translated by paged_attention_forward, and a PrefillPlan reused
  after its device offsets were rewritten (what the per-step plan cache relies on).

Skipped without torch or transformers. The local transformers is 5.24; the same tests pass
against 5.17 (PYTHONPATH to its wheel's files; see the benchmark notes).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pt = pytest.importorskip("ptxattn.torch")
transformers = pytest.importorskip("transformers")
cb_api = pytest.importorskip("transformers.generation.continuous_batching.continuous_api")
import packed_checks as pc  # noqa: E402

from ptxattn.torch import packed_reference as pr  # noqa: E402
from ptxattn.torch import sdpa  # noqa: E402
from ptxattn.torch import transformers_paged as tp  # noqa: E402

BF = torch.bfloat16


def sdpa_cb_name() -> str:
    """transformers' own SDPA implementation for continuous batching."""
    from transformers import AttentionInterface
    return "paged|sdpa" if "paged|sdpa" in AttentionInterface._global_mapping else "sdpa"


@pytest.fixture
def cpu_cb(monkeypatch):
    """Continuous batching on the CPU: transformers 5.17 sizes its cache from psutil's memory
    figures, which this environment may lack (a fixed 8 GiB stands in); counts reset."""
    import transformers.generation.continuous_batching.cache as cache_module
    if hasattr(cache_module, "get_device_and_memory_breakdown"):
        monkeypatch.setattr(cache_module, "get_device_and_memory_breakdown",
                            lambda: (torch.device("cpu"), 8 << 30, 0, 0))
    pt.register_transformers()
    pt.reset_fallback_counts()
    tp.clear_plans()
    yield
    pt.reset_fallback_counts()


class Recorded:
    """The kernels' seams replaced by the independent references (float64, rounded to the
    inputs' dtype), each call kept."""

    def __init__(self):
        self.calls = []

    def varlen(self, call):
        # transformers rewrites its offsets buffers every step: keep this call's values
        self.calls.append(dataclasses.replace(call, cu_q=call.cu_q.clone(),
                                              cu_k=call.cu_k.clone()))
        out = pc.varlen_reference(call.q, call.k, call.v, call.cu_q, call.cu_k,
                                  causal=call.causal, window=call.window, scale=call.scale)
        return out.to(call.q.dtype)

    def paged(self, call):
        self.calls.append(dataclasses.replace(call, cache_seqlens=call.cache_seqlens.clone(),
                                              block_table=call.block_table.clone()))
        return paged_independent(call).to(call.q.dtype)

    def counts(self) -> dict:
        kinds = ["varlen" if isinstance(c, tp.Varlen) else "paged" for c in self.calls]
        return {k: kinds.count(k) for k in set(kinds)}


def paged_independent(call):
    """The block-table call by loops: append each new key at its position, then attend."""
    batch, lq, h, d = call.q.shape
    page = call.k_cache.shape[1]
    out = torch.zeros(batch, lq, h, d, dtype=torch.float64)
    new = 0 if call.k is None else call.k.shape[1]
    for b in range(batch):
        n = max(int(call.cache_seqlens[b]), 0)
        row = call.block_table[b]
        for t in range(new):
            j = n + t
            call.k_cache[int(row[j // page]), j % page] = call.k[b, t]
            call.v_cache[int(row[j // page]), j % page] = call.v[b, t]
        total = n + new
        keys = pc.sequence_keys(call.k_cache, row, total)
        values = pc.sequence_keys(call.v_cache, row, total)
        out[b] = pc.sequence_attention(call.q[b], keys, values, call.causal, call.window,
                                       call.scale)
    return out


@pytest.fixture
def recorded(monkeypatch, cpu_cb):
    rec = Recorded()
    monkeypatch.setattr(sdpa, "_device_reason", lambda q, k, v: None)
    monkeypatch.setattr(tp, "_varlen_kernel", rec.varlen)
    monkeypatch.setattr(tp, "_paged_kernel", rec.paged)
    return rec


def tiny(kind="llama", dtype=BF, head_dim=64, **extra):
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                  max_position_embeddings=512)
    common.update(extra)
    if kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return model.to(dtype).eval()


PROMPT_LENGTHS = (5, 17, 33, 2, 70)


def generate(model, impl, lengths=PROMPT_LENGTHS, new=6):
    """Greedy tokens of generate_batch (a small paged cache, 48-token batches: the longer
    prompts are prefilled in chunks against their own past)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]
    model.set_attn_implementation(impl)
    out = model.generate_batch(
        prompts, generation_config=GenerationConfig(max_new_tokens=new, do_sample=False,
                                                    eos_token_id=None, pad_token_id=0),
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=48,
                                                            block_size=32))
    return [r.generated_tokens for r in out.values()]


def check_call_fields(call, scale, window=(-1, -1)):
    """What every varlen call must carry: transformers' offsets as int32, covering the rows
    of q and k; causal; the layer's window and scale; views the kernels read in place."""
    assert isinstance(call, tp.Varlen), call
    assert call.q.dtype == BF and call.q.dim() == 3 and call.k.shape[1:] == call.v.shape[1:]
    assert call.cu_q.dtype == torch.int32 and call.cu_k.dtype == torch.int32
    assert call.cu_q.shape == call.cu_k.shape
    assert int(call.cu_q[-1]) <= call.q.shape[0] and int(call.cu_k[-1]) <= call.k.shape[0]
    lens_q, lens_k = (c.diff() for c in (call.cu_q, call.cu_k))
    assert bool((lens_q <= lens_k).all()), "a sequence's keys include its new queries"
    assert call.max_q >= int(lens_q.max()) and call.max_k >= int(lens_k.max())
    assert call.causal is True and call.window == window
    assert call.scale == pytest.approx(scale)
    for t in (call.q, call.k, call.v):
        assert t.stride(-1) == 1


# --------------------------------------------------------------------------- registration

def test_register_transformers_registers_both_names():
    from transformers import AttentionInterface
    name = pt.register_transformers()
    pt.register_transformers()                                 # idempotent
    assert name == "ptxattn"
    assert AttentionInterface._global_mapping["paged|ptxattn"] is tp.paged_attention_forward
    switch = cb_api.ContinuousBatchingManager.switch_to_cb_friendly_attn
    original = getattr(switch, "__wrapped__", switch)
    assert not hasattr(original, "_ptxattn_keeps"), "wrapped twice"
    # wrapped exactly where the manager refuses "ptxattn" (transformers 5.24), not elsewhere
    assert hasattr(switch, "_ptxattn_keeps") == tp._refuses_ptxattn(original)


def test_the_wrapped_manager_keeps_ptxattn_and_leaves_other_names_alone():
    from types import SimpleNamespace
    pt.register_transformers()
    switch = cb_api.ContinuousBatchingManager.switch_to_cb_friendly_attn
    if not hasattr(switch, "_ptxattn_keeps"):
        pytest.skip("this transformers' manager takes any registered name (5.17)")
    seen = []
    # dtype and device: what 5.25's check reads before the name (float32: no flash offered)
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="ptxattn"),
                            _supports_flash_attn=False, set_attn_implementation=seen.append,
                            dtype=torch.float32, device=torch.device("cpu"))
    assert switch(SimpleNamespace(_original_attn_impl=None), model) is None and seen == []
    model.config._attn_implementation = "nonsense"
    with pytest.raises(ValueError, match="not supported for continuous batching"):
        switch(SimpleNamespace(_original_attn_impl=None), model)


# --------------------------------------------------------------------------- routing

def decode_on_pages() -> bool:
    """Whether this transformers hands the attention function its cache (5.17), so that
    decode steps run on its pages (5.24 gathers the keys before the call)."""
    return sdpa_cb_name() == "paged|sdpa"


def check_paged_fields(call, scale):
    """A decode step on transformers' pages: one query a sequence, the new keys already
    written (no append), lengths that include them, a table naming pages or -1."""
    assert isinstance(call, tp.Paged) and call.k is None and call.v is None
    batch = call.q.shape[0]
    assert call.q.shape[1] == 1 and call.cache_seqlens.shape == (batch,)
    assert call.cache_seqlens.dtype == torch.int32 and bool((call.cache_seqlens >= 1).all())
    assert call.block_table.dtype == torch.int32 and call.block_table.shape[0] == batch
    pages = call.k_cache.shape[0]
    for b in range(batch):
        # every entry a page of the cache: those past a sequence's last page are never read
        row = call.block_table[b]
        assert bool(((row >= 0) & (row < pages)).all())
    assert call.causal is True and call.window == (-1, -1)
    assert call.scale == pytest.approx(scale)


def test_generate_batch_routes_every_call_to_ptxattn(recorded):
    """Prefills and chunks on the varlen kernel; decode steps too (5.24), or on the paged
    decode kernel over transformers' own pages (5.17, which hands the function its cache)."""
    model = tiny()
    expect = generate(model, sdpa_cb_name())
    got = generate(model, "paged|ptxattn")
    calls = recorded.calls
    assert pt.fallback_counts() == {}, pt.fallback_counts()
    assert pt.packed_call_counts() == recorded.counts() and calls
    assert len(calls) % model.config.num_hidden_layers == 0
    for call in calls:
        if isinstance(call, tp.Varlen):
            check_call_fields(call, 64 ** -0.5)
        else:
            check_paged_fields(call, 64 ** -0.5)
    assert ("paged" in recorded.counts()) == decode_on_pages(), recorded.counts()
    chunked = [c for c in calls if isinstance(c, tp.Paged)
               or bool((c.cu_q.diff() < c.cu_k.diff()).any())]
    assert chunked, "no call had a sequence with past keys (decode or a prefill chunk)"
    assert got == expect, f"tokens differ from {sdpa_cb_name()}: {got} vs {expect}"


def test_decode_tables_name_the_positions_transformers_reads(recorded, monkeypatch):
    """5.17: the block table read off read_index, walked key by key, gives exactly the
    cache positions transformers' own gather would read (its allocator's layout)."""
    if not decode_on_pages():
        pytest.skip("this transformers gathers the keys before the call (5.24)")
    seen = []
    derive = tp._decode_on_pages

    def spy(module, query, key, value, kwargs, cache, cu_q, cu_k, *rest):
        call = derive(module, query, key, value, kwargs, cache, cu_q, cu_k, *rest)
        if call is not None:
            group, _ = cache.layer_index_to_group_indices[module.layer_idx]
            seen.append((call.block_table.clone(), cu_k.clone(),
                         kwargs["read_index"][group].clone(), cache.block_size))
        return call
    monkeypatch.setattr(tp, "_decode_on_pages", spy)
    generate(tiny(), "paged|ptxattn")
    assert seen, "no decode step ran on the pages"
    for table, cu_k, read, block in seen:
        for b in range(cu_k.numel() - 1):
            k0, n = int(cu_k[b]), int(cu_k[b + 1] - cu_k[b])
            walked = [int(table[b, j // block]) * block + j % block for j in range(n)]
            assert walked == read[k0:k0 + n].tolist(), f"sequence {b}"


@pytest.mark.parametrize("kind,extra,windows", [
    ("mistral", dict(sliding_window=8), {(7, 0)}),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
     {(-1, -1), (7, 0)}),                       # hybrid: a full layer and a sliding one
], ids=["mistral", "qwen2_hybrid"])
def test_sliding_window_layers_get_their_window_and_their_keys(recorded, kind, extra,
                                                                windows):
    model = tiny(kind, **extra)
    expect = generate(model, sdpa_cb_name())
    got = generate(model, "paged|ptxattn")
    assert pt.fallback_counts() == {}
    varlen = [c for c in recorded.calls if isinstance(c, tp.Varlen)]
    assert {c.window for c in varlen} == windows
    for call in recorded.calls:
        if isinstance(call, tp.Paged):            # 5.17's decode steps of a full layer
            assert (-1, -1) in windows
            check_paged_fields(call, 64 ** -0.5)
            continue
        check_call_fields(call, 64 ** -0.5, call.window)
        if call.window != (-1, -1):       # a sliding layer's keys: at most window - 1 past
            assert bool((call.cu_k.diff() - call.cu_q.diff() <= 7).all())
    assert got == expect


@pytest.mark.parametrize("dtype,head_dim,reason", [
    (torch.float32, 64, "dtype"), (BF, 32, "head_dim")])
def test_calls_the_kernels_lack_fall_back_counted(recorded, dtype, head_dim, reason):
    model = tiny(dtype=dtype, head_dim=head_dim)
    expect = generate(model, sdpa_cb_name())
    got = generate(model, "paged|ptxattn")
    assert recorded.calls == [] and pt.packed_call_counts() == {}
    counts = pt.fallback_counts()
    assert set(counts) == {reason} and counts[reason] % 2 == 0 and counts[reason] > 0
    assert got == expect


def test_cpu_tensors_fall_back_with_reason_cpu(cpu_cb):
    model = tiny()
    expect = generate(model, sdpa_cb_name())
    with pytest.warns(RuntimeWarning, match="reason 'cpu'"):
        got = generate(model, "paged|ptxattn")
    assert set(pt.fallback_counts()) == {"cpu"} and pt.packed_call_counts() == {}
    assert got == expect


# --------------------------------------------------------------------------- translation

class Module(torch.nn.Module):
    def __init__(self, sliding_window=None, layer_idx=0):
        super().__init__()
        self.is_causal, self.layer_idx = True, layer_idx
        if sliding_window is not None:
            self.sliding_window = sliding_window


def packed_inputs(gen, lens_q, lens_k, H=4, Hkv=2, D=64, dtype=BF):
    """query (1, H, Tq, D) as transformers makes it (a transpose of (1, Tq, H, D)), the
    gathered key/value (1, Hkv, Tk, D), offsets."""
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(1, tq, H, D, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(1, tk, Hkv, D, generator=gen).to(dtype).transpose(1, 2)
    v = torch.randn(1, tk, Hkv, D, generator=gen).to(dtype).transpose(1, 2)
    return q, k, v, pc.offsets(lens_q), pc.offsets(lens_k)


def test_a_524_call_is_translated_in_place(recorded):
    """5.24: keys already gathered; cu_seq_lens_k this layer's; max_length_q/k."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, cu_q, cu_k = packed_inputs(gen, (3, 0, 9, 1), (20, 5, 9, 40))
    out, weights = tp.paged_attention_forward(
        Module(), q, k, v, None, scaling=0.125, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k,
        max_length_q=9, max_length_k=40, is_causal=True)
    (call,) = recorded.calls
    assert weights is None and out.shape == (1, 13, 4, 64)
    assert call.q.data_ptr() == q.data_ptr() and call.k.data_ptr() == k.data_ptr(), \
        "q and k are read in place, not copied"
    assert (call.max_q, call.max_k, call.scale, call.window) == (9, 40, 0.125, (-1, -1))
    expect = pc.varlen_reference(call.q, call.k, call.v, cu_q, cu_k, scale=0.125)
    pc.check_packed(out[0], expect, cu_q, "5.24 call")


class FakeCache:
    """transformers 5.17's PagedAttentionCache as the attention function sees it: update()
    with read/write indices, and the block-table fields."""

    def __init__(self, gen, pages, page, Hkv, D, groups=1):
        self.block_size, self.num_key_value_heads, self.head_dim = page, Hkv, D
        self.key_cache = [torch.randn(pages * page, Hkv, D, generator=gen).to(BF)
                          for _ in range(groups)]
        self.value_cache = [torch.randn(pages * page, Hkv, D, generator=gen).to(BF)
                            for _ in range(groups)]
        self.layer_index_to_group_indices = {0: (0, 0), 1: (1, 0)}
        self.updates = []

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        self.updates.append(layer_idx)
        group, _ = self.layer_index_to_group_indices[layer_idx]
        kc, vc = self.key_cache[0], self.value_cache[0]
        keys, values = key_states.transpose(1, 2)[0], value_states.transpose(1, 2)[0]
        kc.index_copy_(0, write_index[group], keys)
        vc.index_copy_(0, write_index[group], values)
        if read_index[group].numel() == 0:         # write-only: the new keys are all
            return keys, values
        return kc.index_select(0, read_index[group]), vc.index_select(0, read_index[group])


def test_a_517_call_updates_the_cache_and_reads_its_layer_type(recorded):
    """5.17: the function writes the new keys and gathers the sequences' (cache.update, the
    call flash_paged makes), and picks its layer type's offsets from the dicts."""
    gen = torch.Generator().manual_seed(4)
    cache = FakeCache(gen, pages=8, page=16, Hkv=2, D=64)
    lens_q, past = (2, 5), (10, 0)
    q, k, v, cu_q, _ = packed_inputs(gen, lens_q, lens_q)
    write = torch.tensor([10, 11, 40, 41, 42, 43, 44])         # after sequence 0's 10 keys
    read = torch.tensor(list(range(12)) + [40, 41, 42, 43, 44])
    sliding = torch.tensor([0, 7, 12], dtype=torch.int32)       # a sliding layer's offsets
    full = pc.offsets([p + n for p, n in zip(past, lens_q)])
    out, _ = tp.paged_attention_forward(
        Module(), q, k, v, None, scaling=0.125, cache=cache, cu_seq_lens_q=cu_q,
        cu_seq_lens_k={"full_attention": full, "sliding_attention": sliding},
        max_seqlen_q=5, max_seqlen_k={"full_attention": 12, "sliding_attention": 7},
        read_index=[read], write_index=[write], block_table=None)
    (call,) = recorded.calls
    assert cache.updates == [0]
    assert torch.equal(call.cu_k, full) and call.max_k == 12
    assert torch.equal(call.k[10:12], k.transpose(1, 2)[0, :2]), "new keys gathered after past"
    expect = pc.varlen_reference(call.q, call.k, call.v, cu_q, full, scale=0.125)
    pc.check_packed(out[0], expect, cu_q, "5.17 call")
    recorded.calls.clear()
    tp.paged_attention_forward(
        Module(sliding_window=8), q, k, v, None, cache=cache, cu_seq_lens_q=cu_q,
        cu_seq_lens_k={"full_attention": full, "sliding_attention": sliding},
        max_seqlen_q=5, max_seqlen_k={"full_attention": 12, "sliding_attention": 7},
        read_index=[read[:12]], write_index=[write], block_table=None)
    (call,) = recorded.calls
    assert torch.equal(call.cu_k, sliding) and call.max_k == 7 and call.window == (7, 0)


def allocator_indices(table, lengths, block):
    """read_index as transformers 5.17's FullAttentionCacheAllocator builds it: each
    sequence's positions block * block_size + offset, page by page."""
    read = []
    for row, n in zip(table.tolist(), lengths):
        read += [row[j // block] * block + j % block for j in range(n)]
    return torch.tensor(read, dtype=torch.int64)


def test_a_517_decode_step_runs_on_the_pages(recorded):
    """5.17, one query a sequence, full attention: the new keys written at write_index, the
    block table read off read_index, the decode kernel on the pages (no gather)."""
    gen = torch.Generator().manual_seed(12)
    page, pages = 16, 12
    cache = FakeCache(gen, pages, page, Hkv=2, D=64)
    cache.sliding_windows = {0: 1}
    past = (37, 0, 16)
    lengths = [n + 1 for n in past]
    table = pc.random_pages(gen, 3, lengths, page, pages, 4)
    read = allocator_indices(table, lengths, page)
    write = torch.tensor([int(table[b, n // page]) * page + n % page
                          for b, n in enumerate(past)])
    q, k, v = decode_inputs(gen, 3)
    cu_k = pc.offsets(lengths)
    out, _ = tp.paged_attention_forward(
        Module(), q, k, v, None, scaling=0.125, cache=cache, cu_seq_lens_q=pc.offsets([1] * 3),
        cu_seq_lens_k=cu_k, max_seqlen_q=1, max_seqlen_k=max(lengths), read_index=[read],
        write_index=[write], block_table=None)
    (call,) = recorded.calls
    assert isinstance(call, tp.Paged) and call.k is None, "no append: written already"
    assert cache.updates == [], "no gather"
    assert call.cache_seqlens.tolist() == lengths
    reached = [-(-n // page) for n in lengths]
    for b in range(3):
        assert call.block_table[b, :reached[b]].tolist() == table[b, :reached[b]].tolist()
        # past a sequence's last page (never read): some page of the cache
        assert ((call.block_table[b, reached[b]:] >= 0)
                & (call.block_table[b, reached[b]:] < pages)).all()
    kc = cache.key_cache[0]
    for b in range(3):
        assert torch.equal(kc[int(write[b])], k[0, :, b]), f"sequence {b}'s new key"
    gathered = kc.index_select(0, read), cache.value_cache[0].index_select(0, read)
    expect = pc.varlen_reference(q[0].transpose(0, 1), *gathered, pc.offsets([1] * 3), cu_k,
                                 scale=0.125)
    pc.check_packed(out[0], expect, pc.offsets([1] * 3), "5.17 decode on the pages")


@pytest.mark.parametrize("case", ["prefill", "sliding", "padded", "no_past"])
def test_other_517_steps_gather_as_transformers_does(recorded, case):
    gen = torch.Generator().manual_seed(13)
    cache = FakeCache(gen, 12, 16, Hkv=2, D=64)
    cache.sliding_windows = {0: 8 if case == "sliding" else 1}
    lengths = [5, 20]
    table = pc.random_pages(gen, 2, lengths, 16, 12, 4)
    read = allocator_indices(table, lengths, 16)
    q, k, v = decode_inputs(gen, 2)
    write = torch.tensor([int(read[4]), int(read[-1])])
    kw = dict(cu_seq_lens_q=pc.offsets([1, 1]), cu_seq_lens_k=pc.offsets(lengths),
              max_seqlen_q=1, max_seqlen_k=20, read_index=[read], write_index=[write])
    if case == "prefill":
        kw["max_seqlen_q"] = 2                   # another step's query lengths
    elif case == "padded":
        q, k, v = decode_inputs(gen, 3)           # a padded row beyond the sequences
        kw["write_index"] = [torch.cat([write, torch.tensor([191])])]
    elif case == "no_past":                       # two fresh one-token prompts: write-only
        kw.update(read_index=[read[:0]], cu_seq_lens_k=pc.offsets([1, 1]), max_seqlen_k=1)
    module = Module(sliding_window=8) if case == "sliding" else Module()
    tp.paged_attention_forward(module, q, k, v, None, cache=cache, block_table=None, **kw)
    (call,) = recorded.calls
    assert isinstance(call, tp.Varlen), case


def decode_inputs(gen, batch, H=4, Hkv=2, D=64):
    """One new token a sequence: query (1, H, B, D), key/value (1, Hkv, B, D)."""
    q = torch.randn(1, batch, H, D, generator=gen).to(BF).transpose(1, 2)
    k = torch.randn(1, batch, Hkv, D, generator=gen).to(BF).transpose(1, 2)
    v = torch.randn(1, batch, Hkv, D, generator=gen).to(BF).transpose(1, 2)
    return q, k, v


@pytest.mark.parametrize("contract", ["5.17", "5.24"])
def test_a_block_table_call_appends_into_the_pages(recorded, contract):
    gen = torch.Generator().manual_seed(5)
    lengths = (37, 1, 16)                  # cached keys before the new token
    page, pages, max_pages = 16, 12, 4
    cache = FakeCache(gen, pages, page, Hkv=2, D=64, groups=2)
    table = pc.random_pages(gen, 3, [n + 1 for n in lengths], page, pages, max_pages)
    tables = torch.stack([torch.full_like(table, -1), table])      # group 1 is this layer's
    cu_k = pc.offsets([n + 1 for n in lengths])
    q, k, v = decode_inputs(gen, 3)
    kc = cache.key_cache[0].view(pages, page, 2, 64)
    before = kc.clone()
    kw = dict(cu_seq_lens_q=pc.offsets([1, 1, 1]), cu_seq_lens_k=cu_k, scaling=0.125)
    if contract == "5.17":
        out, _ = tp.paged_attention_forward(Module(layer_idx=1), q, k, v, None, cache=cache,
                                            block_table=tables, max_seqlen_q=1,
                                            max_seqlen_k=1, **kw)
    else:
        out, _ = tp.paged_attention_forward(Module(layer_idx=1), q, k, v, None,
                                            block_table=table, max_length_q=1, max_length_k=1,
                                            k_cache=kc, v_cache=cache.value_cache[0].view(
                                                pages, page, 2, 64), **kw)
    (call,) = recorded.calls
    assert isinstance(call, tp.Paged) and call.q.shape == (3, 1, 4, 64)
    assert call.cache_seqlens.tolist() == list(lengths) and torch.equal(call.block_table, table)
    assert call.k_cache.data_ptr() == cache.key_cache[0].data_ptr(), "the pages themselves"
    assert out.shape == (1, 3, 4, 64)
    for b, n in enumerate(lengths):                       # the new key at position n
        where = (int(table[b, n // page]), n % page)
        assert torch.equal(kc[where], k[0, :, b]), f"sequence {b}'s new key"
    changed = (kc != before).any(dim=-1).any(dim=-1).nonzero().tolist()
    assert len(changed) == 3, f"only the three new positions change, got {changed}"


# --------------------------------------------------------------------------- fallbacks

def direct(monkeypatch, **kw):
    """One 5.24-style call with the device accepted and the kernels recorded."""
    rec = Recorded()
    monkeypatch.setattr(sdpa, "_device_reason", lambda q, k, v: None)
    monkeypatch.setattr(tp, "_varlen_kernel", rec.varlen)
    gen = torch.Generator().manual_seed(6)
    q, k, v, cu_q, cu_k = packed_inputs(gen, (4, 9), (10, 9), dtype=kw.pop("dtype", BF))
    if kw.pop("grad", False):
        q.requires_grad_(True)
    pt.reset_fallback_counts()
    out, _ = tp.paged_attention_forward(Module(), q, k, v, kw.pop("mask", None),
                                        cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k,
                                        max_length_q=9, max_length_k=10, **kw)
    return rec, out, (q, k, v, cu_q, cu_k)


@pytest.mark.parametrize("feature", ["softcap", "s_aux"])
def test_softcap_and_sinks_run_on_the_reference(monkeypatch, feature):
    value = 5.0 if feature == "softcap" else torch.tensor([0.5, -1.0, 2.0, 0.0])
    with pytest.warns(RuntimeWarning, match="model_features"):
        rec, out, (q, k, v, cu_q, cu_k) = direct(monkeypatch, **{feature: value})
    assert rec.calls == [] and pt.fallback_counts() == {"model_features": 1}
    expect = pc.varlen_reference(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                 v[0].transpose(0, 1), cu_q, cu_k,
                                 softcap=value if feature == "softcap" else None,
                                 sinks=value if feature == "s_aux" else None)
    pc.check_packed(out[0], expect, cu_q, f"{feature} fallback")
    plain = pc.varlen_reference(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                v[0].transpose(0, 1), cu_q, cu_k)
    assert (expect - plain).abs().max() > 1e-2, "the feature changes the answer"


def test_grad_dropout_and_masks_fall_back(monkeypatch):
    with pytest.warns(RuntimeWarning):
        rec, out, _ = direct(monkeypatch, grad=True)
    assert pt.fallback_counts() == {"grad": 1} and out.requires_grad
    out.float().sum().backward()                          # the reference is differentiable
    torch.manual_seed(0)
    _, dropped, inputs = direct(monkeypatch, dropout=0.5)
    assert pt.fallback_counts() == {"dropout": 1}
    plain = pr.varlen_attention(*(x[0].transpose(0, 1) for x in inputs[:3]), *inputs[3:])
    assert (dropped[0] - plain).abs().max() > 0.1, "dropout is applied, not ignored"
    mask = torch.zeros(1, 1, 13, 19, dtype=torch.bool)     # an explicit mask wins
    mask[..., :, 0] = True
    rec, out, (q, k, v, cu_q, cu_k) = direct(monkeypatch, mask=mask)
    assert pt.fallback_counts() == {"attn_mask": 1} and rec.calls == []
    first = v[0, :, 0]                                     # (Hkv, D): key 0
    for h in range(4):                                     # every query sees key 0 only
        assert torch.allclose(out[0, :, h].float(), first[h // 2].float().expand(13, 64))


def test_a_page_size_the_kernel_lacks_runs_on_the_reference(monkeypatch):
    rec = Recorded()
    monkeypatch.setattr(sdpa, "_device_reason", lambda q, k, v: None)
    monkeypatch.setattr(tp, "_paged_kernel", rec.paged)
    gen = torch.Generator().manual_seed(7)
    page, pages = 8, 10
    kc = torch.randn(pages, page, 2, 64, generator=gen).to(BF)
    vc = torch.randn(pages, page, 2, 64, generator=gen).to(BF)
    lengths = (12, 3)
    table = pc.random_pages(gen, 2, [n + 1 for n in lengths], page, pages, 3)
    q, k, v = decode_inputs(gen, 2)
    pt.reset_fallback_counts()
    with pytest.warns(RuntimeWarning, match="page_size"):
        out, _ = tp.paged_attention_forward(
            Module(), q, k, v, None, cu_seq_lens_q=pc.offsets([1, 1]),
            cu_seq_lens_k=pc.offsets([n + 1 for n in lengths]), block_table=table,
            k_cache=kc, v_cache=vc, max_length_q=1, max_length_k=1)
    assert rec.calls == [] and pt.fallback_counts() == {"page_size": 1}
    call = tp.Paged(q=q.permute(2, 0, 1, 3), k_cache=kc.clone(), v_cache=vc.clone(),
                    k=k.permute(2, 0, 1, 3), v=v.permute(2, 0, 1, 3),
                    cache_seqlens=torch.tensor(lengths, dtype=torch.int32), block_table=table,
                    causal=True, window=(-1, -1), scale=64 ** -0.5)
    expect = paged_independent(call)              # on copies of the caches before the call
    pc.check_packed(out[0], expect.reshape(2, 4, 64), pc.offsets([1, 1]), "page size 8")


# --------------------------------------------------------------------------- the reference

@pytest.mark.parametrize("lens_q,lens_k,causal,window,H,Hkv", [
    ((0, 1, 7, 13), (3, 1, 20, 13), True, (-1, -1), 4, 2),
    ((5, 9), (5, 30), True, (6, 0), 4, 1),
    ((6, 2), (11, 2), False, (3, 2), 2, 2),
    ((4,), (0,), True, (-1, -1), 2, 1),                    # no key: output 0
])
def test_the_varlen_reference_matches_the_loops(lens_q, lens_k, causal, window, H, Hkv):
    gen = torch.Generator().manual_seed(sum(lens_q) + sum(lens_k))
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq + 3, H, 64, generator=gen)          # 3 padding rows past cu_q[-1]
    k, v = (torch.randn(tk + 2, Hkv, 64, generator=gen) for _ in range(2))
    k[tk:], v[tk:] = float("nan"), float("nan")             # rows past cu_k[-1]: garbage
    cu_q, cu_k = pc.offsets(lens_q), pc.offsets(lens_k)
    got = pr.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, window=window)
    expect = pc.varlen_reference(q, k, v, cu_q, cu_k, causal=causal, window=window)
    torch.testing.assert_close(got.double(), expect, rtol=1e-4, atol=1e-5)
    assert (got[tq:] == 0).all(), "padding rows"


def poison_unreached(cache, table, reach):
    """NaN in every page slot no sequence reaches (what a cache from torch.empty may hold)."""
    page = cache.shape[1]
    keep = torch.zeros(cache.shape[:2], dtype=torch.bool)
    for row, n in zip(table.tolist(), reach):
        for j in range(n):
            keep[row[j // page], j % page] = True
    cache[~keep] = float("nan")


def test_the_paged_reference_matches_the_loops():
    gen = torch.Generator().manual_seed(8)
    page, pages = 16, 9
    kc, vc = (torch.randn(pages, page, 2, 64, generator=gen) for _ in range(2))
    lengths = (30, 0, 16)
    table = pc.random_pages(gen, 3, [n + 2 for n in lengths], page, pages, 3)
    for cache in (kc, vc):
        poison_unreached(cache, table, [n + 2 for n in lengths])
    q = torch.randn(3, 2, 4, 64, generator=gen)
    k, v = (torch.randn(3, 2, 2, 64, generator=gen) for _ in range(2))
    call = tp.Paged(q=q, k_cache=kc.clone(), v_cache=vc.clone(), k=k, v=v,
                    cache_seqlens=torch.tensor(lengths, dtype=torch.int32), block_table=table,
                    causal=True, window=(9, 0), scale=0.1)
    expect = paged_independent(call)
    got = pr.paged_attention(q, kc, vc, k, v, call.cache_seqlens, table, causal=True,
                             window=(9, 0), scale=0.1)
    assert torch.isfinite(got).all(), "a NaN in a slot no query sees leaked in"
    torch.testing.assert_close(got.double(), expect, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(kc, call.k_cache, equal_nan=True)      # the same appends
    torch.testing.assert_close(vc, call.v_cache, equal_nan=True)


# --------------------------------------------------------------------------- the emulator

def _to_device(t):
    """An emulated device copy of t with t's strides (its memory order kept: a transposed
    view stays transposed, as the kernels see transformers' tensors)."""
    from ml_dtypes import bfloat16
    from ptxattn import tensors
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))   # outermost first
    dense = t.permute(order).contiguous()
    dev = tensors.from_numpy(dense.view(torch.int16).numpy().view(bfloat16))
    strides = [0] * t.dim()
    for position, d in enumerate(order):
        strides[d] = dense.stride(position)
    return tensors.DeviceArray(dev.ptr, tuple(t.shape), tuple(strides), device=dev.device,
                               owner=dev)


def _from_device(arr):
    return torch.from_numpy(np.ascontiguousarray(arr.to_numpy()).view(np.int16)).view(BF)


def _emulated_varlen(call):
    import ptxattn
    from decode_checks import DeviceInt32
    out = ptxattn.flash_attn_varlen_func(
        *(_to_device(t) for t in (call.q, call.k, call.v)), DeviceInt32(call.cu_q.numpy()),
        DeviceInt32(call.cu_k.numpy()), call.max_q, call.max_k, causal=call.causal,
        window_size=call.window, softmax_scale=call.scale)
    return _from_device(out)


def _emulated_paged(call):
    import ptxattn
    from decode_checks import DeviceInt32
    kc, vc = _to_device(call.k_cache), _to_device(call.v_cache)
    out = ptxattn.flash_attn_with_kvcache(
        _to_device(call.q), kc, vc, k=_to_device(call.k), v=_to_device(call.v),
        cache_seqlens=DeviceInt32(call.cache_seqlens.numpy()), causal=call.causal,
        window_size=call.window, softmax_scale=call.scale,
        block_table=DeviceInt32(call.block_table.numpy()))
    call.k_cache.copy_(_from_device(kc))                   # the appends, back in the pages
    call.v_cache.copy_(_from_device(vc))
    return _from_device(out)


@pytest.mark.parametrize("layout", ["projection", "heads_outermost"])
def test_emulator_runs_a_translated_chunked_prefill(emulated_gpu, monkeypatch, layout):
    """q, k, v as views: the projection's transpose, or (1, heads, S, D) contiguous (what
    RoPE's arithmetic may leave), read in place by the kernels either way."""
    pytest.importorskip("ptxattn.tools.emulator")
    monkeypatch.setattr(sdpa, "_device_reason", lambda q, k, v: None)
    monkeypatch.setattr(tp, "_varlen_kernel", _emulated_varlen)
    gen = torch.Generator().manual_seed(9)
    lens_q, lens_k = (3, 70, 1), (40, 70, 129)
    q, k, v, cu_q, cu_k = packed_inputs(gen, lens_q, lens_k, H=2, Hkv=1)
    if layout == "heads_outermost":
        q, k, v = (x.contiguous() for x in (q, k, v))
    pt.reset_fallback_counts()
    out, _ = tp.paged_attention_forward(Module(sliding_window=50), q, k, v, None,
                                        scaling=0.11, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k,
                                        max_length_q=70, max_length_k=129, is_causal=True)
    assert pt.fallback_counts() == {} and pt.packed_call_counts() == {"varlen": 1}
    expect = pc.varlen_reference(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                 v[0].transpose(0, 1), cu_q, cu_k, window=(49, 0), scale=0.11)
    pc.check_packed(out[0], expect, cu_q, "emulator, chunked prefill with a window")


def test_emulator_runs_a_translated_block_table_decode(emulated_gpu, monkeypatch):
    pytest.importorskip("ptxattn.tools.emulator")
    monkeypatch.setattr(sdpa, "_device_reason", lambda q, k, v: None)
    monkeypatch.setattr(tp, "_paged_kernel", _emulated_paged)
    gen = torch.Generator().manual_seed(10)
    page, pages, lengths = 16, 8, (20, 37)
    kc, vc = (torch.randn(pages, page, 2, 64, generator=gen).to(BF) for _ in range(2))
    table = pc.random_pages(gen, 2, [n + 1 for n in lengths], page, pages, 4)
    q, k, v = decode_inputs(gen, 2)
    expect_call = tp.Paged(q=q.permute(2, 0, 1, 3), k_cache=kc.clone(), v_cache=vc.clone(),
                           k=k.permute(2, 0, 1, 3), v=v.permute(2, 0, 1, 3),
                           cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                           block_table=table, causal=True, window=(-1, -1), scale=0.125)
    expect = paged_independent(expect_call)
    pt.reset_fallback_counts()
    out, _ = tp.paged_attention_forward(
        Module(), q, k, v, None, scaling=0.125, cu_seq_lens_q=pc.offsets([1, 1]),
        cu_seq_lens_k=pc.offsets([n + 1 for n in lengths]), block_table=table, k_cache=kc,
        v_cache=vc, max_length_q=1, max_length_k=1)
    assert pt.fallback_counts() == {} and pt.packed_call_counts() == {"paged": 1}
    pc.check_packed(out[0], expect.reshape(2, 4, 64), pc.offsets([1, 1]), "emulator paged")
    assert torch.equal(kc, expect_call.k_cache) and torch.equal(vc, expect_call.v_cache), \
        "the kernel's appends land where the loops put them"


def test_emulator_a_plan_follows_rewritten_device_offsets(emulated_gpu):
    """The per-step plan cache reuses a PrefillPlan built from device offsets when a later
    step's offsets tensors (the same addresses) hold other values of the same totals."""
    pytest.importorskip("ptxattn.tools.emulator")
    import ptxattn
    from decode_checks import DeviceInt32
    from ptxattn import tensors
    from varlen_checks import check_varlen, varlen_case
    rng = np.random.default_rng(24)
    first = varlen_case(rng, (70, 129), (200, 129), H=2, Hkv=1, D=64)
    second = varlen_case(rng, (129, 1, 69), (100, 1, 228), H=2, Hkv=1, D=64)
    cu_q, cu_k = DeviceInt32(np.zeros(4, np.int32)), DeviceInt32(np.zeros(4, np.int32))
    cu_q.set(np.append(first["cu_q"], 199))            # three offsets' slots: a plateau
    cu_k.set(np.append(first["cu_k"], 329))
    plan = ptxattn.plan_varlen(cu_q, cu_k, heads=2, heads_kv=1, head_dim=64, total_q=199,
                               total_k=329, causal=True)
    for case, what in ((first, "first step"), (second, "offsets rewritten")):
        if case is second:
            cu_q.set(case["cu_q"])
            cu_k.set(case["cu_k"])
        out = plan.run(*(tensors.from_numpy(case[n]) for n in ("q", "k", "v")))
        check_varlen(case, out.to_numpy().astype(np.float32), None, causal=True,
                     window=(-1, -1), what=f"plan, {what}")


# --------------------------------------------------------------------------- the benchmark

def test_cb_bench_runs_tiny_on_the_cpu(recorded, tmp_path, capsys, monkeypatch):
    """bench/models/cb_bench.py end to end on a tiny config: both backends timed, the JSON
    written with the versions, every ptxattn call on the (stand-in) kernels (the torch
    reference here: the loops are slow and this test checks the plumbing)."""
    import json

    def fast(call):
        recorded.calls.append(call)
        return pr.varlen_attention(call.q, call.k, call.v, call.cu_q, call.cu_k,
                                   causal=call.causal, window=call.window, scale=call.scale)
    monkeypatch.setattr(tp, "_varlen_kernel", fast)
    original = tp.paged_attention_forward
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "models"))
    import cb_bench
    rc = cb_bench.main(["--tiny", "--device", "cpu", "--rounds", "1", "--requests", "6",
                        "--out", str(tmp_path)])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 0 and line.startswith("cb_bench: transformers"), line
    (path,) = tmp_path.glob("cb-bench-tiny-*.json")
    report = json.loads(path.read_text())
    assert report["transformers"] == transformers.__version__
    assert set(report["results"]) == {"paged|ptxattn", sdpa_cb_name()}
    assert report["ptxattn_fallbacks"] == {} and report["ptxattn_kernel_calls"]["varlen"] > 0
    for kind, n in report["ptxattn_kernel_calls"].items():
        assert report["ptxattn_host_us"][kind]["calls"] == n, kind
    assert len(report["prompt_lengths"]) == 6
    for r in report["results"].values():
        assert r["tokens_per_s"] > 0 and r["ttft_median_s"] > 0
    assert tp._varlen_kernel is fast and tp._paged_kernel == recorded.paged, \
        "the seams are the test's"
    from transformers import AttentionInterface
    assert tp.paged_attention_forward is original, "the host timer put the function back"
    assert AttentionInterface._global_mapping[tp.NAME] is original


@pytest.mark.parametrize("argv,word", [(["--rounds", "0"], "--rounds"),
                                       (["--min-prompt", "9", "--max-prompt", "3"],
                                        "--min-prompt")])
def test_cb_bench_refuses_bad_arguments(argv, word, capsys):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "models"))
    import cb_bench
    with pytest.raises(SystemExit):
        cb_bench.main(argv)
    assert word in capsys.readouterr().err

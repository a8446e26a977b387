"""Host time per layer call of the transformers integration (attn_implementation
"paged|ptxattn": ptxattn/torch/transformers_paged.py), with the arguments transformers passes;
serving_bench.py's part "integration".

A case is one forward: LAYERS calls of the attention function with one step's kwargs (the
same offsets tensors, tables and lengths for every layer, as transformers hands them), each
layer with its own q, k, v (four sets, rotating) and, where the contract has them, its own
caches. The figure is host µs per layer call with the GPU kept busy (callpath.host_us: a
long kernel queued first, the calls timed with perf_counter, median over repeats), i.e. what
a layer's attention call costs transformers' host thread, transformers' own tensor ops that
happen inside the call (5.17's cache writes and gathers) included.

  prefill_524        a 5.24 prefill step: 8 sequences x 128 new tokens, some with a past
                     (the keys gathered by transformers before the call), through
                     transformers_backend.ptxattn_attention_forward ("ptxattn"): varlen
  decode_524         a 5.24 decode step: 64 sequences x 1 query, 600 keys each, gathered: varlen
  prefill_517        a 5.17 prefill step (the same tokens): its cache (a stand-in for
                     PagedAttentionCache, update() = 2 index_copy_ + 2 index_select, what
                     5.17's does) written and gathered inside the call: varlen
  decode_517_pages   a 5.17 decode step of 64 sequences on the cache's pages (page 256): the
                     new keys written, the block table read off read_index, the paged decode
  decode_block_table a decode step with a block table and k_cache / v_cache (what
                     transformers hands flash implementations): the paged decode, appending

Geometry: Llama-3-8B's attention (32:8 heads, D 128) on the GPU; with --fake (the pretend
driver, CPU tensors passing for CUDA ones) 4:1 heads, D 64 and 8 sequences, so that torch's
CPU arithmetic on the tensors stays small beside the host work (on a GPU it is a launch
whatever the size). Runs against whatever ptxattn is on sys.path first (PYTHONPATH at an
older tree's copy times that tree's integration with this file).
"""

from __future__ import annotations

import numpy as np

LAYERS = 32
FORWARDS = 2                       # per timed loop: 64 layer calls, <= ~900 launches queued


class StandInCache:
    """transformers 5.17's PagedAttentionCache as the attention function sees it (one layer
    group; a cache per layer): the fields transformers_paged reads, and update() as 5.17's
    (the new keys written at write_index, every sequence's keys gathered at read_index)."""

    def __init__(self, torch, pages, page, layers, hkv, d, device):
        self.block_size, self.num_key_value_heads, self.head_dim = page, hkv, d
        bf = torch.bfloat16
        self.key_cache = [torch.zeros(pages * page, hkv, d, dtype=bf, device=device)
                          for _ in range(layers)]
        self.value_cache = [torch.zeros(pages * page, hkv, d, dtype=bf, device=device)
                            for _ in range(layers)]
        self.layer_index_to_group_indices = {i: (0, i) for i in range(layers)}
        self.sliding_windows = {i: 1 for i in range(layers)}

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        group, i = self.layer_index_to_group_indices[layer_idx]
        kc, vc = self.key_cache[i], self.value_cache[i]
        kc.index_copy_(0, write_index[group], key_states.transpose(1, 2)[0])
        vc.index_copy_(0, write_index[group], value_states.transpose(1, 2)[0])
        return kc.index_select(0, read_index[group]), vc.index_select(0, read_index[group])


class Module:
    """What the attention function reads of transformers' attention module."""

    def __init__(self, layer_idx):
        self.is_causal, self.layer_idx = True, layer_idx


def geometry(fake: bool) -> dict:
    if fake:
        return dict(h=4, hkv=1, d=64, seqs=8, new=128, past=600, page=16)
    return dict(h=32, hkv=8, d=128, seqs=64, new=128, past=600, page=256)


def _offsets(torch, lengths, device):
    return torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device=device)


def _activations(torch, gen, rows, heads, d, device, sets=4):
    """(1, heads, rows, D) views of (1, rows, heads, D) projections, `sets` of them."""
    return [torch.randn(1, rows, heads, d, generator=gen, device=device)
            .to(torch.bfloat16).transpose(1, 2) for _ in range(sets)]


def _gathered(torch, gen, rows, heads, d, device, sets=4):
    """(1, heads, rows, D) as 5.24's allocator returns the gathered keys: (rows, heads, D)
    transposed and unsqueezed."""
    return [torch.randn(rows, heads, d, generator=gen, device=device).to(torch.bfloat16)
            .transpose(0, 1).unsqueeze(0) for _ in range(sets)]


def _prefill_lengths(g):
    news = [g["new"]] * 8
    pasts = [0, 0, 64, 0, 128, 0, 0, 32]
    return news, [n + p for n, p in zip(news, pasts)]


def cases(torch, device, fake: bool) -> dict:
    """{name: (forward, layer calls per forward)}."""
    from ptxattn.torch import transformers_backend as tb
    from ptxattn.torch import transformers_paged as tp
    g = geometry(fake)
    h, hkv, d = g["h"], g["hkv"], g["d"]
    gen = torch.Generator(device=device).manual_seed(0)
    scale = d ** -0.5
    mods = [Module(i) for i in range(LAYERS)]
    out = {}

    def forward_of(fn, qs, ks, vs, kwargs):
        def forward():
            for i, m in enumerate(mods):
                j = i % len(qs)
                fn(m, qs[j], ks[j], vs[j], None, dropout=0.0, scaling=scale, **kwargs)
        return forward

    # 5.24, varlen: the keys gathered by transformers, tensors per layer type resolved
    news, totals = _prefill_lengths(g)
    extra = dict(position_ids=torch.zeros(1, sum(news), dtype=torch.long, device=device),
                 read_index=[], write_index=[], block_table=None, use_cache=False)
    kw = dict(cu_seq_lens_q=_offsets(torch, news, device),
              cu_seq_lens_k=_offsets(torch, totals, device), max_length_q=max(news),
              max_length_k=max(totals), is_causal=True, **extra)
    out["prefill_524"] = forward_of(
        tb.ptxattn_attention_forward, _activations(torch, gen, sum(news), h, d, device),
        _gathered(torch, gen, sum(totals), hkv, d, device),
        _gathered(torch, gen, sum(totals), hkv, d, device), kw)
    b, past = g["seqs"], g["past"]
    kw = dict(cu_seq_lens_q=_offsets(torch, [1] * b, device),
              cu_seq_lens_k=_offsets(torch, [past + 1] * b, device), max_length_q=1,
              max_length_k=past + 1, is_causal=True, **extra)
    out["decode_524"] = forward_of(
        tb.ptxattn_attention_forward, _activations(torch, gen, b, h, d, device),
        _gathered(torch, gen, b * (past + 1), hkv, d, device),
        _gathered(torch, gen, b * (past + 1), hkv, d, device), kw)

    # 5.17: its cache in the call (written, gathered or read in place)
    page = g["page"]
    per = -(-(past + 1) // page)
    cache = StandInCache(torch, b * per + 4, page, LAYERS, hkv, d, device)
    table = torch.randperm(b * per, generator=torch.Generator().manual_seed(1)).reshape(b, per)
    positions = [int(table[s, j // page]) * page + j % page
                 for s in range(b) for j in range(past + 1)]
    read = torch.tensor(positions, dtype=torch.long, device=device)
    step = lambda n, lengths: dict(                                          # noqa: E731
        cache=cache, cu_seq_lens_q=_offsets(torch, n, device),
        cu_seq_lens_k={"full_attention": _offsets(torch, lengths, device)},
        max_seqlen_q=max(n), max_seqlen_k={"full_attention": max(lengths)},
        block_table=None)
    # prefill: 8 of the sequences, their last `new` keys new
    news, totals = [g["new"]] * 8, [past + 1] * 8
    mine = read[:8 * (past + 1)]
    write = mine.view(8, past + 1)[:, -g["new"]:].reshape(-1)
    out["prefill_517"] = forward_of(
        tp.paged_attention_forward, _activations(torch, gen, sum(news), h, d, device),
        _activations(torch, gen, sum(news), hkv, d, device),
        _activations(torch, gen, sum(news), hkv, d, device),
        dict(step(news, totals), read_index=[mine], write_index=[write.contiguous()]))
    write = read.view(b, past + 1)[:, -1].contiguous()
    out["decode_517_pages"] = forward_of(
        tp.paged_attention_forward, _activations(torch, gen, b, h, d, device),
        _activations(torch, gen, b, hkv, d, device), _activations(torch, gen, b, hkv, d, device),
        dict(step([1] * b, [past + 1] * b), read_index=[read], write_index=[write]))

    # a block table and the layer's caches (k_cache / v_cache, 5.24's names), appending
    pages = [c.view(-1, page, hkv, d) for c in cache.key_cache]
    vpages = [c.view(-1, page, hkv, d) for c in cache.value_cache]
    qs = _activations(torch, gen, b, h, d, device)
    ks, vs = (_activations(torch, gen, b, hkv, d, device) for _ in range(2))
    base = dict(cu_seq_lens_q=_offsets(torch, [1] * b, device),
                cu_seq_lens_k=_offsets(torch, [past + 1] * b, device), max_length_q=1,
                max_length_k=1, block_table=table.to(torch.int32).to(device))

    def block_table_forward():
        for i, m in enumerate(mods):
            j = i % len(qs)
            tp.paged_attention_forward(m, qs[j], ks[j], vs[j], None, dropout=0.0,
                                       scaling=scale, k_cache=pages[i], v_cache=vpages[i],
                                       **base)
    out["decode_block_table"] = block_table_forward
    return {name: (fn, LAYERS) for name, fn in out.items()}


def run(cb, torch, fake: bool, repeats: int, names=None) -> dict:
    """{case: host_us record per layer call, with the calls that ran on the kernels}."""
    from ptxattn.torch import fallback_counts, packed_call_counts, reset_fallback_counts
    from ptxattn.torch import transformers_paged as tp
    device = "cpu" if fake else "cuda"
    block = cb._blocker(fake, torch) if not fake else (lambda: None)
    results = {}
    for name, (forward, layers) in cases(torch, device, fake).items():
        if names and name not in names:
            continue
        tp.clear_plans()
        reset_fallback_counts()
        rec = cb.host_us(forward, FORWARDS, repeats, block, fake)
        for key in ("median_us", "min_us", "max_us", "cpu_median_us", "cpu_min_us"):
            rec[key] /= layers
        rec.update(layers=layers, forwards_per_loop=FORWARDS, per="layer call",
                   kernel_calls=dict(packed_call_counts()), fallbacks=dict(fallback_counts()))
        results[name] = rec
        fallbacks = f", fallbacks {rec['fallbacks']}" if rec["fallbacks"] else ""
        print(f"integration {name:20s} {rec['median_us']:8.1f} µs per layer call (cpu "
              f"{rec['cpu_median_us']:.1f}, min {rec['cpu_min_us']:.1f}); kernels "
              f"{rec['kernel_calls']}{fallbacks}", flush=True)
    tp.clear_plans()
    return results

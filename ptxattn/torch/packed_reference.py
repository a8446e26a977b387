"""Packed attention in plain torch: what the varlen and paged kernels compute, for the calls
they do not take (the fallback of attn_implementation="paged|ptxattn") and for the tests.

- `varlen_attention(q, k, v, cu_q, cu_k, ...)`: sequences packed end to end, q (Tq, H, D),
  k and v (Tk, Hkv, D), int32 offsets (B + 1); causal and windows bottom-right per sequence
  (query i of a sequence with Lq queries and Lk keys sees keys up to i + Lk - Lq), as
  flash_attn_varlen_func. Rows past cu_q[-1] (transformers' padding) come out 0.
- `paged_attention(q, k_cache, v_cache, k, v, cache_seqlens, block_table, ...)`: the new keys
  appended into the pages in place, then attention over each sequence's pages, as
  flash_attn_with_kvcache(block_table=...); lengths are clamped and bad page entries read as
  zero keys with their writes dropped, as the kernels do.
Both take dropout (on the probabilities, as SDPA's dropout_p: training calls).

Offsets and lengths are read on the device (searchsorted, gathers), so the plain case syncs
nowhere; the masks are boolean and torch's SDPA takes them (its memory-efficient kernel on
CUDA), with GQA through enable_gqa. What SDPA has no argument for (logit soft-capping,
attention sinks) goes through an explicit float32 softmax. Memory is that of a dense packed
call: a (Tq, Tk) mask, as transformers' own "paged|sdpa" builds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _sequence_of(cu: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, position in it) of each of n packed rows; rows past cu[-1] get
    sequence B (no sequence)."""
    rows = torch.arange(n, device=cu.device, dtype=torch.int64)
    cu = cu.to(torch.int64)
    seq = torch.searchsorted(cu[1:].contiguous(), rows, right=True)
    return seq, rows - cu[seq.clamp(max=cu.numel() - 2)]


def window_keep(pos_k: torch.Tensor, diag: torch.Tensor, causal: bool,
                window: tuple[int, int]) -> torch.Tensor:
    """Keys at positions pos_k (broadcast against diag, each query's diagonal) that a query
    sees: j <= diag when causal, diag - left <= j <= diag + right for a window (-1:
    unbounded)."""
    left, right = window
    keep = torch.ones(torch.broadcast_shapes(pos_k.shape, diag.shape), dtype=torch.bool,
                      device=pos_k.device)
    if causal:
        keep &= pos_k <= diag
    if left >= 0:
        keep &= pos_k >= diag - left
    if right >= 0 and not causal:
        keep &= pos_k <= diag + right
    return keep


def varlen_mask(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int,
                causal: bool, window: tuple[int, int]) -> torch.Tensor:
    """(Tq, Tk) bool: packed query row r sees packed key row c."""
    batch = cu_q.numel() - 1
    if batch < 1:
        return torch.zeros(total_q, total_k, dtype=torch.bool, device=cu_q.device)
    seq_q, i = _sequence_of(cu_q, total_q)
    seq_k, j = _sequence_of(cu_k, total_k)
    lens_q = (cu_q[1:] - cu_q[:-1]).to(torch.int64)
    lens_k = (cu_k[1:] - cu_k[:-1]).to(torch.int64)
    own = seq_q.clamp(max=batch - 1)
    diag = i + lens_k[own] - lens_q[own]
    same = (seq_q[:, None] == seq_k[None, :]) & (seq_q < batch)[:, None]
    return same & window_keep(j[None, :], diag[:, None], causal, window)


def _attend(q, k, v, keep, scale, softcap=None, sinks=None, dropout=0.0):
    """softmax(scale q k^T, masked by keep) v on (N, H, Lq, D) / (N, Hkv, Lk, D); keep
    broadcasts to (N, H, Lq, Lk). A query that sees no key gets 0. dropout: on the
    probabilities, as SDPA's dropout_p."""
    groups = q.shape[1] // k.shape[1]
    seen = keep.any(dim=-1, keepdim=True)
    # keys no query sees (past a sequence's length in its last page, padding rows) may hold
    # anything, NaN included, which a 0 weight would still carry into the output: zero them
    used = keep.any(dim=-2).any(dim=1)[:, None, :, None]                 # (N, 1, Lk, 1)
    zero = torch.zeros((), dtype=k.dtype, device=k.device)
    k, v = torch.where(used, k, zero), torch.where(used, v, zero)
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale,
                                             dropout_p=dropout, enable_gqa=groups > 1)
        return torch.where(seen, out, torch.zeros((), dtype=out.dtype, device=out.device))
    kh = k.repeat_interleave(groups, dim=1) if groups > 1 else k
    vh = v.repeat_interleave(groups, dim=1) if groups > 1 else v
    s = torch.matmul(q.float(), kh.float().transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:                        # one extra logit per head, then dropped
        sink = sinks.float().reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        s = torch.cat([s, sink], dim=-1)
    top = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isneginf(top), 0.0, top))
    p = p / p.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    if sinks is not None:
        p = p[..., :-1]
    if dropout:
        p = F.dropout(p, dropout)
    out = torch.matmul(p, vh.float()).to(q.dtype)
    return torch.where(seen, out, torch.zeros((), dtype=out.dtype, device=out.device))


def varlen_attention(q, k, v, cu_q, cu_k, *, causal: bool = True,
                     window: tuple[int, int] = (-1, -1), scale: float | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None,
                     mask: torch.Tensor | None = None, dropout: float = 0.0) -> torch.Tensor:
    """(Tq, H, D) in q's dtype. mask: an explicit (1, 1, Tq, Tk) mask (boolean keep, or
    additive) used instead of the offsets' (transformers' paged|sdpa contract)."""
    tq, h, d = q.shape
    tk = k.shape[0]
    scale = d ** -0.5 if scale is None else scale
    if mask is None:
        keep = varlen_mask(cu_q, cu_k, tq, tk, causal, window)[None, None]
    elif mask.dtype == torch.bool:
        keep = mask
    else:
        keep = mask > torch.finfo(mask.dtype).min / 2
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))     # (1, heads, rows, D)
    out = _attend(qh, kh, vh, keep, scale, softcap, sinks, dropout)
    return out[0].transpose(0, 1).contiguous()


def paged_attention(q, k_cache, v_cache, k, v, cache_seqlens, block_table, *,
                    causal: bool = True, window: tuple[int, int] = (-1, -1),
                    scale: float | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None, dropout: float = 0.0) -> torch.Tensor:
    """(B, Lq, H, D) in q's dtype: k, v (B, Lnew, Hkv, D) written into the pages at
    positions cache_seqlens[b] .. + Lnew - 1 (k_cache, v_cache (num_pages, page, Hkv, D)
    modified in place), then each query against its sequence's cache_seqlens[b] + Lnew keys.
    """
    batch, lq, h, d = q.shape
    num_pages, page = k_cache.shape[0], k_cache.shape[1]
    capacity = block_table.shape[1] * page
    scale = d ** -0.5 if scale is None else scale
    new = 0 if k is None else k.shape[1]
    lengths = cache_seqlens.to(torch.int64).clamp(0, max(capacity - new, 0))
    table = block_table.to(torch.int64)
    if new:
        pos = lengths[:, None] + torch.arange(new, device=q.device)         # (B, new)
        pages = table.gather(1, pos // page)
        ok = (pages >= 0) & (pages < num_pages)        # bad entries: the write is dropped
        rows = pages[ok], (pos % page)[ok]
        k_cache[rows] = k[ok].to(k_cache.dtype)
        v_cache[rows] = v[ok].to(v_cache.dtype)
    j = torch.arange(capacity, device=q.device)
    pages = table[:, j // page]                                          # (B, capacity)
    ok = (pages >= 0) & (pages < num_pages)
    safe = pages.clamp(0, num_pages - 1)
    zero = torch.zeros((), dtype=k_cache.dtype, device=k_cache.device)
    kk = torch.where(ok[..., None, None], k_cache[safe, j % page], zero)  # bad: zero keys
    vv = torch.where(ok[..., None, None], v_cache[safe, j % page], zero)
    total = lengths + new                                                # (B,)
    diag = total[:, None] - lq + torch.arange(lq, device=q.device)       # (B, Lq)
    keep = (j[None, None, :] < total[:, None, None]) & window_keep(
        j[None, None, :], diag[..., None], causal, window)              # (B, Lq, capacity)
    out = _attend(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), keep[:, None],
                  scale, softcap, sinks, dropout)
    return out.transpose(1, 2).contiguous()

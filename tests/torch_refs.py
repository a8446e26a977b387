"""Torch references for the kernels behind ptxattn.torch's ops, on CPU tensors (the tests' seam).

`install(monkeypatch)` puts them in place of ptxattn.torch._op.forward_kernel and
backward_kernel, so the ops, their autograd formula, their fakes and torch.compile run on the
CPU. They keep the kernels' contracts exactly, so that a wiring mistake shows:

- forward: (out in q's dtype, lse float32 (B, H, Lq)) in float64 arithmetic, or an empty
  LSE without return_lse; masks as ptxattn.attention's (causal/window, bottom-right or
  top-left diagonal), GQA by heads, a row that sees no key gives 0 and lse -inf;
- backward: the analytic gradients FROM the given out and lse (P = exp(scale s - lse),
  delta = rowsum(dout * out), dS = P (dP - delta)), as the kernels compute them; so a wrong
  saved tensor gives a wrong gradient, which the tests compare against autograd of torch's
  math attention.

Every call is recorded in `CALLS` (kind and arguments), for the tests that check what reached
the kernels.
"""

from __future__ import annotations

import torch

CALLS: list[dict] = []


def _bhld(x, layout):
    return x if layout == "bhld" else x.transpose(1, 2)


def keep_mask(lq: int, lk: int, causal: bool, window, diagonal: str):
    """(Lq, Lk) bool: key j is seen by query i (ptxattn.attention's mask convention)."""
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0
    offset = lk - lq if diagonal == "bottom_right" else 0
    i = torch.arange(lq)[:, None] + offset
    j = torch.arange(lk)[None, :]
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


def _scores(q, k, scale, causal, window, diagonal):
    """float64 (B, H, Lq, Lk) masked scores (k's heads repeated over each group)."""
    group = q.shape[1] // k.shape[1]
    kh = k.repeat_interleave(group, dim=1) if group > 1 else k
    s = torch.matmul(q, kh.transpose(-1, -2)) * scale
    if causal or window is not None:
        s = s.masked_fill(~keep_mask(s.shape[-2], s.shape[-1], causal, window, diagonal),
                          float("-inf"))
    return s


def forward(q, k, v, scale, layout, is_causal, window, diagonal, return_lse):
    CALLS.append(dict(kind="forward", q=tuple(q.shape), k=tuple(k.shape), scale=scale,
                      layout=layout, causal=is_causal, window=window, diagonal=diagonal,
                      return_lse=return_lse))
    qh, kh, vh = (_bhld(x, layout).double() for x in (q, k, v))
    s = _scores(qh, kh, scale, is_causal, window, diagonal)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    group = qh.shape[1] // vh.shape[1]
    out = torch.matmul(p, vh.repeat_interleave(group, dim=1) if group > 1 else vh)
    out = _bhld(out, layout).to(q.dtype).contiguous()
    if not return_lse:
        return out, q.new_empty((0,), dtype=torch.float32)
    return out, lse.float().contiguous()


def backward(q, k, v, out, lse, dout, scale, layout, is_causal, window, diagonal, deterministic):
    CALLS.append(dict(kind="backward", q=tuple(q.shape), k=tuple(k.shape), scale=scale,
                      layout=layout, causal=is_causal, window=window, diagonal=diagonal,
                      deterministic=deterministic, lse_shape=tuple(lse.shape)))
    qh, kh, vh, oh, doh = (_bhld(x, layout).double() for x in (q, k, v, out, dout))
    b, h, lq, d = qh.shape
    hk = kh.shape[1]
    group = h // hk
    s = _scores(qh, kh, scale, is_causal, window, diagonal)
    lse64 = lse.double()
    p = torch.where(torch.isneginf(lse64)[..., None], 0.0,
                    torch.exp(s - torch.where(torch.isneginf(lse64), 0.0, lse64)[..., None]))
    vr = vh.repeat_interleave(group, dim=1) if group > 1 else vh
    kr = kh.repeat_interleave(group, dim=1) if group > 1 else kh
    dp = torch.matmul(doh, vr.transpose(-1, -2))
    delta = (doh * oh).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = scale * torch.matmul(ds, kr)
    dk = (scale * torch.matmul(ds.transpose(-1, -2), qh)).reshape(b, hk, group, -1, d).sum(2)
    dv = torch.matmul(p.transpose(-1, -2), doh).reshape(b, hk, group, -1, d).sum(2)
    return tuple(_bhld(g, layout).to(x.dtype).contiguous() for g, x in ((dq, q), (dk, k), (dv, v)))


def install(monkeypatch):
    """The references in place of the ops' kernels for one test; CALLS cleared."""
    from ptxattn.torch import _op
    CALLS.clear()
    monkeypatch.setattr(_op, "forward_kernel", forward)
    monkeypatch.setattr(_op, "backward_kernel", backward)
    return CALLS


def math_attention(q, k, v, *, scale, layout="bhld", causal=False, window=None,
                   diagonal="bottom_right", dtype=torch.float64):
    """Differentiable math attention in `dtype` (autograd gives the yardstick gradients);
    returns (out, lse)."""
    qh, kh, vh = (_bhld(x, layout).to(dtype) for x in (q, k, v))
    s = _scores(qh, kh, scale, causal, window, diagonal)
    # rows that see no key: output 0, lse -inf, no gradient (softmax of a finite stand-in,
    # multiplied by 0, so autograd sees no NaN)
    empty = torch.isneginf(s).all(dim=-1, keepdim=True)
    s = torch.where(empty, 0.0, s)
    lse = torch.where(empty[..., 0], float("-inf"), torch.logsumexp(s, dim=-1))
    p = torch.softmax(s, dim=-1) * (~empty)
    group = qh.shape[1] // vh.shape[1]
    out = torch.matmul(p, vh.repeat_interleave(group, dim=1) if group > 1 else vh)
    return _bhld(out, layout), lse


def kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, causal=False,
            window_size=(-1, -1), softmax_scale=None, return_lse=False, num_splits=0, *,
            layout="bshd", out=None, lse_out=None, stream=None):
    """ptxattn.decode.flash_attn_with_kvcache in torch (CPU tensors): new k/v appended into the
    caches in place at each sequence's length, then attention of q over its L_b (+ new) keys,
    bottom-right causal/window. Recorded in CALLS."""
    CALLS.append(dict(kind="kvcache", q=tuple(q.shape), k_cache=tuple(k_cache.shape),
                      causal=causal, window=tuple(window_size), layout=layout,
                      seqlens=None if cache_seqlens is None else (
                          cache_seqlens.tolist() if isinstance(cache_seqlens, torch.Tensor)
                          else cache_seqlens)))
    qh, kc, vc = (_bhld_of_bshd(x, layout) for x in (q, k_cache, v_cache))
    b, h, lq, d = qh.shape
    lmax = kc.shape[2]
    if cache_seqlens is None:
        lengths = [lmax] * b
    elif isinstance(cache_seqlens, int):
        lengths = [cache_seqlens] * b
    else:
        lengths = [int(x) for x in cache_seqlens.tolist()]
    if k is not None:
        kn, vn = _bhld_of_bshd(k, layout), _bhld_of_bshd(v, layout)
        for i in range(b):
            n = kn.shape[2]
            kc[i, :, lengths[i]:lengths[i] + n] = kn[i]
            vc[i, :, lengths[i]:lengths[i] + n] = vn[i]
        lengths = [x + kn.shape[2] for x in lengths]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    outs, lses = [], []
    for i in range(b):
        window = None if tuple(window_size) == (-1, -1) else tuple(window_size)
        o, lse = forward(qh[i:i + 1], kc[i:i + 1, :, :lengths[i]], vc[i:i + 1, :, :lengths[i]],
                         scale, "bhld", causal, window, "bottom_right", True)
        CALLS.pop()                     # the inner forward is not a call of its own
        outs.append(o)
        lses.append(lse)
    o = torch.cat(outs)
    o = o if layout == "bhld" else o.transpose(1, 2).contiguous()
    lse = torch.cat(lses)
    return (o, lse) if return_lse else o


def _bhld_of_bshd(x, layout):
    return x if layout == "bhld" else x.transpose(1, 2)

"""NumPy float64 reference gradients of attention, the bar every backward kernel must meet.

For O = softmax(scale * Q K^T + mask) V and an upstream gradient dO (analytic, no autograd):

    P     = softmax(scale * Q K^T + mask)          (rows that see no key: P = 0)
    dV    = P^T dO
    dP    = dO V^T
    delta = rowsum(dO * O)                          (= rowsum(P * dP))
    dS    = P * (dP - delta)
    dQ    = scale * dS K
    dK    = scale * dS^T Q

computed on the bf16-rounded inputs (as the forward's reference: float32 -> bf16 with
ml_dtypes, float64 through float32 first), in float64, chunked over query rows so that a long
sequence never materialises a full score matrix. GQA/MQA: k and v have fewer heads; query head
h uses key/value head h // (H // Hkv), and dK, dV sum over the query heads of each group.
Masks and their conventions are the forward's (reference.key_mask, reference._window).
"""

from __future__ import annotations

import math

import numpy as np

from .reference import _CHUNK_ELEMENTS, _bf16_to_f64, _check_rank4, _to_bhld, _window, key_mask


def attention_grads_f64(q, k, v, dout, scale: float, *, mask=None, diagonal="bottom_right",
                        chunk_rows: int | None = None):
    """(dq, dk, dv, out) of float64 BHLD arrays, exactly as given (no rounding): the core of
    attention_backward_reference, also what the finite-difference tests differentiate.

    mask: None or (left, right) with -1 for an unbounded side (reference._window's form)."""
    batch, heads, seq_q, head_dim = q.shape
    heads_kv, seq_k = k.shape[1], k.shape[2]
    group = heads // heads_kv
    if chunk_rows is None:
        chunk_rows = max(1, _CHUNK_ELEMENTS // max(1, batch * heads * seq_k))
    # (B, Hkv, G, L, D): the query heads of a group under their key/value head
    qg = q.reshape(batch, heads_kv, group, seq_q, head_dim)
    dog = dout.reshape(batch, heads_kv, group, seq_q, v.shape[3])
    kb, vb = k[:, :, None], v[:, :, None]                        # broadcast over the group
    dq = np.empty_like(qg)
    out = np.empty(dog.shape, np.float64)
    dk = np.zeros_like(k)
    dv = np.zeros_like(v)
    for start in range(0, seq_q, chunk_rows):
        stop = min(seq_q, start + chunk_rows)
        qc, doc = qg[:, :, :, start:stop], dog[:, :, :, start:stop]
        s = np.matmul(qc, kb.swapaxes(-1, -2)) * scale
        if mask is not None:
            keep = key_mask(np.arange(start, stop), seq_q, seq_k, mask, diagonal)
            s = np.where(keep, s, -np.inf)
        m = s.max(axis=-1, keepdims=True)
        empty = np.isneginf(m)                                   # rows that see no key
        p = np.exp(s - np.where(empty, 0.0, m))
        total = p.sum(axis=-1, keepdims=True)
        p /= np.where(empty, 1.0, total)                         # empty rows: p = 0 already
        o = np.matmul(p, vb)
        out[:, :, :, start:stop] = o
        dp = np.matmul(doc, vb.swapaxes(-1, -2))
        delta = (doc * o).sum(axis=-1, keepdims=True)
        ds = p * (dp - delta)
        dq[:, :, :, start:stop] = scale * np.matmul(ds, kb)
        # sum over the group's query heads (axis 2) and this chunk's rows
        dk += scale * np.einsum("bhgqk,bhgqd->bhkd", ds, qc, optimize=True)
        dv += np.einsum("bhgqk,bhgqd->bhkd", p, doc, optimize=True)
    return (dq.reshape(q.shape), dk, dv, out.reshape(batch, heads, seq_q, -1))


def attention_backward_reference(q, k, v, dout, *, scale: float | None = None,
                                 layout: str = "bhld", causal: bool = False, window=None,
                                 diagonal: str = "bottom_right", chunk_rows: int | None = None,
                                 return_out: bool = False):
    """(dq, dk, dv) in float64, each in `layout` and of its input's shape; with
    return_out=True also the float64 forward output (same inputs, same mask) as a fourth.

    q: (B, H, Lq, D), k, v: (B, Hkv, Lk, D) for "bhld"; (B, L, H, D) for "bshd"; dout has q's
    shape. scale defaults to 1/sqrt(D). causal / window / diagonal as in ptxattn.attention:
    a query row that sees no key gets dq = 0 and gives nothing to dk and dv."""
    for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout)):
        _check_rank4(name, np.asarray(x))
    qh = _to_bhld(_bf16_to_f64(q), layout)
    kh = _to_bhld(_bf16_to_f64(k), layout)
    vh = _to_bhld(_bf16_to_f64(v), layout)
    doh = _to_bhld(_bf16_to_f64(dout), layout)
    batch, heads, seq_q, head_dim = qh.shape
    if kh.shape != vh.shape:
        raise ValueError(f"v: expected k's shape (BHLD {kh.shape}), got {vh.shape}")
    if kh.shape[0] != batch or kh.shape[3] != head_dim:
        raise ValueError(f"k: batch and head dim must match q's ({batch}, {head_dim}), "
                         f"got ({kh.shape[0]}, {kh.shape[3]})")
    if doh.shape != qh.shape:
        raise ValueError(f"dout: expected q's shape (BHLD {qh.shape}), got {doh.shape}")
    heads_kv = kh.shape[1]
    if heads_kv == 0 or heads % heads_kv:
        raise ValueError(f"k: key/value heads ({heads_kv}) must divide query heads ({heads})")
    if kh.shape[2] == 0:
        raise ValueError("k: key length is 0; softmax over no keys is undefined")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    dq, dk, dv, out = attention_grads_f64(qh, kh, vh, doh, scale, mask=_window(causal, window),
                                          diagonal=diagonal, chunk_rows=chunk_rows)
    if layout.lower() != "bhld":
        dq, dk, dv, out = (x.transpose(0, 2, 1, 3) for x in (dq, dk, dv, out))
    return (dq, dk, dv, out) if return_out else (dq, dk, dv)

"""How the tests of transformers' packed calls check ("paged|ptxattn"): references written
independently of ptxattn/torch/packed_reference.py (loops over sequences, positions from host
offsets, float64), cases built from per-sequence lengths, and a comparison whose message names
the sequences, rows and heads that are wrong, their error and NaN count (one device run finds a
bug). Shared by the CPU tests and the GPU tests."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")     # (the test modules importing this skip without it)

BAR_REL_L2 = 4e-3          # DESIGN.md's bar for a bf16 kernel against the float64 reference
BAR_MAX = 1e-2             # max |error| <= BAR_MAX * max |reference|


def offsets(lengths) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=torch.int32)


def allowed(lq: int, lk: int, causal: bool, window) -> torch.Tensor:
    """(lq, lk) bool: query i of a sequence (lq queries, lk keys) sees key j, bottom-right
    (its diagonal is i + lk - lq)."""
    left, right = window
    diag = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        keep &= j <= diag
    if left >= 0:
        keep &= j >= diag - left
    if right >= 0 and not causal:
        keep &= j <= diag + right
    return keep


def sequence_attention(q, k, v, causal, window, scale, softcap=None, sinks=None):
    """(Lq, H, D) float64 for one sequence: q (Lq, H, D), k and v (Lk, Hkv, D); a query that
    sees no key gets 0; sinks (H,): one more logit per head, dropped after the softmax."""
    lq, h, d = q.shape
    lk, hkv = k.shape[0], k.shape[1]
    group = h // hkv
    qh = q.double().transpose(0, 1)                                  # (H, Lq, D)
    kh = k.double().transpose(0, 1).repeat_interleave(group, dim=0)  # (H, Lk, D)
    vh = v.double().transpose(0, 1).repeat_interleave(group, dim=0)
    s = torch.matmul(qh, kh.transpose(1, 2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    keep = allowed(lq, lk, causal, window)
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().reshape(h, 1, 1).expand(h, lq, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)
    if sinks is not None:
        p = p[..., :-1]
    p = torch.nan_to_num(p, nan=0.0)                                 # rows with no key
    out = torch.matmul(p, vh).transpose(0, 1)
    return torch.where(keep.any(dim=-1)[:, None, None], out, torch.zeros((), dtype=out.dtype))


def varlen_reference(q, k, v, cu_q, cu_k, *, causal=True, window=(-1, -1), scale=None,
                     softcap=None, sinks=None):
    """(Tq, H, D) float64; rows past cu_q[-1] are 0."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros(q.shape, dtype=torch.float64)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 > q0:
            out[q0:q1] = sequence_attention(q[q0:q1], k[k0:k1], v[k0:k1], causal, window,
                                            scale, softcap, sinks)
    return out


def sequence_keys(cache, table_row, length: int) -> torch.Tensor:
    """A sequence's first `length` keys from its pages, walked one position at a time."""
    page = cache.shape[1]
    return torch.stack([cache[int(table_row[j // page]), j % page] for j in range(length)]) \
        if length else cache.new_zeros((0, *cache.shape[2:]))


def random_pages(gen, batch: int, lengths, page: int, num_pages: int, max_pages: int):
    """A shuffled block table (B, max_pages) int32: distinct pages, not in order, -1 past each
    sequence's pages (transformers' padding); `lengths` are what each sequence reaches."""
    perm = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.full((batch, max_pages), -1, dtype=torch.int32)
    for b, n in enumerate(lengths):
        for j in range(-(-int(n) // page)):
            table[b, j] = perm.pop()
    return table


def describe(got, ref, cu_q, limit: int = 6) -> str:
    """The worst (sequence, row, head) by max |error|, with the sequence's rel L2."""
    err = (got.double() - ref.double()).abs()
    lines = []
    cq = cu_q.tolist()
    per_seq = []
    for b in range(len(cq) - 1):
        q0, q1 = cq[b], cq[b + 1]
        if q1 == q0:
            continue
        e = err[q0:q1]
        r = ref[q0:q1].double()
        rel = ((got[q0:q1].double() - r).norm() / r.norm().clamp_min(1e-30)).item()
        flat = int(torch.nan_to_num(e, nan=float("inf")).reshape(-1).argmax())
        row, head = divmod(flat // e.shape[-1], e.shape[1])
        per_seq.append((float(torch.nan_to_num(e, nan=float("inf")).max()), b, q0 + row,
                        head, rel, int(torch.isnan(got[q0:q1]).sum())))
    per_seq.sort(reverse=True)
    for worst, b, row, head, rel, nans in per_seq[:limit]:
        lines.append(f"sequence {b}: max |err| {worst:.3g} at row {row} head {head}, rel L2 "
                     f"{rel:.3g}, NaN {nans}")
    return "; ".join(lines)


def check_packed(got, ref, cu_q, what: str, rel_bar: float = BAR_REL_L2,
                 max_bar: float = BAR_MAX) -> dict:
    """got (Tq, H, D) against the reference on the rows the sequences cover: no NaN/Inf,
    rel L2 <= rel_bar and max |error| <= max_bar * max |reference|."""
    end = int(cu_q[-1])
    g, r = got[:end].double(), ref[:end].double()
    bad = int((~torch.isfinite(g)).sum())
    rel = ((g - r).norm() / r.norm().clamp_min(1e-30)).item()
    worst = (g - r).abs().max().item() if end else 0.0
    scale = r.abs().max().item() if end else 1.0
    ok = bad == 0 and rel <= rel_bar and worst <= max_bar * max(scale, 1e-30)
    assert ok, (f"{what}: non-finite {bad}, rel L2 {rel:.3g} (bar {rel_bar}), max |err| "
                f"{worst:.3g} (bar {max_bar} x {scale:.3g}); {describe(got, ref, cu_q)}")
    return dict(rel_l2=rel, max_abs=worst, nonfinite=bad)

"""Context-parallel (ring) attention over torch.distributed (extra `torch`).

A sequence too long for one GPU is split along its length over the ranks of a process group.
Each rank holds a shard of q, k and v; the k/v shards travel around the ring (rank r sends
to r + 1 and receives from r - 1) while each rank runs attention of its q shard against the
k/v shard it holds, and the partial outputs are merged exactly through their log-sum-exp:

    lse = logaddexp(lse_a, lse_b),  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

in float32 (float64 for float64 inputs). The transport is NCCL (or gloo on the CPU) through
`dist.batch_isend_irecv`; on the GPU it runs on a stream of its own, and the next k/v shard
is received while the local attention of the current one runs.

Sharding. The sequence is cut into chunks whose lengths differ by at most one (the first
`L % n` chunks are one longer): no padding, every rank knows every shard's length from L
alone. Two schemes:
- "contiguous": rank r holds chunk r of R (the default without a causal mask);
- "zigzag": rank r holds chunks r and 2R-1-r of 2R (the default with causal=True). Under a
  causal mask every rank then does the same work: against an earlier rank's shard all its
  queries see the first chunk only, against a later rank's shard only its second chunk sees
  anything (all of it), and against its own shard the mask is the ordinary causal one.
Shard pairs that see nothing are skipped (no launch, no merge); see `ShardPlan.pairs`.

The sharding arithmetic (chunk bounds, shard indices, which rows see which keys) is pure
Python and NumPy; torch is imported only by the functions that move tensors, and the core
(`import ptxattn`) never imports this module.

Local attention: by default ptxattn.attention with return_lse=True (causal=True on the
diagonal pairs, which needs a checkout whose attention() takes `causal`). Any function with
the signature of `torch_local_attention` can stand in for it (`local_attention=`): the CPU
tests use the torch reference below.

Backward (when q, k or v requires grad and grad mode is on; the standard ring-attention
backward): the forward saves this rank's q, k, v shards, its merged output and merged LSE.
The backward walks the same ring in the same order. At each step, for every shard pair it
runs the local backward of its q rows against the k/v shard held, with the GLOBAL output and
LSE of those rows: P = exp(scale q k^T - lse) is then the global softmax restricted to that
shard and delta = rowsum(dO * O) the global one, so the local dQ, dK, dV are exactly that
pair's share of the true gradients. dQ stays local (summed over the steps in fp32); dK and dV
of the shard held are summed in fp32 and travel the ring with it, one step behind the k/v
shard: a rank adds its share to the partial sums the previous rank sent for that shard and
sends them on; after the last step one more hop brings each shard's complete dK, dV home. On
the GPU both exchanges run on the comm stream, the k/v one overlapped with the step's
compute. `local_backward=` swaps the local kernel (default ptxattn.attention_backward;
`torch_local_backward` is the reference the CPU tests use). A gradient of the returned LSE is
not supported (the backward says so).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

import numpy as np

LAYOUTS = ("bhld", "bshd")
SCHEMES = ("contiguous", "zigzag")


# --------------------------------------------------------------------------- sharding arithmetic

def chunk_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of `parts` chunks covering range(length) in order; lengths differ by at
    most one, the longer ones first (length 10 in 4: 3, 3, 2, 2). Chunks may be empty when
    length < parts."""
    if not isinstance(length, int) or isinstance(length, bool) or length < 0:
        raise ValueError(f"seq_len: expected an integer >= 0, got {length!r}")
    if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:
        raise ValueError(f"parts: expected an integer >= 1, got {parts!r}")
    base, extra = divmod(length, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def shard_chunks(rank: int, world: int, scheme: str) -> tuple[int, ...]:
    """The global chunk numbers rank `rank` holds, in increasing order: (r,) of R chunks for
    "contiguous", (r, 2R-1-r) of 2R chunks for "zigzag"."""
    if scheme == "contiguous":
        return (rank,)
    if scheme == "zigzag":
        return (rank, 2 * world - 1 - rank)
    raise ValueError(f"scheme: expected one of {SCHEMES}, got {scheme!r}")


def chunks_per_sequence(world: int, scheme: str) -> int:
    return world if scheme == "contiguous" else 2 * world


@dataclass(frozen=True)
class Pair:
    """One local attention call of a step: q rows [q0, q1) of the local q shard against
    k/v rows [k0, k1) of the shard held, with a causal mask or without."""
    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool

    @property
    def work(self) -> int:
        """Query-key pairs computed (the causal diagonal counts its lower triangle)."""
        n, m = self.q1 - self.q0, self.k1 - self.k0
        return n * (n + 1) // 2 if self.causal else n * m


@dataclass(frozen=True)
class ShardPlan:
    """How a sequence of seq_len (keys: seq_len_k) is split over `world` ranks.

    Every rank builds the same plan from the same arguments: it says how long every shard
    is (so receive buffers have the right size without asking) and which local attention
    calls each (q shard, k/v shard) pair needs.
    """
    seq_len: int
    world: int
    causal: bool = False
    scheme: str | None = None                  # None: "zigzag" if causal else "contiguous"
    seq_len_k: int | None = None               # None: the same as seq_len
    _bounds: tuple = field(init=False, repr=False, compare=False)
    _bounds_k: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.world, int) or isinstance(self.world, bool) or self.world < 1:
            raise ValueError(f"world: expected an integer >= 1, got {self.world!r}")
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal: expected True or False, got {type(self.causal).__name__}")
        scheme = self.scheme if self.scheme is not None else (
            "zigzag" if self.causal else "contiguous")
        if scheme not in SCHEMES:
            raise ValueError(f"scheme: expected one of {SCHEMES}, got {self.scheme!r}")
        object.__setattr__(self, "scheme", scheme)
        seq_len_k = self.seq_len if self.seq_len_k is None else self.seq_len_k
        n = chunks_per_sequence(self.world, scheme)
        bounds = chunk_bounds(self.seq_len, n)           # checks seq_len
        if seq_len_k != self.seq_len:
            if self.causal:
                raise ValueError(f"seq_len_k: causal context parallel needs as many keys as "
                                 f"queries (seq_len {self.seq_len}), got {seq_len_k}")
            try:
                bounds_k = chunk_bounds(seq_len_k, n)
            except ValueError as exc:
                raise ValueError(str(exc).replace("seq_len", "seq_len_k", 1)) from None
        else:
            bounds_k = bounds
        if seq_len_k < self.world:
            # a rank with no keys would send an empty shard, and its own queries would see no
            # key at all when the sequence is shorter still: refuse rather than guess
            raise ValueError(f"seq_len_k: {seq_len_k} keys cannot give each of {self.world} "
                             f"ranks at least one; use fewer ranks")
        object.__setattr__(self, "seq_len_k", seq_len_k)
        object.__setattr__(self, "_bounds", tuple(bounds))
        object.__setattr__(self, "_bounds_k", tuple(bounds_k))

    # ---- shards
    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.world:
            raise ValueError(f"rank: expected 0 <= rank < {self.world}, got {rank!r}")

    def chunks(self, rank: int) -> tuple[int, ...]:
        self._check_rank(rank)
        return shard_chunks(rank, self.world, self.scheme)

    def ranges(self, rank: int, keys: bool = False) -> list[tuple[int, int]]:
        """The global [start, stop) ranges rank `rank` holds, in the order of its shard."""
        bounds = self._bounds_k if keys else self._bounds
        return [bounds[c] for c in self.chunks(rank)]

    def indices(self, rank: int, keys: bool = False) -> np.ndarray:
        """Global positions of the local shard's rows, in local order (int64)."""
        parts = [np.arange(a, b, dtype=np.int64) for a, b in self.ranges(rank, keys)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def shard_len(self, rank: int, keys: bool = False) -> int:
        return sum(b - a for a, b in self.ranges(rank, keys))

    # ---- which rows see which keys
    def pairs(self, q_rank: int, kv_rank: int) -> list[Pair]:
        """The local attention calls that q shard `q_rank` needs against k/v shard `kv_rank`.

        Without a mask: one call, all against all. Causal: on its own shard the ordinary
        causal mask (a shard's chunks are in increasing global order, so local order is
        global order); against another shard, each q chunk sees exactly the k/v chunks with
        a smaller chunk number, a prefix of the shard, and consecutive q chunks that see
        the same prefix share one call. Nothing is returned for a pair that sees nothing.
        """
        self._check_rank(q_rank)
        self._check_rank(kv_rank)
        q_len, k_len = self.shard_len(q_rank), self.shard_len(kv_rank, keys=True)
        if q_len == 0 or k_len == 0:
            return []
        if not self.causal:
            return [Pair(0, q_len, 0, k_len, False)]
        if q_rank == kv_rank:
            return [Pair(0, q_len, 0, k_len, True)]
        k_chunks = self.chunks(kv_rank)
        k_ends = np.cumsum([b - a for a, b in self.ranges(kv_rank, keys=True)])
        calls: list[Pair] = []
        q0 = 0
        for chunk, (a, b) in zip(self.chunks(q_rank), self.ranges(q_rank)):
            q1 = q0 + (b - a)
            seen = sum(1 for c in k_chunks if c < chunk)          # a prefix: chunks are sorted
            k1 = int(k_ends[seen - 1]) if seen else 0
            if q1 > q0 and k1 > 0:
                last = calls[-1] if calls else None
                if last is not None and last.q1 == q0 and last.k1 == k1:
                    calls[-1] = Pair(last.q0, q1, 0, k1, False)
                else:
                    calls.append(Pair(q0, q1, 0, k1, False))
            q0 = q1
        return calls

    def work(self, rank: int) -> int:
        """Query-key pairs rank `rank` computes over the whole ring (load balance)."""
        return sum(p.work for src in range(self.world) for p in self.pairs(rank, src))


def ring_source(rank: int, step: int, world: int) -> int:
    """Whose k/v shard rank `rank` holds at ring step `step` (step 0: its own)."""
    return (rank - step) % world


def hidden_share(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """The share of communication time that overlaps compute: the length of each comm
    interval covered by the union of compute intervals, summed, over the comm length summed.
    Intervals are (start, stop) on one clock. 1.0 when there is no communication."""
    total = sum(max(0.0, b - a) for a, b in comm)
    if total <= 0:
        return 1.0
    merged: list[list[float]] = []
    for a, b in sorted(compute):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    covered = 0.0
    for a, b in comm:
        for c, d in merged:
            covered += max(0.0, min(b, d) - max(a, c))
    return covered / total


# --------------------------------------------------------------------------- torch side

def _torch():
    try:
        import torch
    except ImportError as exc:      # the extra is missing
        raise ImportError("ptxattn.distributed needs PyTorch: pip install 'ptxattn[torch]'") \
            from exc
    return torch


def _seq_axis(layout: str) -> int:
    return 2 if layout == "bhld" else 1


def _check_layout(layout) -> str:
    if not isinstance(layout, str) or layout.lower() not in LAYOUTS:
        raise ValueError(f"layout: expected 'bhld' or 'bshd', got {layout!r}")
    return layout.lower()


def shard(x, plan: ShardPlan, rank: int, *, layout: str = "bhld", keys: bool = False):
    """Rank `rank`'s shard of the full-sequence tensor x (contiguous, a copy for zigzag)."""
    torch = _torch()
    layout = _check_layout(layout)
    axis = _seq_axis(layout)
    want = plan.seq_len_k if keys else plan.seq_len
    if x.dim() != 4 or x.shape[axis] != want:
        raise ValueError(f"x: expected a rank-4 tensor with {want} positions on axis {axis} "
                         f"(layout {layout!r}), got shape {tuple(x.shape)}")
    parts = [x.narrow(axis, a, b - a) for a, b in plan.ranges(rank, keys)]
    return torch.cat(parts, dim=axis).contiguous()


def unshard(shards, plan: ShardPlan, *, layout: str = "bhld", keys: bool = False):
    """The full-sequence tensor from every rank's shard (list in rank order)."""
    torch = _torch()
    layout = _check_layout(layout)
    axis = _seq_axis(layout)
    if len(shards) != plan.world:
        raise ValueError(f"shards: expected {plan.world} (one per rank), got {len(shards)}")
    pieces = {}
    for rank, s in enumerate(shards):
        if s.shape[axis] != plan.shard_len(rank, keys):
            raise ValueError(f"shards: rank {rank}'s shard has {s.shape[axis]} positions, the "
                             f"plan says {plan.shard_len(rank, keys)}")
        offset = 0
        for a, b in plan.ranges(rank, keys):
            pieces[a] = s.narrow(axis, offset, b - a)
            offset += b - a
    return torch.cat([pieces[a] for a in sorted(pieces)], dim=axis)


def gather(x, plan: ShardPlan, *, group=None, layout: str = "bhld", keys: bool = False):
    """Every rank's shard of x (seq axis per `layout`, or (B, H, L) for an LSE with
    layout='bhl'), all-gathered and put back in sequence order: the full tensor on every rank.
    Shards of unequal length are padded to the longest for the collective, then trimmed."""
    torch = _torch()
    import torch.distributed as dist
    axis = 2 if layout == "bhl" else _seq_axis(_check_layout(layout))
    longest = max(plan.shard_len(r, keys) for r in range(plan.world))
    pad_shape = list(x.shape)
    pad_shape[axis] = longest
    padded = torch.zeros(pad_shape, dtype=x.dtype, device=x.device)
    padded.narrow(axis, 0, x.shape[axis]).copy_(x)
    bufs = [torch.empty_like(padded) for _ in range(plan.world)]
    dist.all_gather(bufs, padded, group=group)
    trimmed = [b.narrow(axis, 0, plan.shard_len(r, keys)) for r, b in enumerate(bufs)]
    if layout == "bhl":      # unshard knows 4-D layouts: give the LSE a trailing axis
        return unshard([t.unsqueeze(-1) for t in trimmed], plan, layout="bhld",
                       keys=keys).squeeze(-1)
    return unshard(trimmed, plan, layout=layout, keys=keys)


def torch_local_attention(q, k, v, *, causal: bool, scale: float, layout: str):
    """Reference local attention in torch (any device): (out in q's dtype and layout,
    lse of shape (B, H, Lq) in float32, float64 for float64 inputs). GQA by heads; a causal
    mask aligned bottom-right (query i sees key j <= i + Lk - Lq), as ptxattn's kernels."""
    torch = _torch()
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qh, kh, vh = (x.to(compute) for x in (q, k, v))
    if layout == "bshd":
        qh, kh, vh = (x.transpose(1, 2) for x in (qh, kh, vh))
    group = qh.shape[1] // kh.shape[1]
    if group > 1:
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if causal:
        lq, lk = s.shape[-2], s.shape[-1]
        i = torch.arange(lq, device=s.device)[:, None] + (lk - lq)
        j = torch.arange(lk, device=s.device)[None, :]
        s = s.masked_fill(j > i, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    out = torch.matmul(p, vh)
    if layout == "bshd":
        out = out.transpose(1, 2)
    return out.to(q.dtype).contiguous(), lse


def torch_local_backward(q, k, v, out, lse, dout, *, causal: bool, scale: float, layout: str):
    """Reference local backward in torch (any device): (dq, dk, dv) in float32 (float64 for
    float64 inputs), from the GIVEN out and lse as the kernels compute it (P = exp(scale
    q k^T - lse), delta = rowsum(dout * out), dS = P (dP - delta)); dk, dv summed over each
    GQA group; the causal mask aligned bottom-right, as torch_local_attention's."""
    torch = _torch()
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qh, kh, vh, oh, doh = (x.to(compute) for x in (q, k, v, out, dout))
    if layout == "bshd":
        qh, kh, vh, oh, doh = (x.transpose(1, 2) for x in (qh, kh, vh, oh, doh))
    group = qh.shape[1] // kh.shape[1]
    kr = kh.repeat_interleave(group, dim=1) if group > 1 else kh
    vr = vh.repeat_interleave(group, dim=1) if group > 1 else vh
    s = torch.matmul(qh, kr.transpose(-1, -2)) * scale
    lse = lse.to(compute)
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    p = torch.where(torch.isneginf(lse)[..., None], 0.0, p)
    if causal:
        lq, lk = s.shape[-2], s.shape[-1]
        i = torch.arange(lq, device=s.device)[:, None] + (lk - lq)
        j = torch.arange(lk, device=s.device)[None, :]
        p = p.masked_fill(j > i, 0.0)
    ds = p * (torch.matmul(doh, vr.transpose(-1, -2)) - (doh * oh).sum(-1, keepdim=True))
    b, h, _, d = qh.shape
    dq = scale * torch.matmul(ds, kr)
    dk = (scale * torch.matmul(ds.transpose(-1, -2), qh)).reshape(b, h // group, group, -1, d)
    dv = torch.matmul(p.transpose(-1, -2), doh).reshape(b, h // group, group, -1, d)
    dk, dv = dk.sum(2), dv.sum(2)
    if layout == "bshd":
        dq, dk, dv = (x.transpose(1, 2) for x in (dq, dk, dv))
    return dq, dk, dv


def ptxattn_local_backward(q, k, v, out, lse, dout, *, causal: bool, scale: float,
                           layout: str):
    """The default local backward: ptxattn.attention_backward on torch CUDA tensors, on torch's
    current stream, its outputs and workspaces from torch's allocator; (dq, dk, dv) bf16."""
    torch = _torch()
    import os
    os.environ.setdefault("PTXATTN_DEVICE", str(q.device.index or 0))
    from .backward import attention_backward
    device = q.device

    def allocator(shape, dtype):
        return torch.empty(shape, device=device,
                           dtype=torch.float32 if dtype == np.float32 else torch.bfloat16)
    return attention_backward(q, k, v, out, lse.float(), dout, scale=scale, layout=layout,
                              causal=causal, allocator=allocator)


def _ptxattn_takes_causal() -> bool:
    from . import api
    return "causal" in inspect.signature(api.attention).parameters


def ptxattn_local_attention(q, k, v, *, causal: bool, scale: float, layout: str):
    """The default local attention: ptxattn's kernel (production build) on torch CUDA tensors,
    on torch's current stream; (out, lse) as torch tensors (bf16 out, float32 lse).

    The output is a torch tensor passed as out= (torch's caching allocator): an output that
    ptxattn allocated would be cuMemFree'd when dropped, and cuMemFree waits for the device,
    which would stall the ring in the middle of an exchange. The LSE is ptxattn's; ring_attention
    keeps it alive until the end of the call for the same reason."""
    torch = _torch()
    import os
    # ptxattn runs on one device per process, PTXATTN_DEVICE (read when its context is made):
    # under torchrun, one process per GPU, that is the device of this rank's tensors
    os.environ.setdefault("PTXATTN_DEVICE", str(q.device.index or 0))
    from . import api
    kwargs = {}
    if causal:
        if not _ptxattn_takes_causal():
            raise NotImplementedError(
                "causal: ptxattn.attention in this checkout takes no causal= argument yet; "
                "pass local_attention= (e.g. ptxattn.distributed.torch_local_attention) for "
                "causal context parallel until it does")
        kwargs["causal"] = True
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _, lse = api.attention(q, k, v, scale=scale, layout=layout, return_lse=True, out=out,
                           **kwargs)
    return out, torch.from_dlpack(lse)


def _lse_weight(w, layout: str):
    """(B, H, L) -> broadcastable against an output in `layout`."""
    return w[..., None] if layout == "bhld" else w.transpose(1, 2)[..., None]


def merge_partial(acc_out, acc_lse, out, lse, layout: str = "bhld") -> None:
    """acc <- the exact merge of acc and one partial result, in place, in acc's dtype.

    acc_out and out: attention outputs over two disjoint key sets, in `layout`; acc_lse and
    lse: their natural-log LSEs, (B, H, L). A row that saw no key has LSE -inf and weight 0
    (two such rows merge to 0 and -inf, not NaN).
    """
    torch = _torch()
    layout = _check_layout(layout)
    lse = lse.to(acc_lse.dtype)
    new = torch.logaddexp(acc_lse, lse)
    base = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    w_acc = _lse_weight(torch.exp(acc_lse - base), layout)
    w_new = _lse_weight(torch.exp(lse - base), layout)
    acc_out.mul_(w_acc).add_(out.to(acc_out.dtype) * w_new)
    acc_lse.copy_(new)


class RingTimeline:
    """CUDA events of one ring_attention call, for the benchmark: per step, the comm
    interval (issue of the exchange to its completion, on the comm stream) and the compute
    interval (local attention, then merge, on the compute stream). Read after a sync."""

    def __init__(self):
        self.origin = None
        self.comm: list[tuple] = []         # (start, stop) events per step with an exchange
        self.compute: list[tuple] = []      # (start, attention done, merge done) per step

    def _event(self, torch):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def intervals(self) -> dict:
        """{'comm': [(a, b)], 'attention': [(a, b)], 'merge': [(a, b)]} in ms from the call's
        start, and 'hidden': the share of comm time under compute (hidden_share)."""
        def t(e):
            return self.origin.elapsed_time(e)
        comm = [(t(a), t(b)) for a, b in self.comm]
        attn = [(t(a), t(b)) for a, b, _ in self.compute]
        merge = [(t(b), t(c)) for _, b, c in self.compute]
        return {"comm": comm, "attention": attn, "merge": merge,
                "hidden": hidden_share(comm, [(a, c) for (a, _), (_, c) in zip(attn, merge)])}


_COMM_STREAMS: dict = {}


def _comm_stream(torch, device):
    """One comm stream per device, made once (streams are cheap to keep, costly to churn)."""
    key = torch.device(device).index
    if key not in _COMM_STREAMS:
        _COMM_STREAMS[key] = torch.cuda.Stream(device=device)
    return _COMM_STREAMS[key]


@dataclass(frozen=True)
class _Ring:
    """What one ring_attention call's forward and backward share: the plan, this rank's
    place on the ring, the axes, the local kernels and the streams."""
    plan: ShardPlan
    group: object
    rank: int
    world: int
    send_to: int                  # global ranks (P2P peers are global, also in a sub-group)
    recv_from: int
    layout: str
    axis: int                     # the sequence axis of q, k, v
    scale: float
    local: object                 # local_attention(q, k, v, *, causal, scale, layout)
    local_backward: object        # local_backward(q, k, v, out, lse, dout, *, ...)
    timeline: object = None


def _exchange(torch, dist, ring: _Ring, sends, recvs, compute, comm, timeline=None):
    """Post one ring exchange (each of `sends` to the next rank, each of `recvs` filled from
    the previous one); returns what _arrived waits on. On the GPU it runs on the comm stream,
    after everything enqueued on compute so far (the tensors sent are ready, and the buffers
    received into are no longer read by earlier steps)."""
    ops = [dist.P2POp(dist.isend, t, ring.send_to, ring.group) for t in sends] + \
          [dist.P2POp(dist.irecv, t, ring.recv_from, ring.group) for t in recvs]
    if comm is None:
        return dist.batch_isend_irecv(ops)
    comm.wait_stream(compute)
    with torch.cuda.stream(comm):
        start = timeline._event(torch) if timeline is not None else None
        for r in dist.batch_isend_irecv(ops):
            r.wait()                                 # the comm stream waits for NCCL's
        done = torch.cuda.Event(enable_timing=timeline is not None)
        done.record()
        if timeline is not None:
            timeline.comm.append((start, done))
    return done


def _arrived(pending, compute) -> None:
    """Order what follows after an exchange: the compute stream waits for its event (GPU), or
    the host for its requests (CPU)."""
    if compute is not None:
        compute.wait_event(pending)
    else:
        for r in pending:
            r.wait()


def _shard_view(buf, like, axis: int, n: int):
    """A prefix of the flat buffer `buf`, viewed as `like` with n positions on `axis`."""
    shape = list(like.shape)
    shape[axis] = n
    return buf[:math.prod(shape)].view(shape)


def _streams(torch, q, world: int):
    cuda = q.is_cuda
    compute = torch.cuda.current_stream(q.device) if cuda else None
    comm = _comm_stream(torch, q.device) if cuda and world > 1 else None
    return compute, comm


def _ring_forward(torch, dist, q, k, v, ring: _Ring):
    """(out in q's dtype, merged lse (B, H, Lq_r)): the ring's forward (see the module's
    docstring); no autograd."""
    plan, axis, layout, world, rank = ring.plan, ring.axis, ring.layout, ring.world, ring.rank
    timeline = ring.timeline
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    head_ax = 1 if layout == "bhld" else 2
    acc_out = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    acc_lse = torch.full((q.shape[0], q.shape[head_ax], q.shape[axis]), float("-inf"),
                         dtype=acc_dtype, device=q.device)
    compute, comm = _streams(torch, q, world)
    if timeline is not None:
        if not q.is_cuda:
            raise ValueError("timeline: CUDA events need CUDA tensors")
        timeline.origin = timeline._event(torch)

    # Two flat receive buffers per tensor, used in turn; a shard is a prefix viewed in the
    # shard's shape (contiguous, as the transport needs).
    cur_k, cur_v = k.contiguous(), v.contiguous()
    longest = max(plan.shard_len(r, keys=True) for r in range(world))
    numel = cur_k.numel() // max(1, k.shape[axis]) * longest
    bufs = [[torch.empty(numel, dtype=k.dtype, device=k.device) for _ in range(2)]
            for _ in range(2)] if world > 1 else []
    hold = []     # local results, freed at the end of the call (see ptxattn_local_attention)

    for step in range(world):
        src = ring_source(rank, step, world)
        pending = None
        if step < world - 1:
            n = plan.shard_len(ring_source(rank, step + 1, world), keys=True)
            nk, nv = (_shard_view(b, k, axis, n) for b in bufs[step % 2])
            pending = _exchange(torch, dist, ring, (cur_k, cur_v), (nk, nv), compute, comm,
                                timeline)

        if timeline is not None:
            t0 = timeline._event(torch)
        results = []
        for p in plan.pairs(rank, src):
            qs = q.narrow(axis, p.q0, p.q1 - p.q0)
            ks = cur_k.narrow(axis, p.k0, p.k1 - p.k0)
            vs = cur_v.narrow(axis, p.k0, p.k1 - p.k0)
            results.append((p, ring.local(qs, ks, vs, causal=p.causal, scale=ring.scale,
                                          layout=layout)))
        hold.append(results)
        if timeline is not None:
            t1 = timeline._event(torch)
        for p, (o, lse) in results:
            merge_partial(acc_out.narrow(axis, p.q0, p.q1 - p.q0),
                          acc_lse.narrow(2, p.q0, p.q1 - p.q0), o, lse, layout)
        if timeline is not None:
            timeline.compute.append((t0, t1, timeline._event(torch)))

        if pending is not None:
            _arrived(pending, compute)
            cur_k, cur_v = nk, nv

    out = acc_out.to(q.dtype)
    del hold
    return out, acc_lse


def _ring_backward(torch, dist, q, k, v, out, lse, dout, ring: _Ring):
    """(dq, dk, dv) of this rank's shards: the ring backward (see the module's docstring)."""
    plan, axis, layout, world, rank = ring.plan, ring.axis, ring.layout, ring.world, ring.rank
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    compute, comm = _streams(torch, q, world)
    dout = dout.to(q.dtype).contiguous()
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    cur_k, cur_v = k.contiguous(), v.contiguous()
    longest = max(plan.shard_len(r, keys=True) for r in range(world))
    row = cur_k.numel() // max(1, k.shape[axis])
    kv_bufs = [[torch.empty(row * longest, dtype=k.dtype, device=k.device) for _ in range(2)]
               for _ in range(2)] if world > 1 else []
    # the dK, dV partial sums received, in turn: fp32 (float64 for float64 inputs)
    grad_bufs = [[torch.empty(row * longest, dtype=acc_dtype, device=k.device)
                  for _ in range(2)] for _ in range(2)] if world > 1 else []
    hold = []     # tensors sent, alive until the call ends (the comm stream may still read)
    partial = None                     # the exchange bringing this step's shard's partial sums
    for step in range(world):
        src = ring_source(rank, step, world)
        pending_kv = None
        if step < world - 1:
            n = plan.shard_len(ring_source(rank, step + 1, world), keys=True)
            nk, nv = (_shard_view(b, k, axis, n) for b in kv_bufs[step % 2])
            pending_kv = _exchange(torch, dist, ring, (cur_k, cur_v), (nk, nv), compute, comm)

        dk = torch.zeros(cur_k.shape, dtype=acc_dtype, device=k.device)
        dv = torch.zeros(cur_v.shape, dtype=acc_dtype, device=k.device)
        for p in plan.pairs(rank, src):
            rows = p.q1 - p.q0
            keys = p.k1 - p.k0
            g = ring.local_backward(
                q.narrow(axis, p.q0, rows), cur_k.narrow(axis, p.k0, keys),
                cur_v.narrow(axis, p.k0, keys), out.narrow(axis, p.q0, rows),
                lse.narrow(2, p.q0, rows), dout.narrow(axis, p.q0, rows),
                causal=p.causal, scale=ring.scale, layout=layout)
            hold.append(g)
            dq.narrow(axis, p.q0, rows).add_(g[0].to(acc_dtype))
            dk.narrow(axis, p.k0, keys).add_(g[1].to(acc_dtype))
            dv.narrow(axis, p.k0, keys).add_(g[2].to(acc_dtype))
        if partial is not None:        # the shares of the ranks before us on this shard
            _arrived(partial[0], compute)
            dk.add_(partial[1])
            dv.add_(partial[2])
        if world > 1:
            # on to the next rank, which holds this shard at the next step; from the previous
            # one, the sums of the shard we hold next (after the last step: our own, complete)
            n = plan.shard_len(ring_source(rank, step + 1, world), keys=True)
            rk, rv = (_shard_view(b, dk, axis, n) for b in grad_bufs[step % 2])
            hold.append((dk, dv))
            partial = (_exchange(torch, dist, ring, (dk, dv), (rk, rv), compute, comm), rk, rv)
        if pending_kv is not None:
            _arrived(pending_kv, compute)
            cur_k, cur_v = nk, nv
    if partial is not None:
        _arrived(partial[0], compute)
        dk, dv = partial[1], partial[2]
    result = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    del hold
    return result


_FUNCTION = []


def _ring_function(torch):
    """The autograd.Function of the ring (made once: torch is imported lazily here)."""
    if _FUNCTION:
        return _FUNCTION[0]
    import torch.distributed as dist

    class RingAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, ring):
            out, lse = _ring_forward(torch, dist, q, k, v, ring)
            ctx.set_materialize_grads(False)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.ring = ring
            return out, lse

        @staticmethod
        def backward(ctx, grad_out, grad_lse):
            if grad_lse is not None:
                raise NotImplementedError(
                    "ring_attention: a gradient reached the returned lse; the ring's backward "
                    "differentiates the output only (use the lse without grad: lse.detach())")
            if grad_out is None:
                return None, None, None, None
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = _ring_backward(torch, dist, q, k, v, out, lse, grad_out, ctx.ring)
            return dq, dk, dv, None

    _FUNCTION.append(RingAttention)
    return RingAttention


def ring_attention(q, k, v, *, seq_len: int, seq_len_k: int | None = None,
                   group=None, causal: bool = False, scheme: str | None = None,
                   layout: str = "bhld", scale: float | None = None, return_lse: bool = False,
                   local_attention=None, local_backward=None,
                   timeline: RingTimeline | None = None):
    """Context-parallel attention: this rank's shard of softmax(scale q k^T) v.

    q, k, v: this rank's shards (`shard(x, plan, rank)`), torch tensors, q (B, H, Lq_r, D)
    and k, v (B, Hkv, Lk_r, D) for 'bhld' (B, L_r, H, D) for 'bshd'; Hkv divides H (GQA).
    seq_len / seq_len_k: the global lengths of q and of k/v (seq_len_k defaults to
    seq_len); every rank must pass the same (they fix every shard's length); causal: the
    causal mask over the global sequence; scheme: 'contiguous' or 'zigzag' (default: zigzag when causal), as sharded.
    group: the process group (default: the world). Returns out (q's dtype, layout and
    shape), or (out, lse) with lse float32 (B, H, Lq_r), natural log.
    local_attention(q, k, v, *, causal, scale, layout) -> (out, lse): the kernel for one
    shard pair (default: ptxattn's, ptxattn_local_attention).
    Differentiable: with grad mode on and q, k or v requiring grad, out.backward() runs the
    ring backward (every rank must call it, as every rank ran the forward), whose kernel for
    one shard pair is local_backward(q, k, v, out, lse, dout, *, causal, scale, layout) ->
    (dq, dk, dv) (default: ptxattn's, ptxattn_local_backward).
    """
    torch = _torch()
    import torch.distributed as dist
    layout = _check_layout(layout)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialized (call "
                           "dist.init_process_group, e.g. under torchrun)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    axis = _seq_axis(layout)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name}: expected a rank-4 torch tensor, got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    if k.shape != v.shape:
        raise ValueError(f"v: expected the same shape as k, {tuple(k.shape)}, got "
                         f"{tuple(v.shape)}")
    head_ax = 1 if layout == "bhld" else 2
    if (q.shape[0], q.shape[3]) != (k.shape[0], k.shape[3]) or \
            k.shape[head_ax] == 0 or q.shape[head_ax] % k.shape[head_ax]:
        raise ValueError(f"k: batch and head dim must match q's and its heads divide q's "
                         f"(layout {layout!r}), got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError(f"q, k, v: expected one device, got {q.device}, {k.device}, {v.device}")
    plan = ShardPlan(seq_len, world, causal=causal, scheme=scheme, seq_len_k=seq_len_k)
    for name, x, keys in (("q", q, False), ("k", k, True)):
        if x.shape[axis] != plan.shard_len(rank, keys):
            raise ValueError(f"{name}: rank {rank} should hold {plan.shard_len(rank, keys)} "
                             f"positions of {plan.seq_len_k if keys else plan.seq_len} "
                             f"({plan.scheme} sharding over {world} ranks), got {x.shape[axis]}")
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    send_to, recv_from = ((rank + 1) % world, (rank - 1) % world)
    if group is not None:
        send_to, recv_from = (dist.get_global_rank(group, r) for r in (send_to, recv_from))
    ring = _Ring(plan, group, rank, world, send_to, recv_from, layout, axis, scale,
                 local_attention or ptxattn_local_attention,
                 local_backward or ptxattn_local_backward, timeline)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _ring_function(torch).apply(q, k, v, ring)
    else:
        out, lse = _ring_forward(torch, dist, q, k, v, ring)
    return (out, lse) if return_lse else out

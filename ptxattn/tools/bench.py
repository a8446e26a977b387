"""Benchmarking stages: event timing, TFLOP/s, same-run ratios against cuDNN.

The protocol (bench/README.md): CUDA events around each launch, warm-ups first;
FLOPs = 4·B·H·Lq·Lk·D; inputs random normal bf16; the peer is cuDNN attention through
PyTorch's SDPA in the same process. Each round times every (stage, peer) pair of a shape in a
seeded random order, the stage and cuDNN alternating launch by launch (or in short blocks), so
that neither is always first or last and clock drift hits both alike. The ratio per shape is the
median over rounds of (peer time / our time), with a 95% bootstrap interval over rounds;
absolute TFLOP/s and each kernel's spread over rounds sit beside it. A kernel that fails its
check is not timed; with check=False (--no-check) nothing is checked and every row says
"unchecked". combine_results() turns two or more runs of the same cases into ranges.

PyTorch is a peer here, never a dependency: it is imported inside run_benchmark() only, and
without it the inputs come from NumPy and the results have no peer column.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Callable

from .. import stages as _stages
from .events import EventTimer
from ..errors import PtxattnError

# name -> (batch, heads, seq_len, head_dim); seq_q = seq_k = seq_len.
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "512": (16, 16, 512, 128),     # launch-bound: few tiles per CTA
    "1k": (8, 16, 1024, 128),
    "4k": (8, 16, 4096, 128),
    "8k": (4, 16, 8192, 128),
    "16k": (2, 16, 16384, 128),
}
DEFAULT_SHAPES = ("4k", "8k", "16k")
DEFAULT_ROUNDS = 10
PEER = "cuDNN"
LSE_TOL = 2e-3          # LSE max |error| in natural-log units, as tests/test_gpu_production.py


class MissingExtraError(PtxattnError):
    """An optional dependency (matplotlib for plots) is not installed."""


# --------------------------------------------------------------------------- shapes and FLOPs

def parse_shape(text: str) -> tuple[str, tuple[int, int, int, int]]:
    """A shape by name ("4k") or as "BxHxLxD" ("2x16x2048x128"), as (name, (B, H, L, D))."""
    key = str(text).strip().lower()
    if key in SHAPES:
        return key, SHAPES[key]
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)x(\d+)", key)
    if not m:
        raise ValueError(f"shape: expected one of {', '.join(SHAPES)} or BxHxLxD, got {text!r}")
    dims = tuple(int(g) for g in m.groups())
    if min(dims) <= 0:
        raise ValueError(f"shape: every dimension must be positive, got {text!r}")
    return key, dims  # type: ignore[return-value]


def attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int) -> int:
    """2 GEMMs (QK^T and PV) of 2·Lq·Lk·D each, per (batch, head); softmax not counted."""
    return 4 * batch * heads * seq_q * seq_k * head_dim


def tflops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, ms: float) -> float:
    if not ms > 0:                                     # also catches NaN
        raise ValueError(f"ms: expected a positive time in milliseconds, got {ms!r}")
    return attention_flops(batch, heads, seq_q, seq_k, head_dim) / (ms * 1e-3) / 1e12


# --------------------------------------------------------------------------- cases

@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark case: a problem (shapes, layout, mask) and the kernels timed on it.

    heads_kv: heads of k and v (0: as many as q; fewer: GQA/MQA). causal aligns the diagonal
    bottom-right (top-left is the same when seq_q == seq_k); window=(left, right) is
    FlashAttention's sliding window, -1 unbounded. kernels: labels of our kernels timed on it
    ("production", "stage14", "production+lse" = the production kernel writing the LSE too);
    empty: the stages the run was asked for. ratios: (a, b) pairs of those labels, each
    reported as a's speed in % of b's over the same rounds (ours vs ours, with an interval).
    versus: another case whose production TFLOP/s this one's is set against (a target of the
    issues, e.g. 4095 vs 4096); timed in other rounds, so a plain ratio without interval.
    """
    name: str
    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    heads_kv: int = 0
    layout: str = "bhld"
    causal: bool = False
    window: tuple[int, int] | None = None
    kernels: tuple[str, ...] = ()
    ratios: tuple[tuple[str, str], ...] = ()
    versus: str | None = None

    def __post_init__(self):
        dims = dict(batch=self.batch, heads=self.heads, seq_q=self.seq_q, seq_k=self.seq_k,
                    head_dim=self.head_dim)
        for key, value in dims.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}: expected a whole number >= 1 in case {self.name!r}, "
                                 f"got {value!r}")
        if not self.heads_kv:
            object.__setattr__(self, "heads_kv", self.heads)
        if self.heads_kv < 1 or self.heads % self.heads_kv:
            raise ValueError(f"heads_kv: expected a divisor of heads {self.heads} in case "
                             f"{self.name!r}, got {self.heads_kv}")
        if self.layout not in ("bhld", "bshd"):
            raise ValueError(f"layout: expected 'bhld' or 'bshd' in case {self.name!r}, "
                             f"got {self.layout!r}")
        if self.window is not None:
            from .. import reference
            object.__setattr__(self, "window", tuple(reference._window(False, self.window)))
        labels = set(self.kernels)
        for a, b in self.ratios:
            if not {a, b} <= labels:
                raise ValueError(f"ratios: ({a!r}, {b!r}) in case {self.name!r} names a kernel "
                                 f"the case does not time ({', '.join(self.kernels) or 'none'})")

    @property
    def masked(self) -> bool:
        return self.causal or self.window is not None

    @property
    def gqa(self) -> bool:
        return self.heads_kv != self.heads

    @property
    def pairs(self) -> int:
        """(query, key) pairs that the mask lets through, per (batch, head)."""
        return unmasked_pairs(self.seq_q, self.seq_k, self.causal, self.window)

    @property
    def flops(self) -> int:
        return case_flops(self)

    def params(self) -> dict:
        """Every parameter of the case, for the results JSON."""
        return {"batch": self.batch, "heads": self.heads, "heads_kv": self.heads_kv,
                "seq_q": self.seq_q, "seq_k": self.seq_k, "head_dim": self.head_dim,
                "layout": self.layout, "causal": self.causal,
                "window": list(self.window) if self.window is not None else None,
                "kernels": list(self.kernels), "ratios": [list(r) for r in self.ratios],
                "versus": self.versus, "pairs": self.pairs, "flops": self.flops,
                "flops_rule": flops_rule(self)}

    def describe(self) -> str:
        """One line: B H(/Hkv) Lq(xLk) D layout mask."""
        heads = f"{self.heads}" + (f":{self.heads_kv}" if self.gqa else "")
        seq = f"{self.seq_q}" + (f"x{self.seq_k}" if self.seq_k != self.seq_q else "")
        mask = ("window " + ",".join(map(str, self.window)) if self.window is not None
                else "causal" if self.causal else "")
        return " ".join(x for x in (f"B={self.batch}", f"H={heads}", f"L={seq}",
                                    f"D={self.head_dim}", self.layout, mask) if x)


def unmasked_pairs(seq_q: int, seq_k: int, causal: bool = False, window=None) -> int:
    """How many (query i, key j) pairs a causal/window mask keeps, exactly.

    Bottom-right alignment as in reference.key_mask: with d = seq_k - seq_q, query i sees
    keys max(0, i+d-left) .. min(seq_k-1, i+d+right) (a bound of -1: no bound). Summed per
    row by that formula (O(seq_q) arithmetic, no mask is built); tests hold it to a
    brute-force count of reference.key_mask on small shapes.
    """
    import numpy as np
    from .. import reference
    bounds = reference._window(causal, window)
    if bounds is None:
        return seq_q * seq_k
    left, right = bounds
    i = np.arange(seq_q, dtype=np.int64) + (seq_k - seq_q)
    hi = np.minimum(seq_k - 1, i + right) if right >= 0 else np.full_like(i, seq_k - 1)
    lo = np.maximum(0, i - left) if left >= 0 else np.zeros_like(i)
    return int(np.clip(hi - lo + 1, 0, None).sum())


def flops_rule(case: Case) -> str:
    if case.window is not None:
        return "4*B*H*D*pairs (pairs: unmasked (query, key) pairs, counted exactly)"
    if case.causal:
        return "4*B*H*Lq*Lk*D / 2 (causal: halved, the convention of FlashAttention and cuDNN)"
    return "4*B*H*Lq*Lk*D"


def case_flops(case: Case) -> int:
    """FLOPs credited to a case: 4·B·H·Lq·Lk·D dense; causal halved (the usual convention,
    what the cuDNN figures in the issues use); windows over the unmasked pairs exactly."""
    dense = attention_flops(case.batch, case.heads, case.seq_q, case.seq_k, case.head_dim)
    if case.window is not None:
        return 4 * case.batch * case.heads * case.head_dim * case.pairs
    if case.causal:
        return dense // 2
    return dense


def case_tflops(case: Case, ms: float) -> float:
    if not ms > 0:                                     # also catches NaN
        raise ValueError(f"ms: expected a positive time in milliseconds, got {ms!r}")
    return case.flops / (ms * 1e-3) / 1e12


def shape_case(name: str, dims, layout: str = "bhld") -> Case:
    """A square MHA case (B, H, L, D) in `layout`: what --shapes gives."""
    batch, heads, seq, dim = dims
    return Case(name, batch, heads, seq, seq, dim, layout=layout)


def _production_cases() -> tuple[Case, ...]:
    """The production set (issues 8 and 9): the production kernel against stage 14 and cuDNN
    at the lineage shapes in both layouts, then every feature shape with its target."""
    p, s14, lse = "production", "stage14", "production+lse"
    cases = []
    for layout in ("bhld", "bshd"):
        for shape in ("4k", "8k", "16k"):
            b, h, seq, d = SHAPES[shape]
            kernels, ratios = (p, s14), ((p, s14),)
            if shape == "8k" and layout == "bhld":          # LSE on vs off, same rounds
                kernels, ratios = (p, lse, s14), ((p, s14), (lse, p))
            name = shape if layout == "bhld" else f"{shape}-bshd"
            cases.append(Case(name, b, h, seq, seq, d, layout=layout, kernels=kernels,
                              ratios=ratios))
    only = (p,)
    cases += [
        Case("4095", 8, 16, 4095, 4095, 128, kernels=only, versus="4k"),
        Case("8191", 4, 16, 8191, 8191, 128, kernels=only, versus="8k"),
        Case("gqa32:4-8k", 4, 32, 8192, 8192, 128, heads_kv=4, kernels=only, versus="8k"),
        Case("video", 1, 12, 32760, 32760, 128, layout="bshd", kernels=only),
        Case("causal-4k", 8, 16, 4096, 4096, 128, causal=True, kernels=only),
        Case("causal-8k", 4, 16, 8192, 8192, 128, causal=True, kernels=only),
        Case("causal-16k", 2, 16, 16384, 16384, 128, causal=True, kernels=only),
        Case("d64-8k", 4, 32, 8192, 8192, 64, kernels=only),
        Case("d64-16k", 2, 32, 16384, 16384, 64, kernels=only),
        Case("d256-8k", 4, 8, 8192, 8192, 256, kernels=only),
        Case("d256-16k", 2, 8, 16384, 16384, 256, kernels=only),
        Case("gqa32:4-causal-8k", 4, 32, 8192, 8192, 128, heads_kv=4, causal=True,
             kernels=only, versus="causal-8k"),
        Case("window1024-16k", 2, 16, 16384, 16384, 128, window=(1024, 0), kernels=only,
             versus="causal-16k"),
        # the models' own shapes: LTX-Video's self-attention at 704x480x161 (21x15x22 latent
        # tokens, 32 heads of 64) and a Llama-3-8B prefill of 8k tokens
        Case("ltx", 1, 32, 6930, 6930, 64, layout="bshd", kernels=only),
        Case("llama-8k", 1, 32, 8192, 8192, 128, heads_kv=8, causal=True, kernels=only),
    ]
    return tuple(cases)


@dataclasses.dataclass(frozen=True)
class BenchSet:
    """A named set of cases with budget-minded defaults (the lead has minutes of GPU time)."""
    name: str
    doc: str
    cases: tuple[Case, ...]
    reps: int
    rounds: int


LINEAGE_SHAPES = ("4k", "8k", "16k", "1k")
SETS: dict[str, BenchSet] = {
    "lineage": BenchSet("lineage", "every lineage stage at 4k/8k/16k/1k, D=128, MHA",
                        tuple(shape_case(s, SHAPES[s]) for s in LINEAGE_SHAPES),
                        reps=20, rounds=10),
    "production": BenchSet("production", "the production kernel vs stage 14 vs cuDNN, and "
                           "the feature shapes of issues 8 and 9", _production_cases(),
                           reps=10, rounds=10),
}


def select_set(name: str, cases=None, layout: str | None = None) -> BenchSet:
    """A named set, optionally cut down to some of its cases (by name, in the set's order).
    layout: re-lays the lineage set's cases (the production set fixes each case's layout)."""
    key = str(name).strip().lower()
    if key not in SETS:
        raise ValueError(f"set: expected one of {', '.join(SETS)}, got {name!r}")
    chosen = SETS[key]
    picked = list(chosen.cases)
    if layout is not None:
        layout = str(layout).lower()
        if key != "lineage":
            raise ValueError(f"layout: the {key} set fixes each case's layout; leave --layout "
                             f"out (its BSHD cases are named *-bshd)")
        picked = [dataclasses.replace(c, layout=layout) for c in picked]
    if cases:
        names = {c.name: c for c in picked}
        wanted = [str(x).strip().lower() for x in cases]
        unknown = [x for x in wanted if x not in names]
        if unknown:
            raise ValueError(f"shapes: {', '.join(map(repr, unknown))} not in the {key} set "
                             f"(its cases: {', '.join(names)})")
        picked = [c for c in picked if c.name in wanted]
    return dataclasses.replace(chosen, cases=tuple(picked))


def _kernel(label: str):
    """(stage, lse) of a kernel label: "stage14", "production", "production+lse"."""
    base, _, extra = label.partition("+")
    if extra not in ("", "lse"):
        raise ValueError(f"kernels: unknown kernel variant {label!r} (only +lse)")
    return _stages.get_stage(base), extra == "lse"


def case_kernels(case: Case, stage_list=None) -> list[tuple[str, object, bool]]:
    """(label, stage, lse) of the kernels timed on a case: its own list (cut to the stages
    asked for, when some were), or else the stages asked for (default: the lineage)."""
    if case.kernels:
        wanted = {s.label for s in stage_list} if stage_list else None
        out = [(label, *_kernel(label)) for label in case.kernels]
        return [k for k in out if wanted is None or k[1].label in wanted]
    stage_list = stage_list or list(_stages.all_stages())
    return [(s.label, s, False) for s in stage_list]


# rough speeds for the run-time estimate only (TFLOP/s, H200): lineage stages 1-4 are slow
_ASSUMED_TFLOPS = {1: 90.0, 2: 130.0, 3: 260.0, 4: 240.0}
_CASE_OVERHEAD_S = 6.0         # inputs, float64 reference on the CPU, JIT, checks


def estimate_seconds(cases, stage_list=None, *, reps: int, rounds: int, warmup: int = 3,
                     peer: bool = True, sustained=None) -> float:
    """A rough run time: every timed and warm-up launch at an assumed speed (500 TFLOP/s;
    stages 1-4 slower), plus a fixed overhead per case for inputs, checks and JIT; with
    `sustained` (a sustained.Config) its windows too."""
    total = 0.0
    for case in cases:
        total += _CASE_OVERHEAD_S
        kernels = case_kernels(case, stage_list)
        with_peer = peer and case.window is None
        for _, stage, _ in kernels:
            rate = _ASSUMED_TFLOPS.get(stage.number, 500.0) if not stage.production else 600.0
            ours_ms = case.flops / (rate * 1e12) * 1e3
            peer_ms = case.flops / (550.0 * 1e12) * 1e3 if with_peer else 0.0
            launches = rounds * reps + warmup + (rounds - 1)
            total += launches * (ours_ms + peer_ms) / 1e3 + 1 + 1    # + check launch
        if sustained is not None:
            total += sustained.estimate_s(len(kernels) + (1 if with_peer else 0))
    return total


# --------------------------------------------------------------------------- timing

def time_launch(fn: Callable[[], object], warmup: int = 3, reps: int = 20, *,
                stream=None, timer=None) -> list[float]:
    """Milliseconds of each of `reps` calls of fn, each between two events; warm-ups untimed.

    All events are recorded first and read at the end: the host does not wait between
    launches, so the GPU's queue stays full and each figure is the launch's own time.
    `timer` is anything with mark() -> token and elapsed_ms(a, b) (tests pass a fake one).
    """
    if reps < 1:
        raise ValueError(f"reps: expected at least 1, got {reps}")
    own = timer is None
    timer = EventTimer(stream) if own else timer
    try:
        for _ in range(warmup):
            fn()
        marks = []
        for _ in range(reps):
            start = timer.mark()
            fn()
            marks.append((start, timer.mark()))
        return [timer.elapsed_ms(a, b) for a, b in marks]
    finally:
        if own:
            timer.close()


def time_interleaved(fns, reps: int, *, block: int = 1, warmup: int = 3, streams=None,
                     timers=None) -> list[list[float]]:
    """Milliseconds of `reps` timed calls of each fn in `fns`, interleaved in blocks.

    The calls go fns[0] x block, fns[1] x block, ..., then again, until each has had `reps`
    timed calls: with block=1 ours and the peer alternate launch by launch. Warm-ups (each fn
    `warmup` times, interleaved the same way) are untimed. As in time_launch, every event is
    read only at the end. streams[i] is the stream fns[i] enqueues on (its events go there);
    timers[i] replaces the event timer of fns[i] (tests pass fake ones).
    """
    if reps < 1:
        raise ValueError(f"reps: expected at least 1, got {reps}")
    if block < 1:
        raise ValueError(f"block: expected at least 1, got {block}")
    n = len(fns)
    streams = list(streams) if streams is not None else [None] * n
    own = timers is None
    timers = [EventTimer(st) for st in streams] if own else list(timers)
    try:
        for _ in range(warmup):
            for fn in fns:
                fn()
        marks: list[list] = [[] for _ in fns]
        for first in range(0, reps, block):
            for i, fn in enumerate(fns):
                for _ in range(min(block, reps - first)):
                    start = timers[i].mark()
                    fn()
                    marks[i].append((start, timers[i].mark()))
        return [[timers[i].elapsed_ms(a, b) for a, b in marks[i]] for i in range(n)]
    finally:
        if own:
            for timer in timers:
                timer.close()


def median(values) -> float:
    return float(statistics.median(values))


def spread_pct(values) -> float:
    """(max - min) / median of per-round figures, in percent: how much a kernel moved."""
    mid = median(values)
    return 100.0 * (max(values) - min(values)) / mid if mid else 0.0


def bootstrap_ci(values, *, level: float = 0.95, samples: int = 4000, seed: int = 0,
                 statistic=None) -> tuple[float, float]:
    """Percentile bootstrap interval of the median (or `statistic`) of `values` (NumPy only).

    Resamples the rounds with replacement `samples` times from a seeded generator, so the same
    rounds give the same interval. One value gives (value, value).
    """
    import numpy as np
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"values: expected a non-empty list of numbers, got {values!r}")
    if not 0 < level < 1:
        raise ValueError(f"level: expected a fraction between 0 and 1, got {level!r}")
    rng = np.random.default_rng(seed)
    picks = x[rng.integers(0, x.size, size=(samples, x.size))]
    stats = (np.median(picks, axis=1) if statistic is None
             else np.apply_along_axis(statistic, 1, picks))
    tail = 100.0 * (1 - level) / 2
    lo, hi = np.percentile(stats, [tail, 100.0 - tail])
    return float(lo), float(hi)


# --------------------------------------------------------------------------- correctness

def _host_f32(x):
    """A NumPy float32 copy of a slice of a torch tensor or NumPy array."""
    import numpy as np
    if hasattr(x, "detach"):                       # torch.Tensor (bf16 -> f32 is exact)
        return x.detach().float().cpu().numpy()
    return np.asarray(x).astype(np.float32)


def _pick(x, layout: str, b: int, h: int, rows):
    """[rows, D] of (batch b, head h) in either layout; rows is an index array."""
    if hasattr(x, "detach") and not isinstance(rows, slice):   # torch: an index tensor
        import torch
        rows = torch.as_tensor(rows, device=x.device)
    return x[b, h, rows, :] if layout == "bhld" else x[b, rows, h, :]


# The check's cost is the float64 reference on the rows compared: rows x Lk x D per (batch,
# head). Every (batch, head) is checked (a kernel wrong on the middle heads must fail), each on
# fewer rows when there are many: CHECK_ROW_BUDGET rows in all (what the former check of the
# four corner heads at 4096 rows each cost), never fewer than MIN_ROWS_PER_PAIR per (batch,
# head): every row position of each tile size at least once (reference.sample_rows needs 194).
CHECK_ROW_BUDGET = 16384
MIN_ROWS_PER_PAIR = 256


def check_subset(shape: tuple[int, int, int, int], max_rows: int = 4096, seed: int = 0,
                 budget: int = CHECK_ROW_BUDGET) -> dict:
    """What is checked on a shape: every batch and every head, each (batch, head) on its own
    seeded random draw of rows_per_pair query rows (subset_rows) that covers every row
    position of a tile (reference.sample_rows), never a fixed stride that would always land
    on the same lanes. rows_per_pair: budget / (B x H), at least MIN_ROWS_PER_PAIR, at most
    max_rows (and all rows of a short sequence)."""
    batch, heads, seq, _ = shape
    pairs = max(1, batch * heads)
    per_pair = max(1, min(max_rows, max(MIN_ROWS_PER_PAIR, budget // pairs)))
    return {"batches": list(range(batch)), "heads": list(range(heads)), "seq_q": seq,
            "rows_per_pair": min(per_pair, seq), "seed": seed}


def subset_rows(subset: dict, b: int, h: int):
    """The query rows check_subset compares for (batch b, head h): a draw of its own, seeded
    by (seed, b, h), so that the heads together see many more row positions than one draw."""
    from .. import reference
    return reference.sample_rows(subset["seq_q"], subset["rows_per_pair"],
                                 seed=[subset["seed"], b, h])


def nonfinite_count(x) -> int:
    """NaN and +-Inf entries of a torch tensor or NumPy array (all of it, not a subset)."""
    import numpy as np
    if hasattr(x, "isfinite"):
        return int((~x.isfinite()).sum().item())
    return int(np.count_nonzero(~np.isfinite(np.asarray(x, dtype=np.float32))))


class ReferenceSubset:
    """The float64 reference on check_subset(), computed once per set of inputs.

    The reference is the expensive part of a check (float64 on the CPU); a benchmark computes
    it once per case and compares every kernel and the peer with it. k and v may have fewer
    heads than q (query head h reads k/v head h // (H // Hkv)) and another length; causal /
    window masks the keys as the kernel must (reference.key_mask, bottom-right).
    """

    def __init__(self, q, k, v, layout: str, *, scale: float | None = None,
                 max_rows: int = 4096, seed: int = 0, causal: bool = False, window=None):
        import numpy as np
        from .. import reference

        if layout == "bhld":
            batch, heads, seq_q, dim = q.shape
            heads_kv = k.shape[1]
        else:
            batch, seq_q, heads, dim = q.shape
            heads_kv = k.shape[2]
        self.layout = layout
        self.subset = check_subset((batch, heads, seq_q, dim), max_rows, seed)
        self.seq_q = seq_q
        group = heads // heads_kv
        self.rows = {(b, h): subset_rows(self.subset, b, h) for b in self.subset["batches"]
                     for h in self.subset["heads"]}
        refs, lses = [], []
        every = slice(None)
        for (b, h), rows in self.rows.items():
            hk = h // group
            # the whole query row range goes in (the mask needs absolute positions); rows=
            # restricts the work to the checked rows
            ref, lse = reference.attention_reference(
                self._one(q, b, h, every), self._one(k, b, hk, every),
                self._one(v, b, hk, every), scale=scale, layout="bhld", rows=rows,
                causal=causal, window=window, return_lse=True)
            refs.append(np.asarray(ref, dtype=np.float64).reshape(-1))
            lses.append(np.asarray(lse, dtype=np.float64).reshape(-1))
        self.ref = np.concatenate(refs)
        self.ref_lse = np.concatenate(lses)

    def _one(self, x, b: int, h: int, rows):
        """(1, 1, rows, D) float32 on the host: one (batch, head) in BHLD for the reference."""
        return _host_f32(_pick(x, self.layout, b, h, rows))[None, None]

    @property
    def pairs(self) -> list[tuple[int, int]]:
        return list(self.rows)

    def describe(self) -> str:
        n, sub = self.subset["rows_per_pair"], self.subset
        picked = ("all rows" if n == self.seq_q
                  else f"{n} of {self.seq_q} rows each, at random (seed {sub['seed']}, "
                       "a draw per (batch, head))")
        return f"every (batch, head) of {len(sub['batches'])}x{len(sub['heads'])}, {picked}"

    def compare(self, out) -> dict:
        """rel_l2, max_abs, nan_count on the subset; nan_total (NaN or Inf) over all of `out`;
        pass (reference.passes, and no non-finite value anywhere)."""
        import numpy as np
        from .. import reference

        got = np.concatenate([_host_f32(_pick(out, self.layout, b, h, rows)).reshape(-1)
                              for (b, h), rows in self.rows.items()])
        metrics = dict(reference.error_metrics(got, self.ref))
        # NaN/Inf over the whole output: catches tiles a kernel never wrote (outputs are
        # poisoned with NaN) and overflow (Inf)
        nan_total = nonfinite_count(out)
        # NumPy scalars -> Python numbers, so that the results serialize as JSON
        metrics = {key: (val.item() if hasattr(val, "item") else val)
                   for key, val in metrics.items()}
        metrics["nan_total"] = nan_total
        metrics["pass"] = bool(reference.passes(metrics)) and nan_total == 0
        metrics["checked"] = self.describe()
        return metrics

    def compare_lse(self, lse) -> dict:
        """lse (B, H, Lq) float32 against the reference log-sum-exp on the subset:
        lse_max_abs, lse_nan_total (NaN anywhere: an unwritten row; a row that sees no key
        has -inf in the reference and must have -inf too), and pass (<= LSE_TOL, no NaN)."""
        import numpy as np
        lse = np.asarray(lse, dtype=np.float64)
        got = np.concatenate([lse[b, h, rows] for (b, h), rows in self.rows.items()])
        both_empty = np.isneginf(got) & np.isneginf(self.ref_lse)
        diff = np.where(both_empty, 0.0, np.abs(got - self.ref_lse))
        err = float(np.max(diff)) if diff.size else 0.0
        nan_total = int(np.count_nonzero(np.isnan(lse)))
        ok = bool(np.isfinite(err) and err <= LSE_TOL and nan_total == 0)
        return {"lse_max_abs": err if np.isfinite(err) else None,
                "lse_nan_total": nan_total, "lse_pass": ok}


def apply_peer_bar(metrics: dict, peer_metrics: dict | None) -> dict:
    """Add the GPU-side relative bar (ours <= 1.25 x the peer's rel L2 + 5e-4) to `metrics`
    when the peer was checked on the same inputs and passed; `pass` then needs both."""
    from .. import reference
    if not peer_metrics or not peer_metrics.get("pass") or "rel_l2" not in metrics:
        return metrics
    bound = reference.peer_bound(peer_metrics["rel_l2"])
    metrics["peer_bound"] = bound
    metrics["pass_vs_peer"] = bool(metrics["rel_l2"] <= bound)
    metrics["pass"] = bool(metrics.get("pass")) and metrics["pass_vs_peer"]
    return metrics


def failure_reason(metrics: dict) -> str:
    """One line: why a checked output failed (for the table and the JSON)."""
    from .. import reference
    why = []
    if metrics.get("nan_total", metrics.get("nan_count", 0)):
        why.append(f"{metrics.get('nan_total', metrics.get('nan_count'))} NaN/Inf")
    if metrics.get("rel_l2", 0) > reference.PASS_REL_L2:
        why.append(f"rel L2 {metrics['rel_l2']:.2e} > {reference.PASS_REL_L2:g}")
    limit = reference.PASS_MAX_ABS_FRACTION * metrics.get("ref_max_abs", 0.0)
    if metrics.get("max_abs", 0) > limit:
        why.append(f"max |err| {metrics['max_abs']:.2e} > {limit:.2e}")
    if metrics.get("lse_pass") is False:
        why.append(f"LSE max |err| {_fmt(metrics.get('lse_max_abs'), '.2e')} or "
                   f"{metrics.get('lse_nan_total')} NaN (bar {LSE_TOL:g}, no NaN)")
    if metrics.get("pass_vs_peer") is False:
        why.append(f"rel L2 {metrics['rel_l2']:.2e} > 1.25 x {PEER}'s + 5e-4 "
                   f"= {metrics['peer_bound']:.2e}")
    return "check failed: " + ("; ".join(why) or "see the metrics")


def check_output(q, k, v, out, layout: str, *, scale: float | None = None,
                 max_rows: int = 4096) -> dict:
    """Error figures of `out` against the float64 NumPy reference, on check_subset().

    q, k, v, out: NumPy arrays or torch tensors in `layout`.
    """
    return ReferenceSubset(q, k, v, layout, scale=scale, max_rows=max_rows).compare(out)


# --------------------------------------------------------------------------- environment

def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_clocks() -> dict | None:
    """SM/memory clocks, power and temperature as nvidia-smi sees them now (first GPU)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    fields = ("clocks.sm", "clocks.max.sm", "clocks.mem", "power.draw", "temperature.gpu")
    try:
        proc = subprocess.run([smi, f"--query-gpu={','.join(fields)}",
                               "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return None
    values = [v.strip() for v in lines[0].split(",")]
    return {name.replace(".", "_"): value for name, value in zip(fields, values)}


def source_id(root=None) -> dict:
    """What code ran: the git commit (and whether the tree had local changes) when git can
    tell, and always a SHA-256 over the files of ptx/ and ptxattn/ (paths and bytes, sorted),
    which identifies the code on a machine that got a copy of the tree without .git."""
    import hashlib
    root = Path(root) if root is not None else Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for folder in ("ptx", "ptxattn"):
        for path in sorted((root / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(root)).encode() + b"\0")
                digest.update(path.read_bytes() + b"\0")
    commit = dirty = None
    git = shutil.which("git")
    if git:
        try:
            head = subprocess.run([git, "-C", str(root), "rev-parse", "HEAD"],
                                  capture_output=True, text=True, timeout=20, check=False)
            if head.returncode == 0:
                commit = head.stdout.strip()
                diff = subprocess.run([git, "-C", str(root), "status", "--porcelain",
                                       "--", "ptx", "ptxattn"],
                                      capture_output=True, text=True, timeout=20, check=False)
                dirty = bool(diff.stdout.strip()) if diff.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            pass
    out = {"commit": commit, "dirty": dirty, "tree_sha256": digest.hexdigest()}
    # A machine that got a copy of the tree may carry a stale .git (the lent H200 does): the
    # runner can declare the commit it copied, and tree_sha256 is what checks the declaration
    # (the same hash computed at that commit locally).
    declared = os.environ.get("PTXATTN_SOURCE_COMMIT", "").strip()
    if declared:
        out["declared_commit"] = declared
    return out


SDPA_BACKENDS = ("flash", "efficient", "math", "cudnn")


def restrict_sdpa(torch, backend: str | None):
    """torch's SDPA restricted to one backend (a name of SDPA_BACKENDS; None: all of them, torch's
    own choice) through the global flags, for a whole run rather than an sdpa_kernel context
    around every call (whose own host time would count against SDPA). A call the backend does
    not take then raises, instead of running another backend unseen. Returns a function that
    restores the flags as they were."""
    if backend is not None and backend not in SDPA_BACKENDS:
        raise ValueError(f"backend: expected one of {SDPA_BACKENDS} or None, got {backend!r}")
    cuda = torch.backends.cuda
    flags = {"flash": (cuda.flash_sdp_enabled, cuda.enable_flash_sdp),
             "efficient": (cuda.mem_efficient_sdp_enabled, cuda.enable_mem_efficient_sdp),
             "math": (cuda.math_sdp_enabled, cuda.enable_math_sdp),
             "cudnn": (cuda.cudnn_sdp_enabled, cuda.enable_cudnn_sdp)}
    saved = {name: get() for name, (get, _) in flags.items()}
    for name, (_, put) in flags.items():
        put(True if backend is None else name == backend)

    def restore():
        for name, (_, put) in flags.items():
            put(saved[name])
    return restore


def environment(info: dict, torch=None) -> dict:
    env = {
        "gpu": info.get("name"),
        "compute_capability": info.get("compute_capability"),
        "sm_count": info.get("sm_count"),
        "driver_version": info.get("driver_version_str") or info.get("driver_version"),
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "cuda_bindings": _version("cuda-bindings") or _version("cuda-python"),
        "ptxattn": _version("ptxattn"),
        "torch": None, "torch_cuda": None, "cudnn": None,
        "host": platform.node(),
    }
    if torch is not None:
        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.version.cuda
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if cudnn:  # 91900 -> 9.19.0
            env["cudnn"] = f"{cudnn // 10000}.{cudnn // 100 % 100}.{cudnn % 100}"
    return env


def _import_torch():
    """PyTorch with a usable CUDA device, or None (then inputs come from NumPy, no peer)."""
    try:
        import torch
    except ImportError:
        return None
    try:
        return torch if torch.cuda.is_available() else None
    except Exception:
        return None


# --------------------------------------------------------------------------- the benchmark

def _inputs(torch, case: Case, seed: int):
    """q (B, H, Lq, D), k and v (B, Hkv, Lk, D), in the case's layout: torch bf16 on the GPU
    when torch is there, else NumPy bf16, random normal."""
    def dims(heads, seq):
        b, d = case.batch, case.head_dim
        return (b, heads, seq, d) if case.layout == "bhld" else (b, seq, heads, d)

    shapes = (dims(case.heads, case.seq_q), dims(case.heads_kv, case.seq_k),
              dims(case.heads_kv, case.seq_k))
    if torch is not None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        return tuple(torch.randn(s, generator=gen, device="cuda", dtype=torch.bfloat16)
                     for s in shapes)
    import numpy as np
    from .. import reference
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s, dtype=np.float32).astype(reference.BF16)
                 for s in shapes)


def _poisoned_out(torch, q):
    """(what check_output reads, the device array the kernel writes), filled with NaN."""
    from .. import tensors
    if torch is not None:
        out = torch.full_like(q, float("nan"))
        return out, tensors.as_device_array(out)
    out = tensors.empty(q.shape)
    out.fill_u16(0xFFFF)                               # bf16 NaN
    return None, out


def _poison_f32(array) -> None:
    """Fill a float32 device array (the LSE) with NaN before the checked launch."""
    from .. import driver
    driver.memset_u16(array.ptr, 0xFFFF, 2 * array.size)


def _device(torch, x):
    """Zero-copy view of a torch tensor, or a device copy of a NumPy array."""
    from .. import tensors
    return tensors.as_device_array(x) if torch is not None else tensors.from_numpy(x)


def _peer_unavailable(case: Case) -> str | None:
    """Why cuDNN (SDPA) cannot be the peer of a case, or None."""
    if case.window is not None:
        return "no cuDNN peer for sliding windows through SDPA"
    if case.causal and case.seq_q != case.seq_k:
        return ("SDPA's is_causal aligns the diagonal top-left, ours bottom-right "
                "(they differ when Lq != Lk)")
    return None


def _cudnn_launcher(torch, q, k, v, layout, *, causal: bool = False, gqa: str | None = None):
    """A no-argument launch of cuDNN SDPA on BHLD views of q, k, v.

    gqa: None (as many k/v heads as q heads), "enable_gqa" (SDPA's own grouped-query
    support), or "repeat" (k/v heads repeated once, before any timing, to q's count; cuDNN
    then reads H k/v heads instead of Hkv: more memory traffic than a GQA kernel needs).
    """
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if layout == "bshd":  # SDPA takes (B, H, L, D); a transposed view keeps the same memory
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    kwargs = {"is_causal": True} if causal else {}
    if gqa == "enable_gqa":
        kwargs["enable_gqa"] = True
    elif gqa == "repeat":
        group = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))

    def launch():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return launch


def _peer_setup(torch, case: Case, q, k, v, ref_of, *, check: bool, seed: int):
    """The peer's row and launch for a case: checked once on these inputs, or n/a / FAILED /
    error (then no launch). GQA: enable_gqa when cuDNN takes it, else repeated k/v heads."""
    row = {"name": PEER, "shape": case.name, "status": "ok"}
    why = _peer_unavailable(case)
    if why:
        row.update(status="n/a", reason=why)
        return row, None
    modes = ("enable_gqa", "repeat") if case.gqa else (None,)
    fn, first_error = None, None
    for mode in modes:
        try:
            fn = _cudnn_launcher(torch, q, k, v, case.layout, causal=case.causal, gqa=mode)
            o = fn()
            torch.cuda.synchronize()
            if mode:
                row["gqa"] = mode if mode == "enable_gqa" else (
                    "repeat: k/v heads repeated to q's count before timing (cuDNN did not "
                    f"take enable_gqa: {first_error}); it reads {case.heads // case.heads_kv}x "
                    "the k/v memory a GQA kernel reads")
            break
        except Exception as exc:
            first_error = first_error or _one_line(exc)
            fn = None
    if fn is None:
        row.update(status="error", reason=first_error)
        return row, None
    try:
        if case.layout == "bshd":
            o = o.transpose(1, 2)
        if check:
            row.update(ref_of().compare(o))
            if not row["pass"]:
                row.update(status="FAILED", reason=failure_reason(row))
                fn = None
        del o
    except Exception as exc:
        row.update(status="error", reason=_one_line(exc))
        fn = None
    return row, fn


def _api_takes(name: str) -> bool:
    """Whether api.prepare() takes keyword `name` (causal, window: they arrive with the
    masked production kernel; until then such cases are n/a, not errors)."""
    import inspect
    from .. import api
    params = inspect.signature(api.prepare).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD
                                 for p in params.values())


def _feature_kwargs(case: Case, lse: bool) -> dict:
    kwargs = {}
    if case.causal:
        kwargs["causal"] = True
    if case.window is not None:
        kwargs["window"] = case.window
    if lse:
        kwargs["return_lse"] = True
    return kwargs


def kernel_takes(stage, case: Case, lse: bool = False) -> str | None:
    """Why a kernel cannot run a case yet (shown as n/a), or None when it can."""
    if case.gqa and not stage.gqa:
        return "k/v with fewer heads than q (GQA/MQA)"
    if lse and not stage.lse:
        return "LSE out"
    if case.masked and not stage.production:
        return "causal/window masks (lineage stages are dense)"
    for name in _feature_kwargs(case, False):
        if not _api_takes(name):
            return f"attention() does not take {name}= yet"
    why = stage.unsupported(case.head_dim, case.seq_q, case.seq_k)
    if why:
        return why
    if stage.production:
        try:
            stage.specialize(case.head_dim, case.masked)
        except ValueError as exc:
            return str(exc)
    return None


def validate_request(stages=None, shapes=DEFAULT_SHAPES, layout: str = "bhld",
                     reps: int = 20, rounds: int = DEFAULT_ROUNDS, block: int = 1):
    """Check a benchmark's arguments before anything touches the GPU: (stages, shapes, layout).

    Unknown stages or shapes, a bad layout or counts below 1 raise ValueError naming the
    argument, so `ptxattn bench --stages 99` says so on a machine without a GPU too.
    """
    layout = str(layout).lower()
    if layout not in ("bhld", "bshd"):
        raise ValueError(f"layout: expected 'bhld' or 'bshd', got {layout!r}")
    _check_counts(reps, rounds, block)
    stage_list = [_stages.get_stage(s) for s in stages] if stages else list(_stages.all_stages())
    if not shapes:
        raise ValueError("shapes: expected at least one shape")
    shape_list = [parse_shape(s) for s in shapes]
    return stage_list, shape_list, layout


def _check_counts(reps, rounds, block) -> None:
    for name, value in (("reps", reps), ("rounds", rounds), ("block", block)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a whole number >= 1, got {value!r}")


def _round_order(rng, labels: list[str], with_peer: bool) -> list[tuple[str, bool]]:
    """One round's order: the pairs shuffled, and in each pair whether the peer goes first."""
    order = [labels[i] for i in rng.permutation(len(labels))]
    return [(label, bool(with_peer and rng.integers(2))) for label in order]


CHECK_PROTOCOL = ("every (batch, head) on sampled rows (check_subset): rel L2 <= 4e-3, max|err| "
                  f"<= 1e-2 max|ref|, no NaN/Inf; LSE max|err| <= {LSE_TOL:g}; with a peer "
                  "also rel L2 <= 1.25 x peer's + 5e-4; failed: not timed")
UNCHECKED_PROTOCOL = ("off (--no-check): no output was compared with the reference; every row "
                      "is timed as it is and says status 'unchecked'")
# What a row of a run is when nothing checked it (ours and the peer).
UNCHECKED = "unchecked"
TIMED = ("ok", UNCHECKED)


def run_benchmark(stages=None, shapes=DEFAULT_SHAPES, layout: str = "bhld", reps: int = 20, *,
                  rounds: int = DEFAULT_ROUNDS, warmup: int = 3, block: int = 1,
                  peer: bool = True, check: bool = True, seed: int = 0,
                  log: Callable[[str], None] | None = None, sustained=None) -> dict:
    """Time stages (and cuDNN) on square MHA shapes in one layout; see run_cases()."""
    stage_list, shape_list, layout = validate_request(stages, shapes, layout, reps, rounds, block)
    cases = [shape_case(name, dims, layout) for name, dims in shape_list]
    return run_cases(cases, stage_list, reps=reps, rounds=rounds, warmup=warmup, block=block,
                     peer=peer, check=check, seed=seed, log=log, layout=layout,
                     sustained=sustained)


def run_set(name: str, cases=None, stages=None, *, layout: str | None = None,
            reps: int | None = None, rounds: int | None = None, warmup: int = 3,
            block: int = 1, peer: bool = True, check: bool = True, seed: int = 0,
            log: Callable[[str], None] | None = None, sustained=None) -> dict:
    """A named case set (SETS), or some of its cases; reps/rounds default to the set's."""
    chosen = select_set(name, cases, layout)
    reps = chosen.reps if reps is None else reps
    rounds = chosen.rounds if rounds is None else rounds
    _check_counts(reps, rounds, block)
    stage_list = [_stages.get_stage(s) for s in stages] if stages else None
    result = run_cases(chosen.cases, stage_list, reps=reps, rounds=rounds, warmup=warmup,
                       block=block, peer=peer, check=check, seed=seed, log=log,
                       layout=layout or ("bhld" if chosen.name == "lineage" else "per case"),
                       sustained=sustained)
    result["set"] = chosen.name
    return result


def run_cases(cases, stage_list=None, *, reps: int, rounds: int, warmup: int = 3,
              block: int = 1, peer: bool = True, check: bool = True, seed: int = 0,
              log: Callable[[str], None] | None = None, layout: str = "per case",
              sustained=None) -> dict:
    """Time our kernels (and cuDNN) on cases; returns the results dict that write_results saves.

    For each case: one set of inputs, shared by every kernel and the peer. The peer and each
    kernel are checked once on a NaN-poisoned output (and LSE); a kernel that fails
    (reference.passes, and with a checked peer also ours <= 1.25 x the peer's rel L2 + 5e-4)
    is marked FAILED and not timed; one that cannot run the case yet is n/a. Then `rounds`
    rounds: each times every (kernel, peer) pair in a seeded random order, the two
    alternating in blocks of `block` launches until each has `reps` timed launches (without
    a peer, each kernel alone). Per round and kernel: our median and the peer's median from
    that pair, their ratio (peer / ours); the headline per case is 100 x the median ratio
    over rounds with a 95% bootstrap interval; ms and TFLOP/s are medians over rounds of the
    per-round medians; spread_pct is (max - min) / median. A case's `ratios` (ours vs ours)
    are medians over rounds of the two kernels' per-round medians, with intervals too.
    sustained: a sustained.Config, or None: then after each case's rounds every timed kernel
    and the peer also run a sustained window at the power cap (ptxattn/tools/sustained.py), into
    row["sustained"].
    """
    import numpy as np

    from .. import api, driver

    _check_counts(reps, rounds, block)
    say = log or (lambda _msg: None)
    info = driver.device_info()                                 # NoGpuError without a GPU
    torch = _import_torch()
    rng = np.random.default_rng(seed)
    sampler = _sustained_sampler(sustained)          # SamplerUnavailable before any case
    result = {
        "schema": 4,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "source": source_id(),
        "env": environment(info, torch),
        "protocol": {"layout": layout, "reps": reps, "rounds": rounds, "warmup": warmup,
                     "block": block, "seed": seed,
                     "inputs": "torch" if torch is not None else "numpy",
                     "flops": "4*B*H*Lq*Lk*D; causal halved; windows 4*B*H*D*unmasked pairs "
                              "(cases[...].flops_rule)",
                     "statistic": "median",
                     "order": "per round: (kernel, peer) pairs in seeded random order; in a "
                              "pair the two alternate in blocks of `block` launches",
                     "ratio": "pct_of_peer = 100 x median over rounds of (peer ms / our ms), "
                              "same pair, same round; pct_of_peer_ci: 95% bootstrap over rounds",
                     "ours_ratios": "100 x median over rounds of (b's ms / a's ms): a's speed "
                                    "in % of b's, same rounds; ci: 95% bootstrap over rounds",
                     "check": CHECK_PROTOCOL if check else UNCHECKED_PROTOCOL},
        "shapes": {}, "cases": {}, "results": [], "peer": [], "clocks": {},
    }
    if sampler is not None:
        from . import sustained as _sus
        result["protocol"]["sustained"] = _sus.protocol(sustained, sampler)
    try:
        _run_each_case(result, cases, stage_list, reps=reps, rounds=rounds, warmup=warmup,
                       block=block, peer=peer, check=check, seed=seed, say=say, torch=torch,
                       rng=rng, sustained=sustained, sampler=sampler)
    finally:
        if sampler is not None:
            sampler.stop()
    result["comparisons"] = compare_cases(result, cases)
    return result


def _sustained_sampler(cfg):
    """The power/clock sampler of a sustained run (started), or None without one."""
    if cfg is None:
        return None
    from . import sustained
    return sustained.start_sampler(cfg)


def _run_each_case(result, cases, stage_list, *, reps, rounds, warmup, block, peer, check, seed,
                   say, torch, rng, sustained, sampler) -> None:
    """run_cases' loop over the cases (one set of inputs each)."""
    from .. import api, driver
    sustained_rng = None

    for case in cases:
        result["shapes"][case.name] = [case.batch, case.heads, case.seq_q, case.seq_k,
                                       case.head_dim]
        result["cases"][case.name] = case.params()
        say(f"{case.name}: {case.describe()}")
        kernels = case_kernels(case, stage_list)
        # what cannot run needs no inputs: n/a rows first
        runnable = []
        for label, stage, lse in kernels:
            row = {"stage": label, "number": stage.number,
                   "name": "" if stage.production else stage.name,
                   "shape": case.name, "lse": lse, "status": "ok" if check else UNCHECKED}
            result["results"].append(row)
            why = kernel_takes(stage, case, lse)
            if why:
                row.update(status="n/a", reason=why)
                say(f"  {label}: n/a ({why})")
            else:
                runnable.append((row, stage, lse))
        with_peer = peer and torch is not None
        if not runnable and not (with_peer and _peer_unavailable(case) is None):
            continue
        q, k, v = _inputs(torch, case, seed)
        qd, kd, vd = (_device(torch, x) for x in (q, k, v))
        refs: list = []

        def ref_of():                     # the float64 reference, made at the first check only
            if not refs:
                refs.append(ReferenceSubset(q, k, v, case.layout, seed=seed, causal=case.causal,
                                            window=case.window))
            return refs[0]

        # the peer first: its error on these inputs sets the relative bar for ours
        peer_row, peer_fn, peer_stream = None, None, None
        if with_peer:
            peer_row, peer_fn = _peer_setup(torch, case, q, k, v, ref_of, check=check, seed=seed)
            if not check and peer_row["status"] == "ok":
                peer_row["status"] = UNCHECKED
            result["peer"].append(peer_row)
            peer_stream = torch.cuda.current_stream().cuda_stream
            if peer_fn is None:
                say(f"  {PEER}: {peer_row['status']} {peer_row.get('reason', '')}")

        entries = {}                      # label -> (result row, launch, stream)
        for row, stage, lse in runnable:
            label = row["stage"]
            try:
                out_torch, out_dev = _poisoned_out(torch, q)
                prepared = api.prepare(qd, kd, vd, stage=stage, layout=case.layout,
                                       out=out_dev, **_feature_kwargs(case, lse))
                if check:
                    if lse:
                        _poison_f32(prepared.lse)
                    prepared.launch()
                    driver.synchronize()
                    out = out_torch if out_torch is not None else out_dev.to_numpy()
                    metrics = ref_of().compare(out)
                    if lse:
                        metrics.update(ref_of().compare_lse(prepared.lse.to_numpy()))
                        metrics["pass"] = bool(metrics["pass"] and metrics["lse_pass"])
                    row.update(apply_peer_bar(metrics, peer_row))
            except Exception as exc:     # record and go on: one broken kernel spoils no table
                row.update(status="error", reason=_one_line(exc))
                say(f"  {label}: {row['reason']}")
                continue
            if check and not row["pass"]:
                row.update(status="FAILED", reason=failure_reason(row))
                say(f"  {label}: FAILED, not timed ({row['reason']})")
                continue
            entries[label] = (row, prepared.launch, prepared.stream)

        timed = time_rounds({label: (fn, stream) for label, (_, fn, stream) in entries.items()},
                            (peer_fn, peer_stream) if peer_fn is not None else None,
                            rounds=rounds, reps=reps, block=block, warmup=warmup, rng=rng)
        raw, peer_raw, peer_all = timed["raw"], timed["peer_raw"], timed["peer_all"]
        for label, why in timed["errors"].items():
            target = peer_row if label == PEER else entries[label][0]
            target.update(status="error", reason=why)
        result["clocks"][case.name] = timed["clocks"]
        result.setdefault("orders", {})[case.name] = timed["orders"]

        for label, (row, _, _) in entries.items():
            if row["status"] not in TIMED or not raw[label]:
                continue
            _summarize(row, raw[label], case)
            if peer_fn is not None and len(peer_raw[label]) == len(raw[label]):
                pair_figures(row, peer_raw[label], seed=seed)
        ours_ratios({label: row for label, (row, _, _) in entries.items()}, case.ratios,
                    seed=seed)
        for label, (row, _, _) in entries.items():
            if "ms" in row:
                say(f"  {label}: {row['ms']:.3f} ms  {row['tflops']:.1f} TFLOP/s"
                    + (f"  {row['pct_of_peer']:.1f}% of {PEER}" if "pct_of_peer" in row else "")
                    + "".join(f"  {x['pct']:.1f}% of {x['vs']}"
                              for x in row.get("ours_ratios", [])))
        if peer_row is not None and peer_row["status"] in TIMED and peer_all:
            _summarize(peer_row, peer_all, case)
            say(f"  {PEER}: {peer_row['ms']:.3f} ms  {peer_row['tflops']:.1f} TFLOP/s")
        if sampler is not None:                         # sustained windows, same inputs
            import numpy as np

            from . import sustained as _sus
            sustained_rng = sustained_rng or np.random.default_rng([seed, 23])
            result.setdefault("sustained_orders", {})[case.name] = _sus.run_case(
                case.flops, entries, (peer_row, peer_fn, peer_stream) if peer_fn else None,
                sampler, sustained, rng=sustained_rng, log=say)
        if torch is not None:
            del q, k, v, qd, kd, vd, refs
            entries.clear()
            torch.cuda.empty_cache()


def ours_ratios(rows: dict, ratios, *, seed: int = 0) -> None:
    """For each (a, b) of a case's ratios, where both were timed in every round: into row a,
    {"vs": b, "pct": 100 x median over rounds of (b ms / a ms), "ci": 95% bootstrap,
    "rounds": the per-round ratios}. Same rounds, same inputs: clock drift cancels as it does
    for the peer's ratio."""
    for a, b in ratios:
        ra, rb = rows.get(a), rows.get(b)
        if not (ra and rb and ra.get("ms_rounds") and rb.get("ms_rounds")
                and len(ra["ms_rounds"]) == len(rb["ms_rounds"])):
            continue
        per_round = [tb / ta for ta, tb in zip(ra["ms_rounds"], rb["ms_rounds"])]
        lo, hi = bootstrap_ci(per_round, seed=seed)
        ra.setdefault("ours_ratios", []).append(
            {"vs": b, "pct": 100.0 * median(per_round), "ci": [100.0 * lo, 100.0 * hi],
             "rounds": per_round})


def compare_cases(result: dict, cases) -> list[dict]:
    """Each case with `versus`: its production TFLOP/s in % of the other case's (e.g. 4095 vs
    4096, GQA vs MHA 8k, window vs causal 16k). Timed in different rounds: no interval."""
    rows = {(r["shape"], r["stage"]): r for r in result["results"]}
    out = []
    for case in cases:
        if not case.versus:
            continue
        a, b = rows.get((case.name, "production")), rows.get((case.versus, "production"))
        entry = {"case": case.name, "versus": case.versus, "kernel": "production"}
        if a and b and a.get("tflops") and b.get("tflops"):
            entry.update(tflops=a["tflops"], versus_tflops=b["tflops"],
                         pct=100.0 * a["tflops"] / b["tflops"])
        else:
            entry["status"] = "not measured in both"
        out.append(entry)
    return out


def time_rounds(ours: dict, peer, *, rounds: int, reps: int, block: int = 1, warmup: int = 3,
                rng=None, clocks: Callable[[], object] | None = None) -> dict:
    """The timed rounds of one shape. ours: label -> (launch, stream); peer: (launch, stream)
    or None. Each round visits every label once, in an order drawn from `rng`; with a peer,
    each visit times the pair (ours and the peer interleaved, which goes first drawn too).

    Returns raw[label] (per round, our times), peer_raw[label] (per round, the peer's times
    in that label's pair), peer_all (per round, every peer time of the round), orders (per
    round, the visits as "a+b" strings), clocks (gpu_clocks() after each round) and
    errors[label] for a pair whose timing raised (that label is not timed again).
    """
    import numpy as np
    rng = rng if rng is not None else np.random.default_rng(0)
    read_clocks = clocks or gpu_clocks
    raw = {label: [] for label in ours}
    peer_raw = {label: [] for label in ours}
    peer_all: list[list[float]] = []
    orders, seen_clocks, errors = [], [], {}
    labels = list(ours) or ([PEER] if peer else [])
    for r in range(rounds):
        order = _round_order(rng, labels, peer is not None)
        orders.append([f"{PEER}+{lab}" if first else (f"{lab}+{PEER}" if peer else lab)
                       for lab, first in order])
        round_peer: list[float] = []
        for label, peer_first in order:
            if label in errors or (PEER in errors and label not in ours):
                continue
            pairs = [ours[label]] if label in ours else []
            if peer is not None and PEER not in errors:
                pairs.insert(0 if peer_first else len(pairs), peer)
            try:
                times = time_interleaved([fn for fn, _ in pairs], reps, block=block,
                                         warmup=warmup if r == 0 else 1,
                                         streams=[st for _, st in pairs])
            except Exception as exc:
                errors[label if label in ours else PEER] = _one_line(exc)
                continue
            if peer is not None and PEER not in errors:
                peer_times = times.pop(0 if peer_first else len(times) - 1)
                round_peer.extend(peer_times)
                if label in ours:
                    peer_raw[label].append(peer_times)
            if label in ours:
                raw[label].append(times[0])
        if round_peer:
            peer_all.append(round_peer)
        seen_clocks.append(read_clocks())
    return {"raw": raw, "peer_raw": peer_raw, "peer_all": peer_all, "orders": orders,
            "clocks": seen_clocks, "errors": errors}


def pair_figures(row: dict, peer_rounds: list[list[float]], *, seed: int = 0) -> None:
    """Same-run ratio figures into row (which has ms_rounds): the peer's per-round medians in
    this pair, ratio_rounds = peer / ours, pct_of_peer = 100 x their median, and the 95%
    bootstrap interval over rounds."""
    peer_ms = [median(t) for t in peer_rounds]
    if len(peer_ms) != len(row["ms_rounds"]):
        raise ValueError("pair_figures: expected one peer round per round of ours")
    row["peer_ms_rounds"] = peer_ms
    row["ratio_rounds"] = [p / o for p, o in zip(peer_ms, row["ms_rounds"])]
    row["pct_of_peer"] = 100.0 * median(row["ratio_rounds"])
    lo, hi = bootstrap_ci(row["ratio_rounds"], seed=seed)
    row["pct_of_peer_ci"] = [100.0 * lo, 100.0 * hi]


def _summarize(row: dict, raw_rounds: list[list[float]], case: Case) -> None:
    """Per-round medians, their median, TFLOP/s (case_flops) and spread, and the raw times."""
    row["ms_raw"] = [[round(t, 6) for t in times] for times in raw_rounds]
    row["ms_rounds"] = [median(times) for times in raw_rounds]
    row["ms"] = median(row["ms_rounds"])
    row["tflops"] = case_tflops(case, row["ms"])
    row["tflops_rounds"] = [case_tflops(case, ms) for ms in row["ms_rounds"]]
    row["spread_pct"] = spread_pct(row["ms_rounds"])


def same_run_pct(ours_ms: list[float], peer_ms: list[float]) -> float:
    """% of the peer's speed: 100 x median over rounds of (peer time / our time).

    Each ratio compares two medians taken seconds apart in one round, so clock and thermal
    drift between rounds cancels; 100 means on par, 50 means twice the peer's time.
    """
    if len(ours_ms) != len(peer_ms) or not ours_ms:
        raise ValueError("same_run_pct: expected one peer time per round")
    return 100.0 * median([peer / ours for ours, peer in zip(ours_ms, peer_ms)])


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


# --------------------------------------------------------------------------- output

def results_filename(result: dict) -> str:
    """<date>-<gpu>[-<set>].json, e.g. 2026-11-29-h200.json, 2026-12-01-h200-production.json."""
    date = str(result.get("date", ""))[:10] or _dt.date.today().isoformat()
    gpu = str(result.get("env", {}).get("gpu") or "gpu").lower().replace("nvidia", "")
    slug = re.sub(r"[^a-z0-9]+", "-", gpu).strip("-") or "gpu"
    suffix = f"-{result['set']}" if result.get("set") else ""
    return f"{date}-{slug}{suffix}.json"


def write_results(result: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def load_results(source) -> dict:
    """A benchmark results dict from a path (or the dict itself), checked for its shape.

    A file that is not JSON, or JSON that is not a benchmark result (a trace, `{}`), raises
    ValueError naming the file.
    """
    if isinstance(source, dict):
        return validate_results(source, "results")
    path = Path(source)
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON file ({exc})") from None
    return validate_results(data, str(path))


def validate_results(data, name: str) -> dict:
    if not (isinstance(data, dict) and isinstance(data.get("results"), list)
            and isinstance(data.get("shapes"), dict) and data["results"]
            and all(isinstance(r, dict) and "stage" in r and "shape" in r
                    for r in data["results"])):
        raise ValueError(f"{name}: not a ptxattn benchmark result (expected 'shapes' and a "
                         f"non-empty 'results' list of stage rows, as `ptxattn bench --out` "
                         f"writes)")
    return data


def filter_results(result: dict, stages=None, shapes=None) -> dict:
    """The same results restricted to some stages and shapes (for --from-json); a stage or
    shape that the results do not hold is a ValueError naming it."""
    out = dict(result)
    if stages:
        wanted = {_stages.get_stage(s).label for s in stages}
        have = {_base_label(r["stage"]) for r in result["results"]}
        missing = sorted(wanted - have)
        if missing:
            raise ValueError(f"stages: {', '.join(missing)} not in these results "
                             f"(they hold {', '.join(sorted(have))})")
        out["results"] = [r for r in out["results"] if _base_label(r["stage"]) in wanted]
    if shapes:
        names = []
        for text in shapes:
            key = str(text).strip().lower()
            if key not in result["shapes"]:
                raise ValueError(f"shapes: {text!r} not in these results "
                                 f"(they hold {', '.join(result['shapes'])})")
            names.append(key)
        out["shapes"] = {k: v for k, v in result["shapes"].items() if k in names}
        out["results"] = [r for r in out["results"] if r["shape"] in names]
        out["peer"] = [p for p in result.get("peer", []) if p["shape"] in names]
        if "cases" in result:
            out["cases"] = {k: v for k, v in result["cases"].items() if k in names}
        out["comparisons"] = [c for c in result.get("comparisons", [])
                              if c["case"] in names and c["versus"] in names]
    return out


def _base_label(label: str) -> str:
    """The kernel of a row label: "production+lse" -> "production"."""
    return label.split("+", 1)[0]


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ci(row: dict) -> str:
    ci = row.get("pct_of_peer_ci")
    return f"{ci[0]:.1f}-{ci[1]:.1f}" if ci else "-"


def _ours(row: dict) -> str:
    """The ours-vs-ours ratios of a row: "99.1% of stage14 (98.0-100.2)"."""
    return "; ".join(f"{x['pct']:.1f}% of {x['vs']} ({x['ci'][0]:.1f}-{x['ci'][1]:.1f})"
                     for x in row.get("ours_ratios", [])) or "-"


def format_table(result: dict) -> str:
    """kernel, case, ms, TFLOP/s, % of cuDNN (same run) with its 95% interval, ours vs ours
    (same rounds, 95% interval), spread over rounds, rel err ours and cuDNN's, check (ok /
    FAILED / n/a / error); then why rows were not timed, cross-case ratios, and the cases."""
    head = ("stage", "shape", "ms", "TFLOP/s", f"% {PEER}", "95% CI", "spread%", "rel err",
            f"rel err {PEER}", "check", "vs ours, same rounds (95% CI)")
    rows = []
    peers = {p["shape"]: p for p in result.get("peer", [])}
    order = list(result.get("shapes", {}))
    ours = sorted(result.get("results", []),
                  key=lambda r: (order.index(r["shape"]) if r["shape"] in order else 99,
                                 r.get("number", 0), r["stage"]))
    shown_peer = set()
    from . import sustained as _sus
    sustained = _sus.has_sustained(result)   # burst and sustained side by side
    if sustained:
        head = head[:6] + _sus.HEAD + head[6:]
    for r in ours:
        p = peers.get(r["shape"], {})
        if p and r["shape"] not in shown_peer:
            shown_peer.add(r["shape"])
            rows.append((PEER, p["shape"], _fmt(p.get("ms"), ".3f"), _fmt(p.get("tflops"), ".1f"),
                         "100.0" if p.get("ms") else "-", "", _fmt(p.get("spread_pct"), ".1f"),
                         _fmt(p.get("rel_l2"), ".1e"), "", _status(p), ""))
            if sustained:
                rows[-1] = rows[-1][:6] + _sus.cells(p) + rows[-1][6:]
        rows.append((f"{r['stage']} {r.get('name', '')}".strip(), r["shape"],
                     _fmt(r.get("ms"), ".3f"), _fmt(r.get("tflops"), ".1f"),
                     _fmt(r.get("pct_of_peer"), ".1f"), _ci(r), _fmt(r.get("spread_pct"), ".1f"),
                     _fmt(r.get("rel_l2"), ".1e"), _fmt(p.get("rel_l2"), ".1e"), _status(r),
                     _ours(r)))
        if sustained:
            rows[-1] = rows[-1][:6] + _sus.cells(r) + rows[-1][6:]
    lines = _columns(head, rows, left=2)
    if sustained:
        lines += _sus.notes(result)
    env = result.get("env", {})
    src = result.get("source") or {}
    proto = result.get("protocol", {})
    lines.insert(0, f"{env.get('gpu', '?')}, driver {env.get('driver_version', '?')}, "
                    + (f"set {result['set']}, " if result.get("set") else "")
                    + f"{proto.get('layout', '?')}, {result.get('date', '?')}"
                    + (f", cuDNN {env['cudnn']}" if env.get("cudnn") else "")
                    + (f", {proto['rounds']} rounds x {proto['reps']} reps"
                       if "rounds" in proto and "reps" in proto else "")
                    + (f", declared commit {src['declared_commit'][:12]}, tree "
                       f"{src['tree_sha256'][:12]}" if src.get("declared_commit") else
                       f", commit {src['commit'][:12]}{' (dirty)' if src.get('dirty') else ''}"
                       if src.get("commit") else
                       (f", tree {src['tree_sha256'][:12]}" if src.get("tree_sha256") else "")))
    if any(_status(r) == UNCHECKED for r in [*ours, *result.get("peer", [])]):
        lines.insert(1, f"check: {proto.get('check', UNCHECKED_PROTOCOL)}"
                        if str(proto.get("check", "")).startswith("off") else
                        "check: rows marked unchecked were timed without a check")
    for r in ours:
        if r.get("status") in ("skipped", "n/a", "error", "FAILED"):
            lines.append(f"{r['stage']} {r['shape']} {r['status']}: {r.get('reason', '')}")
    for p in result.get("peer", []):
        if p.get("status") in ("n/a", "error", "FAILED"):
            lines.append(f"{PEER} {p['shape']} {p['status']}: {p.get('reason', '')}")
        if p.get("gqa"):
            lines.append(f"{PEER} {p['shape']} GQA by {p['gqa']}")
    comparisons = result.get("comparisons", [])
    if comparisons:
        lines.append("across cases (production TFLOP/s, timed in different rounds: no "
                     "interval):")
        for c in comparisons:
            lines.append(f"  {c['case']} vs {c['versus']}: "
                         + (f"{c['pct']:.1f}% ({c['tflops']:.1f} / {c['versus_tflops']:.1f})"
                            if "pct" in c else c.get("status", "-")))
    cases = result.get("cases", {})
    if cases and any(c.get("causal") or c.get("window") or c.get("heads_kv") != c.get("heads")
                     or c.get("layout") != proto.get("layout") for c in cases.values()):
        lines.append("cases (B, H[:Hkv], Lq[xLk], D, layout, mask; FLOPs):")
        for name, c in cases.items():
            mask = (f"window {c['window'][0]},{c['window'][1]}" if c.get("window")
                    else "causal" if c.get("causal") else "dense")
            heads = f"{c['heads']}" + (f":{c['heads_kv']}" if c["heads_kv"] != c["heads"] else "")
            seq = f"{c['seq_q']}" + (f"x{c['seq_k']}" if c["seq_k"] != c["seq_q"] else "")
            lines.append(f"  {name}: {c['batch']}, {heads}, {seq}, {c['head_dim']}, "
                         f"{c['layout']}, {mask}; {c['flops']:.4g}")
    return "\n".join(lines)


def _columns(head, rows, left: int) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    return ["  ".join(f"{c:<{w}}" if i < left else f"{c:>{w}}" for i, (c, w) in
                      enumerate(zip(cells, widths))).rstrip() for cells in (head, *rows)]


def _status(row: dict) -> str:
    """ok / FAILED / unchecked / n/a / skipped / error. A row "ok" without a check result is
    unchecked (what --no-check wrote before it said so)."""
    if row.get("status") in ("skipped", "n/a", "error", "FAILED", UNCHECKED):
        return row["status"]
    if "pass" not in row:
        return UNCHECKED if row.get("status") == "ok" else ""
    return "ok" if row["pass"] else "FAILED"


# --------------------------------------------------------------------------- several runs

CASE_FIELDS = ("batch", "heads", "heads_kv", "seq_q", "seq_k", "head_dim", "layout", "mask",
               "dtype")


def case_identity(result: dict, name: str) -> dict:
    """The full case a result's shape name stands for: batch, heads, heads_kv, seq_q, seq_k,
    head_dim, layout, mask ("dense", "causal" or "window L,R") and dtype. From `cases` (schema
    3), else from `shapes` and the protocol's layout (older runs: dense MHA in bf16)."""
    case = (result.get("cases") or {}).get(name)
    if case is not None:
        window = case.get("window")
        mask = (f"window {window[0]},{window[1]}" if window else
                "causal" if case.get("causal") else "dense")
        return {"batch": case["batch"], "heads": case["heads"],
                "heads_kv": case.get("heads_kv") or case["heads"], "seq_q": case["seq_q"],
                "seq_k": case["seq_k"], "head_dim": case["head_dim"], "layout": case["layout"],
                "mask": mask, "dtype": case.get("dtype", "bfloat16")}
    dims = result.get("shapes", {}).get(name)
    layout = result.get("protocol", {}).get("layout")
    if dims is None or len(dims) not in (4, 5) or layout not in ("bhld", "bshd"):
        raise ValueError(f"from-json: cannot tell which case {name!r} is (no `cases` entry, "
                         f"shape {dims}, layout {layout!r})")
    b, h, lq, *rest = dims
    lk, d = rest if len(rest) == 2 else (lq, rest[0])
    return {"batch": b, "heads": h, "heads_kv": h, "seq_q": lq, "seq_k": lk, "head_dim": d,
            "layout": layout, "mask": "dense", "dtype": "bfloat16"}


def describe_identity(case: dict) -> str:
    """B, H[:Hkv], Lq[xLk], D, layout, mask, dtype on one line."""
    heads = f"{case['heads']}" + (f":{case['heads_kv']}" if case["heads_kv"] != case["heads"]
                                  else "")
    seq = f"{case['seq_q']}" + (f"x{case['seq_k']}" if case["seq_k"] != case["seq_q"] else "")
    return (f"B={case['batch']} H={heads} L={seq} D={case['head_dim']} {case['layout']} "
            f"{case['mask']} {case['dtype']}")


def combine_results(results, names=None) -> dict:
    """Ranges over two or more separate runs (separate machine starts), per stage and case.

    Rows are matched by the full case (CASE_FIELDS: B, H, Hkv, Lq, Lk, D, layout, mask,
    dtype), never by its name alone: a case name that stands for different cases in two runs
    is a ValueError naming both. Returns {"runs": [...], "shapes": [...], "cases": {name:
    case}, "rows": [...]}: each row has stage, number, name, shape, case, and over the runs
    where it was measured pct (the list of % of cuDNN), pct_range (min, max), tflops_range,
    and status: "FAILED" when any run's check failed it, "ok" when every run measured and
    checked it, "unchecked" when every run measured it and some did not check it (--no-check),
    else the first other status seen (skipped / error / missing). Headline figures are these
    ranges, never the best run.
    """
    names = list(names) if names is not None else [f"run {i + 1}" for i in range(len(results))]
    sources = list(results)
    results = [load_results(r) for r in results]
    if len(results) < 2:
        raise ValueError(f"from-json: combining needs at least 2 results files, got {len(results)}")
    shapes: list[str] = []
    cases: dict[str, dict] = {}               # case name -> its identity (the first run's)
    seen_in: dict[str, str] = {}
    keys: dict[tuple[str, str], dict] = {}
    for run, source, result in zip(names, sources, results):
        where = f"{run} ({source})" if isinstance(source, (str, Path)) else run
        for shape in result["shapes"]:
            identity = case_identity(result, shape)
            if shape not in cases:
                shapes.append(shape)
                cases[shape], seen_in[shape] = identity, where
            elif identity != cases[shape]:
                differ = ", ".join(f"{f} {cases[shape][f]} vs {identity[f]}" for f in CASE_FIELDS
                                   if cases[shape][f] != identity[f])
                raise ValueError(
                    f"from-json: case {shape!r} is {describe_identity(cases[shape])} in "
                    f"{seen_in[shape]} but {describe_identity(identity)} in {where} ({differ}): "
                    "runs of different cases are not combined; select the same cases "
                    "(--shapes) or combine runs of one case set")
        for r in result["results"]:
            keys.setdefault((r["stage"], r["shape"]), {"stage": r["stage"],
                            "number": r.get("number", 0), "name": r.get("name", "")})
    rows = []
    for (label, shape), base in keys.items():
        per_run = [next((r for r in res["results"] if r["stage"] == label and r["shape"] == shape),
                        None) for res in results]
        peers = [next((p for p in res.get("peer", []) if p["shape"] == shape), None)
                 for res in results]
        statuses = [("missing" if r is None else _status(r) or r.get("status", "ok"))
                    for r in per_run]
        measured = [r for r in per_run if r is not None and r.get("status") in TIMED
                    and r.get("ms")]
        pct = [r["pct_of_peer"] for r in measured if r.get("pct_of_peer") is not None]
        tf = [r["tflops"] for r in measured]
        peer_tf = [p["tflops"] for p in peers if p and p.get("tflops")]
        if "FAILED" in statuses:
            status = "FAILED"
        elif all(s == "ok" for s in statuses):
            status = "ok"
        elif all(s in TIMED for s in statuses):
            status = UNCHECKED
        else:
            status = next(s for s in statuses if s not in TIMED)
        ours: dict[str, list[float]] = {}
        for r in measured:
            for x in r.get("ours_ratios", []):
                ours.setdefault(x["vs"], []).append(x["pct"])
        from . import sustained as _sus
        sustained = _sus.combined_ranges(measured, peers) if any(
            "sustained" in r for r in measured) else {}
        rows.append({**base, **sustained, "shape": shape, "case": cases[shape],
                     "status": status, "runs": statuses,
                     "ours_ranges": {vs: [min(v), max(v)] for vs, v in ours.items()},
                     "pct": pct, "pct_range": [min(pct), max(pct)] if pct else None,
                     "tflops": tf, "tflops_range": [min(tf), max(tf)] if tf else None,
                     "peer_tflops_range": [min(peer_tf), max(peer_tf)] if peer_tf else None})
    rows.sort(key=lambda r: (shapes.index(r["shape"]), r["number"]))
    # a declared commit (the runner's, where the machine's .git is a stale copy) before git's
    runs = [{"name": n, "date": res.get("date"),
             "commit": (res.get("source") or {}).get("declared_commit")
             or (res.get("source") or {}).get("commit"),
             "tree_sha256": (res.get("source") or {}).get("tree_sha256"),
             "gpu": res.get("env", {}).get("gpu"), "cudnn": res.get("env", {}).get("cudnn"),
             "check": res.get("protocol", {}).get("check")}
            for n, res in zip(names, results)]
    return {"runs": runs, "shapes": shapes, "cases": cases, "rows": rows}


def format_range(lo_hi, unit: str = "", spec: str = ".1f") -> str:
    """(110.24, 112.4) -> '110.2-112.4%'; equal ends print once."""
    if not lo_hi:
        return "-"
    lo, hi = (format(x, spec) for x in lo_hi)
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def format_combined(combined: dict) -> str:
    """One line per stage and shape: % of cuDNN as a range over the runs, TFLOP/s range."""
    head = ("stage", "shape", f"% {PEER} (range)", "TFLOP/s (range)", f"{PEER} TFLOP/s", "runs",
            "vs ours (range)")
    from . import sustained as _sus
    sustained = any("sustained_tflops_range" in r for r in combined["rows"])
    if sustained:                                      # burst and sustained side by side
        head = head[:5] + _sus.COMBINED_HEAD + head[5:]
    rows = []
    for r in combined["rows"]:
        measured = r["status"] in TIMED
        ours = "; ".join(f"{format_range(v, '%')} of {vs}"
                         for vs, v in r.get("ours_ranges", {}).items())
        pct = format_range(r["pct_range"], "%")
        rows.append((f"{r['stage']} {r['name']}".strip(), r["shape"],
                     (pct if r["status"] == "ok" else f"{pct} {UNCHECKED}") if measured
                     else r["status"],
                     format_range(r["tflops_range"]) if measured else "-",
                     format_range(r["peer_tflops_range"]),
                     ",".join(r["runs"]), (ours or "-") if measured else "-"))
        if sustained:
            rows[-1] = rows[-1][:5] + _sus.combined_cells(r, format_range) + rows[-1][5:]
    lines = _columns(head, rows, left=2)
    if sustained:
        lines.append(f"note: {_sus.NOTE}")
    for i, run in enumerate(combined["runs"]):
        lines.insert(i, f"{run['name']}: {run.get('date', '?')}, {run.get('gpu', '?')}"
                        + (f", cuDNN {run['cudnn']}" if run.get("cudnn") else "")
                        + (f", commit {run['commit'][:12]}" if run.get("commit") else "")
                        + (f", tree {run['tree_sha256'][:12]}" if run.get("tree_sha256") else "")
                        + (f", check {run['check']}" if str(run.get("check") or "")
                           .startswith("off") else ""))
    if combined.get("cases"):
        lines.append("cases (B, H[:Hkv], L[xLk], D, layout, mask, dtype):")
        lines.extend(f"  {name}: {describe_identity(c)}" for name, c in combined["cases"].items())
    return "\n".join(lines)


def plot_progression(result_json, path) -> Path:
    """Stage on x, % of cuDNN per shape on y (TFLOP/s when no peer was measured); png or svg."""
    try:
        from matplotlib.figure import Figure   # no pyplot: no GUI backend, no global state
    except ImportError:
        from . import pip_extra
        raise MissingExtraError(f"plotting needs matplotlib: {pip_extra('plot')}") from None
    result = load_results(result_json)
    rows = [r for r in result.get("results", []) if r.get("status") in TIMED and r.get("ms")]
    unchecked = any(_status(r) == UNCHECKED for r in rows)
    if not rows:
        raise ValueError("results: no measured stage to plot")
    use_peer = any(r.get("pct_of_peer") for r in rows)
    key, ylabel = (("pct_of_peer", f"% of {PEER} (same run)") if use_peer
                   else ("tflops", "TFLOP/s"))
    stages_seen = sorted({(r["number"], r["stage"], r.get("name", "")) for r in rows})
    xs = {number: i for i, (number, _, _) in enumerate(stages_seen)}

    fig = Figure(figsize=(max(6.0, 0.6 * len(stages_seen) + 3), 4.2))
    ax = fig.add_subplot()
    for shape in result.get("shapes", {}):
        pts = sorted((xs[r["number"]], r[key]) for r in rows
                     if r["shape"] == shape and r.get(key) is not None)
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=shape)
    if use_peer:
        ax.axhline(100.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_ylim(bottom=0)                # progress reads against zero, not a zoomed band
    ax.set_xticks(range(len(stages_seen)))
    # names slanted, so that long ones (tma_store_epilogue) do not run into their neighbours
    ax.set_xticklabels([f"{n} {name}" for n, _, name in stages_seen], fontsize=8, rotation=30,
                       ha="right", rotation_mode="anchor")
    ax.set_xlabel("stage")
    ax.set_ylabel(ylabel)
    env = result.get("env", {})
    ax.set_title(f"ptxattn lineage on {env.get('gpu', '?')} ({str(result.get('date', ''))[:10]})"
                 + (", unchecked (--no-check)" if unchecked else ""), fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(title="shape", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The same results give the same file (it is committed): no date, fixed SVG ids.
    import matplotlib
    svg = path.suffix.lower() == ".svg"
    with matplotlib.rc_context({"svg.hashsalt": "ptxattn"}):
        fig.savefig(path, metadata={"Date": None} if svg else None)
    return path


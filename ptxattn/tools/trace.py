"""A measured timeline of one CTA: `ptxattn trace STAGE --out FILE.svg`.

A stage with trace points (`TRACE(EV_...)` lines, see ptx/sm90/include/trace.ptxh) built with
the define PTXATTN_TRACE=1 takes one more kernel parameter, `trace_buf`, after softmax_scale.
CTA (0, 0, 0) then writes one 32-byte record per event from lane 0 of the first warp of each
warpgroup (warps 0, 4, 8) into that warp's slot of the buffer:

    offset  w * TRACE_PER_WARP * 32 + i * 32      (slot of warp w, record i)
    record  u64 %clock64 | u64 %globaltimer (ns) | u32 event code | u32 warp | 8 bytes zero

A record whose code is 0 was never written (the buffer is zeroed before the launch). Without
the define every TRACE macro expands to nothing and the kernel is the untraced stage.

    >>> from ptxattn import trace
    >>> t = trace.record(12, batch=1, heads=16, seq_len=2048)     # needs the GPU
    >>> trace.render_svg(t, "trace-stage12.svg")                  # pure Python, no GPU
    >>> trace.intervals(t.events)                                 # (warp, kind, start, end)

Times: %clock64 is the SM's cycle counter (all records come from one CTA, so one SM, so one
counter); %globaltimer is in nanoseconds but may tick coarsely. The axis uses clock64 deltas,
converted with the globaltimer span over the same events (ns per cycle) when that span is at
least 20 us, else with the device's clock rate (else the short span, else in cycles).
"""

from __future__ import annotations

import html
import json
import math
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import stages as _stages

DEFINES = {"PTXATTN_TRACE": "1"}
TRACE_PER_WARP = 4096          # records per warp slot (trace.ptxh)
RECORD_BYTES = 32
MAX_WARPS = 16                 # slots in the buffer: one per warp of a CTA of up to 512 threads
BUFFER_BYTES = MAX_WARPS * TRACE_PER_WARP * RECORD_BYTES

# The event codes of trace.ptxh (#define EV_<NAME> <code>); tests/test_trace.py checks the two
# tables agree.
EVENTS: dict[int, str] = {
    1: "KV_WAIT",
    2: "KV_READY",
    3: "QK_ISSUE",
    4: "QK_DONE",
    5: "SOFTMAX_BEGIN",
    6: "SOFTMAX_END",
    7: "PV_ISSUE",
    8: "PV_DONE",
    9: "EPILOGUE_BEGIN",
    10: "EPILOGUE_END",
    11: "TMA_ISSUE",
    12: "EMPTY_WAIT",
    13: "EMPTY_READY",
    14: "TURN_WAIT",
    15: "TURN_GRANTED",
}
CODES: dict[str, int] = {name: code for code, name in EVENTS.items()}

RECORD_DTYPE = np.dtype([("clock", "<u8"), ("globaltimer", "<u8"), ("code", "<u4"),
                         ("warp", "<u4"), ("pad", "<u8")])
assert RECORD_DTYPE.itemsize == RECORD_BYTES


@dataclass(frozen=True)
class Kind:
    """A begin/end pair of events drawn as a bar (or, without `end`, a point drawn as a tick)."""
    name: str
    begin: str
    end: str | None
    label: str
    row: str
    color: str


# Bars that can overlap in time (a wgmma in flight while the same warps run the softmax) sit on
# different rows of their warpgroup's lane.
KINDS: tuple[Kind, ...] = (
    Kind("tma", "TMA_ISSUE", None, "TMA load issued", "tma", "#444444"),
    Kind("kv_wait", "KV_WAIT", "KV_READY", "wait for K/V (FULL barrier)", "wait", "#d62728"),
    Kind("empty_wait", "EMPTY_WAIT", "EMPTY_READY", "wait for a free slot (EMPTY barrier)", "wait",
         "#e377c2"),
    Kind("turn_wait", "TURN_WAIT", "TURN_GRANTED", "wait for the pingpong turn", "wait",
         "#8c564b"),
    Kind("qk", "QK_ISSUE", "QK_DONE", "S = Q K\u1d40: issue \u2192 done", "qk", "#1f77b4"),
    Kind("softmax", "SOFTMAX_BEGIN", "SOFTMAX_END", "softmax", "cuda", "#ff7f0e"),
    Kind("epilogue", "EPILOGUE_BEGIN", "EPILOGUE_END", "epilogue (O out)", "cuda", "#9467bd"),
    Kind("pv", "PV_ISSUE", "PV_DONE", "O += P V: issue \u2192 done", "pv", "#2ca02c"),
)
KIND_BY_NAME = {k.name: k for k in KINDS}
_BEGINS = {k.begin: k for k in KINDS if k.end}
_ENDS = {k.end: k for k in KINDS if k.end}
_POINTS = {k.begin: k for k in KINDS if k.end is None}

ROWS: tuple[tuple[str, str], ...] = (
    ("tma", "TMA issue"),
    ("wait", "waits"),
    ("qk", "QK\u1d40 (wgmma)"),
    ("cuda", "softmax, epilogue"),
    ("pv", "PV (wgmma)"),
)


# --------------------------------------------------------------------------- events

@dataclass(frozen=True)
class Event:
    warp: int                  # warp index in the CTA (0, 4, 8: one per warpgroup)
    clock: int                 # %clock64 (SM cycles)
    globaltimer: int           # %globaltimer (ns)
    code: int

    @property
    def name(self) -> str:
        return EVENTS.get(self.code, f"EVENT_{self.code}")

    def to_dict(self) -> dict:
        return {"warp": self.warp, "clock": self.clock, "globaltimer": self.globaltimer,
                "code": self.code, "event": self.name}


def _records(raw) -> np.ndarray:
    data = raw if isinstance(raw, np.ndarray) else np.frombuffer(bytes(raw), np.uint8)
    data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if data.size % RECORD_BYTES:
        raise ValueError(f"trace buffer: expected a multiple of {RECORD_BYTES} bytes (one record "
                         f"each), got {data.size}")
    return data.view(RECORD_DTYPE)


def parse(raw) -> list[Event]:
    """The events in a trace buffer (bytes or a uint8 array), warp by warp, in program order.

    Records with code 0 are empty and skipped. The warp of an event is the one the kernel
    wrote into the record (it is also the slot it sits in).
    """
    rec = _records(raw)
    return [Event(int(r["warp"]), int(r["clock"]), int(r["globaltimer"]), int(r["code"]))
            for r in rec[rec["code"] != 0]]


def full_slots(raw) -> tuple[int, ...]:
    """Warps whose slot is full: their later events were dropped by the kernel."""
    rec = _records(raw)
    slots = rec.size // TRACE_PER_WARP
    return tuple(w for w in range(slots) if rec[(w + 1) * TRACE_PER_WARP - 1]["code"] != 0)


def pack(events, warps: int = MAX_WARPS) -> bytes:
    """The buffer a kernel would have written for `events` (tests, replays)."""
    rec = np.zeros(warps * TRACE_PER_WARP, RECORD_DTYPE)
    used = [0] * warps
    for e in events:
        i = e.warp * TRACE_PER_WARP + used[e.warp]
        used[e.warp] += 1
        rec[i] = (e.clock, e.globaltimer, e.code, e.warp, 0)
    return rec.tobytes()


# --------------------------------------------------------------------------- intervals

@dataclass(frozen=True)
class Interval:
    warp: int
    kind: str                  # a Kind name: "qk", "softmax", ... ("tma": a point, start == end)
    start: int                 # clock64
    end: int
    index: int                 # 0, 1, 2 ... per (warp, kind)

    @property
    def row(self) -> str:
        return KIND_BY_NAME[self.kind].row


class UnbalancedTraceError(ValueError):
    """An end event without its begin, or a begin never ended (intervals(strict=True))."""


def intervals(events, strict: bool = False) -> list[Interval]:
    """Pair begin/end events per warp, in order; TMA issues become zero-length intervals.

    Each kind pairs first-in first-out within its warp, so a QK^T issued before the softmax of
    the previous tile and waited for after it pairs correctly. Unpaired events are dropped (a
    full slot cuts the last tile short), or raise UnbalancedTraceError with strict=True.
    """
    out: list[Interval] = []
    open_: dict[tuple[int, str], deque[Event]] = {}
    count: dict[tuple[int, str], int] = {}

    def add(warp, kind, start, end):
        n = count.get((warp, kind.name), 0)
        count[(warp, kind.name)] = n + 1
        out.append(Interval(warp, kind.name, start, end, n))

    for e in events:
        name = e.name
        if name in _POINTS:
            add(e.warp, _POINTS[name], e.clock, e.clock)
        elif name in _BEGINS:
            open_.setdefault((e.warp, _BEGINS[name].name), deque()).append(e)
        elif name in _ENDS:
            kind = _ENDS[name]
            queue = open_.get((e.warp, kind.name))
            if not queue:
                if strict:
                    raise UnbalancedTraceError(f"warp {e.warp}: {name} at clock {e.clock} has "
                                               f"no {kind.begin} before it")
                continue
            begin = queue.popleft()
            add(e.warp, kind, begin.clock, e.clock)
        elif strict:
            raise UnbalancedTraceError(f"warp {e.warp}: unknown event code {e.code}")
    if strict:
        left = [(w, KIND_BY_NAME[k].begin, len(q)) for (w, k), q in open_.items() if q]
        if left:
            w, begin, n = left[0]
            raise UnbalancedTraceError(f"warp {w}: {n} x {begin} never ended")
    out.sort(key=lambda i: (i.warp, i.start, i.end))
    return out


# --------------------------------------------------------------------------- a recorded trace

def role(warp: int, threads: int) -> str:
    """What the warpgroup of `warp` does in a stage with `threads` threads per CTA."""
    wg = warp // 4
    if threads <= 128:
        return f"warpgroup {wg}: computes, thread 0 issues TMA"
    if wg == 0:
        return "producer (warpgroup 0)"
    return f"consumer {wg - 1} (warpgroup {wg})"


def traced_warps(threads: int) -> tuple[int, ...]:
    """The warps that record: lane 0 of the first warp of each warpgroup."""
    return tuple(range(0, threads // 32, 4))


@dataclass
class Trace:
    stage: int
    name: str
    threads: int
    shape: tuple[int, int, int, int, int]          # (batch, heads, seq_q, seq_k, head_dim)
    layout: str
    events: list[Event]
    gpu: str | None = None
    clock_khz: int | None = None                   # device clock rate: fallback ns/cycle
    kernel_ms: float | None = None                 # the whole traced launch (CUDA events)
    truncated: tuple[int, ...] = ()                # warps whose slot filled up
    check: dict | None = None                      # error figures of the traced launch's output
    extra: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"stage{self.stage:02d}"

    def _timebase(self) -> tuple[float | None, str]:
        measured, ns = None, 0
        if self.events:
            first = min(self.events, key=lambda e: (e.clock, e.globaltimer))
            last = max(self.events, key=lambda e: (e.clock, e.globaltimer))
            cycles, ns = last.clock - first.clock, last.globaltimer - first.globaltimer
            if cycles > 0 and ns > 0 and 0.05 < ns / cycles < 20:
                measured = ns / cycles
        # %globaltimer may tick as coarsely as 1 us: trust its span from 20 us on
        if measured is not None and ns >= 20_000:
            return measured, "globaltimer"
        if self.clock_khz:
            return 1e6 / self.clock_khz, "device clock rate"
        if measured is not None:
            return measured, "globaltimer, short span"
        return None, "none"

    @property
    def ns_per_cycle(self) -> float | None:
        """Measured from the globaltimer span, else from clock_khz, else None (axis in cycles)."""
        return self._timebase()[0]

    @property
    def ns_per_cycle_source(self) -> str:
        """"globaltimer", "device clock rate", "globaltimer, short span" or "none"."""
        return self._timebase()[1]

    @property
    def span_cycles(self) -> int:
        if not self.events:
            return 0
        return max(e.clock for e in self.events) - min(e.clock for e in self.events)

    @property
    def span_us(self) -> float | None:
        npc = self.ns_per_cycle
        return None if npc is None else self.span_cycles * npc / 1000.0

    def warps(self) -> list[int]:
        return sorted({e.warp for e in self.events})

    def lane(self, warp: int) -> list[Event]:
        return [e for e in self.events if e.warp == warp]

    def intervals(self, strict: bool = False) -> list[Interval]:
        return intervals(self.events, strict=strict)

    def to_dict(self) -> dict:
        t0 = min((e.clock for e in self.events), default=0)
        npc = self.ns_per_cycle
        return {
            "format": "ptxattn-trace/1",
            "stage": self.stage, "label": self.label, "name": self.name, "threads": self.threads,
            "shape": dict(zip(("batch", "heads", "seq_q", "seq_k", "head_dim"), self.shape)),
            "layout": self.layout, "gpu": self.gpu, "clock_khz": self.clock_khz,
            "kernel_ms": self.kernel_ms, "ns_per_cycle": npc, "span_us": self.span_us,
            "truncated_warps": list(self.truncated), "check": self.check,
            "roles": {str(w): role(w, self.threads) for w in self.warps()},
            "events": [e.to_dict() for e in self.events],
            "intervals": [{"warp": i.warp, "kind": i.kind, "index": i.index,
                           "start_cycles": i.start - t0, "end_cycles": i.end - t0,
                           **({"start_us": (i.start - t0) * npc / 1000,
                               "end_us": (i.end - t0) * npc / 1000} if npc else {})}
                          for i in self.intervals()],
            **self.extra,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Trace":
        if d.get("format") != "ptxattn-trace/1":
            raise ValueError(f"trace: expected a ptxattn trace JSON (format ptxattn-trace/1), "
                             f"got format {d.get('format')!r}")
        s = d["shape"]
        return cls(stage=int(d["stage"]), name=d["name"], threads=int(d["threads"]),
                   shape=(s["batch"], s["heads"], s["seq_q"], s["seq_k"], s["head_dim"]),
                   layout=d["layout"],
                   events=[Event(int(e["warp"]), int(e["clock"]), int(e["globaltimer"]),
                                 int(e["code"])) for e in d["events"]],
                   gpu=d.get("gpu"), clock_khz=d.get("clock_khz"), kernel_ms=d.get("kernel_ms"),
                   truncated=tuple(d.get("truncated_warps", ())), check=d.get("check"))

    def write_json(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def read_json(cls, path) -> "Trace":
        return cls.from_dict(json.loads(Path(path).read_text()))


# --------------------------------------------------------------------------- stages, recording

_TRACE_POINT = re.compile(r"^\s*TRACE\(", re.M)


def has_trace_points(stage) -> bool:
    """True when the stage's sources (its .ptx file and what it includes) have TRACE(...) lines."""
    from .. import ptx
    stage = _stages.get_stage(stage)
    path = _stages.ptx_root() / stage.file
    return path.is_file() and bool(_TRACE_POINT.search(ptx.source_text(stage)))


def traced_stages() -> list[_stages.Stage]:
    return [s for s in _stages.all_stages() if has_trace_points(s)]


def check_traced(stage) -> _stages.Stage:
    """The stage, or a ValueError that names the stages that can be traced."""
    stage = _stages.get_stage(stage)
    if not has_trace_points(stage):
        names = ", ".join(f"{s.label} ({s.name})" for s in traced_stages()) or "none"
        raise ValueError(f"stage: {stage.label} ({stage.name}) has no trace points (no TRACE(...) "
                         f"lines in ptx/{stage.file} or its includes); stages with trace points: {names}")
    return stage


def record(stage, *, batch: int = 1, heads: int = 16, seq_len: int = 2048,
           seq_k: int | None = None, head_dim: int = 128, layout: str = "bhld", seed: int = 0,
           check: bool = True) -> Trace:
    """Run a traced build of `stage` once on random inputs and return the timeline of CTA 0.

    The traced kernel is launched twice: a warm-up (JIT, caches) and the traced launch, with
    the buffer zeroed before each. With `check`, the traced launch's output is compared with
    the float64 reference (tracing must not change the result).
    """
    from .. import api, driver, launch, reference
    from . import bench

    st = check_traced(stage)
    seq_q, seq_k = seq_len, seq_k or seq_len
    why = st.unsupported(head_dim, seq_q, seq_k)
    if why:
        raise ValueError(f"shape: {st.label} ({st.name}) cannot run {why}")
    info = driver.device_info()                     # the clear "no GPU" error comes from here

    q, k, v = reference.random_qkv(batch, heads, seq_q, seq_k, head_dim, layout, seed)
    buf = driver.DeviceBuffer(BUFFER_BYTES)
    try:
        prepared = api.prepare(q, k, v, stage=st, layout=layout, defines=dict(DEFINES),
                               extra_params=((buf.ptr, launch.TRACE_BUF.ctype),))
        stream = prepared.stream
        driver.memset_u8(buf.ptr, 0, BUFFER_BYTES, stream=stream)
        prepared.launch()                           # warm-up
        driver.memset_u8(buf.ptr, 0, BUFFER_BYTES, stream=stream)
        timer = driver.EventPair()
        timer.start(stream)
        prepared.launch()
        timer.stop(stream)
        kernel_ms = timer.elapsed_ms()
        raw = np.empty(BUFFER_BYTES, np.uint8)
        driver.memcpy_dtoh(raw, buf.ptr, stream=stream)
        metrics = None
        if check:
            out = prepared.out.to_numpy()
            metrics = bench.check_output(q, k, v, out, layout)
    finally:
        buf.close()
    # the build that ran: the production kernel's CTA differs per head dim (D = 64: 512 threads)
    return Trace(stage=st.number, name=st.name, threads=st.specialize(head_dim).threads,
                 shape=(batch, heads, seq_q, seq_k, head_dim), layout=layout, events=parse(raw),
                 gpu=info.get("name"), clock_khz=info.get("clock_khz"), kernel_ms=kernel_ms,
                 truncated=full_slots(raw), check=metrics)


# --------------------------------------------------------------------------- many stages

COLLECTION_FORMAT = "ptxattn-traces/1"


@dataclass
class Collection:
    """Traces of several stages, recorded in one session on the same shape (one JSON file:
    bench/results/traces-<date>-<gpu>.json). `errors` holds, per stage number, why a stage
    gave no trace (the others are still kept)."""
    traces: dict[int, Trace]
    errors: dict[int, str] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def get(self, stage) -> Trace:
        st = _stages.get_stage(stage)
        if st.number not in self.traces:
            have = ", ".join(f"stage{n:02d}" for n in sorted(self.traces)) or "none"
            why = f" (it failed: {self.errors[st.number]})" if st.number in self.errors else ""
            raise ValueError(f"stage: no trace of {st.label} in this file{why}; it has: {have}")
        return self.traces[st.number]

    def to_dict(self) -> dict:
        # intervals are derived from the events: left out to halve the file
        def lean(tr: Trace) -> dict:
            d = tr.to_dict()
            d.pop("intervals", None)
            return d
        return {"format": COLLECTION_FORMAT, **self.meta,
                "errors": {str(k): v for k, v in sorted(self.errors.items())},
                "traces": [lean(self.traces[k]) for k in sorted(self.traces)]}

    @classmethod
    def from_dict(cls, d: dict) -> "Collection":
        if d.get("format") == "ptxattn-trace/1":          # one trace: a collection of one
            tr = Trace.from_dict(d)
            return cls({tr.stage: tr})
        if d.get("format") != COLLECTION_FORMAT:
            raise ValueError(f"trace: expected a ptxattn trace JSON (format ptxattn-trace/1 or "
                             f"{COLLECTION_FORMAT}), got format {d.get('format')!r}")
        traces = [Trace.from_dict(t) for t in d.get("traces", [])]
        meta = {k: v for k, v in d.items() if k not in ("format", "errors", "traces")}
        return cls({tr.stage: tr for tr in traces},
                   {int(k): v for k, v in d.get("errors", {}).items()}, meta)

    def write_json(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # one trace per line: small diffs when a stage is re-recorded
        doc = self.to_dict()
        traces = doc.pop("traces")
        head = json.dumps(doc, sort_keys=True)[:-1]
        body = ",\n".join(json.dumps(t, separators=(",", ":")) for t in traces)
        path.write_text(f'{head}, "traces": [\n{body}\n]}}\n')
        return path

    @classmethod
    def read_json(cls, path) -> "Collection":
        return cls.from_dict(json.loads(Path(path).read_text()))


def record_all(stage_list=None, *, progress=None, **shape) -> Collection:
    """record() every traced stage (or those given) on the same shape, in one process.

    A stage that fails (JIT error, failed check is NOT a failure: its trace keeps the check)
    is noted in `errors` and the others go on. `progress(text)` is called per stage."""
    import time
    chosen = [_stages.get_stage(s) for s in stage_list] if stage_list else traced_stages()
    col = Collection({}, meta={"shape_args": dict(shape),
                               "recorded": time.strftime("%Y-%m-%d %H:%M:%S")})
    for st in chosen:
        try:
            tr = record(st, **shape)
        except Exception as exc:      # noqa: BLE001 - one stage's failure must not lose the rest
            col.errors[st.number] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if progress:
                progress(f"{st.label}: FAILED {col.errors[st.number]}")
            continue
        col.traces[st.number] = tr
        if progress:
            progress(summary(tr))
    return col


# --------------------------------------------------------------------------- SVG

_W = 1200                  # picture width
_GUTTER = 250              # lane and row labels on the left
_RIGHT = 30
_TOP = 62
_ROW_H = 14
_ROW_GAP = 4
_LANE_HEAD = 18            # lane title above its rows
_LANE_GAP = 14


def _nice_step(span: float, target: int = 10) -> float:
    raw = span / max(target, 1)
    if raw <= 0:
        return 1.0
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)


def _check_svg_path(path) -> None:
    if path is not None and Path(path).suffix.lower() != ".svg":
        raise ValueError(f"path: the timeline is SVG; name the file *.svg, got {str(path)!r}")


def _time_fn(trace: Trace):
    """(unit, t) for one trace: t(clock) is the time since its first event, in us (kcycles
    when no ns/cycle is known)."""
    npc = trace.ns_per_cycle
    t0 = min((e.clock for e in trace.events), default=0)
    if npc:
        return "\u00b5s", lambda clock: (clock - t0) * npc / 1000.0
    return "kcycles", lambda clock: (clock - t0) / 1000.0


def _draw_lanes(trace: Trace, y: float, x, parts: list[str], legend_kinds: list[Kind],
                lane_title=None) -> float:
    """The lanes of one trace from height y down (one per recording warpgroup); returns the
    y below them. x maps a time (in the trace's unit) to a picture coordinate."""
    unit, t = _time_fn(trace)
    ivs = trace.intervals()
    lanes = trace.warps()
    for warp in lanes:
        mine = [i for i in ivs if i.warp == warp]
        rows = [r for r in ROWS if any(i.row == r[0] for i in mine)]
        n_events = sum(1 for e in trace.events if e.warp == warp)
        height = _LANE_HEAD + max(len(rows), 1) * (_ROW_H + _ROW_GAP)
        title = role(warp, trace.threads) if lane_title is None else lane_title(warp)
        parts.append(f'<rect x="4" y="{y - 4}" width="{_W - 8}" height="{height + 4}" '
                     f'fill="#f4f4f4" rx="3"/>')
        parts.append(f'<text x="10" y="{y + 10}" font-size="12" font-weight="bold">'
                     f'{_esc(title)}</text>')
        parts.append(f'<text x="{_W - _RIGHT}" y="{y + 10}" font-size="10" fill="#666" '
                     f'text-anchor="end">warp {warp}, {n_events} events'
                     f'{" (slot full: later events lost)" if warp in trace.truncated else ""}'
                     f'</text>')
        ry = y + _LANE_HEAD
        for row, row_label in rows:
            parts.append(f'<text x="{_GUTTER - 8}" y="{ry + _ROW_H - 3}" font-size="10" '
                         f'text-anchor="end" fill="#333">{_esc(row_label)}</text>')
            for i in (i for i in mine if i.row == row):
                kind = KIND_BY_NAME[i.kind]
                if kind not in legend_kinds:
                    legend_kinds.append(kind)
                a, b = t(i.start), t(i.end)
                if kind.end is None:
                    xa = x(a)
                    parts.append(f'<line x1="{_fmt(xa)}" y1="{ry}" x2="{_fmt(xa)}" '
                                 f'y2="{ry + _ROW_H}" stroke="{kind.color}" stroke-width="1.5">'
                                 f'<title>{_esc(kind.label)} #{i.index}: {_fmt(a)} {unit}'
                                 f'</title></line>')
                    continue
                xa, xb = x(a), x(b)
                parts.append(f'<rect x="{_fmt(xa)}" y="{ry}" width="{_fmt(max(xb - xa, 0.6))}" '
                             f'height="{_ROW_H}" fill="{kind.color}"><title>{_esc(kind.label)} '
                             f'#{i.index}: {_fmt(a)} \u2192 {_fmt(b)} {unit} '
                             f'({_fmt(b - a)} {unit})</title></rect>')
            ry += _ROW_H + _ROW_GAP
        y += height + _LANE_GAP
    if not lanes:
        parts.append(f'<text x="{_GUTTER}" y="{y + 14}" font-size="12" fill="#a00">no events '
                     f'recorded</text>')
        y += 30
    return y


def _subtitle(trace: Trace, with_shape: bool = True) -> str:
    b, h, lq, lk, d = trace.shape
    npc = trace.ns_per_cycle
    sub = [f"B={b} H={h} Lq={lq} Lk={lk} D={d} {trace.layout}"] if with_shape else []
    sub.append("CTA (0, 0, 0)")
    if trace.kernel_ms is not None:
        sub.append(f"whole kernel {trace.kernel_ms:.3f} ms")
    if trace.gpu and with_shape:
        sub.append(trace.gpu)
    if npc:
        sub.append(f"clock64 at {npc:.3f} ns/cycle ({trace.ns_per_cycle_source})")
    else:
        sub.append("clock64 cycles (no ns/cycle measured)")
    if trace.truncated:
        sub.append(f"warps {', '.join(map(str, trace.truncated))} ran out of trace slots")
    return " \u00b7 ".join(sub)


def _span_text(trace: Trace) -> str:
    unit, t = _time_fn(trace)
    span = t(min((e.clock for e in trace.events), default=0) + trace.span_cycles)
    return f"{span:.1f} {unit}"


def _picture(traces, title: str, subtitle: str, headed: bool, path) -> str:
    """The SVG of one or more traces stacked on one time axis (each from its first event)."""
    _check_svg_path(path)
    units = {_time_fn(tr)[0] for tr in traces}
    if len(units) > 1:
        raise ValueError("traces: cannot share a time axis between a trace in \u00b5s and one in "
                         "cycles (one has no ns/cycle)")
    unit = units.pop()
    span = 0.0
    for tr in traces:
        _, t = _time_fn(tr)
        span = max(span, t(min((e.clock for e in tr.events), default=0) + tr.span_cycles))
    scale_span = span if span > 0 else 1.0
    plot_w = _W - _GUTTER - _RIGHT

    def x(value: float) -> float:
        return _GUTTER + value / scale_span * plot_w

    parts: list[str] = []
    legend_kinds: list[Kind] = []
    y = _TOP
    for tr in traces:
        if headed:
            parts.append(f'<text x="10" y="{y + 4}" font-size="13" font-weight="bold">'
                         f'{_esc(f"{tr.label} {tr.name}: {_span_text(tr)}")}</text>')
            # the subtitle on a line of its own: beside a long header it ran into it
            parts.append(f'<text x="10" y="{y + 18}" font-size="10" fill="#555">'
                         f'{_esc(_subtitle(tr, with_shape=False))}</text>')
            y += 30
            y = _draw_lanes(tr, y, x, parts, legend_kinds,
                            lane_title=lambda w, tr=tr: f"{tr.label}: {role(w, tr.threads)}")
            y += 6
        else:
            y = _draw_lanes(tr, y, x, parts, legend_kinds)

    # time axis, with grid lines through the lanes
    axis_y = y
    step = _nice_step(scale_span)
    grid = [f'<line x1="{_GUTTER}" y1="{axis_y}" x2="{_W - _RIGHT}" y2="{axis_y}" '
            f'stroke="#000"/>']
    k = 0
    while k * step <= scale_span * 1.0000001:
        value = k * step
        gx = _fmt(x(value))
        grid.append(f'<line x1="{gx}" y1="{_TOP - 6}" x2="{gx}" y2="{axis_y}" stroke="#ddd" '
                    f'stroke-width="0.6"/>')
        grid.append(f'<line x1="{gx}" y1="{axis_y}" x2="{gx}" y2="{axis_y + 5}" stroke="#000"/>')
        grid.append(f'<text x="{gx}" y="{axis_y + 17}" font-size="10" text-anchor="middle">'
                    f'{_fmt(round(value, 9))}</text>')
        k += 1
    grid.append(f'<text x="{_GUTTER + plot_w / 2:.1f}" y="{axis_y + 33}" font-size="11" '
                f'text-anchor="middle">time since the first event ({unit})</text>')
    y = axis_y + 50

    # legend, in rows that wrap, in the order of KINDS
    legend_kinds.sort(key=KINDS.index)
    legend: list[str] = []
    lx = _GUTTER
    for kind in legend_kinds:
        w = 22 + 6.2 * len(kind.label) + 18
        if lx + w > _W - _RIGHT and lx > _GUTTER:
            lx, y = _GUTTER, y + 18
        if kind.end is None:
            legend.append(f'<line x1="{lx + 6}" y1="{y - 10}" x2="{lx + 6}" y2="{y + 2}" '
                          f'stroke="{kind.color}" stroke-width="1.5"/>')
        else:
            legend.append(f'<rect x="{lx}" y="{y - 10}" width="12" height="12" '
                          f'fill="{kind.color}"/>')
        legend.append(f'<text x="{lx + 18}" y="{y}" font-size="11">{_esc(kind.label)}</text>')
        lx += w
    height = y + 16

    head = [f'<text x="10" y="24" font-size="15" font-weight="bold">{_esc(title)}</text>',
            f'<text x="10" y="44" font-size="11" fill="#444">{_esc(subtitle)}</text>']
    svg = "\n".join([
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{height:.0f}" '
        f'viewBox="0 0 {_W} {height:.0f}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">',
        f'<title>{_esc(title)}</title>',
        f'<rect width="{_W}" height="{height:.0f}" fill="#ffffff"/>',
        *head, *parts, *grid, *legend, "</svg>", ""])
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(svg, encoding="utf-8")
    return svg


def render_svg(trace: Trace, path=None) -> str:
    """The timeline as SVG text (written to `path` when given). Pure Python, no GPU.

    One lane per warpgroup that recorded (producer, consumer 0, consumer 1; stages 1-3: their
    one warpgroup), each with a row per kind of work that can overlap: TMA issues (ticks),
    barrier waits, QK^T in flight, softmax/epilogue, PV in flight. Hover a bar for its times.
    `path` must end in .svg: the file holds SVG, whatever it is called.
    """
    _check_svg_path(path)
    title = f"{trace.label} {trace.name}: one CTA's timeline, {_span_text(trace)}"
    return _picture([trace], title, _subtitle(trace), headed=False, path=path)


def render_compare_svg(traces, path=None) -> str:
    """Two (or more) stages' timelines one above the other on ONE time axis, each from its own
    first event, so that lengths compare directly. Pure Python, no GPU. The traces must be of
    the same shape and layout (the same CTA's work), else the comparison means nothing."""
    traces = list(traces)
    if len(traces) < 2:
        raise ValueError(f"traces: a comparison needs at least two, got {len(traces)}")
    shapes = {(tr.shape, tr.layout) for tr in traces}
    if len(shapes) > 1:
        got = ", ".join(f"{tr.label} {'x'.join(map(str, tr.shape))} {tr.layout}" for tr in traces)
        raise ValueError(f"traces: compare the same shape and layout; got {got}")
    first = traces[0]
    b, h, lq, lk, d = first.shape
    names = " vs ".join(f"{tr.label} ({_span_text(tr)})" for tr in traces)
    title = f"{names}: CTA (0, 0, 0) on one time axis"
    sub = [f"B={b} H={h} Lq={lq} Lk={lk} D={d} {first.layout}"]
    gpus = sorted({tr.gpu for tr in traces if tr.gpu})
    sub += gpus
    return _picture(traces, title, " \u00b7 ".join(sub), headed=True, path=path)


def summary(trace: Trace) -> str:
    """A few lines for the terminal: per lane, each kind's count and summed time
    (`empty_wait 60x 41.2 us`: 60 waits, 41.2 µs in all; kcycles when no clock rate is known)."""
    npc = trace.ns_per_cycle
    unit = "us" if npc else "kcycles"

    def dur(cycles: int) -> float:
        return cycles * npc / 1000.0 if npc else cycles / 1000.0

    lines = [f"{trace.label} {trace.name}: {len(trace.events)} events from CTA (0, 0, 0), "
             f"span {dur(trace.span_cycles):.1f} {unit}"
             + (f", whole kernel {trace.kernel_ms:.3f} ms" if trace.kernel_ms is not None else "")]
    ivs = trace.intervals()
    for warp in trace.warps():
        totals: dict[str, tuple[int, int]] = {}
        for i in ivs:
            if i.warp == warp:
                n, c = totals.get(i.kind, (0, 0))
                totals[i.kind] = (n + 1, c + i.end - i.start)
        parts = [f"{k} {n}x" + (f" {dur(c):.1f} {unit}" if KIND_BY_NAME[k].end else "")
                 for k, (n, c) in totals.items()]
        lines.append(f"  warp {warp:>2} {role(warp, trace.threads)}: " + ", ".join(parts))
    if trace.truncated:
        lines.append(f"  warning: warps {', '.join(map(str, trace.truncated))} filled their "
                     f"{TRACE_PER_WARP} trace slots; later events were not recorded "
                     f"(use a shorter sequence)")
    return "\n".join(lines)

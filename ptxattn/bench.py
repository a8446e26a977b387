"""Benchmarking stages: event timing, TFLOP/s, same-run ratios against cuDNN.

The protocol (bench/README.md): CUDA events around each launch, warm-ups first,
the median of the reps; FLOPs = 4·B·H·Lq·Lk·D; inputs random normal bf16; the peer is cuDNN
attention through PyTorch's SDPA in the same process, timed in the same rounds as our stages,
so that "% of cuDNN" compares launches seconds apart on the same clocks.

PyTorch is a peer here, never a dependency: it is imported inside run_benchmark() only, and
without it the inputs come from NumPy and the results have no peer column.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import platform
import re
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Callable

from . import stages as _stages
from .errors import PtxattnError

# name -> (batch, heads, seq_len, head_dim); seq_q = seq_k = seq_len.
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "512": (16, 16, 512, 128),     # launch-bound: few tiles per CTA
    "1k": (8, 16, 1024, 128),
    "4k": (8, 16, 4096, 128),
    "8k": (4, 16, 8192, 128),
    "16k": (2, 16, 16384, 128),
}
DEFAULT_SHAPES = ("4k", "8k", "16k")
PEER = "cuDNN"


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
    return attention_flops(batch, heads, seq_q, seq_k, head_dim) / (ms * 1e-3) / 1e12


# --------------------------------------------------------------------------- timing

class EventTimer:
    """CUDA events (ptxattn.driver.Event) recorded on one stream: by default the legacy default
    stream, which is also PyTorch's default stream, so timed work and events are ordered."""

    def __init__(self, stream=None):
        from . import driver
        self._driver = driver
        self._stream = driver.stream_handle(stream)
        self._events: list = []

    def mark(self):
        event = self._driver.Event().record(self._stream)
        self._events.append(event)
        return event

    def elapsed_ms(self, start, end) -> float:
        return self._driver.elapsed_ms(start, end)

    def close(self):
        for event in self._events:
            event.close()
        self._events.clear()


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


def median(values) -> float:
    return float(statistics.median(values))


# --------------------------------------------------------------------------- correctness

def _rows_for_check(seq_q: int, max_rows: int) -> slice:
    """Every row up to max_rows, else an evenly strided subset (rows are independent)."""
    step = -(-seq_q // max_rows)
    return slice(0, seq_q, step)


def _host_f32(x):
    """A NumPy float32 copy of a slice of a torch tensor or NumPy array."""
    import numpy as np
    if hasattr(x, "detach"):                       # torch.Tensor (bf16 -> f32 is exact)
        return x.detach().float().cpu().numpy()
    return np.asarray(x).astype(np.float32)


def _pick(x, layout: str, b: int, h: int, rows):
    """[rows, D] of (batch b, head h) in either layout."""
    return x[b, h, rows, :] if layout == "bhld" else x[b, rows, h, :]


def check_subset(shape: tuple[int, int, int, int], max_rows: int = 4096) -> dict:
    """What is checked on a shape: first/last batch, first/last head, up to max_rows rows."""
    batch, heads, seq, _ = shape
    return {"batches": sorted({0, batch - 1}), "heads": sorted({0, heads - 1}),
            "rows": _rows_for_check(seq, max_rows)}


class ReferenceSubset:
    """The float64 reference on check_subset(), computed once per set of inputs.

    The reference is the expensive part of a check (float64 on the CPU); a benchmark computes
    it once per shape and compares every stage and the peer with it.
    """

    def __init__(self, q, k, v, layout: str, *, scale: float | None = None,
                 max_rows: int = 4096):
        import numpy as np
        from . import reference

        if layout == "bhld":
            batch, heads, seq_q, dim = q.shape
        else:
            batch, seq_q, heads, dim = q.shape
        self.layout = layout
        self.subset = check_subset((batch, heads, seq_q, dim), max_rows)
        refs = []
        rows, every = self.subset["rows"], slice(None)
        for b, h in self.pairs:
            ref = reference.attention_reference(
                self._one(q, b, h, rows), self._one(k, b, h, every), self._one(v, b, h, every),
                scale=scale, layout="bhld")
            refs.append(np.asarray(ref, dtype=np.float64).reshape(-1))
        self.ref = np.concatenate(refs)

    def _one(self, x, b: int, h: int, rows):
        """(1, 1, rows, D) float32 on the host: one (batch, head) in BHLD for the reference."""
        return _host_f32(_pick(x, self.layout, b, h, rows))[None, None]

    @property
    def pairs(self) -> list[tuple[int, int]]:
        return [(b, h) for b in self.subset["batches"] for h in self.subset["heads"]]

    def describe(self) -> str:
        rows = self.subset["rows"]
        return (f"batch {','.join(map(str, self.subset['batches']))} "
                f"head {','.join(map(str, self.subset['heads']))} "
                f"rows {'all' if rows.step == 1 else f'every {rows.step}th'}")

    def compare(self, out) -> dict:
        """rel_l2, max_abs, nan_count on the subset; nan_total over all of `out`; pass."""
        import numpy as np
        from . import reference

        got = np.concatenate([_host_f32(_pick(out, self.layout, b, h, self.subset["rows"]))
                              .reshape(-1) for b, h in self.pairs])
        metrics = dict(reference.error_metrics(got, self.ref))
        # NaN over the whole output: catches tiles a kernel never wrote (outputs are poisoned)
        if hasattr(out, "isnan"):
            nan_total = int(out.isnan().sum().item())
        else:
            nan_total = int(np.isnan(np.asarray(out, dtype=np.float32)).sum())
        # NumPy scalars -> Python numbers, so that the results serialize as JSON
        metrics = {key: (val.item() if hasattr(val, "item") else val)
                   for key, val in metrics.items()}
        metrics["nan_total"] = nan_total
        metrics["pass"] = bool(reference.passes(metrics)) and nan_total == 0
        metrics["checked"] = self.describe()
        return metrics


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

def _inputs(torch, shape, layout, seed):
    """q, k, v (torch on the GPU when torch is there, else NumPy bf16) and a NaN-poisoned out."""
    batch, heads, seq, dim = shape
    dims = (batch, heads, seq, dim) if layout == "bhld" else (batch, seq, heads, dim)
    if torch is not None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v = (torch.randn(dims, generator=gen, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        return q, k, v
    from . import reference
    return reference.random_qkv(batch, heads, seq, seq, dim, layout, seed)


def _poisoned_out(torch, q):
    """(what check_output reads, the device array the kernel writes), filled with NaN."""
    from . import tensors
    if torch is not None:
        out = torch.full_like(q, float("nan"))
        return out, tensors.as_device_array(out)
    out = tensors.empty(q.shape)
    out.fill_u16(0xFFFF)                               # bf16 NaN
    return None, out


def _device(torch, x):
    """Zero-copy view of a torch tensor, or a device copy of a NumPy array."""
    from . import tensors
    return tensors.as_device_array(x) if torch is not None else tensors.from_numpy(x)


def _cudnn_launcher(torch, q, k, v, layout):
    """A no-argument launch of cuDNN SDPA on BHLD views of q, k, v."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if layout == "bshd":  # SDPA takes (B, H, L, D); a transposed view keeps the same memory
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))

    def launch():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)
    return launch


def run_benchmark(stages=None, shapes=DEFAULT_SHAPES, layout: str = "bhld", reps: int = 20, *,
                  rounds: int = 5, warmup: int = 3, peer: bool = True, check: bool = True,
                  seed: int = 0, log: Callable[[str], None] | None = None) -> dict:
    """Time stages (and cuDNN) on shapes; returns the results dict that write_results saves.

    For each shape: one set of inputs, shared by every stage and the peer; each stage is
    checked once on a NaN-poisoned output; then `rounds` rounds, each timing every stage and
    the peer (`reps` launches, median); the headline ratio is the median over rounds of
    our time / peer time, reported as % of cuDNN (higher is better, 100 = on par).
    """
    from . import attention, driver

    layout = layout.lower()
    if layout not in ("bhld", "bshd"):
        raise ValueError(f"layout: expected 'bhld' or 'bshd', got {layout!r}")
    say = log or (lambda _msg: None)
    info = driver.device_info()                                 # NoGpuError without a GPU
    stage_list = [_stages.get_stage(s) for s in stages] if stages else list(_stages.all_stages())
    shape_list = [parse_shape(s) for s in shapes]
    torch = _import_torch()
    result = {
        "schema": 1,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "env": environment(info, torch),
        "protocol": {"layout": layout, "reps": reps, "rounds": rounds, "warmup": warmup,
                     "seed": seed, "inputs": "torch" if torch is not None else "numpy",
                     "flops": "4*B*H*Lq*Lk*D", "statistic": "median",
                     "ratio": "median over rounds of (our median / peer median)"},
        "shapes": {}, "results": [], "peer": [], "clocks": {},
    }

    for shape_name, shape in shape_list:
        batch, heads, seq, dim = shape
        result["shapes"][shape_name] = [batch, heads, seq, seq, dim]
        say(f"{shape_name}: B={batch} H={heads} L={seq} D={dim} {layout}")
        q, k, v = _inputs(torch, shape, layout, seed)
        qd, kd, vd = (_device(torch, x) for x in (q, k, v))

        ref = None                        # ReferenceSubset, made at the first check only

        entries = []                      # (result row, launch, stream) of the stages that run
        for stage in stage_list:
            row = {"stage": stage.label, "number": stage.number, "name": stage.name,
                   "shape": shape_name, "status": "ok"}
            result["results"].append(row)
            why = stage.unsupported(dim, seq, seq)
            if why:
                row.update(status="skipped", reason=why)
                continue
            try:
                out_torch, out_dev = _poisoned_out(torch, q)
                prepared = attention.prepare(qd, kd, vd, stage=stage, layout=layout, out=out_dev)
                if check:
                    prepared.launch()
                    driver.synchronize()
                    out = out_torch if out_torch is not None else out_dev.to_numpy()
                    ref = ref or ReferenceSubset(q, k, v, layout)
                    row.update(ref.compare(out))
            except Exception as exc:     # record and go on: one broken stage spoils no table
                row.update(status="error", reason=_one_line(exc))
                say(f"  {stage.label}: {row['reason']}")
                continue
            entries.append((row, prepared.launch, prepared.stream))

        peer_row, peer_fn = None, None
        if peer and torch is not None:
            peer_row = {"name": PEER, "shape": shape_name, "status": "ok"}
            result["peer"].append(peer_row)
            try:
                peer_fn = _cudnn_launcher(torch, q, k, v, layout)
                o = peer_fn()
                if layout == "bshd":
                    o = o.transpose(1, 2)
                torch.cuda.synchronize()
                if check:
                    ref = ref or ReferenceSubset(q, k, v, layout)
                    peer_row.update(ref.compare(o))
                del o
            except Exception as exc:
                peer_row.update(status="error", reason=_one_line(exc))
                peer_fn = None

        # Same-run rounds: every stage and the peer once per round, warm-ups in round 0.
        # Events go on the stream each launch is enqueued on (torch's current stream for cuDNN).
        timed = list(entries)
        if peer_fn:
            timed.append((peer_row, peer_fn, torch.cuda.current_stream().cuda_stream))
        per_round: dict[int, list[float]] = {id(row): [] for row, _, _ in timed}
        for r in range(rounds):
            for row, fn, stream in timed:
                if row["status"] != "ok":
                    continue
                try:
                    ms = median(time_launch(fn, warmup=warmup if r == 0 else 1, reps=reps,
                                            stream=stream))
                except Exception as exc:
                    row.update(status="error", reason=_one_line(exc))
                    continue
                per_round[id(row)].append(ms)
        result["clocks"][shape_name] = gpu_clocks()

        peer_rounds = per_round.get(id(peer_row), []) if peer_row else []
        for row, _, _ in timed:
            ms_rounds = per_round[id(row)]
            if row["status"] != "ok" or not ms_rounds:
                continue
            row["ms_rounds"] = ms_rounds
            row["ms"] = median(ms_rounds)
            row["tflops"] = tflops(batch, heads, seq, seq, dim, row["ms"])
            if row is not peer_row and len(peer_rounds) == len(ms_rounds):
                row["pct_of_peer"] = same_run_pct(ms_rounds, peer_rounds)
            say(f"  {row.get('stage', PEER)}: {row['ms']:.3f} ms  {row['tflops']:.1f} TFLOP/s")
        if torch is not None:
            del q, k, v, qd, kd, vd
            torch.cuda.empty_cache()
    return result


def same_run_pct(ours_ms: list[float], peer_ms: list[float]) -> float:
    """% of the peer's speed: 100 / median over rounds of (our time / peer time).

    Each ratio compares two medians taken seconds apart in one round, so clock and thermal
    drift between rounds cancels; 100 means on par, 50 means twice the peer's time.
    """
    if len(ours_ms) != len(peer_ms) or not ours_ms:
        raise ValueError("same_run_pct: expected one peer time per round")
    return 100.0 / median([ours / peer for ours, peer in zip(ours_ms, peer_ms)])


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


# --------------------------------------------------------------------------- output

def results_filename(result: dict) -> str:
    """<date>-<gpu>.json, e.g. 2026-11-29-h200.json."""
    date = str(result.get("date", ""))[:10] or _dt.date.today().isoformat()
    gpu = str(result.get("env", {}).get("gpu") or "gpu").lower().replace("nvidia", "")
    slug = re.sub(r"[^a-z0-9]+", "-", gpu).strip("-") or "gpu"
    return f"{date}-{slug}.json"


def write_results(result: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def load_results(source) -> dict:
    if isinstance(source, dict):
        return source
    return json.loads(Path(source).read_text())


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(result: dict) -> str:
    """stage, shape, ms, TFLOP/s, % of cuDNN (same run), rel err ours, rel err cuDNN."""
    head = ("stage", "shape", "ms", "TFLOP/s", f"% {PEER}", "rel err", f"rel err {PEER}", "check")
    rows = []
    peers = {p["shape"]: p for p in result.get("peer", [])}
    order = list(result.get("shapes", {}))
    ours = sorted(result.get("results", []),
                  key=lambda r: (order.index(r["shape"]) if r["shape"] in order else 99,
                                 r.get("number", 0)))
    shown_peer = set()
    for r in ours:
        p = peers.get(r["shape"], {})
        if p and r["shape"] not in shown_peer:
            shown_peer.add(r["shape"])
            rows.append((PEER, p["shape"], _fmt(p.get("ms"), ".3f"), _fmt(p.get("tflops"), ".1f"),
                         "100.0" if p.get("ms") else "-", _fmt(p.get("rel_l2"), ".1e"), "",
                         _status(p)))
        rows.append((f"{r['stage']} {r.get('name', '')}".strip(), r["shape"],
                     _fmt(r.get("ms"), ".3f"), _fmt(r.get("tflops"), ".1f"),
                     _fmt(r.get("pct_of_peer"), ".1f"), _fmt(r.get("rel_l2"), ".1e"),
                     _fmt(p.get("rel_l2"), ".1e"), _status(r)))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(f"{c:<{w}}" if i < 2 else f"{c:>{w}}" for i, (c, w) in
                       enumerate(zip(cells, widths))).rstrip() for cells in (head, *rows)]
    env = result.get("env", {})
    lines.insert(0, f"{env.get('gpu', '?')}, driver {env.get('driver_version', '?')}, "
                    f"{result.get('protocol', {}).get('layout', '?')}, {result.get('date', '?')}"
                    + (f", cuDNN {env['cudnn']}" if env.get("cudnn") else ""))
    for r in ours:
        if r.get("status") in ("skipped", "error"):
            lines.append(f"{r['stage']} {r['shape']} {r['status']}: {r.get('reason', '')}")
    for p in result.get("peer", []):
        if p.get("status") == "error":
            lines.append(f"{PEER} {p['shape']} error: {p.get('reason', '')}")
    return "\n".join(lines)


def _status(row: dict) -> str:
    if row.get("status") in ("skipped", "error"):
        return row["status"]
    if "pass" not in row:
        return ""
    return "ok" if row["pass"] else "FAIL"


def plot_progression(result_json, path) -> Path:
    """Stage on x, % of cuDNN per shape on y (TFLOP/s when no peer was measured); png or svg."""
    try:
        from matplotlib.figure import Figure   # no pyplot: no GUI backend, no global state
    except ImportError:
        raise MissingExtraError(
            "plotting needs matplotlib: pip install 'ptxattn[plot]'") from None
    result = load_results(result_json)
    rows = [r for r in result.get("results", []) if r.get("status") == "ok" and r.get("ms")]
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
    ax.set_title(f"ptxattn lineage on {env.get('gpu', '?')} ({str(result.get('date', ''))[:10]})",
                 fontsize=10)
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


"""Sustained speed at the power cap: each kernel back to back for seconds, power and clock sampled.

The benchmark's burst figures (reps x rounds of short launches) run before the GPU's clock has
settled. A model that runs attention for minutes runs at the power cap (700 W on the H200), and
then the clock the power budget leaves decides the speed: energy per FLOP. This module measures
that, for `ptxattn bench --sustained` (bench.run_cases calls run_case per case) and the
scripts' --sustained (variants.py, backward_bench.py, fp8_bench.py), all through figures():

  - a cool-down before each kernel: at least `cooldown_s`, then until the sampled power reads
    below `idle_w` (at most `cooldown_max_s`); what was waited and the power then are written down;
  - `settle_s` of back-to-back launches (the clock drops to its sustained level within ~1 s),
    then the measured window: launches back to back for `seconds`, enqueued without host waits
    but with a bounded queue (an event every `sync_every` launches; the host waits for the one
    before it, so at most two chunks are queued);
  - power draw and SM clock sampled every ~`period_s` on a background thread, through NVML
    (nvidia-ml-py, `import pynvml`: an optional dependency of the benchmark only), else through
    `nvidia-smi ... --loop-ms` as a subprocess; neither: SamplerUnavailable, one clear line.

Figures per kernel and case: sustained TFLOP/s (FLOPs of the launches inside the window / the
window's event time), median SM clock and power over the samples inside the window, energy as
the integral of the sampled power over the window (trapezoids) and TFLOP per joule from it; the
NVML energy counter's difference over the window is recorded beside it as a cross-check.
Kernels (ours and cuDNN) are measured in a seeded random order, one after the other.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import statistics
import subprocess
import threading
import time
from typing import Callable, NamedTuple

from .events import EventTimer
from ..errors import PtxattnError


class SamplerUnavailable(PtxattnError):
    """Neither NVML (nvidia-ml-py) nor nvidia-smi is there to read power and clocks."""


# the host clock and pause of every function here (tests replace them with a pretend clock)
_now = time.monotonic
_sleep = time.sleep

NO_SAMPLER = ("sustained mode needs power and clock readings: install nvidia-ml-py "
              "(pip install nvidia-ml-py, imported as pynvml) or put nvidia-smi on PATH")


@dataclasses.dataclass(frozen=True)
class Config:
    """How long and how carefully a sustained window runs (bench --sustained)."""
    seconds: float = 3.0          # the measured window
    settle_s: float = 1.0         # back-to-back launches before it (the clock settles)
    cooldown_s: float = 1.0       # at least this pause before each kernel
    cooldown_max_s: float = 5.0   # and at most this long waiting for idle power
    idle_w: float = 150.0         # "idle-ish": an H200 idles near 75-120 W
    period_s: float = 0.05        # sampling period
    chunk_ms: float = 25.0        # GPU time between queue syncs (sets sync_every per kernel)
    rounds: int = 1               # windows per kernel and case (median over them)

    def __post_init__(self):
        for name in ("seconds", "period_s", "chunk_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected a positive number, got {getattr(self, name)!r}")
        for name in ("settle_s", "cooldown_s", "cooldown_max_s", "idle_w"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: expected a number >= 0, got {getattr(self, name)!r}")
        if not isinstance(self.rounds, int) or self.rounds < 1:
            raise ValueError(f"rounds: expected a whole number >= 1, got {self.rounds!r}")

    def estimate_s(self, kernels: int) -> float:
        """Device seconds for one case with `kernels` kernels (the peer counted): cool-down,
        settle and window for each, and each round."""
        return self.rounds * kernels * (self.cooldown_s + self.settle_s + self.seconds + 0.2)


class Sample(NamedTuple):
    t: float                      # host time (time.monotonic), seconds
    power_w: float
    sm_mhz: float
    energy_mj: float | None = None   # NVML's cumulative energy counter, where there is one


# --------------------------------------------------------------------------- samplers

class _Sampler:
    """Samples on a background thread; samples_between(t0, t1) reads them (thread-safe)."""

    kind = "?"
    power_field = "?"

    def __init__(self, period_s: float, now: Callable[[], float] | None = None):
        self.period_s, self.now = period_s, now or _now
        self._samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    def _add(self, sample: Sample) -> None:
        with self._lock:
            self._samples.append(sample)

    def samples(self) -> list[Sample]:
        with self._lock:
            return list(self._samples)

    def samples_between(self, t0: float, t1: float) -> list[Sample]:
        return [s for s in self.samples() if t0 <= s.t <= t1]

    def latest(self) -> Sample | None:
        with self._lock:
            return self._samples[-1] if self._samples else None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self) -> "_Sampler":
        raise NotImplementedError

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class NvmlSampler(_Sampler):
    """NVML through nvidia-ml-py: instantaneous power (field NVML_FI_DEV_POWER_INSTANT) where
    the driver has it, else nvmlDeviceGetPowerUsage (averaged by the driver); the SM clock;
    the energy counter (mJ since the driver loaded)."""

    kind = "nvml"

    def __init__(self, pynvml, period_s: float, *, pci_bus_id: str | None = None,
                 index: int = 0, now=None):
        super().__init__(period_s, now)
        self.nv = pynvml
        pynvml.nvmlInit()
        self.handle = None
        if pci_bus_id:
            try:
                self.handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id)
            except Exception:          # a bus id format NVML does not take: the index then
                self.handle = None
        if self.handle is None:
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self._instant = self._read_instant() is not None
        self.power_field = "instant" if self._instant else "average (nvmlDeviceGetPowerUsage)"
        try:
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
            self._energy = True
        except Exception:
            self._energy = False

    def _read_instant(self) -> float | None:
        nv = self.nv
        field = getattr(nv, "NVML_FI_DEV_POWER_INSTANT", None)
        if field is None:
            return None
        try:
            (value,) = nv.nvmlDeviceGetFieldValues(self.handle, [field])
        except Exception:
            return None
        if getattr(value, "nvmlReturn", 1) != 0:
            return None
        kinds = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal",
                 6: "usVal"}
        return float(getattr(value.value, kinds.get(int(value.valueType), "uiVal"))) / 1000.0

    def read(self) -> Sample:
        nv = self.nv
        power = self._read_instant() if self._instant else None
        if power is None:
            power = nv.nvmlDeviceGetPowerUsage(self.handle) / 1000.0
        mhz = float(nv.nvmlDeviceGetClockInfo(self.handle, nv.NVML_CLOCK_SM))
        energy = (float(nv.nvmlDeviceGetTotalEnergyConsumption(self.handle))
                  if self._energy else None)
        return Sample(self.now(), power, mhz, energy)

    def start(self) -> "NvmlSampler":
        self._add(self.read())                 # one reading before the thread runs

        def loop():
            while not self._stop.wait(self.period_s):
                try:
                    self._add(self.read())
                except Exception as exc:       # noqa: BLE001 - recorded, sampling stops
                    self.error = f"{type(exc).__name__}: {exc}"
                    return
        self._thread = threading.Thread(target=loop, name="ptxattn-nvml", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        super().stop()
        try:
            self.nv.nvmlShutdown()
        except Exception:
            pass


SMI_FIELDS = ("power.draw.instant", "clocks.sm")
SMI_FALLBACK_FIELDS = ("power.draw", "clocks.sm")


class SmiSampler(_Sampler):
    """`nvidia-smi --query-gpu=power.draw[.instant],clocks.sm --format=csv,noheader,nounits
    --loop-ms=P` as a subprocess; a reader thread stamps each line with the host time it
    arrived."""

    kind = "nvidia-smi"

    def __init__(self, smi: str, period_s: float, *, pci_bus_id: str | None = None,
                 index: int = 0, now=None, popen=None, run=None):
        super().__init__(period_s, now)
        self.smi, self.device = smi, pci_bus_id or str(index)
        self._popen = popen or subprocess.Popen
        run = run or subprocess.run
        # power.draw.instant is newer (driver 535+); ask once, fall back to power.draw
        probe = run([smi, f"--id={self.device}", f"--query-gpu={','.join(SMI_FIELDS)}",
                     "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20,
                    check=False)
        ok = probe.returncode == 0 and _parse_smi(probe.stdout.strip().splitlines()[0]
                                                  if probe.stdout.strip() else "") is not None
        self.fields = SMI_FIELDS if ok else SMI_FALLBACK_FIELDS
        self.power_field = self.fields[0]
        self.proc = None

    def command(self) -> list[str]:
        period_ms = max(1, round(self.period_s * 1000))
        return [self.smi, f"--id={self.device}", f"--query-gpu={','.join(self.fields)}",
                "--format=csv,noheader,nounits", f"--loop-ms={period_ms}"]

    def start(self) -> "SmiSampler":
        self.proc = self._popen(self.command(), stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, bufsize=1)

        def loop():
            for line in self.proc.stdout:
                if self._stop.is_set():
                    return
                parsed = _parse_smi(line)
                if parsed is not None:
                    self._add(Sample(self.now(), *parsed))
        self._thread = threading.Thread(target=loop, name="ptxattn-smi", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        super().stop()


def _parse_smi(line: str) -> tuple[float, float] | None:
    """"693.52, 1395" -> (693.52, 1395.0); a header, "[N/A]" or an empty line -> None."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 2:
        return None
    try:
        return float(parts[0]), float(parts[1])
    except ValueError:
        return None


def pci_bus_id() -> str | None:
    """The PCI bus id of the CUDA device ptxattn runs on (NVML and nvidia-smi number devices
    their own way; CUDA_VISIBLE_DEVICES renumbers CUDA's), or None when the driver cannot say."""
    try:
        from . import driver
        ctx = driver.context()
        raw = driver.check(driver.cu().cuDeviceGetPCIBusId(64, ctx.device), "cuDeviceGetPCIBusId")
        text = raw if isinstance(raw, str) else bytes(raw).split(b"\0", 1)[0].decode()
        return text.strip() or None
    except Exception:
        return None


def make_sampler(period_s: float = 0.05, *, pci_bus_id: str | None = None,
                 importer=None, which=shutil.which, now=None) -> _Sampler:
    """An NVML sampler when pynvml imports and initializes, else nvidia-smi's; else
    SamplerUnavailable (with what each one said)."""
    tried = []
    try:
        pynvml = importer("pynvml") if importer else __import__("pynvml")
        return NvmlSampler(pynvml, period_s, pci_bus_id=pci_bus_id, now=now)
    except ImportError:
        tried.append("pynvml not installed")
    except Exception as exc:          # NVML present but failing (no driver access)
        tried.append(f"NVML: {type(exc).__name__}: {exc}")
    smi = which("nvidia-smi")
    if smi:
        return SmiSampler(smi, period_s, pci_bus_id=pci_bus_id, now=now)
    tried.append("no nvidia-smi on PATH")
    raise SamplerUnavailable(f"{NO_SAMPLER} ({'; '.join(tried)})")


# --------------------------------------------------------------------------- the timed window

class Events(EventTimer):
    """bench's CUDA event timer on one stream, plus wait(e): block the host until e is done
    (tests pass a fake with mark / wait / elapsed_ms)."""

    def wait(self, event) -> None:
        event.synchronize()


def sync_every(launch_ms: float, chunk_ms: float = 25.0, cap: int = 512) -> int:
    """Launches between queue syncs: about chunk_ms of GPU time, at least 1."""
    if not launch_ms > 0:
        return 1
    return max(1, min(cap, math.ceil(chunk_ms / launch_ms)))


def back_to_back(launch, events, seconds: float, chunk: int, now=None):
    """Launches for `seconds` of host time in chunks of `chunk`, with an event after each chunk
    and the host waiting on the one before it (at most two chunks queued), so the GPU never
    idles for the host and the host never runs seconds ahead. The caller's events on the
    same stream bracket the work. Returns (launches, the last chunk's event)."""
    now = now or _now
    count, pending, t0 = 0, None, now()
    while True:
        for _ in range(chunk):
            launch()
        count += chunk
        mark = events.mark()
        if pending is not None:
            events.wait(pending)
        pending = mark
        if now() - t0 >= seconds:
            return count, pending


def window(launch, events, *, flops: int, seconds: float, settle_s: float, chunk: int,
           now=None) -> dict:
    """Settle, then the measured window: {launches, window_ms (event time), t_begin / t_end
    (host times that bracket it: right after the host saw its first and last event done),
    tflops, sync_every}."""
    now = now or _now
    if settle_s > 0:
        back_to_back(launch, events, settle_s, chunk, now)
    start = events.mark()
    # the window's first chunk is queued behind `start`; waiting for `start` then costs the
    # GPU nothing (that chunk is queued) and tells the host when the window began
    for _ in range(chunk):
        launch()
    events.wait(start)
    t_begin = now()
    count, _ = back_to_back(launch, events, seconds, chunk, now)
    count += chunk
    end = events.mark()
    events.wait(end)
    t_end = now()
    ms = events.elapsed_ms(start, end)
    return {"launches": count, "window_ms": ms, "t_begin": t_begin, "t_end": t_end,
            "sync_every": chunk, "tflops": count * flops / (ms * 1e-3) / 1e12 if ms > 0 else None}


def energy_j(samples: list[Sample], t0: float, t1: float) -> float | None:
    """The integral of sampled power over [t0, t1] (trapezoids between samples, the first and
    last readings held flat to the window's edges); None without samples."""
    pts = sorted((s.t, s.power_w) for s in samples)
    if not pts or not t1 > t0:
        return None
    inside = [(t, p) for t, p in pts if t0 <= t <= t1]
    before = [(t, p) for t, p in pts if t < t0]
    after = [(t, p) for t, p in pts if t > t1]
    edge0 = before[-1][1] if before else (inside[0][1] if inside else after[0][1])
    edge1 = after[0][1] if after else (inside[-1][1] if inside else before[-1][1])
    curve = [(t0, edge0)] + inside + [(t1, edge1)]
    return sum((tb - ta) * (pa + pb) / 2 for (ta, pa), (tb, pb) in zip(curve, curve[1:]))


def summarize(run: dict, samples: list[Sample], flops: int) -> dict:
    """A window's figures from its samples: medians, energy, TFLOP/J, and the counter's cross
    check; `flags` say what is doubtful (too few samples)."""
    t0, t1 = run["t_begin"], run["t_end"]
    inside = [s for s in samples if t0 <= s.t <= t1]
    out = dict(run)
    out["samples"] = len(inside)
    flags = []
    if len(inside) < 3:
        flags.append(f"only {len(inside)} power/clock samples inside the window")
    if inside:
        out["sm_mhz_median"] = statistics.median(s.sm_mhz for s in inside)
        out["sm_mhz_range"] = [min(s.sm_mhz for s in inside), max(s.sm_mhz for s in inside)]
        out["power_w_median"] = statistics.median(s.power_w for s in inside)
        out["power_w_max"] = max(s.power_w for s in inside)
    joules = energy_j(samples, t0, t1)
    total_flops = run["launches"] * flops
    out["energy_j"] = joules
    out["tflop_per_j"] = total_flops / joules / 1e12 if joules else None
    counter = [s for s in inside if s.energy_mj is not None]
    if len(counter) >= 2 and counter[-1].t > counter[0].t:
        span = counter[-1].t - counter[0].t
        # the counter's energy over the sampled span, scaled to the window
        out["energy_j_counter"] = ((counter[-1].energy_mj - counter[0].energy_mj) / 1000.0
                                   * (t1 - t0) / span)
    out["flags"] = flags
    return out


def cooldown(sampler, cfg: Config, *, sleep=None, now=None) -> dict:
    """Pause cfg.cooldown_s, then until the latest sample's power is under cfg.idle_w (at most
    cfg.cooldown_max_s in all). Returns what was waited and the reading at the end."""
    now, sleep = now or _now, sleep or _sleep
    t0 = now()
    sleep(cfg.cooldown_s)
    while True:
        last = sampler.latest()
        waited = now() - t0
        if last is None or last.power_w < cfg.idle_w or waited >= cfg.cooldown_max_s:
            break
        sleep(min(0.1, cfg.cooldown_max_s - waited))
    last = sampler.latest()
    return {"pause_s": now() - t0, "power_w": last.power_w if last else None,
            "sm_mhz": last.sm_mhz if last else None,
            "idle": bool(last and last.power_w < cfg.idle_w)}


def measure(launch, events, sampler, cfg: Config, *, flops: int, launch_ms: float,
            sleep=None, now=None) -> dict:
    """One kernel's sustained figures (cfg.rounds windows: median TFLOP/s over them, and the
    window whose TFLOP/s is that median for the rest)."""
    windows = []
    for _ in range(cfg.rounds):
        pause = cooldown(sampler, cfg, sleep=sleep, now=now)
        run = window(launch, events, flops=flops, seconds=cfg.seconds, settle_s=cfg.settle_s,
                     chunk=sync_every(launch_ms, cfg.chunk_ms), now=now)
        # the samples up to the window's end are in: the sampler runs ahead of the host's view
        summary = summarize(run, sampler.samples(), flops)
        summary["cooldown"] = pause
        windows.append(summary)
    order = sorted(windows, key=lambda w: w["tflops"] or 0.0)
    chosen = dict(order[(len(order) - 1) // 2])
    chosen["tflops_windows"] = [w["tflops"] for w in windows]
    chosen["sampler"] = getattr(sampler, "kind", "?")
    chosen["power_field"] = getattr(sampler, "power_field", "?")
    if getattr(sampler, "error", None):
        chosen["flags"] = chosen["flags"] + [f"sampler stopped: {sampler.error}"]
    for key in ("t_begin", "t_end"):
        chosen.pop(key, None)
    return chosen


class Kernel(NamedTuple):
    """One timed callable of a sustained run (figures): launch() enqueues one call on
    `stream` (the stream the window's events are recorded on), `flops` are credited per
    call, `launch_ms` is its burst time (it sets the launches between queue syncs)."""
    launch: Callable[[], object]
    stream: object
    flops: float
    launch_ms: float | None = None


def figures(kernels: dict[str, Kernel], cfg: Config, *, rng, peer: str | None = None,
            sampler=None, log=None, events_of=None, sleep=None, now=None) -> dict[str, dict]:
    """The sustained measurement every benchmark shares (ptxattn bench, variants.py,
    backward_bench.py, fp8_bench.py): each kernel, in a seeded random order
    (rng.permutation), gets measure()'s window after its cool-down. Returns {label: figures}
    in the order they ran; a kernel that raised gets {"error": its first line} and the others
    go on. With `peer` (one of the labels) every other kernel's figures also get pct_of_peer
    and energy_pct_of_peer (sustained TFLOP/s and TFLOP/J in % of the peer's, same run).
    sampler: a started one (a benchmark of many cases starts one for all, so a missing
    sampler stops it before any case); None: one is started here and stopped after."""
    if peer is not None and peer not in kernels:
        raise ValueError(f"peer {peer!r}: not one of the kernels ({', '.join(kernels)})")
    say = log or (lambda _m: None)
    own = sampler is None
    if own:
        sampler = start_sampler(cfg)
    labels = list(kernels)
    out: dict[str, dict] = {}
    try:
        for i in rng.permutation(len(labels)):
            label = labels[int(i)]
            k = kernels[label]
            events = (events_of or Events)(k.stream)
            try:
                out[label] = measure(k.launch, events, sampler, cfg, flops=k.flops,
                                     launch_ms=k.launch_ms or 1.0, sleep=sleep, now=now)
            except Exception as exc:   # noqa: BLE001 - recorded, the other kernels go on
                out[label] = {"error": f"{type(exc).__name__}: "
                                       f"{(str(exc).strip().splitlines() or [''])[0]}"}
                say(f"  {label} sustained: {out[label]['error']}")
                continue
            finally:
                close = getattr(events, "close", None)
                if close:
                    close()
            f = out[label]
            say(f"  {label} sustained: {_num(f['tflops'], '.1f')} TFLOP/s, "
                f"{_num(f.get('sm_mhz_median'), '.0f')} MHz, "
                f"{_num(f.get('power_w_median'), '.0f')} W, "
                f"{_num(f.get('tflop_per_j'), '.3f')} TFLOP/J over {f['window_ms'] / 1e3:.2f} s")
    finally:
        if own:
            sampler.stop()
    if peer is not None:
        for label, fig in out.items():
            if label != peer:
                ratio_to(fig, out[peer])
    return out


def run_case(flops: int, entries: dict, peer, sampler, cfg: Config, *, rng, log=None,
             **kw) -> list[str]:
    """bench.run_cases' hook: entries {label: (row, launch, stream)} of our timed kernels and
    peer (row, launch, stream) or None; the kernels that were timed (burst ms) run sustained
    (figures), into row["sustained"] (or row["sustained_error"]), ours with the same-run
    ratios to the peer. Returns the order they ran in."""
    rows, kernels = {}, {}
    for label, (row, fn, stream) in entries.items():
        if row.get("status") == "ok" and row.get("ms"):
            rows[label], kernels[label] = row, Kernel(fn, stream, flops, row["ms"])
    peer_label = None
    if peer is not None:
        peer_row, fn, stream = peer
        if peer_row.get("status") == "ok" and peer_row.get("ms"):
            peer_label = peer_row["name"]
            rows[peer_label] = peer_row
            kernels[peer_label] = Kernel(fn, stream, flops, peer_row["ms"])
    figs = figures(kernels, cfg, rng=rng, peer=peer_label, sampler=sampler, log=log, **kw)
    for label, fig in figs.items():
        if "error" in fig:
            rows[label]["sustained_error"] = fig["error"]
        else:
            rows[label]["sustained"] = fig
    return list(figs)


def ratio_to(fig: dict, peer: dict | None) -> None:
    """fig's sustained TFLOP/s and TFLOP/J in % of peer's (same case, same run: one window
    each, so no interval): pct_of_peer, energy_pct_of_peer, where both have the figure."""
    peer = peer or {}
    if fig.get("tflops") and peer.get("tflops"):
        fig["pct_of_peer"] = 100.0 * fig["tflops"] / peer["tflops"]
    if fig.get("tflop_per_j") and peer.get("tflop_per_j"):
        fig["energy_pct_of_peer"] = 100.0 * fig["tflop_per_j"] / peer["tflop_per_j"]


def peer_ratios(rows: list[dict], peer_row: dict | None) -> None:
    """ratio_to for bench rows: each row's row["sustained"] against peer_row["sustained"]."""
    peer = (peer_row or {}).get("sustained")
    if not peer:
        return
    for row in rows:
        if row.get("sustained"):
            ratio_to(row["sustained"], peer)


# --------------------------------------------------------------------------- the scripts' side

def start_sampler(cfg: Config) -> _Sampler:
    """make_sampler for the CUDA device ptxattn runs on, started (SamplerUnavailable, one
    line, when neither NVML nor nvidia-smi is there)."""
    return make_sampler(cfg.period_s, pci_bus_id=pci_bus_id()).start()


def protocol(cfg: Config, sampler) -> dict:
    """What a results file says of its sustained windows: the config, the sampler, the rule."""
    return {**dataclasses.asdict(cfg), "sampler": getattr(sampler, "kind", "?"),
            "power_field": getattr(sampler, "power_field", "?"), "rule": PROTOCOL, "note": NOTE}


def add_arguments(ap) -> None:
    """--sustained, --sustained-seconds, --cooldown on a benchmark script's argparse parser."""
    ap.add_argument("--sustained", action="store_true",
                    help="also a sustained window per kernel after the burst rounds (seconds "
                         "back to back at the power cap; power and clock through NVML or "
                         "nvidia-smi)")
    ap.add_argument("--sustained-seconds", type=float, default=Config.seconds,
                    help="--sustained: the measured window (seconds)")
    ap.add_argument("--cooldown", type=float, default=Config.cooldown_s,
                    help="--sustained: the least pause before each kernel (then until idle "
                         "power)")


def config_from_args(ap, args) -> Config | None:
    """The Config that add_arguments' options ask for, None without --sustained; a bad value
    is ap.error (the option named) before anything runs."""
    if not args.sustained:
        return None
    try:
        return Config(seconds=args.sustained_seconds, cooldown_s=args.cooldown)
    except ValueError as exc:      # Config names its field; the user typed the option
        field, _, why = str(exc).partition(":")
        option = {"seconds": "--sustained-seconds", "cooldown_s": "--cooldown"}.get(field, field)
        ap.error(f"{option}:{why}")


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


PROTOCOL = ("per case, after the burst rounds: each kernel (ours and the peer, seeded random "
            "order) after a cool-down (cooldown_s, then until power < idle_w, at most "
            "cooldown_max_s: pause and reading recorded), settle_s of back-to-back launches, then "
            "a window of `seconds`: launches back to back, an event every sync_every launches "
            "(the host waits for the one before: at most two chunks queued). tflops = launches x "
            "case FLOPs / the window's event time; sm_mhz_median, power_w_median over the samples "
            "inside the window; energy_j = trapezoid integral of sampled power over the window "
            "(energy_j_counter: NVML's counter, a cross-check); tflop_per_j from energy_j")

NOTE = ("burst: short timed launches (the rounds above), before the clock settles; sustained: "
        "launches back to back for seconds at the power cap, what a model running for minutes "
        "sees")


# --------------------------------------------------------------------------- tables

HEAD = ("sust TFLOP/s", "sust %", "MHz", "W", "TFLOP/J", "J %")
HEAD_NOTE = ("sust: sustained (seconds back to back at the power cap); sust % and J %: "
             "sustained TFLOP/s and TFLOP per joule in % of the peer's, same run")


def cells(row: dict) -> tuple[str, ...]:
    """The sustained columns of one table row (ours or the peer's): '-' where not measured."""
    s = row.get("sustained") or {}
    peer = row.get("name") == "cuDNN" and "stage" not in row
    return (_num(s.get("tflops"), ".1f"),
            "100.0" if peer and s.get("tflops") else _num(s.get("pct_of_peer"), ".1f"),
            _num(s.get("sm_mhz_median"), ".0f"), _num(s.get("power_w_median"), ".0f"),
            _num(s.get("tflop_per_j"), ".3f"),
            "100.0" if peer and s.get("tflop_per_j") else _num(s.get("energy_pct_of_peer"), ".1f"))


def has_sustained(result: dict) -> bool:
    return any("sustained" in r or "sustained_error" in r
               for r in list(result.get("results", [])) + list(result.get("peer", [])))


def notes(result: dict) -> list[str]:
    """The lines under a table with sustained columns: what burst and sustained mean, windows
    that raised, and doubtful windows."""
    out = [f"note: {NOTE}", f"      {HEAD_NOTE}"]
    for r in list(result.get("results", [])) + list(result.get("peer", [])):
        label = r.get("stage") or r.get("name")
        if r.get("sustained_error"):
            out.append(f"{label} {r['shape']} sustained: error: {r['sustained_error']}")
        for flag in (r.get("sustained") or {}).get("flags", []):
            out.append(f"{label} {r['shape']} sustained: {flag}")
    return out


def combined_ranges(measured: list[dict], peers: list[dict | None]) -> dict:
    """Over the runs of one (kernel, case): the ranges of the sustained figures (combine)."""
    def rng(values):
        values = [v for v in values if v is not None]
        return [min(values), max(values)] if values else None
    ours = [r.get("sustained") or {} for r in measured]
    theirs = [(p or {}).get("sustained") or {} for p in peers]
    return {"sustained_tflops_range": rng(s.get("tflops") for s in ours),
            "sustained_pct_range": rng(s.get("pct_of_peer") for s in ours),
            "sustained_mhz_range": rng(s.get("sm_mhz_median") for s in ours),
            "sustained_energy_pct_range": rng(s.get("energy_pct_of_peer") for s in ours),
            "peer_sustained_tflops_range": rng(s.get("tflops") for s in theirs)}


COMBINED_HEAD = ("sust TFLOP/s (range)", "sust % (range)", "MHz (range)", "J % (range)",
                 "cuDNN sust")


def combined_cells(row: dict, fmt_range) -> tuple[str, ...]:
    return (fmt_range(row.get("sustained_tflops_range")),
            fmt_range(row.get("sustained_pct_range"), "%"),
            fmt_range(row.get("sustained_mhz_range"), "", ".0f"),
            fmt_range(row.get("sustained_energy_pct_range"), "%"),
            fmt_range(row.get("peer_sustained_tflops_range")))

"""ptxattn.tools.sustained on the CPU: the timed window on a pretend GPU timeline, the samplers on fake
NVML / nvidia-smi, the figures, the tables, and the benchmark's --sustained hook."""

from __future__ import annotations

import io
import json
import types
from pathlib import Path

import numpy as np
import pytest

from ptxattn.tools import bench, sustained

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


class Timeline:
    """A GPU that runs launches of `ms` each, in order, and a host that spends `enqueue_ms` per
    launch and waits only in Events.wait: host and GPU times in seconds."""

    def __init__(self, ms: float, enqueue_ms: float = 0.01):
        self.ms, self.enqueue_ms = ms, enqueue_ms
        self.host = 0.0
        self.gpu = 0.0                       # when the queued work ends
        self.launches = 0
        self.max_queued_ms = 0.0

    def now(self) -> float:
        return self.host

    def launch(self):
        self.host += self.enqueue_ms / 1e3
        self.gpu = max(self.gpu, self.host) + self.ms / 1e3
        self.launches += 1
        self.max_queued_ms = max(self.max_queued_ms, (self.gpu - self.host) * 1e3)


class FakeEvents:
    """sustained.Events on a Timeline: an event completes when the work before it does."""

    def __init__(self, tl: Timeline):
        self.tl = tl
        self.waits = 0

    def mark(self):
        self.tl.gpu = max(self.tl.gpu, self.tl.host)
        return self.tl.gpu

    def wait(self, event):
        self.waits += 1
        self.tl.host = max(self.tl.host, event)

    def elapsed_ms(self, a, b):
        assert self.tl.host >= b, "read before the end event was waited for"
        return (b - a) * 1e3


class FakeSampler:
    """Readings every `period` s of host time from power(t) / mhz(t), made on demand up to now."""

    kind, power_field, error = "fake", "instant", None

    def __init__(self, now, power=lambda t: 700.0, mhz=lambda t: 1400.0, period=0.05,
                 energy=True):
        self.clock, self.power, self.mhz, self.period, self.energy = now, power, mhz, period, energy

    def samples(self):
        n = int(self.clock() / self.period) + 1
        out, joules = [], 0.0
        for i in range(n):
            t = i * self.period
            if i:
                joules += self.period * (self.power(t - self.period) + self.power(t)) / 2
            out.append(sustained.Sample(t, self.power(t), self.mhz(t),
                                        joules * 1e3 if self.energy else None))
        return out

    def latest(self):
        return self.samples()[-1]

    def start(self):
        return self

    def stop(self):
        pass


def test_window_counts_launches_and_keeps_the_queue_bounded():
    tl = Timeline(ms=2.0)
    ev = FakeEvents(tl)
    run = sustained.window(tl.launch, ev, flops=10**12, seconds=0.5, settle_s=0.2, chunk=8,
                           now=tl.now)
    # the window: its launches' event time, every launch 2 ms (the GPU never idled)
    assert run["window_ms"] == pytest.approx(run["launches"] * 2.0)
    assert run["window_ms"] >= 500.0
    assert run["tflops"] == pytest.approx(500.0)           # 10^12 FLOPs in 2 ms
    assert run["launches"] % 8 == 0 and run["sync_every"] == 8
    # at most two chunks queued ahead of the host (plus the one being enqueued)
    assert tl.max_queued_ms <= 3 * 8 * 2.0 + 1e-6
    assert tl.launches > run["launches"]                                 # the settle launches
    assert run["t_begin"] < run["t_end"]
    assert run["t_end"] - run["t_begin"] == pytest.approx(run["window_ms"] / 1e3, rel=0.05)


def test_window_without_a_bound_would_run_ahead():
    """The check above can fail: with waits disabled the host runs far ahead of the GPU."""
    tl = Timeline(ms=2.0)
    ev = FakeEvents(tl)
    ev.wait = lambda event: None
    with pytest.raises(AssertionError):
        sustained.back_to_back(tl.launch, ev, 0.01, 8, now=tl.now)
        assert tl.max_queued_ms <= 3 * 8 * 2.0


def test_sync_every_is_about_chunk_ms_of_gpu_time():
    assert sustained.sync_every(2.0, 25.0) == 13
    assert sustained.sync_every(100.0, 25.0) == 1
    assert sustained.sync_every(0.001, 25.0) == 512               # capped
    assert sustained.sync_every(0.0) == 1


def test_energy_is_the_integral_of_sampled_power_not_the_median():
    s = sustained.Sample
    # a ramp 100 -> 700 W over [0, 2] s, then flat: trapezoids give the exact area
    samples = [s(t / 10, min(700.0, 100 + 300 * t / 10), 1500.0) for t in range(0, 41)]
    assert sustained.energy_j(samples, 0.0, 4.0) == pytest.approx(0.5 * 2 * 600 + 100 * 2 + 700 * 2)
    # the window's edges between samples: the nearest readings held flat
    flat = [s(0.0, 500.0, 1.0), s(1.0, 500.0, 1.0)]
    assert sustained.energy_j(flat, -1.0, 3.0) == pytest.approx(2000.0)
    assert sustained.energy_j([], 0.0, 1.0) is None
    run = {"launches": 100, "t_begin": 0.0, "t_end": 4.0, "window_ms": 4000.0, "tflops": 1.0}
    out = sustained.summarize(run, samples, flops=10**12)
    assert out["power_w_median"] == 700.0                        # the median ignores the ramp
    assert out["tflop_per_j"] == pytest.approx(100 / 2200.0)     # the integral does not
    assert out["samples"] == 41 and out["flags"] == []


def test_summarize_flags_a_window_with_too_few_samples():
    run = {"launches": 1, "t_begin": 0.0, "t_end": 0.01, "window_ms": 10.0, "tflops": 1.0}
    out = sustained.summarize(run, [sustained.Sample(5.0, 700.0, 1400.0)], flops=1)
    assert out["samples"] == 0 and "only 0 power/clock samples" in out["flags"][0]


def test_cooldown_waits_for_idle_power_and_writes_it_down():
    clock = {"t": 0.0}
    sampler = FakeSampler(lambda: clock["t"], power=lambda t: 700.0 if t < 2.0 else 90.0)
    sleep = lambda dt: clock.__setitem__("t", clock["t"] + dt)      # noqa: E731
    cfg = sustained.Config(cooldown_s=1.0, cooldown_max_s=5.0, idle_w=150.0)
    got = sustained.cooldown(sampler, cfg, sleep=sleep, now=lambda: clock["t"])
    assert 2.0 <= got["pause_s"] <= 2.2 and got["idle"] and got["power_w"] == 90.0
    # never idle: capped at cooldown_max_s, and said so
    clock["t"] = 0.0
    hot = FakeSampler(lambda: clock["t"], power=lambda t: 700.0)
    got = sustained.cooldown(hot, cfg, sleep=sleep, now=lambda: clock["t"])
    assert got["pause_s"] == pytest.approx(5.0) and not got["idle"]


def test_measure_gives_clock_power_and_tflop_per_joule():
    tl = Timeline(ms=2.0)
    sampler = FakeSampler(tl.now, power=lambda t: 690.0, mhz=lambda t: 1395.0)
    cfg = sustained.Config(seconds=1.0, settle_s=0.5, cooldown_s=0.2, cooldown_max_s=0.2,
                           idle_w=0.0)
    sleep = lambda dt: setattr(tl, "host", tl.host + dt)              # noqa: E731
    out = sustained.measure(tl.launch, FakeEvents(tl), sampler, cfg, flops=10**12,
                            launch_ms=2.0, sleep=sleep, now=tl.now)
    assert out["sm_mhz_median"] == 1395.0 and out["power_w_median"] == 690.0
    assert out["tflops"] == pytest.approx(500.0)
    joules = 690.0 * out["window_ms"] / 1e3
    assert out["energy_j"] == pytest.approx(joules, rel=1e-3)
    assert out["tflop_per_j"] == pytest.approx(out["launches"] / joules, rel=1e-3)
    assert out["energy_j_counter"] == pytest.approx(joules, rel=0.02)
    assert out["cooldown"]["pause_s"] == pytest.approx(0.2)
    assert out["sampler"] == "fake" and out["sync_every"] == 13
    assert "t_begin" not in out


def test_measure_case_runs_every_kernel_in_a_random_order_and_ratios_to_the_peer():
    timelines = {"ours": Timeline(ms=2.0), "cuDNN": Timeline(ms=2.5)}
    clock = {"t": 0.0}

    def now():
        return clock["t"] + sum(t.host for t in timelines.values())

    sampler = FakeSampler(now)
    rows = {"ours": {"stage": "production", "shape": "x", "status": "ok", "ms": 2.0},
            "cuDNN": {"name": "cuDNN", "shape": "x", "status": "ok", "ms": 2.5}}
    entries = {"production": (rows["ours"], timelines["ours"].launch, "ours")}
    peer = (rows["cuDNN"], timelines["cuDNN"].launch, "cuDNN")
    cfg = sustained.Config(seconds=0.3, settle_s=0.1, cooldown_s=0.0, idle_w=1e9)
    orders = set()
    for seed in range(6):
        order = sustained.run_case(10**12, entries, peer, sampler, cfg,
                                   rng=np.random.default_rng(seed),
                                   events_of=lambda st: FakeEvents(timelines[st]),
                                   sleep=lambda dt: None, now=now)
        orders.add(tuple(order))
    assert orders == {("production", "cuDNN"), ("cuDNN", "production")}
    s = rows["ours"]["sustained"]
    assert s["tflops"] == pytest.approx(500.0)
    assert s["pct_of_peer"] == pytest.approx(125.0)
    assert s["energy_pct_of_peer"] == pytest.approx(125.0, rel=0.05)
    assert rows["cuDNN"]["sustained"]["tflops"] == pytest.approx(400.0)


def test_a_kernel_that_raises_is_recorded_and_the_others_run():
    tl = Timeline(ms=1.0)
    sampler = FakeSampler(tl.now)
    good = {"stage": "production", "shape": "x", "status": "ok", "ms": 1.0}
    bad = {"stage": "stage14", "shape": "x", "status": "ok", "ms": 1.0}

    def broken():
        raise RuntimeError("launch failed\nsecond line")
    cfg = sustained.Config(seconds=0.05, settle_s=0.0, cooldown_s=0.0, idle_w=1e9)
    sustained.run_case(1, {"production": (good, tl.launch, 0), "stage14": (bad, broken, 0)},
                       None, sampler, cfg, rng=np.random.default_rng(0),
                       events_of=lambda st: FakeEvents(tl), sleep=lambda dt: None, now=tl.now)
    assert "sustained" in good and bad["sustained_error"] == "RuntimeError: launch failed"


# ---- the samplers -------------------------------------------------------------------------

def fake_pynvml(*, instant=True, energy=True):
    calls = []

    class Value:
        def __init__(self, mw):
            self.nvmlReturn, self.valueType = (0 if instant else 3), 1
            self.value = types.SimpleNamespace(uiVal=mw)

    nv = types.SimpleNamespace(
        NVML_FI_DEV_POWER_INSTANT=186, NVML_CLOCK_SM=1,
        nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByPciBusId=lambda bus: calls.append(("bus", bus)) or "h",
        nvmlDeviceGetHandleByIndex=lambda i: calls.append(("index", i)) or "h",
        nvmlDeviceGetFieldValues=lambda h, ids: [Value(693_500)],
        nvmlDeviceGetPowerUsage=lambda h: 650_000,
        nvmlDeviceGetClockInfo=lambda h, kind: 1395 if kind == 1 else 0,
    )
    if energy:
        nv.nvmlDeviceGetTotalEnergyConsumption = lambda h: 123_456
    return nv, calls


def test_nvml_sampler_reads_instant_power_clock_and_energy():
    nv, calls = fake_pynvml()
    s = sustained.NvmlSampler(nv, 0.01, pci_bus_id="0000:19:00.0", now=lambda: 1.5)
    assert s.read() == (1.5, 693.5, 1395.0, 123456.0) and s.power_field == "instant"
    assert ("bus", "0000:19:00.0") in calls
    nv, _ = fake_pynvml(instant=False, energy=False)
    s = sustained.NvmlSampler(nv, 0.01, now=lambda: 2.0)
    assert s.read() == (2.0, 650.0, 1395.0, None) and s.power_field.startswith("average")


def test_nvml_sampler_thread_collects_and_stops():
    nv, calls = fake_pynvml()
    s = sustained.NvmlSampler(nv, 0.001).start()
    import time
    time.sleep(0.05)
    s.stop()
    n = len(s.samples())
    assert n >= 3 and calls[-1] == "shutdown"
    time.sleep(0.01)
    assert len(s.samples()) == n                      # stopped


class FakePopen:
    def __init__(self, lines):
        self.lines, self.cmd, self.terminated = lines, None, False

    def __call__(self, cmd, **kw):
        self.cmd = cmd
        self.stdout = io.StringIO("".join(self.lines))
        return self

    def poll(self):
        return 0 if self.terminated else None

    def terminate(self):
        self.terminated = True

    def wait(self, timeout=None):
        return 0


def test_smi_sampler_parses_lines_and_falls_back_to_power_draw():
    popen = FakePopen(["693.52, 1395\n", "[N/A], 1395\n", "690.1, 1410\n"])
    ok = lambda cmd, **kw: types.SimpleNamespace(returncode=0, stdout="700.0, 1980\n")  # noqa: E731
    s = sustained.SmiSampler("nvidia-smi", 0.1, pci_bus_id="0000:19:00.0", popen=popen, run=ok,
                             now=lambda: 3.0)
    assert s.fields == sustained.SMI_FIELDS
    s.start()
    s._thread.join(timeout=5)
    assert [(x.power_w, x.sm_mhz) for x in s.samples()] == [(693.52, 1395.0), (690.1, 1410.0)]
    assert "--loop-ms=100" in popen.cmd and "--id=0000:19:00.0" in popen.cmd
    assert "--query-gpu=power.draw.instant,clocks.sm" in popen.cmd
    s.stop()
    assert popen.terminated
    old = lambda cmd, **kw: types.SimpleNamespace(returncode=2, stdout="")  # noqa: E731
    s = sustained.SmiSampler("nvidia-smi", 0.1, popen=FakePopen([]), run=old)
    assert s.fields == sustained.SMI_FALLBACK_FIELDS and s.power_field == "power.draw"


def test_make_sampler_prefers_nvml_then_smi_then_one_clear_error(monkeypatch):
    nv, _ = fake_pynvml()
    assert sustained.make_sampler(importer=lambda name: nv).kind == "nvml"

    def missing(name):
        raise ImportError(name)
    ok = lambda cmd, **kw: types.SimpleNamespace(returncode=0, stdout="1.0, 2\n")  # noqa: E731
    import subprocess
    monkeypatch.setattr(subprocess, "run", ok)
    s = sustained.make_sampler(importer=missing, which=lambda name: "/usr/bin/nvidia-smi")
    assert s.kind == "nvidia-smi"
    with pytest.raises(sustained.SamplerUnavailable) as exc:
        sustained.make_sampler(importer=missing, which=lambda name: None)
    text = str(exc.value)
    assert "nvidia-ml-py" in text and "nvidia-smi" in text and "\n" not in text
    assert "pynvml not installed" in text


def test_config_rejects_bad_values_naming_them():
    with pytest.raises(ValueError, match="seconds"):
        sustained.Config(seconds=0)
    with pytest.raises(ValueError, match="rounds"):
        sustained.Config(rounds=0)
    assert sustained.Config().estimate_s(2) == pytest.approx(2 * 5.2)


# ---- tables and files ---------------------------------------------------------------------

def sustained_result():
    """The synthetic results with sustained figures on stage 1 and cuDNN at 4k."""
    result = json.loads((Path(__file__).parent / "fixtures" / "bench_synthetic.json").read_text())
    row = next(r for r in result["results"] if r["stage"] == "stage01" and r["shape"] == "4k")
    peer = next(p for p in result["peer"] if p["shape"] == "4k")
    row["sustained"] = {"tflops": 573.0, "sm_mhz_median": 1395.0, "power_w_median": 692.0,
                        "tflop_per_j": 0.82, "window_ms": 3000.0, "flags": []}
    peer["sustained"] = {"tflops": 553.0, "sm_mhz_median": 1650.0, "power_w_median": 691.0,
                         "tflop_per_j": 0.80, "window_ms": 3000.0,
                         "flags": ["only 2 power/clock samples inside the window"]}
    sustained.peer_ratios([row], peer)
    return result


def test_format_table_shows_burst_and_sustained_side_by_side():
    text = bench.format_table(sustained_result())
    lines = text.splitlines()
    head = lines[1].split()
    assert head[:8] == ["stage", "shape", "ms", "TFLOP/s", "%", "cuDNN", "95%", "CI"]
    assert "sust" in head and "TFLOP/J" in head
    row = next(line for line in lines if line.startswith("stage01 baseline") and " 4k " in line)
    assert "573.0" in row and "103.6" in row and "1395" in row and "0.820" in row
    peer = next(line for line in lines if line.startswith("cuDNN") and " 4k " in line)
    assert "553.0" in peer and "1650" in peer
    assert any("what a model running for minutes" in line for line in lines)
    assert any("cuDNN 4k sustained: only 2 power/clock samples" in line for line in lines)


def test_old_results_files_still_load_and_print_without_sustained_columns():
    files = sorted(RESULTS.glob("*.json"))
    loaded = 0
    for path in files:
        data = json.loads(path.read_text())
        if not (isinstance(data, dict) and isinstance(data.get("results"), list)
                and "shapes" in data):
            continue                                   # traces, callpath files
        text = bench.format_table(bench.load_results(path))
        assert "sust" not in text.splitlines()[1], path.name
        loaded += 1
    assert loaded >= 10


def test_combined_ranges_carry_sustained_figures(tmp_path):
    a, b = sustained_result(), sustained_result()
    row = next(r for r in b["results"] if r["stage"] == "stage01" and r["shape"] == "4k")
    row["sustained"]["tflops"] = 580.0
    row["sustained"]["pct_of_peer"] = 104.9
    combined = bench.combine_results([a, b])
    got = next(r for r in combined["rows"] if r["stage"] == "stage01" and r["shape"] == "4k")
    assert got["sustained_tflops_range"] == [573.0, 580.0]
    assert got["peer_sustained_tflops_range"] == [553.0, 553.0]
    text = bench.format_combined(combined)
    assert "573.0-580.0" in text and "sust TFLOP/s (range)" in text
    assert "what a model running for minutes" in text
    plain = bench.format_combined(bench.combine_results([synthetic_plain(), synthetic_plain()]))
    assert "sust" not in plain


def synthetic_plain():
    return json.loads((Path(__file__).parent / "fixtures" / "bench_synthetic.json").read_text())


# ---- the benchmark's hook -----------------------------------------------------------------

def test_run_benchmark_sustained_on_a_fake_gpu(monkeypatch):
    """--sustained through run_benchmark on the pretend GPU: every timed kernel gets its
    sustained figures, the protocol says how they were made, the table shows them; a stage
    that failed its check gets none."""
    import fake_gpu
    launches = fake_gpu.install(monkeypatch, {1: 4.0, 3: 2.0}, wrong={2})
    ms = {1: 4.0, 2: 3.0, 3: 2.0}
    clock = {"t": 0.0}

    def gpu_s():
        return sum(ms[n] * c for n, c in launches.items()) / 1e3

    def now():
        clock["t"] += 1e-5
        return gpu_s() + clock["t"]

    class Ev:
        def __init__(self, stream):
            pass

        def mark(self):
            return gpu_s()

        def wait(self, e):
            pass

        def elapsed_ms(self, a, b):
            return (b - a) * 1e3

    monkeypatch.setattr(sustained, "make_sampler", lambda *a, **k: FakeSampler(now))
    monkeypatch.setattr(sustained, "pci_bus_id", lambda: None)
    monkeypatch.setattr(sustained, "Events", Ev)
    monkeypatch.setattr(sustained, "_now", now)
    monkeypatch.setattr(sustained, "_sleep", lambda dt: clock.__setitem__("t", clock["t"] + dt))
    cfg = sustained.Config(seconds=0.05, settle_s=0.01, cooldown_s=0.01, idle_w=1e9)
    result = bench.run_benchmark(["1", "2", "3"], ["1x1x128x128"], reps=2, rounds=2,
                                 sustained=cfg)
    rows = {r["stage"]: r for r in result["results"]}
    assert rows["stage01"]["sustained"]["tflops"] == pytest.approx(
        bench.attention_flops(1, 1, 128, 128, 128) / 4e-3 / 1e12)
    assert rows["stage03"]["sustained"]["sm_mhz_median"] == 1400.0
    assert "sustained" not in rows["stage02"]                   # failed its check: not timed
    assert result["schema"] == 4 and result["protocol"]["sustained"]["sampler"] == "fake"
    assert result["protocol"]["sustained"]["seconds"] == 0.05
    assert set(result["sustained_orders"]["1x1x128x128"]) == {"stage01", "stage03"}
    assert "sust TFLOP/s" in bench.format_table(result)


def test_run_benchmark_without_a_sampler_stops_before_any_case(monkeypatch):
    import fake_gpu
    launches = fake_gpu.install(monkeypatch, {1: 4.0})

    def none(*a, **k):
        raise sustained.SamplerUnavailable(sustained.NO_SAMPLER)
    monkeypatch.setattr(sustained, "make_sampler", none)
    monkeypatch.setattr(sustained, "pci_bus_id", lambda: None)
    with pytest.raises(sustained.SamplerUnavailable, match="nvidia-ml-py"):
        bench.run_benchmark(["1"], ["1x1x128x128"], reps=2, rounds=2,
                            sustained=sustained.Config())
    assert launches == {}


def test_cli_sustained_options(monkeypatch):
    from click.testing import CliRunner

    from ptxattn.tools.cli import main
    runner = CliRunner()
    res = runner.invoke(main, ["bench", "--set", "production", "--shapes", "causal-16k",
                               "--estimate"])
    plain = float(res.output.split("~")[1].split()[0])
    res = runner.invoke(main, ["bench", "--set", "production", "--shapes", "causal-16k",
                               "--estimate", "--sustained"])
    assert res.exit_code == 0, res.output
    assert float(res.output.split("~")[1].split()[0]) > plain
    synth = str(Path(__file__).parent / "fixtures" / "bench_synthetic.json")
    res = runner.invoke(main, ["bench", "--from-json", synth, "--sustained"])
    assert res.exit_code != 0 and "--sustained runs kernels" in res.output


# ---- on the GPU -------------------------------------------------------------------------

@pytest.mark.gpu
def test_sampler_reads_plausible_power_and_clock_on_the_gpu():
    """The sampler the benchmark would use (NVML, else nvidia-smi) reads this GPU: power in
    (20, 1200) W and an SM clock in (100, 3000) MHz, several readings in half a second."""
    s = sustained.make_sampler(0.05, pci_bus_id=sustained.pci_bus_id()).start()
    try:
        import time
        time.sleep(0.5)
    finally:
        s.stop()
    got = s.samples()
    assert len(got) >= 3, f"{s.kind} sampler: {len(got)} readings in 0.5 s ({s.error})"
    bad = [x for x in got if not (20 < x.power_w < 1200 and 100 < x.sm_mhz < 3000)]
    assert not bad, f"{s.kind} ({s.power_field}): implausible readings {bad[:3]}"


@pytest.mark.gpu
def test_sustained_window_of_the_production_kernel_on_the_gpu():
    """A short sustained window (1 s after 0.5 s) of the production kernel and cuDNN at
    (2, 16, 4096, 128) causal: figures present and plausible, the window at least as long as
    asked, sustained TFLOP/s within 0.5x-1.3x of the burst figure, the integrated energy
    within 15% of NVML's counter where there is one (a sampler that lags or a window placed
    wrongly on the timeline shows there). About 6 s of device time."""
    case = bench.Case("s", 2, 16, 4096, 4096, 128, causal=True, kernels=("production",))
    cfg = sustained.Config(seconds=1.0, settle_s=0.5, cooldown_s=0.5, cooldown_max_s=1.0)
    result = bench.run_cases([case], reps=5, rounds=2, warmup=2, sustained=cfg)
    rows = [r for r in result["results"] + result["peer"] if r.get("status") == "ok"]
    assert rows, result
    for r in rows:
        label = r.get("stage") or r.get("name")
        assert "sustained" in r, f"{label}: {r.get('sustained_error')}"
        s = r["sustained"]
        assert s["window_ms"] >= 1000.0, (label, s)
        assert s["samples"] >= 3 and not s["flags"], (label, s)
        assert 0.5 * r["tflops"] <= s["tflops"] <= 1.3 * r["tflops"], (
            f"{label}: sustained {s['tflops']:.1f} against burst {r['tflops']:.1f} TFLOP/s")
        assert 100 < s["sm_mhz_median"] < 3000 and 50 < s["power_w_median"] < 1200, (label, s)
        assert s["tflop_per_j"] > 0, (label, s)
        if s.get("energy_j_counter"):
            assert abs(s["energy_j"] / s["energy_j_counter"] - 1) < 0.15, (
                f"{label}: integrated {s['energy_j']:.1f} J, NVML counter "
                f"{s['energy_j_counter']:.1f} J")
    text = bench.format_table(result)
    assert "sust TFLOP/s" in text and "what a model running for minutes" in text

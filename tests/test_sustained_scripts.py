"""--sustained of bench/backward_bench.py and bench/fp8_bench.py on the CPU: their options, the
shared sustained.figures() on pretend GPU timelines and a fake sampler, the JSON rows they
write, the nvidia-smi fallback (a stand-in nvidia-smi on PATH, no pynvml), and the device
script's calls."""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import pytest

from bench_modules import bench_script, run_with_stub_python
from ptxattn.tools import sustained
from test_sustained import FakeEvents, FakeSampler, Timeline

CFG = sustained.Config(seconds=0.3, settle_s=0.1, cooldown_s=0.0, idle_w=1e9)


@pytest.fixture(scope="module")
def backward_bench():
    return bench_script("backward_bench")


@pytest.fixture(scope="module")
def fp8_bench():
    return bench_script("fp8_bench")


def pretend(ms: dict, power=lambda t: 700.0):
    """Timelines (one per stream name, launches of ms[name] each), a clock over all of them, a
    fake sampler on it, and the figures() keywords that put the windows on them."""
    timelines = {name: Timeline(ms=m) for name, m in ms.items()}
    clock = {"t": 0.0}

    def now():
        return clock["t"] + sum(t.host for t in timelines.values())

    kw = dict(events_of=lambda stream: FakeEvents(timelines[stream]),
              sleep=lambda dt: clock.__setitem__("t", clock["t"] + dt), now=now)
    return timelines, FakeSampler(now, power=power), kw


# ---- the options ----------------------------------------------------------------------------

@pytest.mark.parametrize("script", ["backward_bench", "fp8_bench"])
def test_sustained_options_parse_into_a_config(script):
    module = bench_script(script)
    args = module.parse_args(["--sustained", "--sustained-seconds", "2.5", "--cooldown", "0.5"])
    assert args.sustained_cfg == sustained.Config(seconds=2.5, cooldown_s=0.5)
    assert module.parse_args([]).sustained_cfg is None
    assert module.parse_args(["--sustained"]).sustained_cfg == sustained.Config()


@pytest.mark.parametrize("script", ["backward_bench", "fp8_bench"])
@pytest.mark.parametrize("argv, message", [
    (["--sustained", "--sustained-seconds", "0"], "--sustained-seconds: expected a positive"),
    (["--sustained", "--cooldown", "-1"], "--cooldown: expected a number >= 0"),
    (["--sustained-seconds", "x"], "invalid float value"),
])
def test_bad_sustained_values_are_named_before_anything_runs(script, argv, message, capsys):
    module = bench_script(script)
    with pytest.raises(SystemExit) as exc:
        module.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_the_scripts_other_options_still_parse(backward_bench, fp8_bench):
    args = backward_bench.parse_args(["--cases", "dense,causal", "--sustained"])
    assert args.cases == ["dense", "causal"] and args.variants == []
    args = fp8_bench.parse_args(["--shapes", "16k-d128", "--define", "A=1", "--sustained"])
    assert args.names == ["16k-d128"] and args.defines == {"A": "1"}
    with pytest.raises(SystemExit):
        fp8_bench.parse_args(["--shapes", "nope", "--sustained"])


# ---- the shared figures ---------------------------------------------------------------------

def test_figures_arithmetic_order_and_peer_ratios():
    timelines, sampler, kw = pretend({"ours": 2.0, "cuDNN": 2.5}, power=lambda t: 690.0)
    kernels = {"ours": sustained.Kernel(timelines["ours"].launch, "ours", 10**12, 2.0),
               "cuDNN": sustained.Kernel(timelines["cuDNN"].launch, "cuDNN", 10**12, 2.5)}
    orders = set()
    for seed in range(6):
        figs = sustained.figures(kernels, CFG, rng=np.random.default_rng(seed), peer="cuDNN",
                                 sampler=sampler, **kw)
        orders.add(tuple(figs))
    assert orders == {("ours", "cuDNN"), ("cuDNN", "ours")}       # both orders happen
    ours, peer = figs["ours"], figs["cuDNN"]
    assert ours["tflops"] == pytest.approx(500.0) and peer["tflops"] == pytest.approx(400.0)
    assert ours["pct_of_peer"] == pytest.approx(125.0) and "pct_of_peer" not in peer
    joules = 690.0 * ours["window_ms"] / 1e3
    assert ours["energy_j"] == pytest.approx(joules, rel=1e-3)
    assert ours["tflop_per_j"] == pytest.approx(ours["launches"] / joules, rel=1e-3)
    assert ours["energy_pct_of_peer"] == pytest.approx(125.0, rel=0.02)
    assert ours["power_w_median"] == 690.0 and ours["sm_mhz_median"] == 1400.0
    assert ours["window_ms"] >= 300.0 and ours["sampler"] == "fake"


def test_figures_records_a_kernel_that_raises_and_checks_the_peer_label():
    timelines, sampler, kw = pretend({"ours": 1.0})

    def broken():
        raise RuntimeError("launch failed\nmore")
    kernels = {"ours": sustained.Kernel(timelines["ours"].launch, "ours", 1, 1.0),
               "bad": sustained.Kernel(broken, "ours", 1, 1.0)}
    figs = sustained.figures(kernels, CFG, rng=np.random.default_rng(0), peer="bad",
                             sampler=sampler, **kw)
    assert figs["bad"] == {"error": "RuntimeError: launch failed"}
    assert figs["ours"]["tflops"] > 0 and "pct_of_peer" not in figs["ours"]
    with pytest.raises(ValueError, match="peer 'cuDNN'"):
        sustained.figures(kernels, CFG, rng=np.random.default_rng(0), peer="cuDNN",
                          sampler=sampler, **kw)


def test_figures_starts_and_stops_its_own_sampler_when_given_none(monkeypatch):
    timelines, sampler, kw = pretend({"ours": 1.0})
    calls = []
    sampler.start = lambda: calls.append("start") or sampler
    sampler.stop = lambda: calls.append("stop")
    monkeypatch.setattr(sustained, "make_sampler", lambda *a, **k: sampler)
    monkeypatch.setattr(sustained, "pci_bus_id", lambda: None)
    kernels = {"ours": sustained.Kernel(timelines["ours"].launch, "ours", 1, 1.0)}
    sustained.figures(kernels, CFG, rng=np.random.default_rng(0), **kw)
    assert calls == ["start", "stop"]
    calls.clear()
    sustained.figures(kernels, CFG, rng=np.random.default_rng(0), sampler=sampler, **kw)
    assert calls == []                                 # the caller's sampler: the caller's


# ---- the rows the scripts write -------------------------------------------------------------

def test_backward_rows_carry_sustained_beside_burst(backward_bench):
    flops = backward_bench.backward_flops(4, 16, 8192, 128, False)
    ms = {"default": flops / 500e9, "m80": flops / 400e9, "cuDNN": flops / 450e9}
    timelines, sampler, kw = pretend(ms)
    rows = {lab: {"case": "dense", "flops": flops, "ms": ms[lab], "cudnn_ms": ms["cuDNN"],
                  "ratio": ms["cuDNN"] / ms[lab], "ratio_ci": [1.0, 1.2]}
            for lab in ("default", "m80")}
    rows["failed"] = {"case": "dense", "flops": flops, "error": "failed its check: not timed"}
    ours = {lab: (timelines[lab].launch, lab) for lab in ("default", "m80")}
    order = backward_bench.add_sustained(rows, ours, (timelines["cuDNN"].launch, "cuDNN"), CFG,
                                         rng=np.random.default_rng(0), sampler=sampler, **kw)
    assert sorted(order) == ["cuDNN", "default", "m80"]
    d, m = rows["default"], rows["m80"]
    assert d["sustained"]["tflops"] == pytest.approx(500.0, rel=1e-6)
    assert d["cudnn_sustained"]["tflops"] == pytest.approx(450.0, rel=1e-6)
    assert d["sustained_ratio"] == pytest.approx(500 / 450, rel=1e-6)
    assert m["sustained_ratio"] == pytest.approx(400 / 450, rel=1e-6)
    assert d["cudnn_sustained"] is m["cudnn_sustained"]      # one cuDNN window per case
    assert d["ratio"] == pytest.approx(500 / 450)            # the burst figures stay
    assert "sustained" not in rows["failed"]
    back = json.loads(json.dumps(rows))
    assert set(back["default"]) >= {"ms", "ratio", "sustained", "cudnn_sustained",
                                    "sustained_ratio"}
    assert "t_begin" not in back["default"]["sustained"]


def test_fp8_rows_carry_sustained_and_the_bf16_ratio(fp8_bench):
    (b, h, length, d), _, _ = fp8_bench.SHAPES["16k-d128"]
    flops = 4 * b * h * length * length * d
    ms = {"fp8 forward": flops / 850e9, "bf16 production": flops / 600e9,
          "cuDNN": flops / 550e9, "fp8 + quantize": 1.0, "quantize alone": 0.1}
    timelines, sampler, kw = pretend(ms)
    record = {"flops": flops, "cudnn_ms": ms["cuDNN"],
              "rows": {lab: {"ms": ms[lab], "tflops": flops / ms[lab] / 1e9}
                       for lab in fp8_bench.LABELS}}
    ours = {lab: (timelines[lab].launch, lab) for lab in fp8_bench.LABELS}
    order = fp8_bench.add_sustained(record, ours, (timelines["cuDNN"].launch, "cuDNN"), CFG,
                                    rng=np.random.default_rng(1), sampler=sampler, **kw)
    assert sorted(order) == ["bf16 production", "cuDNN", "fp8 forward"]
    rows = record["rows"]
    f8 = rows["fp8 forward"]
    assert f8["sustained"]["tflops"] == pytest.approx(850.0, rel=1e-6)
    assert f8["sustained"]["pct_of_peer"] == pytest.approx(100 * 850 / 550, rel=1e-6)
    assert f8["x_bf16_sustained"] == pytest.approx(850 / 600, rel=1e-6)
    assert record["cudnn_sustained"]["tflops"] == pytest.approx(550.0, rel=1e-6)
    assert "sustained" not in rows["fp8 + quantize"] and "sustained" not in rows["quantize alone"]
    assert timelines["quantize alone"].launches == 0
    json.dumps(record)


def test_fp8_without_a_timed_peer_has_no_peer_figures(fp8_bench):
    timelines, sampler, kw = pretend({"fp8 forward": 1.0, "bf16 production": 2.0})
    record = {"flops": 10**12, "cudnn_ms": None,
              "rows": {"fp8 forward": {"ms": 1.0}, "bf16 production": {"ms": 2.0}}}
    ours = {lab: (timelines[lab].launch, lab) for lab in record["rows"]}
    fp8_bench.add_sustained(record, ours, None, CFG, rng=np.random.default_rng(0),
                            sampler=sampler, **kw)
    f8 = record["rows"]["fp8 forward"]
    assert "cudnn_sustained" not in record and "pct_of_peer" not in f8["sustained"]
    assert f8["x_bf16_sustained"] == pytest.approx(2.0, rel=1e-6)


# ---- the nvidia-smi fallback ----------------------------------------------------------------

def fake_smi(tmp_path, *, instant=True):
    """A stand-in nvidia-smi on PATH: one line per query, lines every 20 ms with --loop-ms;
    without `instant`, asking for power.draw.instant fails (an older driver)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    refuse = "" if instant else 'case "$*" in *power.draw.instant*) exit 2;; esac\n'
    smi.write_text("#!/bin/sh\n" + refuse + 'case "$*" in\n'
                   '  *--loop-ms*) while true; do echo "693.50, 1395"; sleep 0.02; done;;\n'
                   '  *) echo "693.50, 1395";;\nesac\n')
    smi.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("instant", [True, False])
def test_without_nvml_the_scripts_sample_through_nvidia_smi(tmp_path, monkeypatch, instant):
    monkeypatch.setitem(sys.modules, "pynvml", None)          # `import pynvml` fails
    monkeypatch.setenv("PATH", f"{fake_smi(tmp_path, instant=instant)}:/usr/bin:/bin")
    monkeypatch.setattr(sustained, "pci_bus_id", lambda: None)
    cfg = sustained.Config(period_s=0.02)
    sampler = sustained.start_sampler(cfg)
    try:
        deadline = time.monotonic() + 5
        while len(sampler.samples()) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sampler.kind == "nvidia-smi"
        assert [(s.power_w, s.sm_mhz) for s in sampler.samples()[:3]] == [(693.5, 1395.0)] * 3
        proto = sustained.protocol(cfg, sampler)
        assert proto["sampler"] == "nvidia-smi" and proto["seconds"] == cfg.seconds
        assert proto["power_field"] == ("power.draw.instant" if instant else "power.draw")
    finally:
        sampler.stop()
    assert sampler.proc.poll() is not None                     # the subprocess is gone


def test_neither_nvml_nor_nvidia_smi_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sustained, "pci_bus_id", lambda: None)
    with pytest.raises(sustained.SamplerUnavailable, match="pynvml not installed; no nvidia-smi"):
        sustained.start_sampler(sustained.Config())


# ---- the device script ----------------------------------------------------------------------

def test_the_device_script_runs_both_benchmarks_sustained_on_the_issue_shapes(
        tmp_path, backward_bench, fp8_bench):
    proc, calls = run_with_stub_python("bench/device/session10_sustained.sh", tmp_path)
    assert proc.returncode == 0, proc.stderr
    bwd = next(c for c in calls if "backward_bench.py" in c).split()
    fp8 = next(c for c in calls if "fp8_bench.py" in c).split()
    assert "--sustained" in bwd and "--sustained" in fp8
    cases = bwd[bwd.index("--cases") + 1].split(",")
    shapes = fp8[fp8.index("--shapes") + 1].split(",")
    assert {backward_bench.CASES[c][:5] for c in cases} == {(4, 16, 16, 8192, 128)}
    assert sorted(bool(backward_bench.CASES[c][5]) for c in cases) == [False, True]
    assert [fp8_bench.SHAPES[s][0] for s in shapes] == [(2, 16, 16384, 128), (2, 8, 16384, 256)]
    backward_bench.parse_args(bwd[1:])           # they parse (bwd[0]: the script's path)
    fp8_bench.parse_args(fp8[1:])
    assert any("pytest" in c and "test_sustained_scripts.py" in c for c in calls)

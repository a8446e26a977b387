"""ptxattn.bench on the CPU: FLOP/s arithmetic, timing logic with a fake timer, tables, plots."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ptxattn import bench

FIXTURES = Path(__file__).parent / "fixtures"
SYNTHETIC = FIXTURES / "bench_synthetic.json"


def synthetic() -> dict:
    return json.loads(SYNTHETIC.read_text())


def test_tflops_formula():
    # 4·B·H·Lq·Lk·D FLOPs: 8·16·4096·4096·128 · 4 = 1.0995e15 FLOPs; in 1 ms = 1099.5 TFLOP/s
    assert bench.attention_flops(8, 16, 4096, 4096, 128) == 4 * 8 * 16 * 4096 * 4096 * 128
    assert bench.tflops(8, 16, 4096, 4096, 128, 1.0) == pytest.approx(1099.511627776)
    assert bench.tflops(1, 1, 64, 128, 128, 2.0) == pytest.approx(4 * 64 * 128 * 128 / 2e-3 / 1e12)


def test_shapes_and_parse_shape():
    assert bench.SHAPES["4k"] == (8, 16, 4096, 128)
    assert bench.SHAPES["8k"] == (4, 16, 8192, 128)
    assert bench.SHAPES["16k"] == (2, 16, 16384, 128)
    assert {"1k", "512"} <= set(bench.SHAPES)
    assert bench.parse_shape("16K") == ("16k", (2, 16, 16384, 128))
    assert bench.parse_shape("2x16x2048x128") == ("2x16x2048x128", (2, 16, 2048, 128))
    with pytest.raises(ValueError, match="shape"):
        bench.parse_shape("huge")
    with pytest.raises(ValueError, match="positive"):
        bench.parse_shape("0x1x64x128")


class FakeTimer:
    """mark() returns a token; elapsed_ms(a, b) returns the next preset duration."""

    def __init__(self, durations):
        self.durations = list(durations)
        self.marks = 0
        self.read = []

    def mark(self):
        self.marks += 1
        return self.marks

    def elapsed_ms(self, a, b):
        assert b == a + 1                       # a start/stop pair around one launch
        self.read.append((a, b))
        return self.durations.pop(0)


def test_time_launch_warmups_are_untimed_and_the_median_is_taken():
    calls = []
    timer = FakeTimer([5.0, 1.0, 3.0, 100.0, 2.0])
    times = bench.time_launch(lambda: calls.append(timer.marks), warmup=3, reps=5, timer=timer)
    assert len(calls) == 8
    assert calls[:3] == [0, 0, 0]               # warm-ups run before any event
    assert calls[3:] == [1, 3, 5, 7, 9]          # each timed launch sits between its two marks
    assert times == [5.0, 1.0, 3.0, 100.0, 2.0]
    assert bench.median(times) == 3.0            # one outlier does not move the median
    assert bench.median([4.0, 1.0, 3.0, 2.0]) == 2.5


def test_time_launch_rejects_zero_reps():
    with pytest.raises(ValueError, match="reps"):
        bench.time_launch(lambda: None, reps=0, timer=FakeTimer([]))


def test_format_table_on_synthetic_results():
    text = bench.format_table(synthetic())
    lines = text.splitlines()
    assert lines[0].startswith("NVIDIA H200, driver 13.0, bhld")
    assert lines[1].split()[:4] == ["stage", "shape", "ms", "TFLOP/s"]
    row = next(line for line in lines if line.startswith("stage01 baseline") and " 4k " in line)
    cells = row.split()
    # ms, TFLOP/s, % of cuDNN (1.70 / 9.0), rel err ours, rel err cuDNN, check
    assert cells[3:] == ["9.000", "122.2", "18.9", "3.1e-03", "2.9e-03", "ok"]
    assert any(line.startswith("cuDNN") and " 4k " in line and "100.0" in line for line in lines)
    assert "stage03 8k skipped: synthetic: shape not supported" in text


def test_format_table_without_peer():
    result = synthetic()
    result["peer"] = []
    for row in result["results"]:
        row.pop("pct_of_peer", None)
    text = bench.format_table(result)
    assert "cuDNN  " not in text.splitlines()[2]
    assert "9.000" in text


def test_results_filename_and_round_trip(tmp_path):
    result = synthetic()
    assert bench.results_filename(result) == "2026-11-29-h200.json"
    path = bench.write_results(result, tmp_path / "sub" / bench.results_filename(result))
    assert bench.load_results(path) == result


def test_check_subset_bounds_the_reference_work():
    sub = bench.check_subset((8, 16, 16384, 128), max_rows=4096)
    assert sub["batches"] == [0, 7] and sub["heads"] == [0, 15]
    assert sub["rows"] == slice(0, 16384, 4)
    assert bench.check_subset((1, 1, 512, 128))["rows"] == slice(0, 512, 1)


@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_check_output_passes_the_reference_and_catches_nan(layout):
    from ptxattn import reference
    q, k, v = reference.random_qkv(2, 3, 128, 64, 128, layout, seed=1)
    exact = reference.attention_reference(q, k, v, layout=layout).astype(np.float32)
    good = bench.check_output(q, k, v, exact.astype(q.dtype), layout, max_rows=32)
    assert good["pass"] and good["rel_l2"] < 8e-3 and good["nan_total"] == 0
    assert good["checked"] == "batch 0,1 head 0,2 rows every 4th"
    poisoned = exact.copy()
    poisoned[(1, 1, 5, 0) if layout == "bhld" else (1, 5, 1, 0)] = np.nan  # row 5: not checked
    bad = bench.check_output(q, k, v, poisoned, layout, max_rows=32)
    assert not bad["pass"] and bad["nan_total"] == 1


def test_plot_progression(tmp_path):
    pytest.importorskip("matplotlib")
    for name in ("chart.png", "chart.svg"):
        out = bench.plot_progression(SYNTHETIC, tmp_path / name)
        assert out.stat().st_size > 1000
    assert (tmp_path / "chart.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_progression_without_matplotlib(monkeypatch, tmp_path):
    import builtins
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(bench.MissingExtraError, match=r"pip install 'ptxattn\[plot\]'"):
        bench.plot_progression(SYNTHETIC, tmp_path / "x.png")


def test_run_benchmark_flow_with_a_fake_gpu(monkeypatch):
    """The bookkeeping of run_benchmark (checks, skips, errors, rounds, JSON) with the driver,
    the device arrays and the launches faked: NumPy inputs, no peer."""
    import fake_gpu
    launches = fake_gpu.install(monkeypatch, {1: 4.0, 3: 2.0}, fail={2})

    messages = []
    result = bench.run_benchmark([1, 2, 3], ["1x2x128x128", "1x1x96x128"], "bshd", reps=4,
                                 rounds=3, log=messages.append)
    json.dumps(result)                                           # serializable as is
    assert result["env"]["gpu"] == "Fake GPU" and result["env"]["driver_version"] == "13.0"
    assert result["protocol"]["inputs"] == "numpy" and result["protocol"]["layout"] == "bshd"
    assert result["shapes"] == {"1x2x128x128": [1, 2, 128, 128, 128],
                                "1x1x96x128": [1, 1, 96, 96, 128]}
    assert result["peer"] == []
    rows = {(r["stage"], r["shape"]): r for r in result["results"]}
    ok = rows[("stage01", "1x2x128x128")]
    assert ok["status"] == "ok" and ok["pass"] and ok["nan_total"] == 0
    assert ok["ms_rounds"] == [4.0, 4.0, 4.0] and ok["ms"] == 4.0
    assert ok["tflops"] == pytest.approx(bench.tflops(1, 2, 128, 128, 128, 4.0))
    assert "pct_of_peer" not in ok
    assert rows[("stage03", "1x2x128x128")]["ms"] == 2.0
    err = rows[("stage02", "1x2x128x128")]
    assert err["status"] == "error" and err["reason"] == "RuntimeError: fake JIT failure"
    assert all(rows[(s, "1x1x96x128")]["status"] == "skipped" for s in ("stage01", "stage02",
                                                                        "stage03"))
    assert "query length 96" in rows[("stage01", "1x1x96x128")]["reason"]
    assert launches == {1: 4, 3: 4}                # one checked launch + one per round
    assert result["clocks"]["1x2x128x128"] == {"clocks_sm": "1980"}
    table = bench.format_table(result)
    assert "stage02 1x2x128x128 error: RuntimeError: fake JIT failure" in table
    assert any("stage01" in m and "4.000 ms" in m for m in messages)


def test_same_run_pct_is_a_median_of_per_round_ratios():
    # rounds where both slow down together (clock drift) keep the same ratio
    assert bench.same_run_pct([2.0, 4.0, 2.2], [1.0, 2.0, 1.1]) == pytest.approx(50.0)
    # one disturbed round does not move the headline
    assert bench.same_run_pct([2.0, 2.0, 9.0], [1.0, 1.0, 1.0]) == pytest.approx(50.0)
    assert bench.same_run_pct([1.0], [1.25]) == pytest.approx(125.0)
    with pytest.raises(ValueError):
        bench.same_run_pct([1.0, 2.0], [1.0])


@pytest.mark.gpu
def test_run_benchmark_on_the_gpu(tmp_path):
    """The real thing, small: every stage and (with PyTorch) cuDNN on one shape."""
    from ptxattn import stages
    result = bench.run_benchmark(None, ["2x2x512x128"], "bhld", reps=3, rounds=2, warmup=1)
    rows = result["results"]
    assert [r["stage"] for r in rows] == [s.label for s in stages.all_stages()]
    for r in rows:
        assert r["status"] in ("ok", "skipped"), r
        if r["status"] == "ok":
            assert r["pass"], r
            assert len(r["ms_rounds"]) == 2 and r["ms"] > 0 and r["tflops"] > 0
    if result["env"]["torch"] is not None:
        [peer] = result["peer"]
        assert peer["status"] == "ok" and peer["pass"], peer
        assert all("pct_of_peer" in r for r in rows if r["status"] == "ok")
    path = bench.write_results(result, tmp_path / bench.results_filename(result))
    assert "2x2x512x128" in bench.format_table(bench.load_results(path))

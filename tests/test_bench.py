"""ptxattn.tools.bench on the CPU: FLOP/s arithmetic, timing logic with a fake timer, tables, plots."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ptxattn.tools import bench

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
    # ms, TFLOP/s, % of cuDNN (1.70 / 9.0), CI and spread (not in schema 1), rel errs, check
    assert cells[3:] == ["9.000", "122.2", "18.9", "-", "-", "3.1e-03", "2.9e-03", "ok", "-"]
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


@pytest.mark.parametrize("shape", [(8, 16, 16384, 128), (8, 16, 4096, 128), (2, 16, 16384, 128),
                                   (16, 16, 512, 128), (1, 12, 32760, 128), (4, 32, 8192, 64)])
def test_check_subset_checks_every_head_on_a_bounded_number_of_rows(shape):
    batch, heads, seq, _ = shape
    sub = bench.check_subset(shape, max_rows=4096)
    assert sub["batches"] == list(range(batch)) and sub["heads"] == list(range(heads))
    n, pairs = sub["rows_per_pair"], batch * heads
    # the cost bound: the budget in all, or MIN_ROWS_PER_PAIR per pair when there are many
    assert n * pairs <= max(bench.CHECK_ROW_BUDGET, pairs * bench.MIN_ROWS_PER_PAIR)
    assert bench.MIN_ROWS_PER_PAIR <= n <= 4096
    draws = {(b, h): bench.subset_rows(sub, b, h) for b in (0, batch - 1)
             for h in (0, heads // 2, heads - 1)}
    for rows in draws.values():
        assert len(rows) == n and len(set(rows.tolist())) == n
        assert set((rows % 128).tolist()) == set(range(128))    # every position in a tile
        assert set((rows % 192).tolist()) == set(range(192))
        assert len(set(np.diff(rows).tolist())) > 2             # random, not a stride
    assert len({tuple(r.tolist()) for r in draws.values()}) == len(draws)   # a draw per pair


def test_check_subset_short_sequences_check_every_row():
    sub = bench.check_subset((1, 1, 512, 128))
    np.testing.assert_array_equal(bench.subset_rows(sub, 0, 0), np.arange(512))
    assert bench.check_subset((2, 2, 100, 64))["rows_per_pair"] == 100


@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_check_output_passes_the_reference_and_catches_nan(layout):
    from ptxattn import reference
    q, k, v = reference.random_qkv(2, 3, 128, 64, 128, layout, seed=1)
    exact = reference.attention_reference(q, k, v, layout=layout).astype(np.float32)
    good = bench.check_output(q, k, v, exact.astype(q.dtype), layout, max_rows=32)
    assert good["pass"] and good["rel_l2"] < 4e-3 and good["nan_total"] == 0
    assert good["checked"] == ("every (batch, head) of 2x3, 32 of 128 rows each, at random "
                               "(seed 0, a draw per (batch, head))")
    rows = bench.subset_rows(bench.check_subset((2, 3, 128, 128), 32), 1, 1)
    unchecked = int(np.setdiff1d(np.arange(128), rows)[0])
    poisoned = exact.copy()
    poisoned[(1, 1, unchecked, 0) if layout == "bhld" else (1, unchecked, 1, 0)] = np.inf
    bad = bench.check_output(q, k, v, poisoned, layout, max_rows=32)
    assert not bad["pass"] and bad["nan_total"] == 1               # Inf counts, anywhere
    assert bad["nan_count"] == 0                                   # (not in the checked rows)
    assert bench.failure_reason(bad) == "check failed: 1 NaN/Inf"
    biased = bench.check_output(q, k, v, exact * 1.0075, layout, max_rows=32)
    assert not biased["pass"] and "rel L2" in bench.failure_reason(biased)


@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_a_kernel_wrong_on_the_middle_heads_fails_the_check(layout):
    """Half wrong on heads 1..H-2 of the middle batch only: the corner heads and batches are
    right, so a check of {0, B-1} x {0, H-1} alone reported it ok."""
    from ptxattn import reference
    B, H = 3, 6
    q, k, v = reference.random_qkv(B, H, 300, 200, 64, layout, seed=4)
    exact = reference.attention_reference(q, k, v, layout=layout).astype(np.float32)
    wrong = exact.copy()
    middle = (1, slice(1, H - 1)) if layout == "bhld" else (1, slice(None), slice(1, H - 1))
    wrong[middle] *= 0.5
    m = bench.check_output(q, k, v, wrong.astype(q.dtype), layout)
    assert not m["pass"] and "rel L2" in bench.failure_reason(m), m
    assert bench.check_output(q, k, v, exact.astype(q.dtype), layout)["pass"]


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
    with pytest.raises(bench.MissingExtraError, match=r"pip install -e '\.\[plot\]'"):
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
    assert all(rows[(s, "1x1x96x128")]["status"] == "n/a" for s in ("stage01", "stage02",
                                                                        "stage03"))
    assert "query length 96" in rows[("stage01", "1x1x96x128")]["reason"]
    assert launches == {1: 4, 3: 4}                # one checked launch + one per round
    assert result["clocks"]["1x2x128x128"] == [{"clocks_sm": "1980"}] * 3     # after each round
    assert len(result["orders"]["1x2x128x128"]) == 3
    assert sorted(result["orders"]["1x2x128x128"][0]) == ["stage01", "stage03"]
    assert ok["ms_raw"] == [[4.0] * 4] * 3 and ok["spread_pct"] == 0.0
    assert result["source"]["tree_sha256"] == bench.source_id()["tree_sha256"]
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
            assert [len(t) for t in r["ms_raw"]] == [3, 3] and r["spread_pct"] >= 0
    assert len(result["orders"]["2x2x512x128"]) == 2
    assert result["source"]["tree_sha256"] and len(result["clocks"]["2x2x512x128"]) == 2
    if result["env"]["torch"] is not None:
        [peer] = result["peer"]
        assert peer["status"] == "ok" and peer["pass"], peer
        for r in rows:
            if r["status"] == "ok":
                assert "pct_of_peer" in r and r["pass_vs_peer"], r
                lo, hi = r["pct_of_peer_ci"]
                assert lo <= r["pct_of_peer"] <= hi
    path = bench.write_results(result, tmp_path / bench.results_filename(result))
    assert "2x2x512x128" in bench.format_table(bench.load_results(path))


def test_run_benchmark_does_not_time_a_stage_that_fails_its_check(monkeypatch):
    import fake_gpu
    launches = fake_gpu.install(monkeypatch, {1: 4.0, 3: 2.0}, wrong={3})
    result = bench.run_benchmark([1, 3], ["1x2x128x128"], reps=4, rounds=3)
    rows = {r["stage"]: r for r in result["results"]}
    bad = rows["stage03"]
    assert bad["status"] == "FAILED" and not bad["pass"]
    assert bad["reason"].startswith("check failed: rel L2")
    assert "ms" not in bad and "tflops" not in bad and "ms_rounds" not in bad
    assert launches == {1: 4, 3: 1}                 # the checked launch only
    assert rows["stage01"]["status"] == "ok" and rows["stage01"]["ms"] == 4.0
    table = bench.format_table(result)
    row = next(line for line in table.splitlines() if line.startswith("stage03"))
    assert row.split()[-2:] == ["FAILED", "-"] and " - " in row
    assert "stage03 1x2x128x128 FAILED: check failed: rel L2" in table


def test_run_benchmark_checks_arguments_before_the_gpu(monkeypatch):
    from ptxattn import driver

    def no_gpu():
        raise AssertionError("the GPU was asked for before the arguments were checked")

    monkeypatch.setattr(driver, "device_info", no_gpu)
    with pytest.raises(ValueError, match="stage: unknown stage '99'"):
        bench.run_benchmark(["99"], ["4k"])
    with pytest.raises(ValueError, match="shape: expected one of"):
        bench.run_benchmark(None, ["2k"])
    with pytest.raises(ValueError, match="layout"):
        bench.run_benchmark(None, ["4k"], "lbhd")
    with pytest.raises(ValueError, match="rounds"):
        bench.run_benchmark(None, ["4k"], rounds=0)
    with pytest.raises(ValueError, match="block"):
        bench.run_benchmark(None, ["4k"], block=0)


def test_default_rounds_is_at_least_ten():
    import inspect
    assert bench.DEFAULT_ROUNDS >= 10
    assert inspect.signature(bench.run_benchmark).parameters["rounds"].default >= 10


@pytest.mark.parametrize("ms", [0, 0.0, -1.0, float("nan")])
def test_tflops_rejects_a_non_positive_time(ms):
    with pytest.raises(ValueError, match="ms: expected a positive time"):
        bench.tflops(1, 1, 64, 64, 128, ms)


class PerFnTimer(FakeTimer):
    """A FakeTimer that also logs which timer (fn) each mark belongs to."""

    def __init__(self, name, log, durations):
        super().__init__(durations)
        self.name, self.log = name, log

    def mark(self):
        self.log.append(self.name)
        return super().mark()


def test_time_interleaved_alternates_in_blocks():
    log = []
    calls = []
    timers = [PerFnTimer("a", log, [1.0] * 5), PerFnTimer("b", log, [2.0] * 5)]
    out = bench.time_interleaved([lambda: calls.append("A"), lambda: calls.append("B")], 5,
                                 block=2, warmup=1, timers=timers)
    assert out == [[1.0] * 5, [2.0] * 5]
    assert calls == ["A", "B"] + ["A", "A", "B", "B", "A", "A", "B", "B", "A", "B"]
    assert log[::2] == ["a", "a", "b", "b", "a", "a", "b", "b", "a", "b"]   # start marks
    with pytest.raises(ValueError, match="block"):
        bench.time_interleaved([lambda: None], 1, block=0, timers=[FakeTimer([])])


def test_time_interleaved_rep_by_rep():
    calls = []
    timers = [FakeTimer([1.0] * 3), FakeTimer([2.0] * 3)]
    bench.time_interleaved([lambda: calls.append("A"), lambda: calls.append("B")], 3,
                           warmup=0, timers=timers)
    assert calls == ["A", "B", "A", "B", "A", "B"]


def test_bootstrap_ci_is_seeded_and_brackets_the_median():
    rng = np.random.default_rng(1)
    values = list(1.1 + 0.02 * rng.standard_normal(10))
    lo, hi = bench.bootstrap_ci(values, seed=3)
    assert lo <= float(np.median(values)) <= hi and hi - lo < 0.05
    assert (lo, hi) == bench.bootstrap_ci(values, seed=3)
    assert bench.bootstrap_ci([2.0]) == (2.0, 2.0)
    wide = bench.bootstrap_ci([1.0, 1.0, 1.0, 2.0, 2.0, 2.0], seed=0)
    assert wide[0] == 1.0 and wide[1] == 2.0
    with pytest.raises(ValueError, match="values"):
        bench.bootstrap_ci([])


def test_time_rounds_randomizes_pairs_and_keeps_peer_times_per_pair(monkeypatch):
    """Each round visits every stage once, in a seeded shuffled order, paired with the peer;
    the peer's times are kept per pair, so each ratio compares launches of one pair."""
    seen = []
    durations = {"s1": 2.0, "s2": 4.0, "peer": 1.0}

    def fake_interleaved(fns, reps, *, block, warmup, streams):
        seen.append([fn.__name__ for fn in fns])
        return [[durations[fn.__name__] + 0.01 * len(seen)] * reps for fn in fns]

    def named(name):
        def fn():
            pass
        fn.__name__ = name
        return fn

    monkeypatch.setattr(bench, "time_interleaved", fake_interleaved)
    ours = {"stage01": (named("s1"), 0), "stage02": (named("s2"), 0)}
    timed = bench.time_rounds(ours, (named("peer"), 0), rounds=12, reps=3,
                              rng=np.random.default_rng(5), clocks=lambda: None)
    assert len(seen) == 24 and all(len(pair) == 2 and "peer" in pair for pair in seen)
    firsts = {tuple(pair) for pair in seen}
    assert ("peer", "s1") in firsts and ("s1", "peer") in firsts          # both orders occur
    stage_order = [tuple(o.replace("cuDNN+", "").replace("+cuDNN", "") for o in rnd)
                   for rnd in timed["orders"]]
    assert set(stage_order) == {("stage01", "stage02"), ("stage02", "stage01")}
    assert len(timed["raw"]["stage01"]) == 12 and len(timed["peer_raw"]["stage02"]) == 12
    assert len(timed["peer_all"]) == 12 and len(timed["peer_all"][0]) == 6
    # the peer's times in stage01's pair are the ones measured next to stage01
    for ours_times, peer_times in zip(timed["raw"]["stage01"], timed["peer_raw"]["stage01"]):
        assert ours_times[0] - 2.0 == pytest.approx(peer_times[0] - 1.0)
    again = bench.time_rounds(ours, (named("peer"), 0), rounds=12, reps=3,
                              rng=np.random.default_rng(5), clocks=lambda: None)
    assert again["orders"] == timed["orders"]                               # seeded


def test_time_rounds_records_an_error_and_stops_timing_that_stage(monkeypatch):
    def fake_interleaved(fns, reps, **_):
        if any(fn is broken for fn in fns):
            raise RuntimeError("launch failed")
        return [[1.0] * reps for _ in fns]

    def broken():
        pass

    monkeypatch.setattr(bench, "time_interleaved", fake_interleaved)
    timed = bench.time_rounds({"stage01": (lambda: None, 0), "stage02": (broken, 0)}, None,
                              rounds=3, reps=2, clocks=lambda: {"clocks_sm": "1"})
    assert timed["errors"] == {"stage02": "RuntimeError: launch failed"}
    assert len(timed["raw"]["stage01"]) == 3 and timed["raw"]["stage02"] == []
    assert timed["peer_all"] == [] and timed["clocks"] == [{"clocks_sm": "1"}] * 3


def test_pair_figures_ratio_interval_and_spread():
    row = {"ms_rounds": [2.0, 2.0, 2.1, 1.9, 2.0]}
    peer = [[2.2, 2.3, 2.2], [2.2], [2.31], [2.09], [2.4]]
    bench.pair_figures(row, peer, seed=0)
    assert row["peer_ms_rounds"] == [2.2, 2.2, 2.31, 2.09, 2.4]
    assert row["ratio_rounds"] == pytest.approx([1.1, 1.1, 1.1, 1.1, 1.2])
    assert row["pct_of_peer"] == pytest.approx(110.0)
    lo, hi = row["pct_of_peer_ci"]
    assert lo == pytest.approx(110.0) and 110.0 <= hi <= 120.0
    assert bench.spread_pct([2.0, 2.1, 1.9]) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="one peer round per round"):
        bench.pair_figures({"ms_rounds": [1.0]}, [[1.0], [1.0]])


def test_same_run_pct_is_peer_over_ours():
    assert bench.same_run_pct([1.0, 1.0, 1.0], [1.1, 1.2, 1.3]) == pytest.approx(120.0)


# --------------------------------------------------------------------------- results files

def run_result(pcts, *, failed=(), date="2026-12-01T00:00:00+00:00", commit="abc123"):
    """A schema-2-like result: stage01/stage14 on 4k and 8k, % of cuDNN from `pcts`."""
    results = []
    for (label, number), shape in [(("stage01", 1), "4k"), (("stage14", 14), "4k"),
                                   (("stage14", 14), "8k")]:
        row = {"stage": label, "number": number, "name": "x", "shape": shape, "status": "ok",
               "pass": True}
        if (label, shape) in failed:
            row.update(status="FAILED", reason="check failed: 3 NaN/Inf")
            row["pass"] = False
        else:
            pct = pcts[(label, shape)]
            row.update(ms=1.0, tflops=6.0 * pct, pct_of_peer=pct,
                       pct_of_peer_ci=[pct - 1, pct + 1])
        results.append(row)
    return {"schema": 2, "date": date, "source": {"commit": commit, "tree_sha256": "f" * 64},
            "env": {"gpu": "NVIDIA H200", "cudnn": "9.19.0"},
            "protocol": {"layout": "bhld", "reps": 20, "rounds": 10},
            "shapes": {"4k": [8, 16, 4096, 4096, 128], "8k": [4, 16, 8192, 8192, 128]},
            "results": results,
            "peer": [{"name": "cuDNN", "shape": s, "status": "ok", "ms": 1.0, "tflops": t}
                     for s, t in (("4k", 580.0), ("8k", 565.0))]}


def test_combine_results_gives_ranges_over_runs(tmp_path):
    a = run_result({("stage01", "4k"): 30.21, ("stage14", "4k"): 112.44, ("stage14", "8k"): 116.0})
    b = run_result({("stage01", "4k"): 30.26, ("stage14", "4k"): 110.24, ("stage14", "8k"): 116.0},
                   commit="def456")
    paths = [bench.write_results(r, tmp_path / f"run{i}.json") for i, r in enumerate((a, b))]
    combined = bench.combine_results(paths, names=["run1", "run2"])
    rows = {(r["stage"], r["shape"]): r for r in combined["rows"]}
    assert rows[("stage14", "4k")]["pct_range"] == [110.24, 112.44]
    assert rows[("stage14", "4k")]["status"] == "ok"
    assert [r["commit"] for r in combined["runs"]] == ["abc123", "def456"]
    text = bench.format_combined(combined)
    line = next(x for x in text.splitlines() if x.startswith("stage14") and " 4k " in x)
    assert "110.2-112.4%" in line
    line8 = next(x for x in text.splitlines() if x.startswith("stage14") and " 8k " in x)
    assert "116.0%" in line8 and "116.0-" not in line8          # equal ends print once
    assert [x[:4] for x in text.splitlines()[:2]] == ["run1", "run2"]
    assert bench.format_range((1.04, 1.06), "%") == "1.0-1.1%"
    with pytest.raises(ValueError, match="at least 2"):
        bench.combine_results([a])


def test_combine_results_a_failure_in_any_run_shows_failed():
    a = run_result({("stage01", "4k"): 30.0, ("stage14", "4k"): 112.0, ("stage14", "8k"): 116.0})
    b = run_result({("stage01", "4k"): 30.0, ("stage14", "8k"): 115.0},
                   failed={("stage14", "4k")})
    combined = bench.combine_results([a, b])
    row = next(r for r in combined["rows"] if r["stage"] == "stage14" and r["shape"] == "4k")
    assert row["status"] == "FAILED" and row["runs"] == ["ok", "FAILED"]
    line = next(x for x in bench.format_combined(combined).splitlines()
                if x.startswith("stage14") and " 4k " in x)
    assert "FAILED" in line and "112" not in line


def test_no_check_rows_say_unchecked_in_the_run_the_table_and_the_ranges(monkeypatch):
    """--no-check: every row is 'unchecked' (never 'ok' with pass None), the protocol says the
    check was off, and ranges over such runs say unchecked too."""
    import fake_gpu
    runs = []
    for check in (False, False, True):
        fake_gpu.install(monkeypatch, {1: 4.0, 3: 2.0}, wrong={3})
        runs.append(bench.run_benchmark([1, 3], ["1x2x128x128"], reps=2, rounds=2, check=check))
    unchecked, _, checked = runs
    for row in unchecked["results"]:
        assert row["status"] == "unchecked" and "pass" not in row and row["ms"] > 0, row
    assert unchecked["protocol"]["check"].startswith("off (--no-check)")
    assert "failed: not timed" in checked["protocol"]["check"]
    assert {r["stage"]: r["status"] for r in checked["results"]} == {"stage01": "ok",
                                                                    "stage03": "FAILED"}
    table = bench.format_table(unchecked)
    assert table.splitlines()[1].startswith("check: off (--no-check)")
    for line in table.splitlines()[3:5]:
        assert line.startswith("stage0") and " unchecked " in f"{line} ", line
    both = bench.combine_results(runs[:2])
    assert {r["stage"]: r["status"] for r in both["rows"]} == {"stage01": "unchecked",
                                                               "stage03": "unchecked"}
    text = bench.format_combined(both)
    line = next(x for x in text.splitlines() if x.startswith("stage01"))
    assert "unchecked" in line and "unchecked,unchecked" in line
    assert "check off (--no-check)" in text.splitlines()[0]
    mixed = {r["stage"]: r for r in bench.combine_results(runs[1:])["rows"]}
    assert mixed["stage01"]["status"] == "unchecked" and mixed["stage01"]["runs"] == [
        "unchecked", "ok"]
    assert mixed["stage03"]["status"] == "FAILED"


def test_an_older_no_check_row_reads_as_unchecked():
    """Rows written by --no-check before it said so: status ok, no check result."""
    a = run_result({("stage01", "4k"): 30.0, ("stage14", "4k"): 112.0, ("stage14", "8k"): 116.0})
    b = json.loads(json.dumps(a))
    for row in b["results"]:
        del row["pass"]
    rows = {(r["stage"], r["shape"]): r for r in bench.combine_results([a, b])["rows"]}
    assert rows[("stage14", "4k")]["status"] == "unchecked"
    assert rows[("stage14", "4k")]["runs"] == ["ok", "unchecked"]
    assert " unchecked " in bench.format_table(b)


def test_combine_refuses_two_cases_that_share_a_name(tmp_path):
    """A BSHD (1, 1, 4096, 64) run and a BHLD (8, 16, 4096, 128) run both named '4k' were
    merged into one row; now the case is matched in full and a mismatch is refused."""
    a = run_result({("stage01", "4k"): 30.0, ("stage14", "4k"): 112.0, ("stage14", "8k"): 116.0})
    b = json.loads(json.dumps(a))
    b["schema"] = 3
    b["protocol"]["layout"] = "per case"
    b["cases"] = {
        "4k": dict(batch=1, heads=1, heads_kv=1, seq_q=4096, seq_k=4096, head_dim=64,
                   layout="bshd", causal=False, window=None),
        "8k": dict(batch=4, heads=16, heads_kv=16, seq_q=8192, seq_k=8192, head_dim=128,
                   layout="bhld", causal=False, window=None)}
    paths = [bench.write_results(r, tmp_path / f"{n}.json") for n, r in (("a", a), ("b", b))]
    with pytest.raises(ValueError) as err:
        bench.combine_results(paths, names=["one", "two"])
    message = str(err.value)
    for words in ("case '4k'", "B=8 H=16 L=4096 D=128 bhld dense", "B=1 H=1 L=4096 D=64 bshd",
                  "one (", "two (", "batch 8 vs 1", "head_dim 128 vs 64", "layout bhld vs bshd"):
        assert words in message, (words, message)
    # the same cases, described either way (shapes + layout, or `cases`), do combine
    b["cases"]["4k"].update(batch=8, heads=16, heads_kv=16, head_dim=128, layout="bhld")
    combined = bench.combine_results([a, b])
    assert combined["cases"]["4k"] == dict(batch=8, heads=16, heads_kv=16, seq_q=4096,
                                           seq_k=4096, head_dim=128, layout="bhld",
                                           mask="dense", dtype="bfloat16")
    for change, field in ((dict(causal=True), "mask dense vs causal"),
                          (dict(window=[64, 0]), "mask dense vs window 64,0"),
                          (dict(heads_kv=4), "heads_kv 16 vs 4"),
                          (dict(seq_k=2048), "seq_k 4096 vs 2048"),
                          (dict(dtype="float8_e4m3"), "dtype bfloat16 vs float8_e4m3")):
        c = json.loads(json.dumps(b))
        c["cases"]["4k"].update(change)
        with pytest.raises(ValueError, match=field):
            bench.combine_results([a, c])
    older = json.loads(json.dumps(a))
    older["shapes"]["4k"] = [1, 1, 4096, 4096, 64]           # no `cases`: shapes say it
    with pytest.raises(ValueError, match="batch 8 vs 1"):
        bench.combine_results([a, older])


@pytest.mark.parametrize("content,what", [("{}", "not a ptxattn benchmark result"),
                                          ('{"events": []}', "not a ptxattn benchmark result"),
                                          ("# README\n", "not a JSON file")])
def test_load_results_rejects_other_files_and_names_them(tmp_path, content, what):
    path = tmp_path / "other.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=what) as info:
        bench.load_results(path)
    assert str(path) in str(info.value)


def test_filter_results_applies_stages_and_shapes():
    result = run_result({("stage01", "4k"): 30.0, ("stage14", "4k"): 112.0,
                         ("stage14", "8k"): 116.0})
    only = bench.filter_results(result, stages=["14"], shapes=["8K"])
    assert [(r["stage"], r["shape"]) for r in only["results"]] == [("stage14", "8k")]
    assert list(only["shapes"]) == ["8k"] and [p["shape"] for p in only["peer"]] == ["8k"]
    with pytest.raises(ValueError, match="stages: stage05 not in these results"):
        bench.filter_results(result, stages=["5"])
    with pytest.raises(ValueError, match="shapes: '16k' not in these results"):
        bench.filter_results(result, shapes=["16k"])


def test_source_id_hashes_ptx_and_package(tmp_path):
    for folder in ("ptx", "ptxattn"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "a.txt").write_text("one")
    first = bench.source_id(tmp_path)
    assert first["commit"] is None and len(first["tree_sha256"]) == 64     # no git here
    (tmp_path / "ptx" / "a.txt").write_text("two")
    assert bench.source_id(tmp_path)["tree_sha256"] != first["tree_sha256"]
    (tmp_path / "other.txt").write_text("not hashed")
    assert bench.source_id(tmp_path)["tree_sha256"] == bench.source_id(tmp_path)["tree_sha256"]


# --------------------------------------------------------------------------- the bench command

def _cli(*args):
    from cli_helpers import cli
    return cli(*args)


def test_cli_bench_validates_arguments_before_the_gpu(monkeypatch):
    from cli_helpers import one_clean_error
    from ptxattn import driver
    from ptxattn.errors import NoGpuError

    def no_gpu():
        raise NoGpuError("ptxattn: no CUDA GPU available (test)")

    monkeypatch.setattr(driver, "device_info", no_gpu)
    one_clean_error(_cli("bench", "--stages", "99"), "unknown stage '99'")
    one_clean_error(_cli("bench", "--shapes", "2k"), "shape: expected one of")
    one_clean_error(_cli("bench", "--shapes", "4k"), "no CUDA GPU")     # valid: then the GPU


def test_cli_bench_from_json_combines_runs(tmp_path):
    a = run_result({("stage01", "4k"): 30.21, ("stage14", "4k"): 112.44, ("stage14", "8k"): 116.0})
    b = run_result({("stage01", "4k"): 30.26, ("stage14", "4k"): 110.24, ("stage14", "8k"): 117.0})
    pa = bench.write_results(a, tmp_path / "a.json")
    pb = bench.write_results(b, tmp_path / "b.json")
    result = _cli("bench", "--from-json", pa, "--from-json", pb)
    assert result.exit_code == 0, result.output
    assert "110.2-112.4%" in result.output and "116.0-117.0%" in result.output
    assert str(pa) in result.output and str(pb) in result.output
    only = _cli("bench", "--from-json", pa, "--from-json", pb, "--stages", "1")
    assert only.exit_code == 0 and "stage14" not in only.output and "stage01" in only.output


def test_cli_bench_from_json_applies_or_refuses_options(tmp_path):
    from cli_helpers import one_clean_error
    a = bench.write_results(run_result({("stage01", "4k"): 30.0, ("stage14", "4k"): 112.0,
                                        ("stage14", "8k"): 116.0}), tmp_path / "a.json")
    one = _cli("bench", "--from-json", a, "--shapes", "8k")
    assert one.exit_code == 0, one.output
    assert " 8k " in one.output and " 4k " not in one.output
    one_clean_error(_cli("bench", "--from-json", a, "--shapes", "16k"), "'16k' not in these")
    one_clean_error(_cli("bench", "--from-json", a, "--out", tmp_path / "o"), "--out")
    one_clean_error(_cli("bench", "--from-json", a, "--from-json", a, "--plot", tmp_path / "x.svg"),
                    "--plot")
    (tmp_path / "trace.json").write_text('{"events": [], "intervals": []}')
    one_clean_error(_cli("bench", "--from-json", tmp_path / "trace.json"),
                    str(tmp_path / "trace.json"), "not a ptxattn benchmark result")
    (tmp_path / "README.md").write_text("# hello\n")
    one_clean_error(_cli("bench", "--from-json", tmp_path / "README.md"),
                    str(tmp_path / "README.md"), "not a JSON file")


# --------------------------------------------------------------------------- PTXATTN_REQUIRE_GPU

class FakeItem:
    def __init__(self, gpu: bool):
        self.keywords = {"gpu": True} if gpu else {}
        self.markers = []

    def add_marker(self, marker):
        self.markers.append(marker)


@pytest.mark.parametrize("required", ["", "0", "1"])
def test_conftest_skips_or_fails_gpu_tests_without_a_gpu(monkeypatch, required):
    import conftest
    monkeypatch.setattr(conftest, "gpu_status", lambda: (False, "no device (test)"))
    monkeypatch.setenv("PTXATTN_REQUIRE_GPU", required)
    gpu, cpu = FakeItem(True), FakeItem(False)
    conftest.pytest_collection_modifyitems(None, [gpu, cpu])
    assert cpu.markers == []
    conftest.pytest_runtest_setup(cpu)                       # a CPU test always runs
    if required == "1":
        assert gpu.markers == []                             # not skipped ...
        with pytest.raises(pytest.fail.Exception, match="PTXATTN_REQUIRE_GPU=1 but no usable"):
            conftest.pytest_runtest_setup(gpu)               # ... failed at setup
    else:
        [skip] = gpu.markers
        assert skip.name == "skip" and "no usable GPU: no device (test)" in skip.kwargs["reason"]
        conftest.pytest_runtest_setup(gpu)


def test_conftest_runs_gpu_tests_with_a_gpu(monkeypatch):
    import conftest
    monkeypatch.setattr(conftest, "gpu_status", lambda: (True, ""))
    monkeypatch.setenv("PTXATTN_REQUIRE_GPU", "1")
    gpu = FakeItem(True)
    conftest.pytest_collection_modifyitems(None, [gpu])
    conftest.pytest_runtest_setup(gpu)
    assert gpu.markers == []


@pytest.mark.parametrize("required", ["", "1"])
def test_framework_skips_become_failures_when_required(monkeypatch, required):
    import gpu_checks
    monkeypatch.setenv("PTXATTN_REQUIRE_GPU", required)
    expected = pytest.fail.Exception if required else pytest.skip.Exception
    with pytest.raises(expected, match="not_a_module_ptxattn is not importable"):
        gpu_checks.import_or_skip("not_a_module_ptxattn")
    with pytest.raises(expected, match="JAX has no GPU"):
        gpu_checks.skip_or_fail("JAX has no GPU backend")
    assert gpu_checks.import_or_skip("json").__name__ == "json"


# --------------------------------------------------------------------------- FASTEST_FIRST

RESULTS_DIR = Path(__file__).resolve().parent.parent / "bench" / "results"
NOISE = 0.02          # 2%: stage 14's per-round spread was 1.6-2.7% (bench/README.md)


def newest_results() -> tuple[Path, dict]:
    """The newest committed benchmark results file in bench/results (by its recorded date,
    then its name); trace JSONs and other files there are not benchmark results."""
    found = []
    for path in RESULTS_DIR.glob("*.json"):
        try:
            data = bench.load_results(path)
        except ValueError:
            continue
        if data.get("set") not in (None, "lineage"):      # the production set: other kernels
            continue
        found.append((str(data.get("date", "")), path.name, path, data))
    assert found, f"no benchmark results JSON in {RESULTS_DIR}"
    _, _, path, data = max(found)
    return path, data


def test_fastest_first_agrees_with_the_newest_results():
    """attention(stage=None) tries stages in FASTEST_FIRST order: no stage listed earlier
    may be slower than one listed later by more than the noise (geometric mean of the time
    ratio over the shapes both were measured on), and every measured stage is listed."""
    import math
    from ptxattn import stages
    path, data = newest_results()
    ms: dict[int, dict[str, float]] = {}
    for r in data["results"]:
        if r.get("status") == "ok" and r.get("ms") and r.get("number"):   # lineage stages
            ms.setdefault(r["number"], {})[r["shape"]] = r["ms"]
    assert len(ms) >= 2, f"{path.name}: fewer than two measured stages"
    unlisted = sorted(set(ms) - set(stages.FASTEST_FIRST))
    assert not unlisted, f"stages {unlisted} measured in {path.name} but not in FASTEST_FIRST"
    order = [n for n in stages.FASTEST_FIRST if n in ms]
    for i, earlier in enumerate(order):
        for later in order[i + 1:]:
            shared = sorted(set(ms[earlier]) & set(ms[later]))
            if not shared:
                continue
            ratio = math.exp(sum(math.log(ms[earlier][s] / ms[later][s]) for s in shared)
                             / len(shared))
            assert ratio <= 1 + NOISE, (
                f"FASTEST_FIRST puts stage {earlier} before stage {later}, but in {path.name} "
                f"stage {earlier} takes {ratio:.3f}x stage {later}'s time over {shared}")


# --------------------------------------------------------------------------- sanitizer controls

ROOT = Path(__file__).resolve().parent.parent


def test_planted_hazard_is_one_barrier_and_nothing_else():
    """-D PTXATTN_PLANT_HAZARD=1/2 on stage 1 (bench/sanitize.sh's negative control) drops the
    bar.sync between the P stores and the PV wgmma (=1 also adds one ordinary ld.shared of
    another warp's P word); without the define the stage is exactly as before."""
    import difflib
    from ptxattn import ptx
    plain = ptx.source(1)
    assert "PLANT_HAZARD" not in plain and "ld.volatile.shared" not in plain
    for value, added in ((1, ["ld.volatile.shared.b32 %pk_lo, [%p_store+256];"]), (2, [])):
        planted = ptx.source(1, {"PTXATTN_PLANT_HAZARD": value})
        diff = [line for line in difflib.unified_diff(plain.splitlines(), planted.splitlines(),
                                                      lineterm="", n=0)
                if line[:1] in "+-" and line[:3] not in ("+++", "---")]
        assert [d[1:].strip() for d in diff if d[0] == "-"] == ["bar.sync 0;"], diff
        assert [d[1:].strip() for d in diff if d[0] == "+"] == added, diff


def test_sanitize_cases_cover_bshd_several_tiles_and_the_controls():
    import subprocess
    import sys
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    listed = subprocess.run([sys.executable, "bench/sanitize_case.py", "--list", "--stages",
                             "1,14"], cwd=ROOT, capture_output=True, text=True, env=env,
                            timeout=120, check=True).stdout.split("\n")
    cases = [line.split("\t") for line in listed if line]
    assert ["stage01 1x2x256 bshd", "0", "--stage 1 -b 1 -H 2 -L 256 --layout bshd"] in cases
    assert ["stage14 2x2x512 bshd ctas=2", "2",                 # 8 tiles per CTA, BSHD
            "--stage 14 -b 2 -H 2 -L 512 --layout bshd"] in cases
    controls = subprocess.run([sys.executable, "bench/sanitize_case.py", "--controls"], cwd=ROOT,
                              capture_output=True, text=True, env=env, timeout=120,
                              check=True).stdout.split("\n")
    assert [c.split()[-1] for c in controls if c] == ["PTXATTN_PLANT_HAZARD=1",
                                                      "PTXATTN_PLANT_HAZARD=2"]
    dry = subprocess.run(["bash", "bench/sanitize.sh"], cwd=ROOT, capture_output=True, text=True,
                         env={**env, "DRY_RUN": "1", "STAGES": "1", "PYTHON": sys.executable},
                         timeout=120)
    assert dry.returncode == 0, dry.stderr
    assert ("--tool racecheck --racecheck-report analysis --error-exitcode 86 --print-limit 20 "
            f"{sys.executable} bench/sanitize_case.py --stage 1 -b 1 -H 2 -L 256 --layout bhld "
            "-D PTXATTN_PLANT_HAZARD=1") in dry.stdout


# --------------------------------------------------------------------------- feature cases

@pytest.mark.parametrize("seq_q,seq_k", [(1, 1), (7, 7), (5, 13), (13, 5), (64, 64), (100, 37)])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (3, 0)),
                                           (False, (0, 2)), (False, (-1, 4)), (False, (6, -1)),
                                           (True, (4, 9)), (False, (2, 2)), (False, (0, 0))])
def test_unmasked_pairs_match_a_brute_force_count(seq_q, seq_k, causal, window):
    from ptxattn import reference
    bounds = reference._window(causal, window)
    brute = (seq_q * seq_k if bounds is None else
             int(reference.key_mask(np.arange(seq_q), seq_q, seq_k, bounds).sum()))
    assert bench.unmasked_pairs(seq_q, seq_k, causal, window) == brute


def test_case_flops_dense_causal_halved_window_exact():
    dense = bench.Case("d", 2, 16, 4096, 4096, 128)
    assert dense.flops == bench.attention_flops(2, 16, 4096, 4096, 128) and not dense.masked
    causal = bench.Case("c", 2, 16, 4096, 4096, 128, causal=True)
    assert causal.flops == dense.flops // 2                  # the convention, not L(L+1)/2
    win = bench.Case("w", 2, 16, 16384, 16384, 128, window=(1024, 0))
    # query i sees min(i, 1024) + 1 keys
    pairs = sum(min(i, 1024) + 1 for i in range(16384))
    assert win.pairs == pairs and win.flops == 4 * 2 * 16 * 128 * pairs
    assert bench.case_tflops(win, 1.0) == pytest.approx(win.flops / 1e-3 / 1e12)
    gqa = bench.Case("g", 4, 32, 8192, 8192, 128, heads_kv=4)
    assert gqa.gqa and gqa.flops == bench.attention_flops(4, 32, 8192, 8192, 128)
    assert bench.Case("m", 1, 8, 64, 64, 64).heads_kv == 8
    params = win.params()
    assert params["window"] == [1024, 0] and params["pairs"] == pairs
    assert "exactly" in params["flops_rule"] and "halved" in causal.params()["flops_rule"]
    json.dumps(params)


@pytest.mark.parametrize("kwargs,what", [
    (dict(heads_kv=3), "heads_kv: expected a divisor of heads 16"),
    (dict(seq_q=0), "seq_q: expected a whole number >= 1"),
    (dict(layout="lbhd"), "layout"),
    (dict(window=(1, "x")), "window"),
    (dict(window=(-2, 0)), "window"),
    (dict(kernels=("production",), ratios=(("production", "stage14"),)), "ratios"),
])
def test_case_rejects_bad_parameters_naming_them(kwargs, what):
    base = dict(name="x", batch=1, heads=16, seq_q=64, seq_k=64, head_dim=128)
    with pytest.raises(ValueError, match=what):
        bench.Case(**{**base, **kwargs})


def test_production_set_holds_the_issue_cases():
    cases = {c.name: c for c in bench.SETS["production"].cases}
    for shape in ("4k", "8k", "16k"):
        for name in (shape, f"{shape}-bshd"):
            assert cases[name].kernels[0] == "production" and "stage14" in cases[name].kernels
            assert ("production", "stage14") in cases[name].ratios
        assert (cases[shape].batch, cases[shape].heads, cases[shape].seq_q) == \
            bench.SHAPES[shape][:3]
        assert cases[f"{shape}-bshd"].layout == "bshd"
        c = cases[f"causal-{shape}"]
        assert c.causal and (c.batch, c.heads, c.seq_q) == bench.SHAPES[shape][:3]
    assert ("production+lse", "production") in cases["8k"].ratios
    assert (cases["4095"].seq_q, cases["4095"].versus) == (4095, "4k")
    assert (cases["8191"].seq_q, cases["8191"].versus) == (8191, "8k")
    g = cases["gqa32:4-8k"]
    assert (g.batch, g.heads, g.heads_kv, g.seq_q, g.head_dim) == (4, 32, 4, 8192, 128)
    v = cases["video"]
    assert (v.batch, v.heads, v.seq_q, v.head_dim, v.layout) == (1, 12, 32760, 128, "bshd")
    assert [(cases[n].batch, cases[n].heads, cases[n].seq_q, cases[n].head_dim) for n in
            ("d64-8k", "d64-16k", "d256-8k", "d256-16k")] == [
        (4, 32, 8192, 64), (2, 32, 16384, 64), (4, 8, 8192, 256), (2, 8, 16384, 256)]
    gc = cases["gqa32:4-causal-8k"]
    assert gc.causal and gc.heads_kv == 4 and gc.heads == 32
    w = cases["window1024-16k"]
    assert w.window == (1024, 0) and not w.causal and w.versus == "causal-16k"
    ltx, llama = cases["ltx"], cases["llama-8k"]
    assert (ltx.batch, ltx.heads, ltx.seq_q, ltx.head_dim, ltx.layout) == (1, 32, 6930, 64, "bshd")
    assert (llama.heads, llama.heads_kv, llama.seq_q, llama.causal) == (32, 8, 8192, True)
    assert bench.SETS["production"].reps == 10 and bench.SETS["production"].rounds == 10
    lineage = bench.SETS["lineage"]
    assert [c.name for c in lineage.cases] == ["4k", "8k", "16k", "1k"]
    assert (lineage.reps, lineage.rounds) == (20, 10)
    for case in cases.values():
        json.dumps(case.params())
        assert bench._peer_unavailable(case) == (
            "no cuDNN peer for sliding windows through SDPA" if case.window else None)


def test_select_set_cuts_cases_and_guards_the_layout():
    picked = bench.select_set("production", ["CAUSAL-8k", "8k"])
    assert [c.name for c in picked.cases] == ["8k", "causal-8k"]        # the set's order
    with pytest.raises(ValueError, match="shapes: 'nope' not in the production set"):
        bench.select_set("production", ["nope"])
    with pytest.raises(ValueError, match="layout: the production set fixes"):
        bench.select_set("production", layout="bshd")
    assert {c.layout for c in bench.select_set("lineage", layout="BSHD").cases} == {"bshd"}
    with pytest.raises(ValueError, match="set: expected one of lineage, production"):
        bench.select_set("fast")


def test_estimate_grows_with_the_work():
    cases = bench.SETS["production"].cases
    small = bench.estimate_seconds(cases, reps=10, rounds=10)
    assert small > 0
    assert bench.estimate_seconds(cases, reps=20, rounds=10) > small
    assert bench.estimate_seconds(cases, reps=10, rounds=10, peer=False) < small


def tiny_production_cases():
    """The production set's cases shrunk to CPU size, kinds kept (GQA, masks, tails, D)."""
    import dataclasses
    out = []
    for c in bench.SETS["production"].cases:
        seq = 130 if c.seq_q % 2 else 128
        out.append(dataclasses.replace(
            c, batch=1, heads=4 if c.gqa else 2, heads_kv=1 if c.gqa else 0, seq_q=seq,
            seq_k=seq, window=(40, 0) if c.window else None))
    return out


def test_production_set_with_a_fake_gpu_that_takes_masks(monkeypatch):
    """Every case runs (the fake takes causal/window and any D); ours-vs-ours ratios come
    out of the same rounds, cross-case ratios from the TFLOP/s, the LSE is checked."""
    import fake_gpu
    from ptxattn import stages
    # the fake takes every head dim and masks: a production build for each
    variants = {(d, m): stages.PRODUCTION_VARIANTS[(128, False)]
                for d in (64, 128, 256) for m in (False, True)}
    monkeypatch.setattr(stages, "PRODUCTION_VARIANTS", variants)
    monkeypatch.setattr(stages, "PRODUCTION",
                        __import__("dataclasses").replace(stages.PRODUCTION,
                                                          head_dims=(64, 128, 256)))
    launches = fake_gpu.install(monkeypatch, {0: 2.0, (0, "lse"): 2.02, 14: 2.1,
                                              (0, "causal"): 1.0})
    result = bench.run_cases(tiny_production_cases(), reps=3, rounds=4)
    json.dumps(result)
    rows = {(r["stage"], r["shape"]): r for r in result["results"]}
    assert all(r["status"] == "ok" for r in rows.values()), [
        (k, r.get("reason")) for k, r in rows.items() if r["status"] != "ok"]
    p8 = rows[("production", "8k")]
    [vs14] = [x for x in p8["ours_ratios"] if x["vs"] == "stage14"]
    assert vs14["pct"] == pytest.approx(105.0) and vs14["ci"] == [pytest.approx(105.0)] * 2
    assert len(vs14["rounds"]) == 4
    lse = rows[("production+lse", "8k")]
    assert lse["lse"] and lse["lse_pass"] and lse["lse_max_abs"] < 1e-5
    assert lse["ours_ratios"][0]["vs"] == "production"
    assert lse["ours_ratios"][0]["pct"] == pytest.approx(100 * 2.0 / 2.02)
    causal = rows[("production", "causal-8k")]
    case = bench.Case("c", 1, 2, 128, 128, 128, causal=True)
    assert causal["tflops"] == pytest.approx(bench.case_tflops(case, 1.0))
    assert result["cases"]["window1024-16k"]["window"] == [40, 0]
    assert result["cases"]["gqa32:4-8k"]["heads_kv"] == 1
    comp = {c["case"]: c for c in result["comparisons"]}
    assert comp["4095"]["versus"] == "4k" and comp["4095"]["pct"] == pytest.approx(
        100 * 130 * 130 / (128 * 128))
    assert comp["window1024-16k"]["pct"] > 0
    assert launches[0] > 0 and launches[14] > 0
    table = bench.format_table(result)
    assert "105.0% of stage14 (105.0-105.0)" in table
    assert "99.0% of production" in table
    assert "across cases" in table
    assert f"4095 vs 4k: {100 * 130 * 130 / 128 ** 2:.1f}%" in table
    assert "window1024-16k: 1, 2, 128, 128, bhld, window 40,0;" in table
    assert "gqa32:4-8k: 1, 4:1, 128, 128, bhld, dense;" in table


def test_features_the_api_does_not_take_yet_are_na(monkeypatch):
    """Before attention() takes causal=/window= (and before the D=64/256 builds), those cases
    are n/a, not errors, and nothing is launched for them; the rest runs."""
    import fake_gpu
    launches = fake_gpu.install(monkeypatch, {0: 2.0, 14: 2.1}, masks=False)
    cases = {c.name: c for c in tiny_production_cases()}
    picked = [cases[n] for n in ("4k", "causal-8k", "window1024-16k")]
    result = bench.run_cases(picked, reps=2, rounds=2)
    rows = {(r["stage"], r["shape"]): r for r in result["results"]}
    assert rows[("production", "4k")]["status"] == "ok"
    for name, why in (("causal-8k", "attention() does not take causal= yet"),
                      ("window1024-16k", "attention() does not take window= yet")):
        row = rows[("production", name)]
        assert row["status"] == "n/a" and why in row["reason"], row
        assert "ms" not in row
    assert launches == {0: 3, 14: 3}                 # 4k only: one check + one per round
    table = bench.format_table(result)
    assert "production causal-8k n/a: attention() does not take causal= yet" in table
    line = next(x for x in table.splitlines() if x.startswith("production") and "causal-8k" in x)
    assert " n/a " in f"{line} "


def test_lineage_stages_are_na_on_gqa_lse_and_masks():
    from ptxattn import stages
    s14 = stages.get_stage(14)
    assert "GQA" in bench.kernel_takes(s14, bench.Case("g", 1, 4, 128, 128, 128, heads_kv=2))
    assert bench.kernel_takes(s14, bench.Case("l", 1, 4, 128, 128, 128), lse=True) == "LSE out"
    assert "masks" in bench.kernel_takes(s14, bench.Case("c", 1, 4, 128, 128, 128, causal=True))
    assert "length 4095" in bench.kernel_takes(s14, bench.Case("t", 1, 4, 4095, 4095, 128))
    assert bench.kernel_takes(s14, bench.Case("ok", 1, 4, 256, 256, 128)) is None
    assert bench.case_kernels(bench.Case("x", 1, 1, 128, 128, 128,
                                         kernels=("production", "production+lse", "stage14")),
                              [stages.get_stage(14)]) == [("stage14", s14, False)]


def test_a_wrong_lse_fails_the_check_and_is_not_timed(monkeypatch):
    import fake_gpu
    fake_gpu.install(monkeypatch, {0: 2.0, (0, "lse"): 2.0, 14: 2.1}, wrong_lse=True)
    [case] = [c for c in tiny_production_cases() if c.name == "8k"]
    result = bench.run_cases([case], reps=2, rounds=2)
    rows = {r["stage"]: r for r in result["results"]}
    bad = rows["production+lse"]
    assert bad["status"] == "FAILED" and not bad["lse_pass"] and "ms" not in bad
    assert "LSE max |err| 1.00e-02" in bad["reason"]
    assert rows["production"]["status"] == "ok"
    assert [x["vs"] for x in rows["production"]["ours_ratios"]] == ["stage14"]


def test_combine_keeps_feature_cases_and_ours_ratio_ranges(monkeypatch):
    import fake_gpu
    runs = []
    for ms14 in (2.1, 2.2):
        fake_gpu.install(monkeypatch, {0: 2.0, (0, "lse"): 2.02, 14: ms14})
        cases = [c for c in tiny_production_cases() if c.name in ("8k", "gqa32:4-8k")]
        runs.append(bench.run_cases(cases, reps=2, rounds=2))
    combined = bench.combine_results(runs, names=["a", "b"])
    rows = {(r["stage"], r["shape"]): r for r in combined["rows"]}
    assert rows[("production", "gqa32:4-8k")]["status"] == "ok"
    assert rows[("production", "8k")]["ours_ranges"]["stage14"] == [
        pytest.approx(105.0), pytest.approx(110.0)]
    text = bench.format_combined(combined)
    line = next(x for x in text.splitlines() if x.startswith("production ") and " 8k " in x)
    assert "105.0-110.0% of stage14" in line


# --------------------------------------------------------------------------- --set on the CLI

def test_cli_bench_set_production_with_a_fake_gpu(monkeypatch, tmp_path):
    import fake_gpu
    fake_gpu.install(monkeypatch, {0: 2.0, (0, "lse"): 2.02, 14: 2.1}, masks=False)
    cases = {c.name: c for c in tiny_production_cases()}
    prod = bench.SETS["production"]
    import dataclasses
    monkeypatch.setitem(bench.SETS, "production", dataclasses.replace(
        prod, cases=tuple(cases[n] for n in ("8k", "causal-8k"))))
    result = _cli("bench", "--set", "production", "--rounds", "2", "--out", tmp_path)
    assert result.exit_code == 0, result.output
    assert "estimate: ~" in result.output and "2 cases x 2 rounds x 10 reps" in result.output
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "bench-production.txt" in files
    [json_file] = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
    assert json_file.name.endswith("-fake-gpu-production.json")
    data = json.loads(json_file.read_text())
    assert data["set"] == "production" and data["protocol"]["reps"] == 10
    assert data["cases"]["causal-8k"]["causal"] is True
    assert "99.0% of production" in (tmp_path / "bench-production.txt").read_text()
    again = _cli("bench", "--from-json", json_file, "--stages", "production", "--shapes", "8k")
    assert again.exit_code == 0, again.output
    assert "production+lse" in again.output and "causal-8k" not in again.output


def test_cli_bench_estimate_needs_no_gpu(monkeypatch):
    from cli_helpers import one_clean_error
    from ptxattn import driver

    def no_gpu():
        raise AssertionError("--estimate asked for the GPU")

    monkeypatch.setattr(driver, "device_info", no_gpu)
    out = _cli("bench", "--set", "production", "--estimate")
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0] == "4k: B=8 H=16 L=4096 D=128 bhld: production, stage14"
    assert "8k: B=4 H=16 L=8192 D=128 bhld: production, production+lse, stage14" in lines
    assert "window1024-16k: B=2 H=16 L=16384 D=128 bhld window 1024,0: production" in lines
    assert lines[-1].startswith("estimate: ~") and "21 cases x 10 rounds x 10 reps" in lines[-1]
    lineage = _cli("bench", "--set", "lineage", "--estimate", "--stages", "14")
    assert lineage.exit_code == 0 and "1k: B=8 H=16 L=1024 D=128 bhld: stage14" in lineage.output
    assert "4 cases x 10 rounds x 20 reps" in lineage.output
    one_clean_error(_cli("bench", "--set", "production", "--layout", "bshd"),
                    "the production set fixes")
    one_clean_error(_cli("bench", "--set", "production", "--shapes", "2k"),
                    "'2k' not in the production set")


def test_device_run_passes_each_set_its_arguments(tmp_path):
    """bench/device_run.sh with a stand-in python3 that logs its arguments: both sets by
    default, SETS/CASES/SHAPES/REPS routed to the right set, an unknown set is an error."""
    import os
    import subprocess
    stub = tmp_path / "bin"
    stub.mkdir()
    log = tmp_path / "calls.txt"
    (stub / "python3").write_text(f'#!/bin/bash\necho "$*" >> {log}\n')
    (stub / "python3").chmod(0o755)
    (stub / "nvidia-smi").write_text("#!/bin/bash\nexit 0\n")
    (stub / "nvidia-smi").chmod(0o755)

    def run(**env):
        log.write_text("")
        proc = subprocess.run(
            ["bash", str(ROOT / "bench" / "device_run.sh")], cwd=ROOT, capture_output=True,
            text=True, timeout=60,
            env={"PATH": f"{stub}:/usr/bin:/bin", "OUT": str(tmp_path / "out"),
                 "SKIP_SASS": "1", "SKIP_TESTS": "1", "SKIP_RUN": "1", **env})
        benches = [x for x in log.read_text().splitlines()
                   if x.startswith("-m ptxattn bench") and "--estimate" not in x]
        return proc, benches

    proc, benches = run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert benches == [f"-m ptxattn bench --set lineage --out {tmp_path / 'out'} --shapes "
                       "4k,8k,16k,1k --layout bhld",
                       f"-m ptxattn bench --set production --out {tmp_path / 'out'}"]
    proc, benches = run(SETS="production", CASES="8k,causal-8k", REPS="5", ROUNDS="3")
    assert benches == [f"-m ptxattn bench --set production --out {tmp_path / 'out'} --shapes "
                       "8k,causal-8k --reps 5 --rounds 3"]
    proc, benches = run(SETS="production", SUSTAINED="1", SUSTAINED_SECONDS="4")
    assert benches == [f"-m ptxattn bench --set production --out {tmp_path / 'out'} "
                       "--sustained --sustained-seconds 4"]
    proc, benches = run(SETS="lineage,fast")
    assert proc.returncode == 2 and "unknown set 'fast'" in proc.stdout


@pytest.mark.gpu
def test_production_set_small_on_the_gpu():
    """The production set's cases at CPU-checkable sizes on the real GPU: every kernel row is
    measured and passes, or is n/a (a feature not built yet); never an error. With PyTorch,
    cuDNN is the peer of the dense cases (GQA by enable_gqa or repeated heads)."""
    result = bench.run_cases(tiny_production_cases(), reps=2, rounds=2, warmup=1)
    json.dumps(result)
    for r in result["results"]:
        assert r["status"] in ("ok", "n/a"), r
        if r["status"] == "ok":
            assert r["pass"] and r["ms"] > 0 and r["tflops"] > 0, r
    rows = {(r["stage"], r["shape"]): r for r in result["results"]}
    p8 = rows[("production", "8k")]
    assert p8["status"] == "ok" and [x["vs"] for x in p8["ours_ratios"]] == ["stage14"]
    lse = rows[("production+lse", "8k")]
    assert lse["status"] == "ok" and lse["lse_pass"], lse
    if result["env"]["torch"] is not None:
        peers = {p["shape"]: p for p in result["peer"]}
        for name in ("4k", "8k-bshd", "4095", "gqa32:4-8k", "video", "d64-8k", "d256-8k"):
            assert peers[name]["status"] in ("ok",), peers[name]
        assert peers["gqa32:4-8k"]["gqa"].startswith(("enable_gqa", "repeat"))
        assert "pct_of_peer" in p8


def test_a_declared_commit_is_recorded_beside_the_tree_hash(tmp_path, monkeypatch):
    """The lent GPU's copy of the tree carries a stale .git: the runner's declared commit is
    kept apart from git's answer, and the tree hash (which checks it) is unchanged by it."""
    (tmp_path / "ptx").mkdir()
    (tmp_path / "ptx" / "a.ptx").write_text("x")
    plain = bench.source_id(tmp_path)
    assert "declared_commit" not in plain
    monkeypatch.setenv("PTXATTN_SOURCE_COMMIT", "abc123def456789")
    declared = bench.source_id(tmp_path)
    assert declared["declared_commit"] == "abc123def456789"
    assert declared["tree_sha256"] == plain["tree_sha256"]

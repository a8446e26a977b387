"""bench/fuzz.py on the CPU: the fuzzer run for a handful of cases against a stand-in kernel
(the float64 reference itself, rounded to bf16, on the NumPy path) passes them, and flags a
planted wrong answer (a masked case off by 2%, middle heads off by half, an LSE off by 0.01, a
repeat call that moves), shrinks it, and prints a regression test that reproduces it."""

from __future__ import annotations

import json

import hypothesis  # noqa: F401  (a test dependency: the fuzzer is built on it)
import numpy as np
import pytest
from bench_modules import bench_script

from ptxattn import reference

fuzz = bench_script("fuzz")
BF16 = reference.BF16


def reference_kernel(wrong=None):
    """attention() as the reference computes it; wrong(case kwargs, out, lse, call) may spoil
    the answer (call: 0 the first call of a case, 1 the repeat)."""
    calls = {}

    def attention(q, k, v, *, layout="bhld", causal=False, window=None,
                  diagonal="bottom_right", return_lse=False, out=None):
        assert out is None and isinstance(q, np.ndarray)            # the NumPy path
        ref, lse = reference.attention_reference(q, k, v, layout=layout, causal=causal,
                                                 window=window, diagonal=diagonal,
                                                 return_lse=True)
        ref, lse = ref.astype(np.float32), lse.astype(np.float32)
        key = (q.tobytes()[:64], q.shape, layout, causal, window, diagonal)
        call = calls[key] = calls.get(key, -1) + 1
        if wrong is not None:
            ref, lse = wrong(dict(layout=layout, causal=causal, window=window), ref, lse,
                             call % 2)
        out = ref.astype(BF16)
        return (out, lse) if return_lse else out
    return attention


def run(attention, cases=12, seed=1):
    lines = []
    summary = fuzz.fuzz(cases=cases, seconds=120, seed=seed, paths=("numpy",), max_len=64,
                        shrink_seconds=30, attention=attention, log=lines.append)
    return summary, "\n".join(lines)


def test_the_reference_passes_every_case(tmp_path):
    summary, text = run(reference_kernel())
    assert summary["failures"] == [] and summary["cases_run"] == 12, text
    assert summary["by_feature"]["numpy"] == 12
    assert summary["source"]["tree_sha256"] and "bar" in summary
    assert "fuzz: 12 cases in" in text
    path = fuzz.write_summary(summary, tmp_path)
    assert json.loads(path.read_text())["cases_run"] == 12 and path.name.endswith("-fuzz.json")


def _failure(summary, text):
    assert summary["cases_run"] > 0 and len(summary["failures"]) == 1, text
    [failure] = summary["failures"]
    case = fuzz.FuzzCase(**{k: tuple(v) if k == "window" and v else v
                            for k, v in failure["case"].items()})
    return case, failure


def _reproduces(case, failure, attention, words):
    for word in words:
        assert word in failure["why"], failure["why"]
    test = failure["regression_test"]
    assert test.startswith("@pytest.mark.gpu\ndef test_fuzz_regression_") and \
        "fuzz.Runner().run(fuzz.FuzzCase(" in test
    compile(test, "regression", "exec")
    printed = test.split("fuzz.Runner().run(fuzz.", 1)[1].rsplit(")", 1)[0]
    assert eval(printed, {"FuzzCase": fuzz.FuzzCase}) == case           # the case as printed
    with pytest.raises(fuzz.CaseFailure):
        fuzz.Runner(attention).run(case)                                # still fails


def test_a_masked_case_two_percent_off_is_flagged_and_shrunk():
    def off(kw, out, lse, call):
        return (out * 1.02 if kw["causal"] or kw["window"] else out), lse
    attention = reference_kernel(off)
    summary, text = run(attention, cases=40)
    case, failure = _failure(summary, text)
    assert case.masked
    # shrunk: nothing more than the mask is needed to fail
    assert (case.batch, case.heads, case.heads_kv, case.lse) == (1, 1, 1, False), case
    assert case.seq_q <= 8 and case.seq_k <= 8, case
    _reproduces(case, failure, attention, ["rel L2"])
    assert "FAILED (shrunk)" in text and "def test_fuzz_regression_" in text


def test_middle_heads_off_by_half_are_flagged_naming_them():
    def off(kw, out, lse, call):
        axis = 1 if kw["layout"] == "bhld" else 2
        heads = out.shape[axis]
        if heads > 2:
            idx = [slice(None)] * 4
            idx[axis] = slice(1, heads - 1)
            out = out.copy()
            out[tuple(idx)] *= 0.5
        return out, lse
    attention = reference_kernel(off)
    summary, text = run(attention, cases=60, seed=2)
    case, failure = _failure(summary, text)
    # shrunk to a smallest that fails: 3 heads (3 k/v heads) or 4 (a group of 4 over 1)
    assert case.heads in (3, 4) and (case.batch, case.seq_q, case.seq_k) == (1, 1, 1), case
    _reproduces(case, failure, attention,
                [f"failing (b, h): {[[0, h] for h in range(1, case.heads - 1)]}"])


def test_a_wrong_lse_is_flagged():
    attention = reference_kernel(lambda kw, out, lse, call: (out, lse + 0.01))
    summary, text = run(attention, cases=30)
    case, failure = _failure(summary, text)
    assert case.lse
    _reproduces(case, failure, attention, ["lse max |err| 1.000e-02"])


def test_a_repeat_call_that_moves_is_flagged():
    def moving(kw, out, lse, call):
        if call == 1:
            out = out.copy()
            out.flat[0] += 0.25
        return out, lse
    attention = reference_kernel(moving)
    summary, text = run(attention, cases=10)
    case, failure = _failure(summary, text)
    _reproduces(case, failure, attention, ["the repeat call at the same addresses gave another "
                                           "out: 1 of"])


def test_the_strategy_respects_its_bounds():
    from hypothesis import given, settings

    seen = []

    @settings(max_examples=300, deadline=None, database=None)
    @given(fuzz.strategy())
    def draw(case):
        q_shape, kv_shape = case.shapes()
        for shape, seq in ((q_shape, case.seq_q), (kv_shape, case.seq_k)):
            assert np.prod(shape) <= max(fuzz.MAX_ELEMENTS, max(case.seq_q, case.seq_k)
                                         * case.head_dim) <= fuzz.POOL_ELEMENTS - 64, case
        assert case.heads % case.heads_kv == 0 and 1 <= case.seq_q <= fuzz.MAX_LEN
        assert 1 <= case.seq_k <= fuzz.MAX_LEN and case.head_dim in fuzz.HEAD_DIMS
        if case.causal and case.window is not None:
            assert case.window[1] in (0, -1)
        assert case.offset % 8 == 0 and (case.path in fuzz.DEVICE_PATHS or not case.out_given)
        assert "diagonal" not in case.kwargs() or case.masked
        seen.append(case)
    draw()
    longest = max(max(c.seq_q, c.seq_k) for c in seen)
    short = sum(max(c.seq_q, c.seq_k) <= 300 for c in seen)
    assert longest > 4096 and short > len(seen) // 3, (longest, short)  # weighted to short
    assert {c.path for c in seen} == set(fuzz.PATHS)

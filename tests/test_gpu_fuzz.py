"""bench/fuzz.py on the GPU: a short run over every path (the full run is the lead's:
`python3 bench/fuzz.py --cases 2000 --out bench/results`), and the regressions it found.

A failure of the fuzzer prints a ready test (`test_fuzz_regression_<hash>`): paste it below,
where it re-runs the shrunk case through the same check on every GPU run.
"""

from __future__ import annotations

import pytest
from bench_modules import bench_script
from gpu_checks import import_or_skip

pytestmark = pytest.mark.gpu


def test_a_short_fuzz_run_passes_on_every_path():
    """~200 cases in at most a minute: every way in (NumPy, torch, DLPack, DeviceArray),
    lengths up to 20000, masks, GQA, LSE, repeats at the same addresses and reused addresses
    with other shapes. A failure names the case, what was wrong, and its regression test."""
    import_or_skip("torch")
    import_or_skip("hypothesis")
    fuzz = bench_script("fuzz")
    summary = fuzz.fuzz(cases=200, seconds=60, seed=7, max_len=20000, shrink_seconds=60)
    assert not summary["failures"], "\n".join(
        f"{f['why']}\n{f['case']}\n{f['regression_test']}" for f in summary["failures"])
    assert summary["cases_run"] >= 50, summary
    assert set(summary["by_feature"]) >= {"numpy", "torch", "dlpack", "device"}, summary


def test_one_case_of_each_path_launches_and_writes_every_element():
    """The small end: one short case per path, out= given or not, checked in full."""
    import_or_skip("torch")
    fuzz = bench_script("fuzz")
    runner = fuzz.Runner()
    for i, path in enumerate(fuzz.PATHS):
        case = fuzz.FuzzCase(batch=2, heads=4, heads_kv=2, seq_q=130, seq_k=257, head_dim=128,
                             layout="bshd" if i % 2 else "bhld", causal=True, lse=True,
                             path=path, out_given=path != "numpy", offset=8 * i, seed=i)
        runner.run(case)


# --------------------------------------------------------------------------- regressions
# (none yet: paste the fuzzer's test_fuzz_regression_* functions here)

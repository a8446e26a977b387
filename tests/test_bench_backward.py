"""bench/backward_bench.py without a GPU: which variants each case times, and its arguments."""

from __future__ import annotations

import pytest
from bench_modules import bench_script

from ptxattn import bwd_builds

bench = bench_script("backward_bench")


def test_each_case_times_the_variants_it_has():
    everything = list(bwd_builds.VARIANT_NAMES)
    today = bwd_builds.DEFAULT_VARIANT        # today's rows, by name (None: the measured default)
    d128 = [today, "st_ahead", "dqred", "m80", "m80_edv"]
    assert bench.case_variants("dense", everything) == d128
    assert bench.case_variants("causal", everything) == d128
    assert bench.case_variants("d64", everything) == [today, "st_ahead", "dqred"]
    assert bench.case_variants("gqa", everything) == d128
    assert bench.case_variants("d256", everything) == [today, "qsplit", "qsplit_dqred"]
    assert bench.case_variants("d256", ["qsplit"]) == [today, "qsplit"]
    assert bench.case_variants("dense", ["m80", "st_ahead"]) == [today, "m80", "st_ahead"]
    # deterministic=True: today's build and the variants that keep its order
    assert bench.case_variants("deterministic", everything) == [today, "st_ahead", "m80",
                                                                 "m80_edv"]
    assert bench.case_variants("dense", ["default"]) == [today]


def test_unknown_variants_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--variants", "qsplit,fast"])
    assert "unknown variant 'fast'" in capsys.readouterr().err


def test_the_five_target_shapes_are_cases():
    assert bench.CASES["dense"][:5] == (4, 16, 16, 8192, 128)
    assert bench.CASES["d64"][:5] == (4, 32, 32, 8192, 64)
    assert bench.CASES["d256"][:5] == (4, 8, 8, 8192, 256)
    assert bench.CASES["gqa"][:5] == (4, 32, 4, 8192, 128)
    assert bench.CASES["causal"][5] == {"causal": True}

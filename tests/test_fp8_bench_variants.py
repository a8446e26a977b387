"""bench/fp8_bench.py --variants on the CPU: the option, run_variants' record (same-round
ratios against the default build, a build that fails reported and not timed, today's call
beside) on stand-ins for the GPU parts, and the sustained windows on pretend timelines."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from bench_modules import bench_script
from test_sustained_scripts import CFG, pretend


@pytest.fixture()
def fb():
    return bench_script("fp8_bench")


def test_the_variants_option(fb):
    args = fb.parse_args(["--variants", "default,n192,n224", "--shapes", "16k-d128,wan"])
    assert args.variants == ["default", "n192", "n224"] and args.names == ["16k-d128", "wan"]
    assert fb.parse_args([]).variants is None
    # the three-consumer variant is one of builds.FP8_VARIANTS like the others
    assert fb.parse_args(["--variants", "default,m3n96"]).variants == ["default", "m3n96"]
    with pytest.raises(SystemExit):
        fb.parse_args(["--variants", "default,n999"])


def test_a_variant_with_a_knob_of_its_own(fb):
    """m3n96:SW_EXP2_PER_8=1: the variant's defines and the knob, beside the plain one in the
    same rounds; a knob that is no NAME=VALUE, or an unknown variant, is refused."""
    args = fb.parse_args(["--variants", "default,m3n96,m3n96:SW_EXP2_PER_8=1"])
    assert args.variants == ["default", "m3n96", "m3n96:SW_EXP2_PER_8=1"]
    assert fb.variant_defines("m3n96:SW_EXP2_PER_8=1") == {
        "FP8_BLOCK_N": "96", "FP8_CONSUMERS": "3", "SW_EXP2_PER_8": "1"}
    assert fb.variant_defines("default:SW_EXP2_PER_8=2") == {"SW_EXP2_PER_8": "2"}
    assert fb.variant_defines("default") == {}
    for bad in ("m3n96:SW_EXP2_PER_8", "m3n96:=1", "n999:SW_EXP2_PER_8=1"):
        with pytest.raises(SystemExit):
            fb.parse_args(["--variants", f"default,{bad}"])


def test_the_causal_shapes(fb):
    """causal-16k-d128/-d256: the targets' shapes, masked, FLOPs credited halved; not run
    unless asked for."""
    dims, layout, _, causal, flops = fb.shape_of("causal-16k-d256")
    assert causal and dims == fb.SHAPES["16k-d256"][0] and layout == "bhld"
    assert flops * 2 == fb.shape_of("16k-d256")[4] == 4 * 2 * 8 * 16384 * 16384 * 256
    assert not fb.shape_of("wan")[3]
    assert fb.parse_args([]).names == ["16k-d128", "16k-d256", "wan"]
    assert fb.parse_args(["--shapes", "causal-16k-d128"]).names == ["causal-16k-d128"]


class _Prepared:
    def __init__(self, ms):
        self.ms, self.out = ms, None

    def launch(self):
        pass

    launch_forward = launch

    def close(self):
        pass


def test_run_variants_record(fb, monkeypatch):
    """Each variant prepared with its defines (a failing one reported, not timed), today's
    call and bf16 timed beside; x_default = the default's time over the row's, per round."""
    seen = []
    speed = {None: 1.30, "128": 1.00, "192": 0.90, "224": 0.85}      # ms by FP8_BLOCK_N

    def prepare(plan, defines=None):
        seen.append(dict(defines or {}))
        n = (defines or {}).get("FP8_BLOCK_N")
        if defines == {}:
            n = "128"
        if (defines or {}).get("FP8_KV_STAGES"):
            raise RuntimeError("ptxas: planted failure")
        return _Prepared(speed[n])

    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(
        synchronize=lambda: None,
        current_stream=lambda: types.SimpleNamespace(cuda_stream=7)))
    monkeypatch.setattr(fb, "inputs", lambda torch, shape, layout, seed: [object()] * 3)
    monkeypatch.setattr(fb, "per_head_e4m3", lambda torch, x, layout: (x, x))
    monkeypatch.setattr(fb, "reference_rows", lambda *a: None)
    monkeypatch.setattr(fb, "check", lambda *a, **k: {"passes": True, "rel_l2": 0.05})
    monkeypatch.setattr(fb.fp8, "validate", lambda *a, **k: object())
    monkeypatch.setattr(fb.fp8_forward, "prepare", prepare)
    monkeypatch.setattr(fb.attn_module, "prepare", lambda *a, **k: _Prepared(1.4))
    peer_out = types.SimpleNamespace(transpose=lambda *a: None)
    monkeypatch.setattr(fb.bench, "_cudnn_launcher", lambda *a, **k: (lambda: peer_out))
    launches = {}

    def time_rounds(ours, peer, *, rounds, reps, rng):
        launches.update(ours)
        ms = {lab: fn.__self__.ms for lab, (fn, _) in ours.items()}
        raw = {lab: [[ms[lab] * (1 + 0.01 * rng.random())] for _ in range(rounds)]
               for lab in ours}
        return {"raw": raw, "peer_raw": {lab: [[2.0]] * rounds for lab in ours},
                "peer_all": [[2.0]] * rounds, "orders": [], "clocks": [], "errors": {}}

    monkeypatch.setattr(fb.bench, "time_rounds", time_rounds)
    rec = fb.run_variants(fake_torch, "16k-d128", ["default", "n192", "n224", "n192s3"], 10, 5, 0)
    assert seen == [{}, {"FP8_BLOCK_N": "192"}, {"FP8_BLOCK_N": "224"},
                    {"FP8_BLOCK_N": "192", "FP8_KV_STAGES": "3"}, {}]
    rows = rec["rows"]
    assert set(rows) == {"fp8 default", "fp8 n192", "fp8 n224", "fp8 forward", "bf16 production"}
    assert "error" in rec["checks"]["fp8 n192s3"] and not rec["checks"]["fp8 n192s3"]["passes"]
    assert rows["fp8 default"]["x_default"] == pytest.approx(1.0)
    assert rows["fp8 n224"]["x_default"] == pytest.approx(1.0 / 0.85, rel=0.02)
    lo, hi = rows["fp8 n192"]["x_default_ci"]
    assert lo <= rows["fp8 n192"]["x_default"] <= hi
    assert rows["fp8 n224"]["tflops"] > rows["fp8 default"]["tflops"]
    assert rows["fp8 n192"]["pct_of_peer"] == pytest.approx(100 * 2.0 / 0.9, rel=0.02)
    json.dumps(rec, default=float)


def test_variant_sustained_windows(fb):
    flops = 4 * 2 * 16 * 16384 * 16384 * 128
    ms = {"fp8 default": flops / 850e9, "fp8 n224": flops / 950e9, "fp8 forward": flops / 840e9,
          "bf16 production": flops / 650e9, "cuDNN": flops / 600e9}
    timelines, sampler, kw = pretend(ms)
    record = {"flops": flops, "cudnn_ms": ms["cuDNN"],
              "rows": {lab: {"ms": ms[lab]} for lab in ms if lab != "cuDNN"}}
    ours = {lab: (timelines[lab].launch, lab) for lab in record["rows"]}
    order = fb.variant_sustained(record, ours, (timelines["cuDNN"].launch, "cuDNN"), CFG,
                                 rng=np.random.default_rng(2), sampler=sampler, **kw)
    assert sorted(order) == ["bf16 production", "cuDNN", "fp8 default", "fp8 n224"]
    rows = record["rows"]
    assert "sustained" not in rows["fp8 forward"] and timelines["fp8 forward"].launches == 0
    assert rows["fp8 n224"]["sustained"]["tflops"] == pytest.approx(950.0, rel=1e-6)
    assert rows["fp8 n224"]["x_default_sustained"] == pytest.approx(950 / 850, rel=1e-6)
    assert record["cudnn_sustained"]["tflops"] == pytest.approx(600.0, rel=1e-6)
    assert record["sustained_order"] == order

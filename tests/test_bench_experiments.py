"""bench/experiments/variants.py on the pretend GPU (tests/fake_gpu.py): its bookkeeping, not
its timing (the lead runs it on the H200 through bench/device_run.sh's VARIANTS hook)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import fake_gpu
from ptxattn import driver, stages
from ptxattn.tools import bench

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "experiments" / "variants.py"


@pytest.fixture
def variants(monkeypatch):
    """The script on the pretend GPU: stage 14 takes 2 ms, production 1 ms; stage 1's output is
    wrong. Its prepare() resolves kernel names and drops build defines (the fake has none)."""
    fake_gpu.install(monkeypatch, {14: 2.0, 0: 1.0, 1: 1.0, (0, "causal"): 1.0}, wrong={1})
    spec = importlib.util.spec_from_file_location("experiments_variants", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from ptxattn import api
    fake_prepare = api.prepare

    def prepare(q, k, v, *, stage, defines=None, **kwargs):
        return fake_prepare(q, k, v, stage=stages.get_stage(stage), **kwargs)

    monkeypatch.setattr(module, "prepare", prepare)
    monkeypatch.setattr(driver, "context", lambda: type("Ctx", (), {"name": "Fake GPU"})())
    monkeypatch.setattr(bench, "source_id", lambda: "test")
    return module


def run(module, tmp_path, *argv):
    out = tmp_path / "v.jsonl"
    rc = module.main([*argv, "--rounds", "2", "--reps", "2", "--out", str(out)])
    return rc, json.loads(out.read_text().splitlines()[-1])


def test_causal_flops_are_credited_as_ptxattn_bench_credits_them(variants, tmp_path):
    """A causal Lq != Lk shape: bench halves the dense FLOPs (the convention); the script
    used the exact pair count, 1.875x more here, so its TFLOP/s were not bench's."""
    rc, result = run(variants, tmp_path, "a=production", "--shape", "1x2x128x512x64", "--causal")
    assert rc == 0
    case = bench.Case(name="x", batch=1, heads=2, seq_q=128, seq_k=512, head_dim=64,
                      causal=True)
    assert result["variants"]["a"]["tflops"] == pytest.approx(case.flops / 1.0 / 1e9)
    assert result["flops"] == case.flops == 4 * 2 * 128 * 512 * 64 // 2
    assert "halved" in result["flops_rule"]


def test_window_flops_are_the_exact_pairs(variants, tmp_path):
    rc, result = run(variants, tmp_path, "a=production", "--shape", "1x1x256x64",
                     "--window", "16,0")
    assert rc == 0
    assert result["flops"] == 4 * 64 * bench.unmasked_pairs(256, 256, window=(16, 0))
    assert result["mask"] == {"causal": False, "window": [16, 0]}


def test_every_variant_failing_is_reported_not_a_crash(variants, tmp_path, capsys):
    rc, result = run(variants, tmp_path, "bad=stage1", "--shape", "1x1x128x128")
    assert rc == 1
    assert list(result["failed"]) == ["bad"] and result["variants"] == {}
    assert "every variant failed" in capsys.readouterr().out


def test_ratios_are_against_the_first_variant(variants, tmp_path):
    rc, result = run(variants, tmp_path, "base=stage14", "prod=production",
                     "--shape", "1x1x256x128")
    assert rc == 0
    assert result["variants"]["prod"]["ratio_to_first"] == pytest.approx(2.0)


@pytest.mark.parametrize("argv, message", [
    (["a=production", "a=stage14"], "each LABEL once"),
    (["a=production:PTXATTN_X"], "expected LABEL=KERNEL"),
    (["a=production", "--window", "3"], "--window '3': expected LEFT,RIGHT"),
])
def test_bad_arguments_are_named(variants, argv, message):
    with pytest.raises(SystemExit, match=message):
        variants.main([*argv, "--shape", "1x1x128x128"])

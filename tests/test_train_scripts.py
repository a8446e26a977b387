"""The training scripts without a GPU: the training check's arithmetic and figure
(bench/models/train_curves.py, torch-free), and the plumbing of bench/models/train_check.py
and bench/models/train_step_bench.py on tiny configs on the CPU, with torch references behind
ptxattn's ops (tests/torch_refs.py): every attention call of the ptxattn runs goes through
the forward and backward ops, none falls back.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

MODELS = Path(__file__).resolve().parents[1] / "bench" / "models"
sys.path.insert(0, str(MODELS))
import train_curves  # noqa: E402


def test_smooth_is_a_trailing_moving_average():
    assert train_curves.smooth([1, 2, 3, 4], 2) == [1.0, 1.5, 2.5, 3.5]
    assert train_curves.smooth([5.0], 3) == [5.0]
    with pytest.raises(ValueError, match="window"):
        train_curves.smooth([1], 0)


def test_verdict_compares_the_gap_with_the_spread():
    base = [4.0 - 0.01 * t for t in range(100)]
    other = [x + (0.05 if t % 2 else -0.05) for t, x in enumerate(base)]   # noisy, same trend
    close = [x + 0.001 for x in base]
    far = [x + (0.3 if t > 60 else 0.0) for t, x in enumerate(base)]
    ok = train_curves.verdict({"ptxattn": close, "sdpa": base, "sdpa_other_order": other},
                              window=1, skip=10)
    assert ok["pass"] and ok["gap"] == pytest.approx(0.001) and ok["spread"] == pytest.approx(0.05)
    bad = train_curves.verdict({"ptxattn": far, "sdpa": base, "sdpa_other_order": other},
                               window=1, skip=10)
    assert not bad["pass"] and bad["gap_step"] > 60 and "spread" in bad["why"]
    nan = train_curves.verdict({"ptxattn": base[:50] + [math.nan] * 50, "sdpa": base,
                                "sdpa_other_order": other})
    assert not nan["pass"] and "non-finite" in nan["why"]
    with pytest.raises(ValueError, match="missing"):
        train_curves.verdict({"sdpa": base})
    with pytest.raises(ValueError, match="skip"):
        train_curves.max_gap(base, base, 1, 200)


def test_the_figure_is_an_svg_with_every_run():
    runs = {"ptxattn": [3, 2, 1.5], "sdpa": [3, 2.1, 1.4], "sdpa_other_order": [3, 2, 1.6]}
    text = train_curves.svg(runs, "a <title>", window=2)
    assert text.startswith("<svg") and text.rstrip().endswith("</svg>")
    assert text.count("<polyline") == 6 and "a &lt;title&gt;" in text
    for name in runs:
        assert f">{name}</text>" in text
    assert train_curves.svg(runs, "a <title>", window=2) == text      # the same file


@pytest.fixture
def refs(monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch_refs

    from ptxattn.torch import sdpa
    calls = torch_refs.install(monkeypatch)
    monkeypatch.setattr(sdpa, "_device_reason", lambda q, k, v: None)
    return calls


def test_train_check_runs_tiny_on_the_cpu(refs, tmp_path, capsys):
    import train_check
    rc = train_check.main(["--tiny", "--device", "cpu", "--steps", "6", "--out",
                           str(tmp_path)])
    out = capsys.readouterr().out
    record = json.loads(next(tmp_path.glob("train-check-tiny-*.json")).read_text())
    assert set(record["runs"]) == {"ptxattn", "sdpa", "sdpa_other_order"}
    assert all(len(v) == 6 and all(math.isfinite(x) for x in v) for v in record["runs"].values())
    assert record["info"]["ptxattn"]["fallbacks"] == {}
    kinds = [c["kind"] for c in refs]
    assert kinds.count("forward") == kinds.count("backward") == 6 * 2   # steps x layers
    assert rc == (0 if record["check"]["pass"] else 1) and "wrote" in out
    assert next(tmp_path.glob("train-check-tiny-*.svg")).read_text().startswith("<svg")
    # the same init and the same order: ptxattn's first loss is sdpa's (before any update)
    assert record["runs"]["ptxattn"][0] == pytest.approx(record["runs"]["sdpa"][0], rel=2e-2)


def test_markov_pool_is_seeded_and_in_range():
    import numpy as np
    import train_check
    a = train_check.markov_pool(50, 7, 20, seed=3)
    assert a.shape == (7, 20) and a.min() >= 0 and a.max() < 50
    assert np.array_equal(a, train_check.markov_pool(50, 7, 20, seed=3))
    assert not np.array_equal(a, train_check.markov_pool(50, 7, 20, seed=4))


def test_train_step_bench_runs_tiny_on_the_cpu(refs, tmp_path, capsys):
    import train_step_bench
    rc = train_step_bench.main(["--tiny", "--device", "cpu", "--rounds", "2", "--warmup", "0",
                                "--out", str(tmp_path)])
    record = json.loads(next(tmp_path.glob("train-step-tiny-*.json")).read_text())
    assert rc == 0, capsys.readouterr().out
    assert record["ptxattn_fallbacks"] == {} and "ptxattn" in record["results"]
    assert {"math", "flash"} <= set(record["results"])
    assert record["speedup"]["rounds"] == 2 and len(record["results"]["ptxattn"]["ms"]) == 2
    grads = record["grad_rel_l2"][f"ptxattn_vs_{record['speedup']['against']}"]
    assert set(grads) == {p.format(last=1) for p in train_step_bench.PROBES}
    assert all(g < 3e-2 for g in grads.values()), grads
    assert any(c["kind"] == "backward" for c in refs)


def test_readme_training_block_compiles_and_uses_this_api():
    from readme_blocks import python_blocks
    blocks = python_blocks("## Training")
    assert len(blocks) == 1
    compile(blocks[0], "README.md", "exec")
    assert "pt.attention(" in blocks[0] and ".backward()" in blocks[0]
    assert "deterministic=True" in blocks[0]


def test_train_device_script_runs_each_part_with_its_switches(tmp_path):
    """bench/train_device.sh with a stand-in python3 that logs its arguments: the kernel tests,
    the training tests, the check and the step benchmark, each with its switches."""
    from bench_modules import run_with_stub_python

    def run(**env):
        return run_with_stub_python("bench/train_device.sh", tmp_path, **env)

    proc, calls = run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [" ".join(c.split()[:2]) if c.startswith("-m pytest") else c.split()[0]
            for c in calls] == ["-m pytest", "-m pytest", "bench/models/train_check.py",
                                "bench/models/train_step_bench.py"]
    assert "tests/test_gpu_backward.py" in calls[0]
    assert "tests/test_gpu_torch_autograd.py tests/test_torch_gpu.py" in calls[1]
    assert calls[2].endswith(f"--steps 300 --out {tmp_path / 'o'}")
    proc, calls = run(SKIP_KERNEL_TESTS="1", SKIP_TESTS="1", SKIP_CHECK="1", LAYERS="16",
                      TOKENS="4096", ROUNDS="3")
    assert calls == [f"bench/models/train_step_bench.py --rounds 3 --out {tmp_path / 'o'} "
                     "--layers 16 --tokens 4096"]

"""The capstone's plumbing on the CPU: every builder of bench/models/capstone.py at its tiny
config (--tiny --device cpu), through the real diffusers/transformers routing.

There is no GPU here, so ptxattn's own kernel cannot run. Two ways round that:
- `routed`: the CPU is let through ptxattn's device check and the kernel seam
  (ptxattn.torch.sdpa._kernel) is a float32 softmax-attention written here, so every call the
  real kernel would take reaches the "ptxattn" path, is hooked, counted and timed there;
- without it, the real decision runs: every call falls back to torch with reason "cpu".
Needs torch, diffusers and transformers (skipped without them; CI has none of them).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pt_sdpa = pytest.importorskip("ptxattn.torch.sdpa")

from bench_modules import load  # noqa: E402  (tests/ is on sys.path)


capstone = load("capstone")
bk = load("bookkeeping")


def reference_kernel(q, k, v, is_causal, scale, layout):
    """softmax(scale q kᵀ) v in float32 with GQA and a top-left causal mask: the kernel's
    contract (ptxattn.torch.sdpa._kernel), in either layout, bf16 out in q's layout."""
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    hq, hk = q.shape[1], k.shape[1]
    k, v = (t.repeat_interleave(hq // hk, dim=1) for t in (k, v))
    s = q.float() @ k.float().transpose(-1, -2) * (scale or 1 / math.sqrt(q.shape[-1]))
    if is_causal:
        lq, lk = s.shape[-2:]
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(1), float("-inf"))
    out = (s.softmax(-1) @ v.float()).to(q.dtype)
    return out.transpose(1, 2).contiguous() if layout == "bshd" else out


@pytest.fixture
def routed(monkeypatch):
    monkeypatch.setattr(pt_sdpa, "_device_reason", lambda q, k, v: None)
    monkeypatch.setattr(pt_sdpa, "_kernel", reference_kernel)


def run(model, tmp_path, *extra):
    assert capstone.main([model, "--tiny", "--device", "cpu", "--reps", "1", "--warmup", "0",
                          "--out", str(tmp_path), *extra]) == 0
    (path,) = tmp_path.glob(f"{model}-tiny-*.json")
    return json.loads(path.read_text())


# the roles each tiny model's step makes, two blocks each
ROLES = {"wan": {"attn1": 2, "attn2": 2},
         "ltx": {"attn1": 2, "attn2": 2},
         "ltx2": {"attn1": 2, "audio_attn1": 2, "attn2": 2, "audio_attn2": 2,
                  "audio_to_video_attn": 2, "video_to_audio_attn": 2},
         "llama": {"self_attn": 2}}


@pytest.mark.parametrize("model", sorted(ROLES))
def test_every_builder_runs_routed_through_ptxattn(model, tmp_path, routed):
    report = run(model, tmp_path)
    assert bk.missing_fields(report) == []
    assert report["tiny"] and report["device"] == "cpu" and report["layers"] == 2
    results = {r["backend"]: r for r in report["results"]}
    assert set(results) == {"math", "flash", "ptxattn"}
    for name, r in results.items():
        assert "error" not in r, (name, r)
        assert r["calls"]["by_role"] == ROLES[model], name
        assert r["step_ms_median"] > 0 and r["attention_ms_in_hooked_pass"] > 0
        assert r["attention_share"] == pytest.approx(
            r["attention_ms_in_hooked_pass"] / r["step_ms_median"])
    calls = sum(ROLES[model].values())
    assert results["ptxattn"]["calls"]["by_path"] == {"ptxattn": calls}
    assert results["ptxattn"]["fallbacks"] == {}
    assert results["math"]["calls"]["by_path"] == {"torch": calls}
    # the same calls on both paths: the same FLOPs (layouts differ, shapes agree)
    assert results["ptxattn"]["calls"]["flops"] == results["math"]["calls"]["flops"] > 0
    c = report["comparison"]
    assert c["baseline"] in ("math", "flash")
    assert c["speedup_step"] > 0
    assert c["speedup_by_round"]["rounds"] == 1 == len(results["ptxattn"]["step_ms"])
    # a float32 softmax against torch's bf16 kernels: within a few times torch's own spread
    assert c["ptxattn_vs_baseline_rel_l2"] < max(5 * c["yardstick_rel_l2"], 2e-2)
    if model == "ltx2":
        assert set(c["ptxattn_vs_baseline_rel_l2_by_output"]) == {"video", "audio"}


def test_ltx2_calls_have_the_pipeline_shapes(tmp_path, routed):
    """LTX-2's six attentions per block: video and audio self, each with the text, and the
    two cross-modal ones (Q video / KV audio and back), BSHD on the ptxattn path."""
    r = next(r for r in run("ltx2", tmp_path)["results"] if r["backend"] == "ptxattn")
    shapes = r["calls"]["by_shape"]
    video, audio, text = 32, 9, 16           # TINY["ltx2"]: 2x4x4 latents; 9/24 s of audio
    for role, lq, lk in (("attn1", video, video), ("audio_attn1", audio, audio),
                         ("attn2", video, text), ("audio_attn2", audio, text),
                         ("audio_to_video_attn", video, audio),
                         ("video_to_audio_attn", audio, video)):
        key = f"ptxattn {role} q=[1, {lq}, 2, 64] k=[1, {lk}, 2, 64] bshd"
        assert shapes.get(key) == 2, (key, shapes)


def test_llama_prefill_is_causal_gqa_and_counted_as_such(tmp_path, routed):
    r = next(r for r in run("llama", tmp_path)["results"] if r["backend"] == "ptxattn")
    assert r["calls"]["by_shape"] == {
        "ptxattn self_attn q=[1, 32, 2, 64] k=[1, 32, 1, 64] bshd causal": 2}
    assert r["calls"]["flops"] == 2 * 4 * 2 * (32 * 33 // 2) * 64


def test_text_mask_sends_cross_attention_to_torch(tmp_path, routed):
    """--text-mask: the pipelines' text mask reaches LTX-Video's cross-attention as an
    attn_mask; ptxattn hands those calls to torch and counts them (per step)."""
    report = run("ltx", tmp_path, "--text-mask")
    r = next(r for r in report["results"] if r["backend"] == "ptxattn")
    assert r["fallbacks"] == {"attn_mask": 2}
    assert r["calls"]["by_path"] == {"ptxattn": 2, "torch": 2}
    assert "text mask on" in report["note"]


def test_on_the_cpu_unrouted_every_call_falls_back_with_reason_cpu(tmp_path):
    report = run("wan", tmp_path, "--backends", "math")
    r = next(r for r in report["results"] if r["backend"] == "ptxattn")
    assert r["fallbacks"] == {"cpu": 4}
    assert r["calls"]["by_path"] == {"torch": 4}
    # torch's default CPU kernel against its math kernel: a bf16 rounding apart
    assert report["comparison"]["ptxattn_vs_baseline_rel_l2"] < 2e-2


def test_a_backend_that_cannot_run_is_recorded_not_fatal(tmp_path, routed, monkeypatch):
    """A torch backend that refuses the model (as efficient did on the 8k GQA prefill) is an
    error entry in the JSON; the others, the comparison and the record go on."""
    real = capstone.sdpa_kernel

    @contextlib.contextmanager
    def sdpa_kernel(backends):
        if torch.nn.attention.SDPBackend.FLASH_ATTENTION in backends:
            raise RuntimeError("No available kernel. Aborting execution.")
        with real(backends):
            yield
    monkeypatch.setattr(capstone, "sdpa_kernel", sdpa_kernel)
    report = run("llama", tmp_path)
    flash = next(r for r in report["results"] if r["backend"] == "flash")
    assert flash["error"].startswith("RuntimeError: No available kernel")
    assert report["comparison"]["baseline"] == "math"
    assert report["comparison"]["torch_backends_vs_baseline_rel_l2"] == {}
    assert report["comparison"]["yardstick_rel_l2"] is None
    assert bk.missing_fields(report) == []


def test_bad_arguments_are_refused_naming_them(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        capstone.main(["wan"])                           # --device cuda, the default
    assert "--device cuda: torch sees no CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        capstone.main(["wan", "--device", "cpu", "--reps", "0"])
    assert "--reps" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        capstone.main(["wan", "--device", "tpu"])
    assert "--device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        capstone.main(["wan", "--device", "cpu", "--backends", "cudnn"])
    assert "--backends" in capsys.readouterr().err


if __name__ == "__main__":                               # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.fixture
def saved(tmp_path):
    """The tiny configs saved the way the hub holds them (diffusers: <id>/transformer/)."""
    import diffusers
    import transformers
    root = tmp_path / "hub"
    for name, cls, base in (("ltx2", diffusers.LTX2VideoTransformer3DModel, capstone.LTX_2),
                            ("wan", diffusers.WanTransformer3DModel, capstone.WAN_T2V_1_3B)):
        config = {**base, **capstone.TINY[name]["config"]}
        cls(**config).save_pretrained(root / name / "transformer")
    config = {**capstone.LLAMA_3_1_8B, **capstone.TINY["llama"]["config"]}
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).save_pretrained(
        root / "llama")
    return root


@pytest.mark.parametrize("model", ["ltx2", "llama"])
def test_pretrained_loads_saved_weights_and_cuts_depth(model, saved, tmp_path, routed):
    """--pretrained's from_pretrained path (the hub is not reachable here: a saved copy)."""
    report = run(model, tmp_path / "out", "--pretrained", str(saved / model), "--layers", "1")
    assert report["weights"] == "pretrained" and report["layers"] == 1
    assert report["layers_reduced"]
    r = next(r for r in report["results"] if r["backend"] == "ptxattn")
    assert r["calls"]["by_role"] == {k: 1 for k in ROLES[model]}     # one block left
    assert r["fallbacks"] == {}


def test_pretrained_wan_names_what_it_needs_or_loads(saved, tmp_path, routed):
    """diffusers loads Wan (float32 modules kept) only through accelerate: without it the
    script stops with an error that names the package; with it, the weights load."""
    args = ("--pretrained", str(saved / "wan"), "--layers", "1")
    if importlib.util.find_spec("accelerate") is None:
        with pytest.raises(SystemExit, match="accelerate"):
            run("wan", tmp_path / "out", *args)
    else:
        assert run("wan", tmp_path / "out", *args)["weights"] == "pretrained"


def test_a_run_leaves_diffusers_as_it_found_it(tmp_path, routed):
    """set_attention_backend sets diffusers' process-wide backend too: after a run, models
    that name none must be back on the one found (a leak routed another test's native pass
    through ptxattn)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    from diffusers.utils import logging as diffusers_logging
    before = (_AttentionBackendRegistry._active_backend, diffusers_logging.get_verbosity())
    run("wan", tmp_path, "--backends", "math")
    assert (_AttentionBackendRegistry._active_backend, diffusers_logging.get_verbosity()) == before


def test_no_speedup_is_reported_when_ptxattn_ran_no_call(tmp_path):
    """On the CPU without the routing stand-in every "ptxattn" call falls back to torch: the
    record must say so instead of a speedup of torch over torch."""
    report = run("wan", tmp_path)
    ours = next(r for r in report["results"] if r["backend"] == "ptxattn")
    assert ours["calls"]["by_path"].get("ptxattn", 0) == 0 and ours["fallbacks"]
    c = report["comparison"]
    assert c["speedup_step"] is None and "speedup_by_round" not in c
    assert "none of the attention calls" in c["no_speedup"]


def test_a_plumbing_run_writes_outside_the_results(monkeypatch, tmp_path, routed):
    """--tiny / --device cpu without --out: the temp directory, never bench/results/models."""
    import tempfile
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    assert capstone.main(["wan", "--tiny", "--device", "cpu", "--reps", "1", "--warmup", "0"]) == 0
    assert list((tmp_path / "ptxattn-capstone").glob("wan-tiny-*.json"))

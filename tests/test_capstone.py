"""The capstone's torch-free parts (run everywhere, CI included): the FLOP and call
bookkeeping of bench/models/bookkeeping.py, the figure writer bench/models/figure.py on
synthetic records, and the device script's syntax. The models themselves run in
tests/test_capstone_models.py (torch, diffusers, transformers; skipped without them)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from bench_modules import MODELS, load  # noqa: E402  (tests/ is on sys.path)


bk = load("bookkeeping")
figure = load("figure")


# --------------------------------------------------------------------------- bookkeeping

def test_dims_reads_both_layouts():
    assert bk.dims([2, 12, 4096, 128], "bhld") == (2, 12, 4096, 128)
    assert bk.dims([2, 4096, 12, 128], "bshd") == (2, 12, 4096, 128)


@pytest.mark.parametrize("shape,layout,match", [([2, 3, 4], "bhld", "shape"),
                                                ([1, 2, 3, 4], "bsdh", "layout")])
def test_dims_refuses_bad_input_naming_it(shape, layout, match):
    with pytest.raises(ValueError, match=match):
        bk.dims(shape, layout)


@pytest.mark.parametrize("lq,lk", [(1, 1), (5, 5), (7, 3), (3, 7), (0, 4), (64, 64)])
def test_causal_pairs_counts_what_a_top_left_mask_keeps(lq, lk):
    brute = sum(1 for i in range(lq) for j in range(lk) if j <= i)
    assert bk.causal_pairs(lq, lk) == brute


def test_attention_flops_follow_the_protocol():
    # 4·B·H·Lq·Lk·D, the same in either layout
    assert bk.attention_flops([1, 12, 32760, 128], [1, 12, 512, 128]) == 4 * 12 * 32760 * 512 * 128
    assert (bk.attention_flops([2, 100, 8, 64], [2, 30, 8, 64], "bshd")
            == 4 * 2 * 8 * 100 * 30 * 64)
    # causal: the unmasked pairs, 8192·8193/2 for the 8k prefill (GQA: q's heads count)
    assert (bk.attention_flops([1, 32, 8192, 128], [1, 8, 8192, 128], causal=True)
            == 4 * 32 * (8192 * 8193 // 2) * 128)


@pytest.mark.parametrize("name,role", [("transformer_blocks.7.audio_attn1", "audio_attn1"),
                                       ("blocks.0.attn2", "attn2"),
                                       ("model.layers.31.self_attn", "self_attn"),
                                       (None, "other"), ("", "other")])
def test_role_is_the_module_name_without_its_block(name, role):
    assert bk.role_of(name) == role


def entry(path, role, q, k, layout="bshd", causal=False):
    return {"path": path, "role": role, "q": q, "k": k, "layout": layout, "causal": causal}


def test_summarize_calls_counts_roles_paths_shapes_and_flops():
    record = [entry("ptxattn", "attn1", [1, 100, 2, 64], [1, 100, 2, 64]),
              entry("ptxattn", "attn1", [1, 100, 2, 64], [1, 100, 2, 64]),
              entry("torch", "attn2", [1, 2, 100, 64], [1, 2, 16, 64], "bhld"),
              entry("ptxattn", "self_attn", [1, 32, 2, 64], [1, 32, 1, 64], causal=True)]
    s = bk.summarize_calls(record)
    assert s["calls"] == 4
    assert s["by_role"] == {"attn1": 2, "attn2": 1, "self_attn": 1}
    assert s["by_path"] == {"ptxattn": 3, "torch": 1}
    assert s["by_shape"]["ptxattn attn1 q=[1, 100, 2, 64] k=[1, 100, 2, 64] bshd"] == 2
    assert s["by_shape"]["ptxattn self_attn q=[1, 32, 2, 64] k=[1, 32, 1, 64] bshd causal"] == 1
    assert s["flops"] == (2 * 4 * 2 * 100 * 100 * 64 + 4 * 2 * 100 * 16 * 64
                          + 4 * 2 * (32 * 33 // 2) * 64)


# --------------------------------------------------------------------------- figure

def result(backend, step_ms, share, calls=10):
    return {"backend": backend, "step_ms_median": step_ms, "step_ms": [step_ms] * 3,
            "attention_ms_in_hooked_pass": share * step_ms, "attention_share": share,
            "attention_tflops": 500.0,
            "calls": {"calls": calls, "by_role": {"attn1": calls}, "by_path": {"torch": calls},
                      "by_shape": {}, "flops": 1},
            "fallbacks": {}}


def report(model, date, base_ms, ours_ms, *, tiny=False, gpu="NVIDIA H200"):
    return {"model": model, "note": f"{model} at its default shape", "config": {"num_layers": 30},
            "layers": 30, "layers_reduced": False, "tiny": tiny, "weights": "random",
            "device": "cuda", "args": {}, "torch": "2.11", "gpu": gpu, "commit": "abc",
            "date": date,
            "results": [result("cudnn", base_ms, 0.5), result("flash", base_ms * 1.1, 0.55),
                        {"backend": "efficient", "error": "RuntimeError: No available kernel"},
                        result("ptxattn", ours_ms, 0.4)],
            "comparison": {"baseline": "cudnn",
                           "torch_backends_vs_baseline_rel_l2": {"flash": 0.0153},
                           "yardstick_rel_l2": 0.0153, "ptxattn_vs_baseline_rel_l2": 0.0156,
                           "speedup_step": base_ms / ours_ms,
                           "speedup_by_round": {"median": base_ms / ours_ms, "min": 1.0,
                                                "max": 1.5, "rounds": 3}}}


@pytest.fixture
def results_dir(tmp_path):
    d = tmp_path / "models"
    d.mkdir()
    (d / "wan-old.json").write_text(json.dumps(report("wan2.1-t2v-1.3b", "2026-11-30T10:00:00",
                                                      999.0, 998.0)))
    (d / "wan-new.json").write_text(json.dumps(report("wan2.1-t2v-1.3b", "2026-12-01T10:00:00",
                                                      500.0, 400.0)))
    (d / "llama.json").write_text(json.dumps(report("llama-3.1-8b-arch", "2026-12-01T11:00:00",
                                                    300.0, 290.0)))
    (d / "ltx-tiny.json").write_text(json.dumps(report("ltx-video-tiny", "2026-12-01T12:00:00",
                                                       30.0, 20.0, tiny=True, gpu="x86_64")))
    broken = report("ltx-2", "2026-12-01T09:00:00", 1.0, 1.0)
    broken["results"] = [{"backend": b, "error": "IndexError: tuple index out of range"}
                         for b in ("cudnn", "flash", "efficient")] + [result("ptxattn", 70, 0.3)]
    broken["comparison"] = {}
    (d / "ltx2.json").write_text(json.dumps(broken))
    (d / "other.json").write_text(json.dumps({"rounds": 10}))     # another kind of result
    return d


def test_figure_keeps_the_newest_record_per_model_and_leaves_tiny_out(results_dir):
    reports = figure.load_reports(results_dir)
    assert [r["model"] for r in reports] == ["ltx-2", "wan2.1-t2v-1.3b", "llama-3.1-8b-arch"]
    assert reports[1]["_file"] == "wan-new.json"
    with_tiny = figure.load_reports(results_dir, include_tiny=True)
    assert "ltx-video-tiny" in [r["model"] for r in with_tiny]


def bars(svg_text):
    """(width, fill) of every bar rectangle, in document order (legend squares excluded)."""
    root = ET.fromstring(svg_text)
    rects = [r for r in root.iter("{http://www.w3.org/2000/svg}rect")
             if r.get("height") == str(figure.BAR_H)]
    return [(float(r.get("width")), r.get("fill")) for r in rects]


def test_figure_draws_step_time_and_attention_share_to_scale(results_dir):
    svg = figure.render(figure.load_reports(results_dir))
    ET.fromstring(svg)                                   # well-formed
    b = bars(svg)
    # ltx-2 has no comparison (no bars); wan: baseline 500 ms (share 0.5), ptxattn 400 (0.4)
    wan = b[:4]
    assert wan[0][0] == pytest.approx(figure.BAR_W, abs=0.1)          # the longer step, full
    assert wan[1][0] == pytest.approx(0.5 * figure.BAR_W, abs=0.1)    # its attention part
    assert wan[2][0] == pytest.approx(0.8 * figure.BAR_W, abs=0.1)    # 400 / 500
    assert wan[3][0] == pytest.approx(0.4 * 0.8 * figure.BAR_W, abs=0.1)
    assert [f for _, f in wan] == [figure.REST, figure.ATTN, figure.REST_US, figure.ATTN_US]
    assert "500.0 ms, attention 50%" in svg and "400.0 ms, attention 40%" in svg
    assert "step speedup with ptxattn 1.250x (per round 1.000-1.500, 3 rounds)" in svg
    assert "ptxattn 1.56e-02; torch&apos;s own backends 1.53e-02" in svg or \
        "ptxattn 1.56e-02; torch's own backends 1.53e-02" in svg
    assert "no comparison: cudnn: IndexError" in svg
    assert len(b) == 8                                   # wan and llama, 4 rects each


def test_figure_caps_a_share_above_one_at_the_bar(results_dir):
    r = report("wan2.1-t2v-1.3b", "2026-12-02", 100.0, 100.0)
    r["results"][0]["attention_share"] = 11.95          # the cold-pass bug of 2026-12-01
    svg = figure.render([r])
    b = bars(svg)
    assert b[1][0] == pytest.approx(b[0][0])             # never past the step itself
    assert "attention 1195%" in svg                      # but the number is printed as measured


def test_figure_is_deterministic_and_main_writes_it(results_dir, tmp_path):
    out1, out2 = tmp_path / "a.svg", tmp_path / "b.svg"
    assert figure.main(["--results", str(results_dir), "--out", str(out1)]) == 0
    assert figure.main(["--results", str(results_dir), "--out", str(out2)]) == 0
    assert out1.read_text() == out2.read_text()
    assert out1.read_text().startswith("<svg")


def test_table_gives_the_readme_rows(results_dir):
    text = figure.table(figure.load_reports(results_dir))
    lines = text.splitlines()
    assert lines[0].startswith("| model (layers) |") and len(lines) == 2 + 3
    assert ("| wan2.1-t2v-1.3b (30) | cudnn 500.0 | 400.0 | 1.250x (1.000-1.500) | 50% → 40% "
            "| 1.56e-02 / 1.53e-02 |") in lines
    assert lines[2].startswith("| ltx-2 (30) | no comparison: cudnn: IndexError")


def test_figure_with_no_records_says_so(tmp_path):
    svg = figure.render([])
    ET.fromstring(svg)
    assert "no capstone results found" in svg


def test_figure_refuses_a_missing_results_folder(tmp_path, capsys):
    with pytest.raises(SystemExit):
        figure.main(["--results", str(tmp_path / "nope"), "--out", str(tmp_path / "x.svg")])
    assert "--results" in capsys.readouterr().err


def test_figure_names_an_unreadable_json(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        figure.load_reports(tmp_path)


def test_synthetic_report_has_every_field():
    assert bk.missing_fields(report("m", "2026-12-01", 2.0, 1.0)) == []
    r = report("m", "2026-12-01", 2.0, 1.0)
    del r["results"][3]["attention_share"], r["comparison"]["speedup_step"], r["gpu"]
    assert bk.missing_fields(r) == ["gpu", "results[3].attention_share",
                                    "comparison.speedup_step"]


# --------------------------------------------------------------------------- device script

@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_run_all_is_valid_bash():
    subprocess.run(["bash", "-n", str(MODELS / "run_all.sh")], check=True)


def test_committed_figure_is_well_formed():
    svg = MODELS / "capstone.svg"
    assert svg.exists(), ("bench/models/capstone.svg is missing: it is drawn from the committed "
                          "records (python bench/models/figure.py)")
    ET.fromstring(svg.read_text())


def test_committed_results_are_readable_by_the_figure():
    """A record for every capstone model, with every field, drawn by the figure: no record
    at all is a failure (the loop below would pass it vacuously)."""
    results = MODELS.parents[0] / "results" / "models"
    reports = figure.load_reports(results)
    models = [r["model"] for r in reports]
    for prefix in figure.MODEL_ORDER:
        assert any(m.startswith(prefix) for m in models), (
            f"no capstone record for {prefix!r} in {results} (found {models or 'none'})")
    for r in reports:
        assert bk.missing_fields(r) == [], (r["_file"], bk.missing_fields(r))
        figure.row(r)                                     # every committed record draws


if __name__ == "__main__":                               # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_figure_draws_the_fp8_backend_as_a_third_bar_with_its_speedups():
    r = report("wan2.1-t2v-1.3b", "2026-12-02", 500.0, 400.0)
    r["results"].append(result("ptxattn_fp8", 320.0, 0.25))
    r["comparison"]["fp8"] = {"vs_baseline_rel_l2": 0.041, "speedup_vs_baseline": 500 / 320,
                              "speedup_vs_ptxattn_bf16": 400 / 320}
    svg = figure.render([r])
    b = bars(svg)
    assert len(b) == 6
    assert b[4] == (pytest.approx(0.64 * figure.BAR_W, abs=0.1), figure.REST_FP8)
    assert b[5] == (pytest.approx(0.25 * 0.64 * figure.BAR_W, abs=0.1), figure.ATTN_FP8)
    assert "FP8: 1.562x the baseline, 1.250x ptxattn bf16; its output rel. diff vs baseline " \
        "4.10e-02" in svg
    # the README's table keeps its two columns of steps (the FP8 bar is the figure's)
    assert figure.table([r]).count("|") == figure.table([report(
        "wan2.1-t2v-1.3b", "2026-12-02", 500.0, 400.0)]).count("|")


def test_capstone_compares_fp8_only_when_its_kernel_ran():
    torch = pytest.importorskip("torch")        # capstone.py imports torch and diffusers
    cap = load("capstone")

    def res(backend, ms, ran):
        return {"backend": backend, "step_ms_median": ms, "step_ms": [ms, ms * 1.01],
                "calls": {"by_path": {backend: 4} if ran else {"torch": 4}},
                "fallbacks": {} if ran else {"cpu": 4},
                "_out": {"video": torch.full((4,), float(ms))}}
    ran = cap.compare([res("cudnn", 500, True), res("ptxattn", 400, True),
                       res("ptxattn_fp8", 320, True)], ["cudnn"])
    assert ran["fp8"]["speedup_vs_baseline"] == pytest.approx(500 / 320)
    assert ran["fp8"]["speedup_vs_ptxattn_bf16"] == pytest.approx(400 / 320)
    assert ran["fp8"]["vs_baseline_rel_l2"] == pytest.approx(180 / 500)
    fell_back = cap.compare([res("cudnn", 500, True), res("ptxattn", 400, True),
                             res("ptxattn_fp8", 320, False)], ["cudnn"])
    assert fell_back["fp8"]["speedup_step"] is None and "no speedup" in fell_back["fp8"]["no_speedup"]
    assert "speedup_vs_baseline" not in fell_back["fp8"]

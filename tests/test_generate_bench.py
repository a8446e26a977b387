"""bench/models/generate_bench.py without a GPU: the verdict on ptxattn's decode steps (kernel
counts, decode calls, fallbacks), the figures, the token comparison and the static cache's
rewind on their own; then the whole script on a tiny Llama on the CPU, twice: as it is (the
ptxattn backend falls back there, so the script must refuse a speedup) and with torch
references behind ptxattn's kernels (tests/torch_refs.py; every decode step must then be seen
on the decode call, and the speedup is printed). Skipped without torch or transformers.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import bench_modules  # noqa: E402
import torch_refs  # noqa: E402

gb = bench_modules.load("generate_bench")


# --------------------------------------------------------------------------- the verdict

def probe(kernels=None, calls=(), layers=4, forwards=3, compiled=False):
    return gb.probe_record(kernels, list(calls), layers, forwards, compiled)


def record(p, fallbacks=None, compiled=False):
    return {"probe": p, "fallbacks": fallbacks or {}, "compiled": compiled}


def test_the_kernel_counts_decide_when_the_profiler_sees_kernels():
    good = {"ptxattn_decode": 12, "ptxattn_combine": 12, "nvjet_gemm": 70}
    assert gb.verdict(record(probe(good)), 4) == (True, "")
    ok, why = gb.verdict(record(probe({**good, "ptxattn_decode": 11})), 4)
    assert not ok and "11 ptxattn_decode launches" in why and "= 12" in why
    ok, why = gb.verdict(record(probe({**good, "ptxattn_fwd": 1})), 4)
    assert not ok and "forward-kernel launches 1" in why
    sdpa = {**good, "flash_fwd_splitkv_kernel<...>": 4}
    ok, why = gb.verdict(record(probe(sdpa)), 4)
    assert not ok and "flash_fwd_splitkv_kernel" in why
    ok, why = gb.verdict(record(probe(good), fallbacks={"attn_mask": 2}), 4)
    assert not ok and "attn_mask" in why
    # a compiled run whose replays the profiler missed: the hint says so
    ok, why = gb.verdict(record(probe({"ptxattn_decode": 4}, compiled=True), compiled=True), 4)
    assert not ok and "CUDA-graph replays" in why


def test_without_kernels_eager_runs_count_decode_calls_and_compiled_runs_fail():
    assert gb.verdict(record(probe(None, [1] * 12)), 4) == (True, "")
    ok, why = gb.verdict(record(probe(None, [1] * 11)), 4)
    assert not ok and "11 decode calls" in why
    ok, why = gb.verdict(record(probe(None, [1] * 11 + [7])), 4)     # a 7-query call
    assert not ok and "[1, 7]" in why
    ok, why = gb.verdict(record(probe(None, [1] * 12), compiled=True), 4)
    assert not ok and "replays run no Python" in why


def test_probe_record_names_torch_attention_kernels_but_not_ours_or_gemms():
    p = probe({"ptxattn_decode": 3, "ptxattn_fwd_causal": 1, "fmha_cutlassF_bf16": 2,
               "cudnn_generated_fort_native_sdpa_sm90": 5, "sm90_xmma_gemm_bf16": 9,
               "at::native::softmax_warp_forward": 1,
               # inductor's pointwise kernel around our op (compiled static cache), and one
               # around cuDNN's: named after the ops they fuse
               "triton_poi_fused__to_copy_bmm_cat_kvcache_attention_mul_5": 64,
               "triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy_3": 2})
    assert p["decode_kernels"] == 3 and p["forward_kernels"] == 1
    assert set(p["torch_attention_kernels"]) == {
        "fmha_cutlassF_bf16", "cudnn_generated_fort_native_sdpa_sm90",
        "at::native::softmax_warp_forward",
        "triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy_3"}


# --------------------------------------------------------------------------- figures

def test_decode_figures_count_decode_steps_only():
    times = [0.0, 1.0, 1.1, 1.2, 1.4]            # the prompt, then 4 new tokens
    f = gb.decode_figures(-0.5, 1.5, times, batch=8, new=4)
    assert f["generate_s"] == 2.0 and f["first_token_s"] == 1.5
    assert f["decode_tok_s"] == pytest.approx(8 * 3 / 0.4)
    assert f["decode_tok_s_per_sequence"] == pytest.approx(3 / 0.4)
    assert f["step_ms"]["median"] == pytest.approx(100.0) and f["step_ms"]["n"] == 3
    with pytest.raises(RuntimeError, match="saw 3 new tokens, expected 4"):
        gb.decode_figures(0, 1, times[:-1], batch=1, new=4)


def test_first_difference_per_sequence_and_pairs():
    a = [[1, 2, 3, 4], [5, 6, 7, 8]]
    b = [[1, 2, 9, 4], [5, 6, 7, 8]]
    assert gb.first_difference(a, b) == {"first": 2, "rows": [2, None], "tokens": 4}
    assert gb.first_difference(a, a)["first"] is None
    runs = {"cudnn": {"tokens": a}, "ptxattn": {"tokens": b}, "flash": {"tokens": a}}
    assert set(gb.pairs_of(runs)) == {"ptxattn~cudnn", "ptxattn~flash", "cudnn~flash"}


def run(impl, tok_s, generate_s, verified=True, batch=2, new=4):
    return {"impl": impl, "decode_tok_s": tok_s, "generate_s": generate_s,
            "tokens": [[0] * new] * batch, "verified": verified, "why_not": "because"}


def test_speedups_against_the_best_backend_only_when_verified():
    runs = {"ptxattn": run("ptxattn", 110.0, 3.0), "cudnn": run("cudnn", 100.0, 3.5),
            "flash": run("flash", 90.0, 2.5)}
    s = gb.speedups(runs, {"ptxattn": 1.0, "cudnn": 1.0, "flash": 2.0})
    assert s["printed"] and s["decode"] == {"against": "cudnn", "ratio": pytest.approx(1.1)}
    # end to end: 2 x 4 tokens over prefill + generate: ptxattn 4.0 s, cudnn and flash 4.5 s
    assert s["e2e"]["ratio"] == pytest.approx(4.5 / 4.0)
    assert runs["flash"]["e2e_tok_s"] == pytest.approx(8 / 4.5)
    runs["ptxattn"]["verified"] = False
    s = gb.speedups(runs, {"cudnn": 1.0})
    assert not s["printed"] and "because" in s["why"]
    assert not gb.speedups({"cudnn": run("cudnn", 1.0, 1.0)}, {})["printed"]


def test_the_budget_keeps_static_runs_it_cannot_finish():
    clock = gb.Clock(budget_s=100.0)
    assert clock.static_fits(1, layers=32)                   # 60 s guessed before any seen
    assert not clock.static_fits(2, layers=32)
    assert clock.static_fits(2, layers=16)
    clock.static_seen.append(10.0)
    assert clock.static_fits(9, layers=32) and not clock.static_fits(11, layers=32)


def test_a_static_cache_rewinds_in_place():
    import transformers
    cfg = transformers.LlamaConfig(**gb.TINY)
    kv = [(torch.randn(1, 2, 5, 64).to(torch.bfloat16), torch.randn(1, 2, 5, 64).to(
        torch.bfloat16)) for _ in range(cfg.num_hidden_layers)]
    cache = gb.static_copy(cfg, kv, max_len=16)
    keys = cache.layers[0].keys
    assert int(cache.get_seq_length()) == 5 and torch.equal(keys[:, :, :5], kv[0][0])
    cache.update(kv[0][0][:, :, :2], kv[0][1][:, :, :2], 0)        # a decode wrote on
    gb.rewind_static(cache, 5)
    assert int(cache.get_seq_length()) == 5 and cache.layers[0].keys is keys
    copy = gb.dynamic_copy(kv)
    assert copy.layers[1].keys.data_ptr() != kv[1][0].data_ptr()
    assert torch.equal(copy.layers[1].keys, kv[1][0])


# --------------------------------------------------------------------------- the script

ARGS = ["--tiny", "--batches", "1", "--context", "24", "--new-tokens", "4"]


def test_tiny_on_the_cpu_falls_back_and_prints_no_speedup(tmp_path, capsys):
    rc = gb.main([*ARGS, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    rec = json.loads(next(tmp_path.glob("generate-tiny-*.json")).read_text())
    assert rc == 1, out
    batch = rec["batches"][0]
    assert set(batch["runs"]) == {"dynamic", "static"}
    for kind in ("dynamic", "static"):
        ours = batch["runs"][kind]["ptxattn"]
        assert not ours["verified"] and "'cpu'" in ours["why_not"], ours["why_not"]
        assert not batch["speedup"][kind]["printed"]
        assert len(ours["tokens"]) == 1 and len(ours["tokens"][0]) == 4
    assert "x " not in out.split("summary:")[1].split("(")[0]      # no ratio printed
    assert "no speedup (ptxattn not verified" in out
    assert batch["prefill"]["ptxattn"]["fallbacks"]["cpu"] == rec["layers"]
    assert {p["phase"] for p in rec["phases"]} >= {"model", "b1 prefill ptxattn",
                                                   "b1 dynamic ptxattn"}


@pytest.fixture
def routed(monkeypatch):
    """ptxattn's kernels replaced by torch references on CPU tensors, which the device check
    lets through: the backend then takes every call it would take on the GPU."""
    from ptxattn.torch import kvcache, sdpa
    calls = torch_refs.install(monkeypatch)
    monkeypatch.setattr(sdpa, "_device_reason", lambda q, k, v: None)
    monkeypatch.setattr(kvcache, "flash_attn_with_kvcache", torch_refs.kvcache)
    return calls


def test_tiny_with_the_kernels_routed_sees_every_decode_step(routed, tmp_path, capsys):
    rc = gb.main([*ARGS, "--static-sdpa", "all", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    rec = json.loads(next(tmp_path.glob("generate-tiny-*.json")).read_text())
    assert rc == 0, out
    batch, layers = rec["batches"][0], rec["layers"]
    assert batch["prefill_reference"] == "flash"          # REFERENCE_PREFILL's first here
    assert batch["prefill"]["ptxattn"]["fallbacks"] == {}
    for kind in ("dynamic", "static"):
        runs = batch["runs"][kind]
        assert set(runs) == {"ptxattn", "math", "flash"}, (kind, batch["skipped"])
        ours = runs["ptxattn"]
        assert ours["verified"], ours["why_not"]
        assert ours["probe"]["decode_calls"] == layers * gb.PROBE_TOKENS
        assert ours["fallbacks"] == {}
        assert batch["speedup"][kind]["printed"]
        assert set(batch["first_difference"][kind]) == {"ptxattn~flash", "ptxattn~math",
                                                        "flash~math"}
    # the static runs' decode calls carried each sequence's length (the mask's verdict)
    static = [c for c in routed if c["kind"] == "kvcache" and c["seqlens"] is not None]
    assert static and all(c["k_cache"][1] == batch["static_max_len"] for c in static)
    assert "x math" in out or "x flash" in out
    assert "every decode step on the decode kernel" in out


def test_the_device_script_runs_the_tests_then_the_benchmark_with_its_switches(tmp_path):
    """bench/generate_device.sh with a stand-in python3 that logs its arguments."""
    def run(**env):
        return bench_modules.run_with_stub_python("bench/generate_device.sh", tmp_path, **env)

    proc, calls = run()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(calls) == 2 and calls[0].startswith("-m pytest"), calls
    assert "tests/test_gpu_generate.py" in calls[0] and "static_cache" in calls[0]
    assert calls[1] == f"bench/models/generate_bench.py --out {tmp_path / 'o'} --budget-s 240"
    proc, calls = run(SKIP_TESTS="1", BATCHES="8", CACHES="static", LAYERS="16",
                      BUDGET="420", STATIC_SDPA="all")
    assert calls == [f"bench/models/generate_bench.py --out {tmp_path / 'o'} --budget-s 420 "
                     "--batches 8 --caches static --layers 16 --static-sdpa all"]

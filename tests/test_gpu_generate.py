"""transformers generate() on the GPU with attn_implementation="ptxattn": every decode step on
the decode kernel, with the dynamic cache, the static cache in eager mode and the static cache
compiled (transformers' own torch.compile, mode reduce-overhead: CUDA graphs), through the
machinery of bench/models/generate_bench.py (its decode runs, its kernel probe, its verdict).

In order, so that a failure names its layer: the profiler sees the decode kernel in plain
calls and in CUDA-graph replays (what the benchmark's verdict on compiled runs rests on);
teacher-forced decode logits against "sdpa" from the same prefill (rel L2 <= 2e-2 per step:
two bf16 attention kernels on a bf16 model); greedy generate() from the same prefill, ptxattn
against "sdpa", with the verdict (no fallback, `layers` ptxattn_decode launches per forward
and no other attention kernel) and the tokens (a large lm_head gives wide margins, so they
must agree on the first 6 of 8); the benchmark itself at 2 layers and a 2k context.

Run (the lead, on the H200): PTXATTN_REQUIRE_GPU=1 python -m pytest -q tests/test_gpu_generate.py
(~1 minute: four compiles of a 2-layer model and one small benchmark run).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import bench_modules
from torch_gpu import pt, torch  # noqa: F401  (fixtures)

pytestmark = pytest.mark.gpu
gb = bench_modules.load("generate_bench")

LAYERS, PROMPT, NEW = 2, 300, 8


def _transformers():
    try:
        import transformers
    except Exception as e:                              # noqa: BLE001
        pytest.skip(f"transformers is not importable (optional, extra `models`): {e}")
    return transformers


def peaked_llama(torch, transformers):
    """GQA 8:2, head dim 128, random weights with a large lm_head (wide greedy margins: a token
    difference is a real difference, not a tie broken by rounding)."""
    cfg = dict(vocab_size=256, hidden_size=512, intermediate_size=512,
               num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=2,
               head_dim=128, max_position_embeddings=2048)
    model = gb.build_model(torch, transformers, cfg, "cuda", seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model


@pytest.fixture
def prefilled(torch, pt):
    """(model, prompt (2, PROMPT), the prompt's cache but its last token) from an SDPA
    prefill."""
    transformers = _transformers()
    pt.register_transformers()
    model = peaked_llama(torch, transformers)
    g = torch.Generator(device="cuda").manual_seed(1)
    prompt = torch.randint(0, 256, (2, PROMPT), device="cuda", generator=g)
    gb.use(model, "sdpa")
    cache, _, _ = gb.prefill(torch, model, prompt, "cuda")
    yield model, prompt, gb.kv_of(cache)
    torch._dynamo.reset()


def test_the_profiler_sees_decode_kernels_in_plain_calls_and_graph_replays(torch, pt):
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(2, 4096, 2, 128, device="cuda", dtype=torch.bfloat16)
              for _ in range(2))
    lens = torch.tensor([4096, 1000], dtype=torch.int32, device="cuda")

    def step():
        return pt.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
    _, plain = gb.kernel_counts(torch, "cuda", lambda: [step() for _ in range(2)])
    assert plain and plain.get(gb.DECODE_KERNEL) == 2, f"plain calls: kernels seen {plain}"
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    _, replays = gb.kernel_counts(torch, "cuda", lambda: [graph.replay() for _ in range(3)])
    assert replays and replays.get(gb.DECODE_KERNEL) == 3, (
        f"3 graph replays: kernels seen {replays} (without them the benchmark cannot verify "
        "its compiled static-cache runs)")


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_teacher_forced_decode_logits_match_sdpa(torch, pt, prefilled, kind):
    model, prompt, kv = prefilled
    nxt = torch.randint(0, 256, (2, 3), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(2))
    feed = torch.cat([prompt[:, -1:], nxt], dim=1)            # the prompt's last token first
    logits, calls = {}, {}
    for impl in ("sdpa", "ptxattn"):
        gb.use(model, impl)
        cache = gb.dynamic_copy(kv) if kind == "dynamic" else gb.static_copy(
            model.config, kv, max_len=PROMPT + 64)
        steps = []
        with gb.counting_decode_calls() as seen, torch.no_grad():
            for t in range(feed.shape[1]):
                mask = torch.ones(2, PROMPT + t, dtype=torch.long, device="cuda")
                steps.append(model(input_ids=feed[:, t:t + 1], attention_mask=mask,
                                   use_cache=True, **{gb.cache_kwarg(model): cache}
                                   ).logits[:, -1].float())
        logits[impl], calls[impl] = steps, list(seen)
    assert calls["ptxattn"] == [1] * (LAYERS * feed.shape[1]), (
        f"{kind}: decode calls by query length {calls['ptxattn']}, expected "
        f"{LAYERS} layers x {feed.shape[1]} steps of 1; fallbacks {pt.fallback_counts()}")
    assert pt.fallback_counts() == {}, pt.fallback_counts()
    for t, (a, b) in enumerate(zip(logits["ptxattn"], logits["sdpa"])):
        err = gb.rel_l2(a, b)
        assert err <= 2e-2, f"{kind} decode step {t}: logits rel L2 {err:.3g} against sdpa"


@pytest.mark.parametrize("kind", ["dynamic", "static-eager", "static-compiled"])
def test_generate_runs_every_decode_step_on_the_decode_kernel(torch, pt, prefilled, kind):
    model, prompt, kv = prefilled
    cache = kind.split("-")[0]
    args = SimpleNamespace(device="cuda", static_eager=kind == "static-eager", new_tokens=NEW)
    runs = {impl: gb.DecodeRun(torch, model, prompt, kv, cache, impl, args,
                               max_len=PROMPT + 64).run() for impl in ("sdpa", "ptxattn")}
    ours = runs["ptxattn"]
    assert ours["compiled"] == (kind == "static-compiled")
    assert ours["verified"], f"{kind}: {ours['why_not']}; probe {ours['probe']}"
    assert ours["fallbacks"] == {}
    diff = gb.first_difference(ours["tokens"], runs["sdpa"]["tokens"])
    assert diff["first"] is None or diff["first"] >= 6, (
        f"{kind}: greedy tokens first differ at new token {diff['rows']}: ptxattn "
        f"{ours['tokens']}, sdpa {runs['sdpa']['tokens']}")
    assert ours["decode_tok_s"] > 0 and len(ours["tokens"][0]) == NEW


def test_the_benchmark_runs_small_on_the_gpu(torch, pt, tmp_path, capsys):
    """The published config at 2 layers, a 2k context, 8 new tokens, batch 2: every part
    (calls, prefills, dynamic and compiled static runs), every ptxattn run verified."""
    _transformers()
    rc = gb.main(["--layers", "2", "--context", "2048", "--new-tokens", "8", "--batches", "2",
                  "--out", str(tmp_path)])
    out = capsys.readouterr().out
    rec = json.loads(next(tmp_path.glob("generate-*.json")).read_text())
    batch = rec["batches"][0]
    why = {k: r.get("why_not") for k, runs in batch["runs"].items() for i, r in runs.items()
           if i == "ptxattn"}
    assert rc == 0, f"not verified: {why}; skipped {batch['skipped']}\n{out[-3000:]}"
    assert set(batch["runs"]) == {"dynamic", "static"}
    assert batch["runs"]["static"]["ptxattn"]["compiled"]
    assert all(batch["speedup"][k]["printed"] for k in batch["runs"]), batch["speedup"]
    assert "summary:" in out

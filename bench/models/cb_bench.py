"""transformers continuous batching (generate_batch over its paged cache): tokens/s and
time to first token with attn_implementation="paged|ptxattn" against transformers' own
"paged|sdpa", in the same process, the backends alternating round by round.

    python bench/models/cb_bench.py --out bench/results/models     # Llama-3-8B config, H200
    python bench/models/cb_bench.py --layers 16 --rounds 2         # shallower, quicker
    python bench/models/cb_bench.py --tiny --device cpu            # plumbing only

Model: the published Llama-3-8B configuration (32 layers, 32:8 heads, head dim 128, vocab
128256) with random weights (torch.manual_seed(0)) in bf16; --layers reduces the depth (the
JSON and the printout say so). Requests: 64 prompts of random tokens, lengths drawn uniformly
from 32 to 1024 tokens (NumPy default_rng(0); the lengths are in the JSON), 64 new tokens
each, greedy, no EOS (every request generates all of them). Both backends get the same
ContinuousBatchingConfig: block_size 256, num_blocks enough for every request at once, 4096
tokens a batch, no CUDA graphs (transformers' default for both names: neither is a flash
implementation), transformers' own warmup off (an untimed warm-up batch runs first instead).

Per run: tokens/s = generated tokens / (the last request's finish - the first request's
creation) from transformers' request timestamps (manager start-up excluded; the call's wall
time is reported beside it), and each request's time to first token (its first token's
timestamp - its creation: queueing behind the other prompts included, as a server sees it),
median and p90. The figure per backend is the median over rounds; the speedup is the median of
the per-round ratios with a 95% bootstrap interval. Also recorded: how many attention calls
ran on ptxattn's kernels and its fallbacks (a fallback would time torch: none expected), the
host time of the attention function's calls that ran on them (the whole call: translation,
plan lookup, launches; varlen, and with transformers 5.17 also the decode steps on its
pages; until 2026-12-02 this field timed the kernels' seam alone), whether the greedy tokens agree between the backends (random weights: near-ties
may flip a token; informational), the transformers and torch versions. --eager adds "paged|eager" (slow: it materializes the scores).

Writes cb-bench[-tiny]-<date>.json into --out (or $OUT, or bench/results/models/) and prints
one summary line, with the elapsed time of each phase. On the H200 the default run (model
build, warm-up, 3 rounds of both backends) takes about 2-3 minutes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bookkeeping import commit  # noqa: E402  (beside this script)

# the published Llama-3-8B config (meta-llama/Meta-Llama-3-8B config.json)
LLAMA_3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=128, hidden_act="silu", max_position_embeddings=8192,
                  rms_norm_eps=1e-5, rope_theta=500000.0, attention_bias=False,
                  tie_word_embeddings=False)
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            max_position_embeddings=512)
BLOCK = 256


def sdpa_name() -> str:
    """transformers' own SDPA implementation for continuous batching ("paged|sdpa" up to
    5.22, "sdpa" since)."""
    from transformers import AttentionInterface
    return "paged|sdpa" if "paged|sdpa" in AttentionInterface._global_mapping else "sdpa"


def prompt_lengths(args) -> list[int]:
    import numpy as np
    rng = np.random.default_rng(args.seed)
    lo, hi = (4, 48) if args.tiny else (args.min_prompt, args.max_prompt)
    return [int(n) for n in rng.integers(lo, hi + 1, size=args.requests)]


def build_model(torch, transformers, args):
    cfg = dict(TINY if args.tiny else LLAMA_3_8B)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    torch.manual_seed(0)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)          # built in bf16: no fp32 copy of 8B
    try:
        with torch.device(args.device):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    finally:
        torch.set_default_dtype(dtype)
    return model.eval(), cfg


def cb_config(transformers, args, lengths):
    pages = sum(-(-(n + args.new_tokens) // BLOCK) for n in lengths)
    return transformers.ContinuousBatchingConfig(block_size=BLOCK, num_blocks=pages + 8,
                                                 max_batch_tokens=args.batch_tokens,
                                                 use_cuda_graph=False)


def percentile(values, p: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * p
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class Runner:
    """One model; run(impl) generates the batch with one attention implementation."""

    def __init__(self, torch, transformers, args, prompts):
        self.torch, self.transformers, self.args, self.prompts = torch, transformers, args, prompts
        t0 = time.perf_counter()
        self.model, self.config = build_model(torch, transformers, args)
        self.sync()
        self.build_s = time.perf_counter() - t0
        self.lengths = [len(p) for p in prompts]

    def sync(self):
        if self.args.device.startswith("cuda"):
            self.torch.cuda.synchronize()

    def run(self, impl: str, prompts=None, new_tokens=None) -> dict:
        from transformers import GenerationConfig
        prompts = self.prompts if prompts is None else prompts
        new = self.args.new_tokens if new_tokens is None else new_tokens
        self.model.set_attn_implementation(impl)
        gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        self.sync()
        t0 = time.perf_counter()
        out = self.model.generate_batch(
            prompts, generation_config=gen,
            continuous_batching_config=cb_config(self.transformers, self.args,
                                                 [len(p) for p in prompts]),
            record_timestamps=True, warmup=False)
        self.sync()
        wall = time.perf_counter() - t0
        results = list(out.values())
        failed = [r.request_id for r in results if r.error is not None]
        if len(results) != len(prompts) or failed:
            raise RuntimeError(f"{impl}: {len(results)} of {len(prompts)} requests came back, "
                               f"failed: {failed[:4]}")
        generated = sum(len(r.generated_tokens) for r in results)
        start = min(r.created_time for r in results)
        end = max(r.lifespan[1] for r in results)
        ttft = [r.timestamps[0] - r.created_time for r in results if r.timestamps]
        return dict(tokens=[list(r.generated_tokens) for r in results], generated=generated,
                    tokens_per_s=generated / (end - start), span_s=end - start, wall_s=wall,
                    ttft_median_s=statistics.median(ttft), ttft_p90_s=percentile(ttft, 0.9))


class HostTimer:
    """Times the attention function's calls on the host while active (the GPU is not waited
    for), by the kernel each ran on: translation, plan lookup and launches, what a layer's
    call costs transformers. The function is wrapped where transformers finds it: the
    module attribute transformers_backend calls (5.24 runs "ptxattn") and the registry's
    "paged|ptxattn" entry (5.17 calls it directly). A call is a kernel's when it counted one
    (packed_call_counts); fallbacks are not timed."""

    KINDS = ("varlen", "paged")

    def __init__(self, tp):
        self.tp = tp
        self.spent = {kind: [] for kind in self.KINDS}

    def __enter__(self):
        from transformers import AttentionInterface

        from ptxattn.torch import sdpa
        self.mapping = AttentionInterface._global_mapping
        self.original = self.tp.paged_attention_forward
        self.registered = self.mapping.get(self.tp.NAME)
        packed, spent, original = sdpa._packed, self.spent, self.original

        def timed(*args, **kwargs):
            before = packed["varlen"], packed["paged"]
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            dt = time.perf_counter() - t0
            if packed["varlen"] != before[0]:
                spent["varlen"].append(dt)
            elif packed["paged"] != before[1]:
                spent["paged"].append(dt)
            return out
        self.tp.paged_attention_forward = timed
        if self.registered is original:
            self.mapping[self.tp.NAME] = timed
        return self.spent

    def __exit__(self, *exc):
        self.tp.paged_attention_forward = self.original
        if self.registered is self.original:
            self.mapping[self.tp.NAME] = self.original


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=0, help="reduce depth (0: the published 32)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=0, help="new tokens a request (64)")
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--batch-tokens", type=int, default=0, help="tokens a batch (4096)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="the prompt lengths' and tokens' seed")
    ap.add_argument("--eager", action="store_true", help='also time "paged|eager"')
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny config (the CPU plumbing test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.new_tokens = args.new_tokens or (4 if args.tiny else 64)
    args.batch_tokens = args.batch_tokens or (256 if args.tiny else 4096)
    if args.rounds < 1 or args.requests < 1 or args.new_tokens < 1:
        ap.error("--rounds, --requests, --new-tokens: expected >= 1")
    if not 1 <= args.min_prompt <= args.max_prompt:
        ap.error("--min-prompt, --max-prompt: expected 1 <= min <= max")
    t_start = time.perf_counter()
    import numpy as np
    import torch
    import transformers

    import ptxattn.torch as pt
    from ptxattn.tools.bench import bootstrap_ci
    from ptxattn.torch import transformers_paged as tp
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA GPU (--tiny --device cpu for the plumbing)")
    pt.register_transformers()
    lengths = prompt_lengths(args)
    rng = np.random.default_rng(args.seed + 1)
    cfg_vocab = (TINY if args.tiny else LLAMA_3_8B)["vocab_size"]
    prompts = [rng.integers(0, cfg_vocab, size=n).tolist() for n in lengths]
    runner = Runner(torch, transformers, args, prompts)
    depth = runner.config["num_hidden_layers"]
    print(f"Llama-3-8B architecture{' (tiny)' if args.tiny else ''}: {depth} layers"
          f"{' (reduced by --layers)' if args.layers else ''}, {args.requests} requests of "
          f"{min(lengths)}..{max(lengths)} prompt tokens (mean {statistics.mean(lengths):.0f}), "
          f"{args.new_tokens} new tokens each, transformers {transformers.__version__}; "
          f"model built in {runner.build_s:.1f} s", flush=True)
    sdpa = sdpa_name()
    impls = ["paged|ptxattn", sdpa] + (["paged|eager"] if args.eager else [])

    t0 = time.perf_counter()                       # warm-up: JIT, allocator, cuBLAS choices
    warm = prompts[:8]
    for impl in impls:
        runner.run(impl, warm, new_tokens=2)
    warmup_s = time.perf_counter() - t0
    print(f"warm-up {warmup_s:.1f} s", flush=True)

    pt.reset_fallback_counts()
    runs = {impl: [] for impl in impls}
    with HostTimer(tp) as host:
        for r in range(args.rounds):
            order = impls if r % 2 == 0 else impls[::-1]
            for impl in order:
                res = runner.run(impl)
                runs[impl].append(res)
                print(f"round {r} {impl:>14}: {res['tokens_per_s']:8.1f} tokens/s, TTFT "
                      f"median {res['ttft_median_s'] * 1e3:.0f} ms p90 "
                      f"{res['ttft_p90_s'] * 1e3:.0f} ms, {res['wall_s']:.1f} s", flush=True)
    fallbacks, kernel_calls = pt.fallback_counts(), pt.packed_call_counts()

    summary = {}
    for impl, rs in runs.items():
        summary[impl] = {k: statistics.median(x[k] for x in rs) for k in (
            "tokens_per_s", "ttft_median_s", "ttft_p90_s", "span_s", "wall_s")}
        summary[impl]["rounds"] = [{k: v for k, v in x.items() if k != "tokens"} for x in rs]
    ratios = [a["tokens_per_s"] / b["tokens_per_s"]
              for a, b in zip(runs["paged|ptxattn"], runs[sdpa])]
    ttft_ratios = [b["ttft_median_s"] / a["ttft_median_s"]
                   for a, b in zip(runs["paged|ptxattn"], runs[sdpa])]
    ours, theirs = runs["paged|ptxattn"][0]["tokens"], runs[sdpa][0]["tokens"]
    same = sum(a == b for a, b in zip(ours, theirs))
    report = {
        "what": "transformers continuous batching, generate_batch, paged|ptxattn vs " + sdpa,
        "config": runner.config, "layers": depth, "layers_reduced": bool(args.layers),
        "tiny": args.tiny, "args": vars(args), "prompt_lengths": lengths,
        "prompt_distribution": f"uniform integers [{args.min_prompt}, {args.max_prompt}], "
                               f"numpy default_rng({args.seed})" if not args.tiny else
                               "tiny: uniform [4, 48]",
        "cb_config": dict(block_size=BLOCK, num_blocks=cb_config(transformers, args, lengths)
                          .num_blocks, max_batch_tokens=args.batch_tokens, use_cuda_graph=False,
                          transformers_warmup=False),
        "results": summary,
        "speedup_tokens_per_s": {"median": statistics.median(ratios),
                                 "ci95": list(bootstrap_ci(ratios)), "rounds": len(ratios)},
        "ttft_median_speedup": {"median": statistics.median(ttft_ratios),
                                "ci95": list(bootstrap_ci(ttft_ratios))},
        "identical_requests": {"count": same, "of": len(ours)},
        "ptxattn_kernel_calls": kernel_calls, "ptxattn_fallbacks": fallbacks,
        "ptxattn_host_us": {kind: {"median": statistics.median(t) * 1e6 if t else None,
                                   "calls": len(t)} for kind, t in host.items()},
        "elapsed_s": {"build": runner.build_s, "warmup": warmup_s,
                      "total": time.perf_counter() - t_start},
        "transformers": transformers.__version__, "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "commit": commit(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    out_dir = Path(args.out or os.environ.get("OUT")
                   or Path(__file__).resolve().parents[1] / "results" / "models")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"cb-bench{'-tiny' if args.tiny else ''}-{datetime.date.today()}.json"
    path.write_text(json.dumps(report, indent=1))
    s, o = summary[sdpa], summary["paged|ptxattn"]
    sp = report["speedup_tokens_per_s"]
    print(f"cb_bench: transformers {transformers.__version__}, {depth} layers, "
          f"{args.requests} requests: paged|ptxattn {o['tokens_per_s']:.0f} tokens/s vs {sdpa} "
          f"{s['tokens_per_s']:.0f} = {sp['median']:.2f}x [{sp['ci95'][0]:.2f}, "
          f"{sp['ci95'][1]:.2f}]; TTFT median {o['ttft_median_s'] * 1e3:.0f} vs "
          f"{s['ttft_median_s'] * 1e3:.0f} ms, p90 {o['ttft_p90_s'] * 1e3:.0f} vs "
          f"{s['ttft_p90_s'] * 1e3:.0f} ms; {same}/{len(ours)} requests identical; kernel "
          f"calls {kernel_calls}, fallbacks {fallbacks or 'none'}; "
          f"{report['elapsed_s']['total']:.0f} s in all; wrote {path}")
    return 0 if not fallbacks and kernel_calls.get("varlen") else 1



if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Where a decode step of transformers' generate() spends its time, ptxattn against SDPA's
flash backend, at full depth: the question generate_bench.py left open (ours 0.64-0.74x
flash's decode with the dynamic cache, while the attention calls alone are level).

    python bench/experiments/generate_profile.py --batch 1            # H200, ~1.5 min
    python bench/experiments/generate_profile.py --batch 8 --no-static

Per implementation, from one prefilled cache (cuDNN's prefill, copied for every run, as
generate_bench does), with the dynamic cache:
- steps: a timed generate() of --tokens tokens, the step times from a streamer (median, p90);
  the same with Python's garbage collector off (gc.disable()) and the collections counted
  with it on (a collector pass over a model's objects is milliseconds);
- host: the same generate() under cProfile, the top entries by own time and by cumulative
  time under the attention function (what the host does per step, per layer);
- GPU: a generate() of 4 tokens under torch.profiler: per step the wall time, the time the
  GPU ran kernels (the union of their intervals: idle GPU means a host-bound step), and the
  runtime API calls that block or allocate (synchronize, malloc, free, memcpy) per step.
With --static (default on) the compiled static-cache path too (transformers compiles the
decode forward): the steps, and dynamo's graph-break and recompile counters after its
warm-up (a graph break inside the attention function compiles every layer as its own frame;
past torch._dynamo's recompile limit the rest run eager).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
import generate_bench as gb        # noqa: E402  (the model, caches and runs of the benchmark)

BLOCKING = ("Synchronize", "Malloc", "Free", "Memcpy", "memcpy", "EventQuery", "Memset")


def step_figures(times) -> dict:
    steps = [b - a for a, b in zip(times[1:], times[2:])]      # decode steps (after the 1st)
    steps.sort()
    return {"median_ms": 1e3 * statistics.median(steps),
            "p90_ms": 1e3 * steps[int(0.9 * (len(steps) - 1))], "steps": len(steps)}


def timed(run, tokens: int) -> dict:
    streamer = gb.streamer_class()()
    run.generate(tokens, streamer)
    return step_figures(streamer.times)


def gc_counted(run, tokens: int) -> dict:
    seen = {"collections": 0, "s": 0.0, "gen2": 0}
    start = {}

    def callback(phase, info):
        if phase == "start":
            start["t"] = time.perf_counter()
        else:
            seen["collections"] += 1
            seen["gen2"] += info.get("generation") == 2
            seen["s"] += time.perf_counter() - start.get("t", time.perf_counter())
    gc.callbacks.append(callback)
    try:
        rec = timed(run, tokens)
    finally:
        gc.callbacks.remove(callback)
    rec.update(gc_collections=seen["collections"], gc_gen2=seen["gen2"],
               gc_ms_per_step=1e3 * seen["s"] / max(rec["steps"] + 1, 1))
    gc.disable()
    try:
        rec["gc_off"] = timed(run, tokens)
    finally:
        gc.enable()
    return rec


def host_profile(run, tokens: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    run.generate(tokens)
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    text.write(f"-- own time, {tokens} tokens\n")
    stats.sort_stats("tottime").print_stats(top)
    text.write("-- cumulative, attention and ptxattn entries\n")
    stats.sort_stats("cumtime").print_stats(r"attention|ptxattn|kvcache|decode|mask", top)
    return text.getvalue()


def gpu_profile(torch, run, tokens: int = 4) -> dict:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        run.generate(tokens)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    intervals, calls = [], {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            intervals.append((evt.time_range.start, evt.time_range.end))
        elif any(w in evt.name for w in BLOCKING) and evt.name.startswith("cu"):
            calls[evt.name] = calls.get(evt.name, 0) + 1
    intervals.sort()
    busy, end = 0.0, float("-inf")
    for a, b in intervals:                       # the union of kernel intervals (us)
        if b > end:
            busy += b - max(a, end)
            end = b
    return {"wall_ms_per_forward": 1e3 * wall / tokens, "gpu_busy_ms_per_forward":
            busy / 1e3 / tokens, "kernels_per_forward": len(intervals) / tokens,
            "blocking_calls_per_forward": {k: v / tokens for k, v in sorted(calls.items())}}


def dynamo_counters(torch) -> dict:
    from torch._dynamo.utils import counters
    out = {}
    for key in ("graph_break", "recompiles", "frames", "stats"):
        if counters.get(key):
            out[key] = {str(k)[:160]: v for k, v in counters[key].items()}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=0, help="0: the published 32")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--impls", default="ptxattn,flash")
    ap.add_argument("--no-static", dest="static", action="store_false")
    ap.add_argument("--top", type=int, default=22)
    ap.add_argument("--tiny", action="store_true", help="CPU plumbing check: a tiny model")
    args = ap.parse_args(argv)
    import torch
    import transformers
    import ptxattn.torch as pt
    pt.register_transformers()
    dev = "cpu" if args.tiny else "cuda"
    args.device, args.static_eager, args.new_tokens = dev, False, args.tokens
    if args.tiny:
        args.context, args.impls = min(args.context, 64), args.impls.replace("flash", "math")
    model = gb.build_model(torch, transformers, gb.llama_config(args), dev, 0)
    layers = model.config.num_hidden_layers
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, args.context),
                           device=dev, generator=torch.Generator(dev).manual_seed(1))
    ref = "math" if args.tiny else "cudnn"
    gb.use(model, ref)
    with gb.backend_flags(torch, ref):
        cache, seconds, _ = gb.prefill(torch, model, prompt, dev)
    kept = gb.kv_of(cache)
    del cache
    print(f"== batch {args.batch}, {layers} layers, context {args.context}: prefill "
          f"{seconds:.2f} s", flush=True)
    max_len = -(-(args.context + args.tokens + 8) // 64) * 64
    for kind in ("dynamic", "static") if args.static else ("dynamic",):
        for impl in args.impls.split(","):
            run = gb.DecodeRun(torch, model, prompt, kept, kind, impl, args, max_len)
            gb.use(model, impl)
            pt.reset_fallback_counts()
            if run.compiled:
                torch._dynamo.reset()
                torch._dynamo.utils.counters.clear()
                if hasattr(model, "_compiled_call"):
                    del model._compiled_call
            with gb.backend_flags(torch, impl):
                t0 = time.perf_counter()
                run.generate(gb.WARMUP_TOKENS[kind])
                warm = time.perf_counter() - t0
                print(f"\n== {kind} {impl}: warm-up {warm:.1f} s", flush=True)
                if run.compiled:
                    print(f"   dynamo after warm-up: {dynamo_counters(torch)}", flush=True)
                rec = gc_counted(run, args.tokens)
                print(f"   steps: {rec}", flush=True)
                if not args.tiny:
                    print(f"   gpu: {gpu_profile(torch, run)}", flush=True)
                if not run.compiled:
                    print(host_profile(run, 6, args.top), flush=True)
            print(f"   fallbacks: {pt.fallback_counts()}", flush=True)
            if run.compiled:
                torch._dynamo.reset()
            del run
            gb._free(torch, dev)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""transformers generate() on a Llama-architecture model: attn_implementation="ptxattn" against
"sdpa" under each of torch's SDPA backends, at a long context (the decode end-to-end target).

    python bench/models/generate_bench.py --out bench/results/models    # H200: ~4 min (below)
    python bench/models/generate_bench.py --batches 8 --caches dynamic --out /tmp/g
    python bench/models/generate_bench.py --tiny --out /tmp/g           # CPU plumbing only

The model: the published Llama-3.1-8B configuration (capstone.LLAMA_3_1_8B: Llama-3-8B's
architecture, GQA 32:8, head dim 128, with the llama3 RoPE scaling that puts 32k positions in
range) with seeded random weights in bf16; --layers reduces the depth (the JSON and the
printout say so). Prompt: `--context` random tokens (32768) per sequence, batch 8 and 1,
`--new-tokens` greedy tokens (128).

What runs, per batch size, all in one process:
1. The attention calls alone, at the model's exact shapes and layouts, through the attention
   functions transformers calls (ptxattn's and transformers' "sdpa" under each backend): the
   prefill call, a dynamic-cache decode call and a static-cache decode call (the whole cache
   and its materialized mask). Which backend takes which call (a backend that refuses raises,
   see ptxattn.tools.bench.restrict_sdpa), their times, and the warm-up of every kernel (JIT,
   cuDNN plans) before anything is timed.
2. Prefill: one forward of the model over the prompt but its last token into a DynamicCache,
   for ptxattn and each SDPA backend (own kernels, timed once each), with the last position's
   logits compared. The cache of one of them (the reference: cuDNN where it takes the call)
   is kept; every decode run below starts from a copy of that same cache. That is fair (a
   decode step reads the same bytes whoever wrote them) and makes the greedy tokens
   comparable: they then differ only through the decode steps.
3. Decode: generate(prompt, cache=<the copy>, max_new_tokens) for each backend that takes
   the decode call: its first forward is the prompt's last token, so all its forwards are
   decode steps. Dynamic cache: eager (transformers' default). Static cache
   (a StaticCache filled from the same prefill): transformers compiles the decode forward
   (torch.compile, mode reduce-overhead: CUDA graphs), for ptxattn and for SDPA's fastest
   backend on the static call of part 1 (--static-sdpa all: every backend that takes it).
   Each run: a warm-up generate (compile, graph recording), a probe generate of 3 tokens
   under torch.profiler (kernel names and launches per step), then the timed generate, its
   tokens timestamped by a streamer as they reach the host (generate syncs every step).
   ptxattn's decode steps must all have run on its decode kernel: no fallback counted
   (ptxattn.torch.fallback_counts), `layers` launches of ptxattn_decode per forward in the
   probe and no forward-kernel or torch attention kernel, and (eager runs) `layers` calls of
   the decode entry per forward. If that is not shown, the script says what it saw and
   prints no speedup for that case.

Figures: prefill seconds; decode tokens/s = batch x (new - 1) / (time from the first new
token to the last), i.e. decode steps only; generate seconds; end-to-end tokens/s = batch x
new / (that backend's prefill + its generate). Speedups are against SDPA's best backend for
that figure (each measured). Greedy tokens: per pair of runs the first new-token index where
they differ (per sequence, and the smallest), SDPA's backends against each other beside ours
against each: the yardstick. One run per figure (a 32k prefill at batch 8 takes seconds), not
DESIGN.md's rounds: step times are given with their spread.

Device time (H200, full depth, estimates): model ~10 s; batch 8: calls ~5 s, prefills ~35 s
(cuDNN, flash, ptxattn ~10-13 s each; efficient refuses GQA), dynamic decode ~6 s a backend
(transformers' DynamicCache copies the whole cache every step), static ~40-60 s a backend
(the compile) + ~2 s; batch 1 ~1/8 of that, its compiles as long. --budget-s (240) bounds
it: a static-cache run that would end past the budget (guessed from the compiles seen so
far) is skipped and says so, most likely the batch-1 pair at full depth; --budget-s 420 runs
everything (~5-6 minutes), or run it alone: --batches 1 --caches static (~2-3 minutes).
Memory at batch 8: 16 GB of weights, 34 GB for the kept cache, 34 GB for a run's copy, ~35 GB
of prefill activations.
Writes generate-<date>.json (generate-tiny-... for --tiny) into --out, $OUT, or
bench/results/models/; exit status 0 when every ptxattn run was verified.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            max_position_embeddings=512)
SDPA_ON = {"cuda": ("cudnn", "flash", "efficient"), "cpu": ("math", "flash")}
REFERENCE_PREFILL = ("cudnn", "flash", "math", "efficient", "ptxattn")   # whose cache is kept
DECODE_KERNEL, COMBINE_KERNEL, FORWARD_KERNEL = "ptxattn_decode", "ptxattn_combine", "ptxattn_fwd"
# words in the names of torch's attention kernels (flash, cutlass fmha, cuDNN's sdpa, math)
TORCH_ATTENTION_WORDS = ("flash", "fmha", "sdpa", "attention", "softmax", "cudnn")
# inductor names a fused kernel after the ops of its nodes, so a pointwise kernel feeding or
# reading ptxattn's decode op carries the op's name: such a kernel is not a torch attention
OUR_OP_WORDS = ("ptxattn", "kvcache_attention", "flash_attn_with_kvcache")
WARMUP_TOKENS = {"dynamic": 2, "static": 4}    # static: compile, graph warm-up, record, replay
PROBE_TOKENS = 3
STATIC_ESTIMATE_S = 60.0      # a static run's compile before one has been seen (full depth)


# --------------------------------------------------------------------------- the model

def llama_config(args) -> dict:
    from capstone import LLAMA_3_1_8B           # the published config, beside this script
    cfg = dict(TINY) if args.tiny else dict(LLAMA_3_1_8B)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    return cfg


def build_model(torch, transformers, cfg: dict, device: str, seed: int):
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **cfg, attn_implementation="sdpa"))
    model = model.to(device, torch.bfloat16).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None     # always `new` tokens
    return model


def cache_kwarg(model) -> str:
    """The name transformers gives the cache argument ("cache" from 5.2x, "past_key_values"
    before)."""
    import inspect
    return "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"


def use(model, impl: str) -> None:
    model.set_attn_implementation("ptxattn" if impl == "ptxattn" else "sdpa")


@contextmanager
def backend_flags(torch, impl: str):
    """SDPA restricted to `impl` for an SDPA run; every backend (torch's own choice, which is
    where a ptxattn fallback would go) for ptxattn and for "sdpa"."""
    from ptxattn.tools.bench import restrict_sdpa
    restore = restrict_sdpa(torch, None if impl in ("ptxattn", "sdpa") else impl)
    try:
        yield
    finally:
        restore()


def sync(torch, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- caches

def kv_of(cache) -> list:
    return [(layer.keys, layer.values) for layer in cache.layers]


def dynamic_copy(kv):
    """A DynamicCache holding copies of `kv` (its first update copies: the kept cache is
    never touched)."""
    from transformers import DynamicCache
    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    return cache


def static_copy(config, kv, max_len: int):
    from transformers import StaticCache
    cache = StaticCache(config=config, max_cache_len=max_len)
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    return cache


def rewind_static(cache, length: int) -> None:
    """Back to `length` cached positions, in place (the graphs keep the same addresses). What
    a generate wrote past it is overwritten before anything reads it: the mask and the
    decode kernel's lengths only reach the positions written so far."""
    for layer in cache.layers:
        if not hasattr(layer, "cumulative_length"):
            raise RuntimeError(f"{type(layer).__name__}: no cumulative_length (this "
                               "transformers' static layer keeps its length elsewhere)")
        layer.cumulative_length.fill_(length)


# --------------------------------------------------------------------------- measuring

class Timeline:
    """A generate() streamer: the host time at which each put() arrives (first the prompt,
    then each new token, after generate's per-step sync) and the tokens."""

    def __init__(self):
        self.times, self.tokens = [], []

    def put(self, value):
        self.times.append(time.perf_counter())
        self.tokens.append(value)

    def end(self):
        pass


def streamer_class():
    from transformers.generation.streamers import BaseStreamer

    class Streamer(Timeline, BaseStreamer):
        pass
    return Streamer


def kernel_counts(torch, device: str, fn):
    """fn() under torch.profiler: (its result, {kernel name: launches}); None for the counts
    off CUDA (or when the profiler saw no kernel)."""
    if not device.startswith("cuda"):
        return fn(), None
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    counts = collections.Counter()
    events = prof.events()
    for evt in events:
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            counts[evt.name] += 1
    if not counts:                      # profilers that hang kernels under their CPU op
        for evt in events:
            for k in getattr(evt, "kernels", ()) or ():
                counts[k.name] += 1
    return result, (dict(counts) or None)


@contextmanager
def counting_decode_calls():
    """Counts the library's decode entry (ptxattn.decode.flash_attn_with_kvcache) by query
    length: it runs in eager calls and wherever a compiled graph's op body runs (the graph's
    warm-up and recording, not its replays). ptxattn.torch looks it up at call time and a
    compiled graph never traces it, so wrapping it changes nothing a graph guards on. When
    the torch-level call has been replaced (the CPU tests' torch reference), that is counted
    instead."""
    from ptxattn import decode
    from ptxattn.torch import kvcache
    seen = []
    real_lib, real_torch = decode.flash_attn_with_kvcache, kvcache.flash_attn_with_kvcache
    replaced = getattr(real_torch, "__module__", None) != kvcache.__name__

    def counted(real):
        def call(q, *a, **kw):
            seen.append(int(q.shape[1]))
            return real(q, *a, **kw)
        return call
    decode.flash_attn_with_kvcache = counted(real_lib)
    if replaced:
        kvcache.flash_attn_with_kvcache = counted(real_torch)
    try:
        yield seen
    finally:
        decode.flash_attn_with_kvcache = real_lib
        kvcache.flash_attn_with_kvcache = real_torch


def timed_call(torch, device: str, fn, warmup: int, reps: int) -> list[float]:
    """ms of each of `reps` calls of fn after `warmup` (CUDA events on the GPU)."""
    for _ in range(warmup):
        fn()
    sync(torch, device)
    out = []
    for _ in range(reps):
        if device.startswith("cuda"):
            start, stop = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            out.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def spread(values) -> dict:
    v = sorted(values)
    if not v:
        return {}
    q = lambda f: v[min(len(v) - 1, int(f * (len(v) - 1) + 0.5))]   # noqa: E731
    return {"median": statistics.median(v), "mean": statistics.fmean(v), "p10": q(0.1),
            "p90": q(0.9), "min": v[0], "max": v[-1], "n": len(v)}


# --------------------------------------------------------------------------- attention calls

def attention_inputs(torch, model, batch: int, context: int, max_len: int, device: str,
                     seed: int) -> dict:
    """The three calls of a generate at these sizes, as transformers makes them: q a
    (B, H, S, D) view of (B, S, H, D) projections, keys and values (B, Hkv, L, D) contiguous
    (what the caches hold); the static call with the mask generate builds for it."""
    from ptxattn.torch import transformers_backend as tb
    cfg = model.config
    h, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16)
    past = context - 1
    q_decode = rand(batch, 1, h, d).transpose(1, 2)
    mask = tb.ptxattn_mask(batch_size=batch, q_length=1, kv_length=max_len, q_offset=past,
                           attention_mask=torch.ones(batch, context, dtype=torch.bool,
                                                     device=device), device=device)
    return {
        "prefill": (rand(batch, past, h, d).transpose(1, 2), rand(batch, hkv, past, d),
                    rand(batch, hkv, past, d), None),
        "decode_dynamic": (q_decode, rand(batch, hkv, context, d), rand(batch, hkv, context, d),
                           None),
        "decode_static": (q_decode, rand(batch, hkv, max_len, d), rand(batch, hkv, max_len, d),
                          mask),
    }


def attention_calls(torch, model, impls, inputs: dict, device: str) -> dict:
    """{call: {impl: {"ms": spread, or "error"}, with ptxattn's fallbacks}} of each call
    through the function transformers would call for it (layer 0's attention module)."""
    import ptxattn.torch as pt
    from ptxattn.torch import transformers_backend as tb
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    module = model.model.layers[0].self_attn
    out = {}
    for call, (q, k, v, mask) in inputs.items():
        out[call] = {}
        reps = (1, 2) if call == "prefill" else (3, 10)
        for impl in impls:
            fn = tb.ptxattn_attention_forward if impl == "ptxattn" else sdpa_attention_forward
            pt.reset_fallback_counts()
            try:
                with backend_flags(torch, impl), torch.no_grad():
                    ms = timed_call(torch, device, lambda: fn(module, q, k, v, mask,
                                                              scaling=module.scaling),
                                    *reps)
                row = {"ms": spread(ms)}
            except Exception as exc:                    # noqa: BLE001 (a refusal)
                row = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:240]}"}
            if impl == "ptxattn":
                row["fallbacks"] = pt.fallback_counts()
            out[call][impl] = row
    pt.reset_fallback_counts()
    return out


def takes(calls: dict, call: str, impl: str) -> bool:
    return "error" not in calls[call][impl]


# --------------------------------------------------------------------------- prefill

def prefill(torch, model, prompt, device: str):
    """The prompt but its last token into a DynamicCache: (cache, seconds, last logits)."""
    from transformers import DynamicCache
    cache = DynamicCache()
    sync(torch, device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model(input_ids=prompt[:, :-1], use_cache=True, logits_to_keep=1,
                    **{cache_kwarg(model): cache})
    sync(torch, device)
    seconds = time.perf_counter() - t0
    return cache, seconds, out.logits[:, -1].float()


def rel_l2(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# --------------------------------------------------------------------------- decode runs

class DecodeRun:
    """One (cache kind, implementation) decode run from the kept prefill."""

    def __init__(self, torch, model, prompt, kv, kind: str, impl: str, args, max_len: int):
        self.torch, self.model, self.prompt, self.kv = torch, model, prompt, kv
        self.kind, self.impl, self.args, self.max_len = kind, impl, args, max_len
        self.device = args.device
        self.compiled = kind == "static" and args.device.startswith("cuda") \
            and not args.static_eager
        self.past = prompt.shape[1] - 1
        self.static = None

    def cache(self):
        if self.kind == "dynamic":
            return dynamic_copy(self.kv)
        if self.static is None:
            self.static = static_copy(self.model.config, self.kv, self.max_len)
        else:
            rewind_static(self.static, self.past)
        return self.static

    def generate(self, new: int, streamer=None):
        torch = self.torch
        kwargs = dict(input_ids=self.prompt, attention_mask=torch.ones_like(self.prompt),
                      max_new_tokens=new, do_sample=False, streamer=streamer,
                      **{cache_kwarg(self.model): self.cache()})
        if self.kind == "static" and not self.compiled:
            kwargs["disable_compile"] = True
        sync(torch, self.device)
        t0 = time.perf_counter()
        out = self.model.generate(**kwargs)
        sync(torch, self.device)
        return out[:, self.prompt.shape[1]:], t0, time.perf_counter()

    def run(self) -> dict:
        """warm-up, probe, timed run: the record (tokens as a list of rows)."""
        import ptxattn.torch as pt
        torch, layers = self.torch, self.model.config.num_hidden_layers
        use(self.model, self.impl)
        if self.compiled:
            torch._dynamo.reset()
            if hasattr(self.model, "_compiled_call"):
                del self.model._compiled_call
        rec = {"cache": self.kind, "impl": self.impl, "compiled": self.compiled}
        pt.reset_fallback_counts()
        with backend_flags(torch, self.impl):
            with counting_decode_calls() as warm_calls:
                _, t0, t1 = self.generate(WARMUP_TOKENS[self.kind])
            rec["warmup_s"] = t1 - t0
            if self.compiled:        # the graph's op body runs in its warm-up and recording
                rec["warmup_decode_calls"] = len(warm_calls)
            with counting_decode_calls() as probe_calls:
                _, kernels = kernel_counts(torch, self.device,
                                           lambda: self.generate(PROBE_TOKENS))
            rec["probe"] = probe_record(kernels, probe_calls, layers, PROBE_TOKENS,
                                        self.compiled)
            streamer = streamer_class()()
            tokens, t0, t1 = self.generate(self.args.new_tokens, streamer)
        rec["fallbacks"] = pt.fallback_counts()
        rec.update(decode_figures(t0, t1, streamer.times, self.prompt.shape[0],
                                  self.args.new_tokens))
        rec["tokens"] = tokens.tolist()
        if self.impl == "ptxattn":
            rec["verified"], rec["why_not"] = verdict(rec, layers)
        if self.compiled:
            torch._dynamo.reset()
        self.static = None
        return rec


def probe_record(kernels, calls, layers: int, forwards: int, compiled: bool) -> dict:
    rec = {"forwards": forwards, "layers": layers, "decode_calls": len(calls),
           "decode_call_query_lengths": sorted(set(calls)), "kernels_seen": kernels is not None}
    if kernels is not None:
        rec["decode_kernels"] = kernels.get(DECODE_KERNEL, 0)
        rec["combine_kernels"] = kernels.get(COMBINE_KERNEL, 0)
        rec["forward_kernels"] = sum(n for k, n in kernels.items()
                                     if k.startswith(FORWARD_KERNEL))
        rec["torch_attention_kernels"] = {
            k: n for k, n in kernels.items() if not any(w in k.lower() for w in OUR_OP_WORDS)
            and any(w in k.lower() for w in TORCH_ATTENTION_WORDS)}
    return rec


def verdict(rec: dict, layers: int) -> tuple[bool, str]:
    """Did every decode step of this ptxattn run take the decode kernel? (bool, why not)."""
    p = rec["probe"]
    want = layers * p["forwards"]
    if rec["fallbacks"]:
        return False, f"fallbacks counted: {rec['fallbacks']}"
    if p["kernels_seen"]:
        if p["decode_kernels"] != want:
            hint = ""
            if rec["compiled"] and p["decode_kernels"] == layers:
                hint = (" (as many as its one eager forward launches: this profiler may not "
                        "see the kernels of CUDA-graph replays)")
            return False, (f"probe: {p['decode_kernels']} {DECODE_KERNEL} launches for "
                           f"{p['forwards']} forwards x {layers} layers = {want}{hint}")
        if p["forward_kernels"] or p["torch_attention_kernels"]:
            return False, (f"probe: forward-kernel launches {p['forward_kernels']}, torch "
                           f"attention kernels {p['torch_attention_kernels']}")
        return True, ""
    if rec["compiled"]:
        return False, "no kernels seen by the profiler, and a compiled run's replays run no Python"
    if p["decode_calls"] != want or p["decode_call_query_lengths"] != [1]:
        return False, (f"probe: {p['decode_calls']} decode calls (query lengths "
                       f"{p['decode_call_query_lengths']}) for {want} decode steps x layers")
    return True, ""


def decode_figures(t_start: float, t_end: float, times: list, batch: int, new: int) -> dict:
    """times: the streamer's (prompt, then each new token)."""
    token_times = times[1:]
    if len(token_times) != new:
        raise RuntimeError(f"the streamer saw {len(token_times)} new tokens, expected {new}")
    steps = [1e3 * (b - a) for a, b in zip(token_times, token_times[1:])]
    span = token_times[-1] - token_times[0]
    return {"generate_s": t_end - t_start, "first_token_s": token_times[0] - t_start,
            "step_ms": spread(steps),
            "decode_tok_s": batch * (new - 1) / span if span > 0 else None,
            "decode_tok_s_per_sequence": (new - 1) / span if span > 0 else None}


# --------------------------------------------------------------------------- comparing

def first_difference(a: list, b: list) -> dict:
    """Per sequence the first new-token index where the rows differ (None: never)."""
    rows = [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), None)
            for ra, rb in zip(a, b)]
    found = [r for r in rows if r is not None]
    return {"first": min(found) if found else None, "rows": rows, "tokens": len(a[0])}


def pairs_of(runs: dict) -> dict:
    """First differences between every two runs (ptxattn first in a pair)."""
    names = sorted(runs, key=lambda n: (n != "ptxattn", n))
    return {f"{a}~{b}": first_difference(runs[a]["tokens"], runs[b]["tokens"])
            for i, a in enumerate(names) for b in names[i + 1:]}


def speedups(runs: dict, prefill_s: dict) -> dict:
    """ours / SDPA's best, decode tokens/s and end to end, when ptxattn's run is verified."""
    ours = runs.get("ptxattn")
    sdpa = {n: r for n, r in runs.items() if n != "ptxattn" and r.get("decode_tok_s")}
    for r in runs.values():
        if r.get("decode_tok_s") and r["impl"] in prefill_s:
            r["e2e_tok_s"] = len(r["tokens"]) * len(r["tokens"][0]) / (
                prefill_s[r["impl"]] + r["generate_s"])
    if ours is None or not sdpa:
        return {"printed": False, "why": "no ptxattn run" if ours is None else "no SDPA run"}
    if not ours.get("verified"):
        return {"printed": False, "why": f"ptxattn not verified: {ours.get('why_not')}"}
    best = max(sdpa, key=lambda n: sdpa[n]["decode_tok_s"])
    out = {"printed": True, "decode": {"against": best,
                                       "ratio": ours["decode_tok_s"] / sdpa[best]["decode_tok_s"]}}
    e2e = {n: r for n, r in sdpa.items() if r.get("e2e_tok_s")}
    if ours.get("e2e_tok_s") and e2e:
        b2 = max(e2e, key=lambda n: e2e[n]["e2e_tok_s"])
        out["e2e"] = {"against": b2, "ratio": ours["e2e_tok_s"] / e2e[b2]["e2e_tok_s"]}
    return out


# --------------------------------------------------------------------------- the run

class Clock:
    def __init__(self, budget_s: float):
        self.t0, self.budget_s, self.phases = time.perf_counter(), budget_s, []
        self.static_seen: list[float] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    @contextmanager
    def phase(self, label: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            s = time.perf_counter() - t
            self.phases.append({"phase": label, "s": round(s, 3),
                                "at_s": round(self.elapsed(), 3)})
            print(f"[{self.elapsed():7.1f} s] {label}: {s:.2f} s", flush=True)

    def static_fits(self, runs: int, layers: int) -> bool:
        guess = max(self.static_seen) if self.static_seen else STATIC_ESTIMATE_S * layers / 32
        return self.elapsed() + runs * guess <= self.budget_s


def one_batch(torch, model, args, batch: int, clock: Clock, impls: list) -> dict:
    import ptxattn.torch as pt
    device, layers = args.device, model.config.num_hidden_layers
    max_len = -(-(args.context + args.new_tokens + 4) // 64) * 64
    g = torch.Generator(device=device).manual_seed(args.seed + batch)
    prompt = torch.randint(0, model.config.vocab_size, (batch, args.context), device=device,
                           generator=g)
    rec = {"batch": batch, "context": args.context, "new_tokens": args.new_tokens,
           "static_max_len": max_len, "prefill": {}, "runs": {}, "skipped": []}
    with clock.phase(f"b{batch} attention calls"):
        inputs = attention_inputs(torch, model, batch, args.context, max_len, device, args.seed)
        rec["attention_calls"] = calls = attention_calls(torch, model, impls, inputs, device)
        del inputs
    for call, row in calls.items():
        print(f"    {call}: " + ", ".join(
            f"{i} {r['ms']['median']:.3f} ms" if "ms" in r else f"{i} refused"
            for i, r in row.items()), flush=True)
    # prefill: every implementation that takes the call, the reference last (its cache kept)
    able = [i for i in impls if takes(calls, "prefill", i)]
    ref = next((i for i in REFERENCE_PREFILL if i in able), None)
    kept, logits = None, {}
    for impl in [i for i in able if i != ref] + ([ref] if ref else []):
        use(model, impl)
        pt.reset_fallback_counts()
        with clock.phase(f"b{batch} prefill {impl}"), backend_flags(torch, impl):
            try:
                cache, seconds, logits[impl] = prefill(torch, model, prompt, device)
                rec["prefill"][impl] = {"s": seconds, "fallbacks": pt.fallback_counts()}
            except Exception as exc:                    # noqa: BLE001
                rec["prefill"][impl] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
                cache = None
        if impl == ref and cache is not None:
            kept = kv_of(cache)
        del cache
        _free(torch, device)
    for impl in impls:
        if impl not in able:
            rec["prefill"][impl] = {"error": calls["prefill"][impl]["error"]}
    if kept is None:
        rec["error"] = "no prefill ran: nothing to decode from"
        return rec
    rec["prefill_reference"] = ref
    for impl, lg in logits.items():
        rec["prefill"][impl]["logits_rel_l2_vs_reference"] = rel_l2(lg, logits[ref])
        rec["prefill"][impl]["argmax_agrees"] = (lg.argmax(-1) == logits[ref].argmax(-1)).tolist()
    prefill_s = {i: r["s"] for i, r in rec["prefill"].items() if "s" in r and (
        i != "ptxattn" or not r["fallbacks"])}
    for kind in args.caches:
        call = f"decode_{kind}"
        chosen = [i for i in impls if takes(calls, call, i)]
        for i in impls:
            if i not in chosen:
                rec["skipped"].append({"cache": kind, "impl": i, "why": "refuses the call: "
                                       + calls[call][i]["error"]})
        if kind == "static" and args.static_sdpa == "best":
            sdpa = [i for i in chosen if i != "ptxattn"]
            if sdpa:
                best = min(sdpa, key=lambda i: calls[call][i]["ms"]["median"])
                for i in sdpa:
                    if i != best:
                        rec["skipped"].append({"cache": kind, "impl": i, "why": (
                            f"not SDPA's fastest on the static call ({best} is; "
                            "--static-sdpa all runs it)")})
                chosen = [i for i in chosen if i == "ptxattn" or i == best]
        runs = rec["runs"][kind] = {}
        for n, impl in enumerate(chosen):
            run = DecodeRun(torch, model, prompt, kept, kind, impl, args, max_len)
            if run.compiled and not clock.static_fits(len(chosen) - n, layers):
                rec["skipped"].append({"cache": kind, "impl": impl, "why": (
                    f"time budget: {clock.elapsed():.0f} s gone of --budget-s "
                    f"{clock.budget_s:.0f}")})
                continue
            with clock.phase(f"b{batch} {kind} {impl}"):
                try:
                    runs[impl] = run.run()
                except Exception as exc:                # noqa: BLE001
                    runs[impl] = {"error": f"{type(exc).__name__}: {exc}"[:400], "impl": impl}
            if run.compiled and "warmup_s" in runs[impl]:
                clock.static_seen.append(runs[impl]["warmup_s"] + runs[impl]["generate_s"])
            del run
            _free(torch, device)
            print("    " + run_line(runs[impl]), flush=True)
        done = {i: r for i, r in runs.items() if "tokens" in r}
        rec.setdefault("first_difference", {})[kind] = pairs_of(done)
        rec.setdefault("speedup", {})[kind] = speedups(done, prefill_s)
    if {"dynamic", "static"} <= set(rec["runs"]):
        rec["first_difference"]["dynamic~static"] = {
            i: first_difference(rec["runs"]["dynamic"][i]["tokens"],
                                rec["runs"]["static"][i]["tokens"])
            for i in rec["runs"]["static"] if "tokens" in rec["runs"]["static"][i]
            and "tokens" in rec["runs"]["dynamic"].get(i, {})}
    return rec


def _free(torch, device: str) -> None:
    import gc
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_line(r: dict) -> str:
    if "error" in r:
        return f"{r['impl']}: error {r['error'][:200]}"
    tok = r.get("decode_tok_s")
    line = (f"{r['impl']}: decode {tok:.1f} tok/s (step {r['step_ms']['median']:.2f} ms, "
            f"p90 {r['step_ms']['p90']:.2f}), generate {r['generate_s']:.2f} s, warm-up "
            f"{r['warmup_s']:.1f} s")
    if r["impl"] == "ptxattn":
        line += "; every decode step on the decode kernel" if r.get("verified") else \
            f"; NOT VERIFIED: {r.get('why_not')}"
    else:
        seen = r["probe"].get("torch_attention_kernels") or {}
        top = sorted(seen.items(), key=lambda kv: -kv[1])[:2]
        if top:
            line += "; attention kernels " + ", ".join(f"{k[:60]} x{n}" for k, n in top)
    return line


def batch_lines(rec: dict) -> list[str]:
    out = []
    b = rec["batch"]
    for kind, s in rec.get("speedup", {}).items():
        if s.get("printed"):
            text = f"b{b} {kind}: decode {s['decode']['ratio']:.3f}x {s['decode']['against']}"
            if "e2e" in s:
                text += f", end to end {s['e2e']['ratio']:.3f}x {s['e2e']['against']}"
        else:
            text = f"b{b} {kind}: no speedup ({s.get('why')})"
        diffs = rec.get("first_difference", {}).get(kind, {})
        if diffs:
            text += "; tokens first differ " + ", ".join(
                f"{p} {d['first'] if d['first'] is not None else 'never'}"
                for p, d in diffs.items())
        out.append(text)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default=None, help="comma-separated (8,1)")
    ap.add_argument("--context", type=int, default=0, help="prompt tokens (32768)")
    ap.add_argument("--new-tokens", type=int, default=0, help="greedy tokens (128)")
    ap.add_argument("--layers", type=int, default=0, help="reduce depth (0: the published 32)")
    ap.add_argument("--backends", default=None,
                    help="SDPA backends beside ptxattn (cuda: cudnn,flash,efficient)")
    ap.add_argument("--caches", default="dynamic,static")
    ap.add_argument("--static-sdpa", choices=("best", "all"), default="best",
                    help="static cache: SDPA's fastest backend on the static call, or all")
    ap.add_argument("--static-eager", action="store_true",
                    help="static cache without torch.compile (no CUDA graphs)")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="skip static-cache runs that would end past this many seconds")
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="a tiny config (the CPU plumbing test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    args.context = args.context or (40 if args.tiny else 32768)
    args.new_tokens = args.new_tokens or (6 if args.tiny else 128)
    batches = [int(x) for x in (args.batches or ("2,1" if args.tiny else "8,1")).split(",") if x]
    args.caches = [c for c in args.caches.split(",") if c]
    if any(c not in ("dynamic", "static") for c in args.caches) or not args.caches:
        ap.error(f"--caches: expected dynamic and/or static, got {args.caches}")
    if args.new_tokens < 2 or args.context < 2 or not batches or min(batches) < 1:
        ap.error("--new-tokens and --context: expected >= 2; --batches: expected >= 1")
    import torch
    import transformers

    import ptxattn.torch as pt
    from ptxattn.tools.bench import source_id
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA GPU (--tiny for the CPU plumbing)")
    available = SDPA_ON["cuda" if args.device.startswith("cuda") else "cpu"]
    names = [b for b in (args.backends.split(",") if args.backends else available) if b]
    unknown = [b for b in names if b not in available]
    if unknown:
        ap.error(f"--backends: {unknown} not among {list(available)}")
    impls = ["ptxattn", *names]
    pt.register_transformers()
    clock = Clock(args.budget_s)
    cfg = llama_config(args)
    with clock.phase("model"):
        model = build_model(torch, transformers, cfg, args.device, args.seed)
    depth = cfg["num_hidden_layers"]
    print(f"Llama-3.1-8B architecture{' (tiny)' if args.tiny else ''}: {depth} layers"
          f"{' (reduced by --layers)' if args.layers else ''}, context {args.context}, "
          f"{args.new_tokens} new tokens, batches {batches}, caches {args.caches}, "
          f"{args.device}", flush=True)
    report = {"config": cfg, "layers": depth, "layers_reduced": bool(args.layers),
              "tiny": args.tiny, "args": dict(vars(args)), "source": source_id(ROOT),
              "torch": torch.__version__, "transformers": transformers.__version__,
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "batches": []}
    out_dir = Path(args.out or os.environ.get("OUT")
                   or Path(__file__).resolve().parents[1] / "results" / "models")
    path = out_dir / f"generate{'-tiny' if args.tiny else ''}-{datetime.date.today()}.json"
    try:
        for batch in batches:
            report["batches"].append(one_batch(torch, model, args, batch, clock, impls))
            _free(torch, args.device)
    finally:
        report["phases"], report["elapsed_s"] = clock.phases, clock.elapsed()
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))
    lines = [line for rec in report["batches"] for line in batch_lines(rec)]
    for rec in report["batches"]:
        for s in rec["skipped"]:
            print(f"b{rec['batch']} {s['cache']} {s['impl']} skipped: {s['why'][:200]}")
    print(f"wrote {path}")
    print("summary: " + " | ".join(lines) + f" ({clock.elapsed():.0f} s)")
    ours = [r for rec in report["batches"] for kind in rec["runs"].values()
            for i, r in kind.items() if i == "ptxattn"]
    ok = ours and all(r.get("verified") for r in ours) and all(
        "error" not in rec for rec in report["batches"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

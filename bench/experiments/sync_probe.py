#!/usr/bin/env python3
"""Where a transformers decode step on ptxattn synchronizes with the host: a small Llama
(random weights, 4 layers, 32:8 heads, D 128) prefills 2,048 tokens, then one decode step
runs under torch.cuda.set_sync_debug_mode("warn") for "ptxattn" and for "sdpa", dynamic cache
and static cache (eager: no compile), and every synchronizing call is printed with the
frames of its stack that are ptxattn's or transformers'. A step that synchronizes serializes
the host's launches with the GPU, which costs an eager decode step its overlap.

    python bench/experiments/sync_probe.py        (a CUDA GPU; ~30 s)
"""

from __future__ import annotations

import traceback
import warnings

import torch
import transformers

import ptxattn.torch as pt


def main() -> int:
    pt.register_transformers()
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=4096,
                                      num_hidden_layers=4, num_attention_heads=32,
                                      num_key_value_heads=8, head_dim=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 32000, (8, 2048), device="cuda")
    for impl in ("ptxattn", "sdpa"):
        model.set_attn_implementation(impl)
        for cache in ("dynamic", "static"):
            kw = {"cache_implementation": "static"} if cache == "static" else {}
            with torch.no_grad():
                model.generate(ids, max_new_tokens=3, do_sample=False, **kw)   # warm
                found = []

                def show(message, category, filename, lineno, file=None, line=None):
                    frames = [f for f in traceback.extract_stack()
                              if "ptxattn" in f.filename or "transformers" in f.filename]
                    found.append((str(message)[:80], [f"{f.filename.split('site-packages/')[-1]}:"
                                                      f"{f.lineno} {f.name}" for f in frames[-6:]]))
                old = warnings.showwarning
                warnings.showwarning = show
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("always")
                        warnings.showwarning = show
                        model.generate(ids, max_new_tokens=3, do_sample=False, **kw)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    warnings.showwarning = old
            print(f"== {impl} {cache}: {len(found)} synchronizing calls in a 3-token generate()")
            seen = {}
            for msg, frames in found:
                key = tuple(frames[-3:])
                seen[key] = seen.get(key, 0) + 1
            for key, n in sorted(seen.items(), key=lambda kv: -kv[1])[:8]:
                print(f"  {n:4d} x " + " <- ".join(reversed(key)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""What a dynamic-cache decode step of transformers' generate() spends its GPU time on, for
attn_implementation="ptxattn" and for "sdpa" (flash): a Llama-3-8B-shaped model cut to 4
layers (random weights), batch 8, a 32k-token prompt prefilled once per backend, then 4 greedy
tokens under torch.profiler; the CUDA kernels by total time, and the step's wall time.

    python bench/experiments/decode_step_profile.py      (a CUDA GPU; ~40 s)
"""

from __future__ import annotations

import time

import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel

import ptxattn.torch as pt


def main() -> int:
    pt.register_transformers()
    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096,
                                      intermediate_size=14336, num_hidden_layers=4,
                                      num_attention_heads=32, num_key_value_heads=8,
                                      head_dim=128, max_position_embeddings=65536)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 128256, (8, 32768), device="cuda")
    for impl in ("ptxattn", "sdpa"):
        model.set_attn_implementation(impl)
        with torch.no_grad(), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            model.generate(ids[:, :1024], max_new_tokens=3, do_sample=False)      # warm
            out = model(ids, use_cache=True)
            cache = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                    torch.profiler.ProfilerActivity.CPU]) as prof:
                t = time.perf_counter()
                for _ in range(4):
                    o = model(nxt, past_key_values=cache, use_cache=True)
                    cache, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t) / 4 * 1e3
        print(f"== {impl}: {wall:.2f} ms a decode step (4 layers, batch 8, 32k cache)")
        rows = sorted((e for e in prof.key_averages() if e.device_time_total > 0),
                      key=lambda e: -e.device_time_total)[:12]
        for e in rows:
            print(f"  {e.device_time_total / 4e3:8.3f} ms/step  {e.count // 4:4d}/step  {e.key[:90]}")
        cpu = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:6]
        for e in cpu:
            print(f"  cpu {e.self_cpu_time_total / 4e3:8.3f} ms/step  {e.count // 4:4d}/step  {e.key[:80]}")
        del cache, out, o
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

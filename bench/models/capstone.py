"""ptxattn inside real models: one denoising step (video) or one prefill (LLM), torch's
fastest SDPA backend against ptxattn.

    python bench/models/capstone.py wan   [--layers N] [--frames 81 --height 480 --width 832]
    python bench/models/capstone.py ltx   [--layers N]
    python bench/models/capstone.py llama [--layers N] [--tokens 8192]
    ... [--pretrained PATH_OR_ID] [--reps 5] [--out DIR]

Models are built from their published configurations (embedded below: no hub access is
needed) with random weights, in bf16 on the GPU; --layers reduces depth (the JSON says so).
--pretrained loads real weights with from_pretrained where a hub or a local copy is there.

Measured, all in one process: attention calls per step and their shapes (a hook on both
paths), time per step for each torch SDPA backend that runs (cuDNN, flash, efficient; the
fastest is the baseline) and for ptxattn, the attention share of the step (CUDA events around
each attention call, in a separate pass), and the relative L2 difference of the model's output
between ptxattn and the baseline, and between torch's own backends (the yardstick).
Calls ptxattn does not take run torch's SDPA (its fallback): the JSON lists them by reason.
Writes <model>-<date>.json into $OUT, or --out, or bench/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import ptxattn.torch as pt
from ptxattn.torch import sdpa as pt_sdpa

# --------------------------------------------------------------------------- published configs

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers, transformer/config.json
WAN_T2V_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128,
                    in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960,
                    num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                    eps=1e-6, image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024)
# Lightricks/LTX-Video (0.9.x), transformer/config.json
LTX_VIDEO = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1,
                 num_attention_heads=32, attention_head_dim=64, cross_attention_dim=2048,
                 num_layers=28, activation_fn="gelu-approximate", qk_norm="rms_norm_across_heads",
                 norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=4096,
                 attention_bias=True, attention_out_bias=True)
# meta-llama/Llama-3.1-8B, config.json (GQA 32:8, head dim 128)
LLAMA_3_1_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, hidden_act="silu", max_position_embeddings=131072,
                    rms_norm_eps=1e-5, rope_theta=500000.0, attention_bias=False,
                    tie_word_embeddings=False,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0,
                                      original_max_position_embeddings=8192))

TORCH_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                  "efficient": SDPBackend.EFFICIENT_ATTENTION}


# --------------------------------------------------------------------------- models

class Case:
    """A model, its inputs, and how to switch its attention between torch and ptxattn."""
    name: str
    model: torch.nn.Module
    inputs: dict
    config: dict
    note: str = ""

    def use(self, backend: str) -> None: ...

    def step(self) -> torch.Tensor: ...


class DiffusersCase(Case):
    def use(self, backend):
        self.model.set_attention_backend("ptxattn" if backend == "ptxattn" else "native")

    def step(self):
        return self.model(**self.inputs, return_dict=False)[0]


def diffusers_case(name: str, config: dict, model_class, args) -> DiffusersCase:
    """A diffusers transformer in bf16 on the GPU: the published config (--layers cuts its
    depth) with random weights, or --pretrained's weights."""
    c = DiffusersCase()
    c.name, c.config = name, dict(config)
    if args.layers:
        c.config["num_layers"] = args.layers
    if args.pretrained:
        c.model = model_class.from_pretrained(
            args.pretrained, subfolder="transformer", torch_dtype=torch.bfloat16).cuda()
    else:
        c.model = model_class(**c.config).to("cuda", torch.bfloat16)
    return c


def build_wan(args) -> Case:
    import diffusers
    c = diffusers_case("wan2.1-t2v-1.3b", WAN_T2V_1_3B, diffusers.WanTransformer3DModel, args)
    # the Wan VAE: 8x spatial, 4x temporal compression; 16 latent channels
    frames = (args.frames - 1) // 4 + 1
    shape = (1, 16, frames, args.height // 8, args.width // 8)
    c.inputs = dict(hidden_states=randn(shape, 1), timestep=torch.tensor([500], device="cuda"),
                    encoder_hidden_states=randn((1, 512, 4096), 2))
    tokens = frames * (shape[3] // 2) * (shape[4] // 2)       # patch (1, 2, 2)
    c.note = f"latent {shape}: {tokens} video tokens, 512 text tokens"
    return c


def build_ltx(args) -> Case:
    import diffusers
    c = diffusers_case("ltx-video", LTX_VIDEO, diffusers.LTXVideoTransformer3DModel, args)
    # LTX's VAE: 32x spatial, 8x temporal; default 704x480, 161 frames
    frames, h, w = (args.frames - 1) // 8 + 1, args.height // 32, args.width // 32
    tokens = frames * h * w
    c.inputs = dict(hidden_states=randn((1, tokens, 128), 1),
                    encoder_hidden_states=randn((1, 128, 4096), 2),
                    timestep=torch.tensor([500], device="cuda"),
                    encoder_attention_mask=torch.ones(1, 128, device="cuda", dtype=torch.bool),
                    num_frames=frames, height=h, width=w)
    c.note = f"{tokens} video tokens ({frames}x{h}x{w}), 128 text tokens; head dim 64"
    return c


class LlamaCase(Case):
    def use(self, backend):
        impl = "ptxattn" if backend == "ptxattn" else "sdpa"
        if hasattr(self.model, "set_attn_implementation"):
            self.model.set_attn_implementation(impl)
        else:
            self.model.config._attn_implementation = impl

    def step(self):
        return self.model(**self.inputs, use_cache=False).logits


def build_llama(args) -> Case:
    import transformers
    c = LlamaCase()
    c.name, c.config = "llama-3.1-8b-arch", dict(LLAMA_3_1_8B)
    if args.layers:
        c.config["num_hidden_layers"] = args.layers
    if args.pretrained:
        c.model = transformers.AutoModelForCausalLM.from_pretrained(
            args.pretrained, torch_dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    else:
        with torch.device("cuda"):
            c.model = transformers.LlamaForCausalLM(
                transformers.LlamaConfig(**c.config, attn_implementation="sdpa")).to(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(3)
    c.inputs = dict(input_ids=torch.randint(0, c.config["vocab_size"], (1, args.tokens),
                                            device="cuda", generator=g))
    c.note = f"prefill of {args.tokens} tokens, causal, GQA 32:8"
    return c


BUILDERS = {"wan": build_wan, "ltx": build_ltx, "llama": build_llama}
DEFAULT_SHAPES = {"wan": (81, 480, 832), "ltx": (161, 480, 704), "llama": (0, 0, 0)}


def randn(shape, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16)


# --------------------------------------------------------------------------- measuring

@contextmanager
def attention_hook(record: list, timed: bool):
    """Record every attention call of both paths (torch SDPA and the ptxattn kernel):
    shapes, and with `timed` a CUDA event pair around it."""
    real_sdpa, real_kernel = F.scaled_dot_product_attention, pt_sdpa._kernel

    def wrap(fn, kind):
        def call(*a, **kw):
            # diffusers' native backend passes query=/key= by keyword (an IndexError here made
            # every torch backend fail on Wan, H200 2026-12-01)
            q = a[0] if len(a) > 0 else kw.get("query", kw.get("q"))
            k = a[1] if len(a) > 1 else kw.get("key", kw.get("k"))
            layout = kw.get("layout") or (a[5] if kind == "ptxattn" and len(a) > 5 else "bhld")
            entry = {"path": kind, "q": list(q.shape), "k": list(k.shape), "layout": layout}
            if timed:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(*a, **kw)
                end.record()
                entry["events"] = (start, end)
            else:
                out = fn(*a, **kw)
            record.append(entry)
            return out
        return call

    F.scaled_dot_product_attention = wrap(real_sdpa, "torch")
    pt_sdpa._kernel = wrap(real_kernel, "ptxattn")
    try:
        yield
    finally:
        F.scaled_dot_product_attention, pt_sdpa._kernel = real_sdpa, real_kernel


def time_steps(case: Case, reps: int) -> list[float]:
    with torch.no_grad():
        for _ in range(2):
            case.step()
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            case.step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def summarize_calls(record: list) -> dict:
    shapes: dict[str, int] = {}
    for e in record:
        key = f"{e['path']} q={e['q']} k={e['k']} {e['layout']}"
        shapes[key] = shapes.get(key, 0) + 1
    return {"calls": len(record), "by_shape": shapes}


def run_backend(case: Case, backend: str, reps: int) -> dict:
    case.use("ptxattn" if backend == "ptxattn" else "torch")
    ctx = sdpa_kernel([TORCH_BACKENDS[backend]]) if backend in TORCH_BACKENDS else nullctx()
    result = {"backend": backend}
    pt.reset_fallback_counts()
    try:
        with ctx:
            # timed steps first: they warm up (JIT, plans), and the hooked pass after them
            # measures attention on a warm path (events around a cold call span the host's
            # compile time too: the first run reported attention at 14x the step)
            times = time_steps(case, reps)
            with torch.no_grad():
                record: list = []
                with attention_hook(record, timed=True):
                    out = case.step()
                torch.cuda.synchronize()
            attention_ms = sum(s.elapsed_time(e) for s, e in (r.pop("events") for r in record))
    except Exception as e:                      # a torch backend that cannot run this model
        return {"backend": backend, "error": f"{type(e).__name__}: {e}"[:500]}
    result.update(step_ms_median=statistics.median(times), step_ms=times,
                  attention_ms_in_hooked_pass=attention_ms,
                  attention_share=attention_ms / statistics.median(times),
                  calls=summarize_calls(record), fallbacks=pt.fallback_counts())
    result["_out"] = out.float()
    return result


@contextmanager
def nullctx():
    yield


def rel_l2(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=sorted(BUILDERS))
    ap.add_argument("--layers", type=int, default=0, help="reduce depth (0: the published one)")
    ap.add_argument("--frames", type=int, default=0)
    ap.add_argument("--height", type=int, default=0)
    ap.add_argument("--width", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=8192, help="llama: prefill length")
    ap.add_argument("--pretrained", default=None, help="PATH_OR_ID for from_pretrained")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="directory for the JSON ($OUT or bench/results)")
    args = ap.parse_args(argv)
    f, h, w = DEFAULT_SHAPES[args.model]
    args.frames, args.height, args.width = args.frames or f, args.height or h, args.width or w

    pt.register_diffusers() if args.model != "llama" else pt.register_transformers()
    case = BUILDERS[args.model](args)
    case.model.eval()
    results = [run_backend(case, b, args.reps) for b in (*TORCH_BACKENDS, "ptxattn")]
    ok = [r for r in results if "error" not in r]
    torch_ok = [r for r in ok if r["backend"] in TORCH_BACKENDS]
    best = min(torch_ok, key=lambda r: r["step_ms_median"]) if torch_ok else None
    ours = next((r for r in ok if r["backend"] == "ptxattn"), None)
    comparison = {}
    if best is not None:
        comparison["baseline"] = best["backend"]
        comparison["torch_backends_vs_baseline_rel_l2"] = {
            r["backend"]: rel_l2(r["_out"], best["_out"]) for r in torch_ok if r is not best}
        if ours is not None:
            comparison["ptxattn_vs_baseline_rel_l2"] = rel_l2(ours["_out"], best["_out"])
            comparison["speedup_step"] = best["step_ms_median"] / ours["step_ms_median"]
    for r in results:
        r.pop("_out", None)
    report = {
        "model": case.name, "note": case.note, "config": case.config,
        "layers_reduced": bool(args.layers), "pretrained": args.pretrained,
        "weights": "pretrained" if args.pretrained else "random",
        "args": vars(args), "results": results, "comparison": comparison,
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
        "cudnn": torch.backends.cudnn.version(), "commit": _commit(),
        "ptxattn_takes_causal": pt.library_takes_causal(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    out_dir = Path(args.out or os.environ.get("OUT") or Path(__file__).parents[1] / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{args.model}-{datetime.date.today().isoformat()}.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    for r in results:
        line = (f"{r['backend']:>9}: error {r['error'][:120]}" if "error" in r else
                f"{r['backend']:>9}: {r['step_ms_median']:.1f} ms/step, attention "
                f"{100 * r['attention_share']:.0f}%, {r['calls']['calls']} calls, "
                f"fallbacks {r['fallbacks']}")
        print(line)
    print(json.dumps(comparison, indent=1))
    print(f"wrote {path}")
    return 0


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return ""


if __name__ == "__main__":
    sys.exit(main())

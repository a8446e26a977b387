"""ptxattn inside real models: one denoising step (video) or one prefill (LLM), torch's
fastest SDPA backend against ptxattn.

    python bench/models/capstone.py wan   [--layers N] [--frames 81 --height 480 --width 832]
    python bench/models/capstone.py ltx   [--layers N]      LTX-Video 0.9
    python bench/models/capstone.py ltx2  [--layers N]      LTX-2 (video + audio)
    python bench/models/capstone.py llama [--layers N] [--tokens 8192]
    ... [--pretrained PATH_OR_ID] [--reps 5] [--backends cudnn,flash] [--out DIR]
    ... --tiny --device cpu     (a tiny config at a few tokens: the CPU plumbing test)

Models are built from their published configurations (embedded below: no hub access is
needed) with random weights, in bf16 on the GPU; --layers reduces depth (the JSON and the
printout say so). --pretrained loads real weights with from_pretrained where a hub or a local
copy is there (--layers then keeps the first N blocks).

Measured, all in one process: attention calls per step, by role (the attention module that
made the call: attn1, attn2, audio_attn1, ...) and by shape (a hook on both paths), time per
step for each torch SDPA backend that runs (cuDNN, flash, efficient; the fastest is the
baseline) and for ptxattn, all in the same rounds (one step each per round, in a random
order; the speedup is also given per round), the attention share of the step (CUDA events around each attention
call, in a warm pass after the timed steps), and the relative L2 difference of the model's
output between ptxattn and the baseline, and between torch's own backends (the yardstick).
Calls ptxattn does not take run torch's SDPA (its fallback): the JSON counts them by reason.
Writes <model>-<date>.json into --out, or $OUT, or bench/results/models/.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import ptxattn.torch as pt
from ptxattn.torch import fp8_sdpa as pt_fp8_sdpa
from ptxattn.torch import sdpa as pt_sdpa

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bookkeeping as bk  # noqa: E402  (beside this script; torch-free, tested on its own)

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
# Lightricks/LTX-2 (19B, audio + video), transformer/config.json as diffusers writes it: the
# "2.0" config of diffusers' scripts/convert_ltx2_to_diffusers.py (the script that made the
# hub's diffusers copy), equal to LTX2VideoTransformer3DModel's defaults in 0.42.1 except
# rope_type "split". Video 32 x 128 heads, audio 32 x 64, 48 blocks.
LTX_2 = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1,
             num_attention_heads=32, attention_head_dim=128, cross_attention_dim=4096,
             vae_scale_factors=(8, 32, 32), pos_embed_max_pos=20, base_height=2048,
             base_width=2048, audio_in_channels=128, audio_out_channels=128,
             audio_patch_size=1, audio_patch_size_t=1, audio_num_attention_heads=32,
             audio_attention_head_dim=64, audio_cross_attention_dim=2048, audio_scale_factor=4,
             audio_pos_embed_max_pos=20, audio_sampling_rate=16000, audio_hop_length=160,
             num_layers=48, activation_fn="gelu-approximate", qk_norm="rms_norm_across_heads",
             norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=3840,
             attention_bias=True, attention_out_bias=True, rope_theta=10000.0,
             rope_double_precision=True, causal_offset=1, timestep_scale_multiplier=1000,
             cross_attn_timestep_scale_multiplier=1000, rope_type="split")
# meta-llama/Llama-3.1-8B, config.json (GQA 32:8, head dim 128)
LLAMA_3_1_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, hidden_act="silu", max_position_embeddings=131072,
                    rms_norm_eps=1e-5, rope_theta=500000.0, attention_bias=False,
                    tie_word_embeddings=False,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0,
                                      original_max_position_embeddings=8192))

# (frames, height, width) in pixels: each pipeline's default (Wan: the 480p setting of
# issue 12; LTX-Video's 704x480x161; LTX-2's pipeline default 768x512x121)
DEFAULT_SHAPES = {"wan": (81, 480, 832), "ltx": (161, 480, 704), "ltx2": (121, 512, 768),
                  "llama": (0, 0, 0)}
# text tokens each model gets: Wan's umT5 512, LTX-Video's T5 128, LTX-2's Gemma connectors 1024
DEFAULT_TEXT = {"wan": 512, "ltx": 128, "ltx2": 1024, "llama": 0}

# --tiny: the same classes at a few dozen tokens, head dim 64 (a head dim the kernel has, so
# the CPU test's stand-in kernel takes the same calls ptxattn would), depth 2
TINY = {
    "wan": dict(config=dict(num_attention_heads=2, attention_head_dim=64, in_channels=4,
                            out_channels=4, text_dim=32, freq_dim=32, ffn_dim=128, num_layers=2),
                shape=(5, 64, 64), text=16),                      # 2 x 4 x 4 = 32 tokens
    "ltx": dict(config=dict(in_channels=8, out_channels=8, num_attention_heads=2,
                            attention_head_dim=64, cross_attention_dim=128, num_layers=2,
                            caption_channels=32),
                shape=(9, 128, 128), text=16),                    # 2 x 4 x 4 = 32 tokens
    "ltx2": dict(config=dict(in_channels=8, out_channels=8, num_attention_heads=2,
                             attention_head_dim=64, cross_attention_dim=128,
                             audio_in_channels=8, audio_out_channels=8,
                             audio_num_attention_heads=2, audio_attention_head_dim=64,
                             audio_cross_attention_dim=128, num_layers=2, caption_channels=32),
                 shape=(9, 128, 128), text=16),                   # 32 video, 9 audio tokens
    "llama": dict(config=dict(vocab_size=512, hidden_size=128, intermediate_size=256,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=64),
                  tokens=32),
}

OURS = ("ptxattn", "ptxattn_fp8")       # ptxattn's paths: bf16, and FP8 with --fp8 (diffusers)
BACKENDS = {
    "cuda": {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION},
    # CPU (the plumbing test): torch's math and CPU flash kernels
    "cpu": {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION},
}


# --------------------------------------------------------------------------- models

class Case:
    """A model, its inputs, and how to switch its attention between torch and ptxattn."""
    name: str
    model: torch.nn.Module
    inputs: dict
    config: dict
    note: str = ""
    outputs: tuple[str, ...] = ("video",)

    def use(self, backend: str) -> None: ...

    def step(self) -> dict[str, torch.Tensor]: ...

    def restore(self) -> None:
        """Leave the libraries as they were found (the model keeps torch's attention)."""


class DiffusersCase(Case):
    def use(self, backend):
        if not hasattr(self, "_found_active"):
            from diffusers.models.attention_dispatch import _AttentionBackendRegistry
            self._found_active = _AttentionBackendRegistry._active_backend
        # "ptxattn" and the opt-in "ptxattn_fp8" are diffusers backends of their own names
        self.model.set_attention_backend(backend if backend in OURS else "native")

    def restore(self):
        # set_attention_backend also sets diffusers' process-wide active backend, which
        # every model whose processors name none then uses: put back the one found
        if hasattr(self, "_found_active"):
            from diffusers.models.attention_dispatch import _AttentionBackendRegistry
            self.model.reset_attention_backend()
            _AttentionBackendRegistry.set_active_backend(self._found_active)
        if hasattr(self, "_found_verbosity"):
            from diffusers.utils import logging as diffusers_logging
            diffusers_logging.set_verbosity(self._found_verbosity)

    def step(self):
        out = self.model(**self.inputs, return_dict=False)
        return dict(zip(self.outputs, out))


def published(config: dict, model: str, args) -> dict:
    """The published config, with --tiny's overrides and --layers' depth."""
    c = dict(config)
    if args.tiny:
        c.update(TINY[model]["config"])
    if args.layers:
        c["num_hidden_layers" if model == "llama" else "num_layers"] = args.layers
    return c


def diffusers_case(name: str, config: dict, model_class, args) -> DiffusersCase:
    """A diffusers transformer in bf16 on args.device: the published config (--layers cuts its
    depth) with random weights, or --pretrained's weights."""
    c = DiffusersCase()
    c.name = name + ("-tiny" if args.tiny else "")
    if args.pretrained:
        c.model = load_diffusers(model_class, args.pretrained)
        if args.layers:
            # Wan names its blocks `blocks`, the LTX models `transformer_blocks`
            attr = "blocks" if hasattr(c.model, "blocks") else "transformer_blocks"
            setattr(c.model, attr, getattr(c.model, attr)[:args.layers])
        c.model = c.model.to(args.device)
        c.config = dict(c.model.config)
        if args.layers:
            c.config["num_layers"] = args.layers
    else:
        c.config = published(config, args.model, args)
        # random init on the device itself (fp32, then bf16): LTX-2's 19B parameters take
        # minutes to initialise on the host
        with torch.device(args.device):
            c.model = model_class(**c.config)
        # (.to(device) too: a buffer made on an explicit device in __init__ follows the rest)
        c.model = c.model.to(args.device, torch.bfloat16)
    return c


def load_diffusers(model_class, path_or_id: str):
    """from_pretrained(..., subfolder="transformer") in bf16 (modules the class keeps in
    float32 stay so, as in the pipelines)."""
    try:
        return model_class.from_pretrained(path_or_id, subfolder="transformer",
                                           torch_dtype=torch.bfloat16)
    except ValueError as e:
        # diffusers loads classes with float32 modules (Wan) only through accelerate
        if "low_cpu_mem_usage" in str(e) and importlib.util.find_spec("accelerate") is None:
            raise SystemExit(f"--pretrained: diffusers needs the package accelerate to load "
                             f"{model_class.__name__} (pip install accelerate): {e}") from e
        raise


def build_wan(args) -> Case:
    import diffusers
    c = diffusers_case("wan2.1-t2v-1.3b", WAN_T2V_1_3B, diffusers.WanTransformer3DModel, args)
    cfg = c.config
    # the Wan VAE: 8x spatial, 4x temporal compression; patches (1, 2, 2)
    frames = (args.frames - 1) // 4 + 1
    shape = (1, cfg["in_channels"], frames, args.height // 8, args.width // 8)
    c.inputs = dict(hidden_states=randn(shape, 1, args.device),
                    timestep=torch.tensor([500], device=args.device),
                    encoder_hidden_states=randn((1, args.text_tokens, cfg["text_dim"]), 2,
                                                args.device))
    tokens = frames * (shape[3] // 2) * (shape[4] // 2)
    c.note = f"latent {shape}: {tokens} video tokens, {args.text_tokens} text tokens"
    return c


def text_mask(args, tokens: int):
    """--text-mask: the pipelines' (all ones here) text mask, which the transformers turn into
    an additive bias, so each text cross-attention carries an attn_mask (ptxattn falls back:
    reason attn_mask). Default None: every text token attends, the same attention, no mask."""
    if not args.text_mask:
        return None
    return torch.ones(1, tokens, device=args.device, dtype=torch.bool)


def build_ltx(args) -> Case:
    import diffusers
    c = diffusers_case("ltx-video", LTX_VIDEO, diffusers.LTXVideoTransformer3DModel, args)
    cfg = c.config
    # LTX's VAE: 32x spatial, 8x temporal; patch 1
    frames, h, w = (args.frames - 1) // 8 + 1, args.height // 32, args.width // 32
    tokens = frames * h * w
    c.inputs = dict(hidden_states=randn((1, tokens, cfg["in_channels"]), 1, args.device),
                    encoder_hidden_states=randn((1, args.text_tokens, cfg["caption_channels"]),
                                                2, args.device),
                    timestep=torch.tensor([500], device=args.device),
                    encoder_attention_mask=text_mask(args, args.text_tokens),
                    num_frames=frames, height=h, width=w)
    c.note = (f"{tokens} video tokens ({frames}x{h}x{w}), {args.text_tokens} text tokens; "
              f"head dim {cfg['attention_head_dim']}; text mask "
              f"{'on (ptxattn falls back on it)' if args.text_mask else 'none'}")
    return c


def build_ltx2(args) -> Case:
    """LTX-2: one step of the audio-video transformer. It needs its audio inputs (the audio
    stream and the a2v/v2a cross-attentions run in every block), sized as LTX2Pipeline sizes
    them: audio latents at sampling_rate / hop_length / audio_scale_factor per second of video
    (16000 / 160 / 4 = 25 per second) at 24 fps."""
    import diffusers
    c = diffusers_case("ltx-2", LTX_2, diffusers.LTX2VideoTransformer3DModel, args)
    c.outputs = ("video", "audio")
    cfg = c.config
    scale_t, scale_s = cfg["vae_scale_factors"][0], cfg["vae_scale_factors"][1]
    frames, h, w = (args.frames - 1) // scale_t + 1, args.height // scale_s, args.width // scale_s
    tokens = frames * h * w
    fps = 24.0
    audio_tokens = round(args.frames / fps * cfg["audio_sampling_rate"] / cfg["audio_hop_length"]
                         / cfg["audio_scale_factor"])
    text = args.text_tokens
    mask = text_mask(args, text)
    c.inputs = dict(
        hidden_states=randn((1, tokens, cfg["in_channels"]), 1, args.device),
        audio_hidden_states=randn((1, audio_tokens, cfg["audio_in_channels"]), 2, args.device),
        encoder_hidden_states=randn((1, text, cfg["caption_channels"]), 3, args.device),
        audio_encoder_hidden_states=randn((1, text, cfg["caption_channels"]), 4, args.device),
        timestep=torch.tensor([500.0], device=args.device),
        encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
        num_frames=frames, height=h, width=w, fps=fps, audio_num_frames=audio_tokens)
    c.note = (f"{tokens} video tokens ({frames}x{h}x{w}), {audio_tokens} audio tokens, "
              f"{text} text tokens; video heads {cfg['num_attention_heads']}x"
              f"{cfg['attention_head_dim']}, audio {cfg['audio_num_attention_heads']}x"
              f"{cfg['audio_attention_head_dim']}; text mask "
              f"{'on (ptxattn falls back on it)' if args.text_mask else 'none'}")
    return c


class LlamaCase(Case):
    outputs = ("logits",)

    def use(self, backend):
        impl = "ptxattn" if backend == "ptxattn" else "sdpa"
        if hasattr(self.model, "set_attn_implementation"):
            self.model.set_attn_implementation(impl)
        else:
            self.model.config._attn_implementation = impl

    def step(self):
        return {"logits": self.model(**self.inputs, use_cache=False).logits}

    def restore(self):
        self.use("sdpa")


def build_llama(args) -> Case:
    import transformers
    c = LlamaCase()
    c.name = "llama-3.1-8b-arch" + ("-tiny" if args.tiny else "")
    if args.pretrained:
        c.model = transformers.AutoModelForCausalLM.from_pretrained(
            args.pretrained, dtype=torch.bfloat16, attn_implementation="sdpa")
        if args.layers:
            c.model.model.layers = c.model.model.layers[:args.layers]
            c.model.config.num_hidden_layers = args.layers
        c.model = c.model.to(args.device)
        c.config = c.model.config.to_dict()
    else:
        c.config = published(LLAMA_3_1_8B, "llama", args)
        with torch.device(args.device):
            c.model = transformers.LlamaForCausalLM(
                transformers.LlamaConfig(**c.config, attn_implementation="sdpa"))
        c.model = c.model.to(args.device, torch.bfloat16)
    g = torch.Generator(device=args.device).manual_seed(3)
    c.inputs = dict(input_ids=torch.randint(0, c.config["vocab_size"], (1, args.tokens),
                                            device=args.device, generator=g))
    hq, hkv = c.config["num_attention_heads"], c.config["num_key_value_heads"]
    c.note = f"prefill of {args.tokens} tokens, causal, GQA {hq}:{hkv}"
    return c


BUILDERS = {"wan": build_wan, "ltx": build_ltx, "ltx2": build_ltx2, "llama": build_llama}


def randn(shape, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device).to(torch.bfloat16)


# --------------------------------------------------------------------------- measuring

def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class CallClock:
    """Time around one call: CUDA events on the GPU (read after the pass, no sync per call),
    the host clock on the CPU (where the call is synchronous)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def elapsed_ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


def _arg(a, kw, index, *names, default=None):
    """Argument `index` of a call, or its keyword (diffusers passes query=, key= by keyword:
    reading a[0] only made an IndexError that failed every torch backend on Wan, H200
    2026-12-01)."""
    if len(a) > index:
        return a[index]
    for n in names:
        if n in kw:
            return kw[n]
    return default


@contextmanager
def attention_hook(record: list, model: torch.nn.Module | None = None, clock: CallClock | None = None):
    """Record every attention call of both paths (torch SDPA and the ptxattn kernel): the
    attention module that made it (its role), shapes, layout, causal, and with `clock` a
    time pair around it (read after the pass: clock.elapsed_ms)."""
    real_sdpa, real_kernel = F.scaled_dot_product_attention, pt_sdpa._kernel
    real_fp8 = pt_fp8_sdpa._kernel
    modules: list[str] = []                    # the attention modules being run, innermost last

    def wrap(fn, kind):
        def call(*a, **kw):
            q = _arg(a, kw, 0, "query", "q")
            k = _arg(a, kw, 1, "key", "k")
            if kind in OURS:                     # _kernel(q, k, v, is_causal, scale, layout)
                causal = _arg(a, kw, 3, "is_causal", default=False)
                layout = _arg(a, kw, 5, "layout", default="bhld")
            else:                                # F.sdpa(q, k, v, attn_mask, dropout_p, is_causal)
                causal = _arg(a, kw, 5, "is_causal", default=False)
                layout = "bhld"
            entry = {"path": kind, "role": bk.role_of(modules[-1] if modules else None),
                     "q": list(q.shape), "k": list(k.shape), "layout": layout,
                     "causal": bool(causal)}
            if clock is not None:
                start = clock.mark()
                out = fn(*a, **kw)
                entry["clock"] = (start, clock.mark())
            else:
                out = fn(*a, **kw)
            record.append(entry)
            return out
        return call

    handles = []
    if model is not None:
        for name, m in model.named_modules():
            # diffusers' WanAttention / LTXAttention / LTX2Attention, transformers' LlamaAttention
            if type(m).__name__.endswith("Attention"):
                handles.append(m.register_forward_pre_hook(
                    lambda _m, _a, name=name: modules.append(name)))      # returns None
                handles.append(m.register_forward_hook(_pop_module(modules)))
    F.scaled_dot_product_attention = wrap(real_sdpa, "torch")
    pt_sdpa._kernel = wrap(real_kernel, "ptxattn")
    pt_fp8_sdpa._kernel = wrap(real_fp8, "ptxattn_fp8")
    try:
        yield
    finally:
        F.scaled_dot_product_attention, pt_sdpa._kernel = real_sdpa, real_kernel
        pt_fp8_sdpa._kernel = real_fp8
        for h in handles:
            h.remove()


def _pop_module(modules: list):
    def hook(_module, _args, _output):
        modules.pop()          # and return None: a forward hook's value replaces the output
    return hook


def backend_ctx(backend: str, device: str):
    """torch's SDPA limited to `backend` (cudnn, flash, ...); ptxattn's paths: no limit (their
    fallbacks take torch's default choice)."""
    torch_backends = BACKENDS[device.split(":")[0]]
    return sdpa_kernel([torch_backends[backend]]) if backend in torch_backends else nullctx()


def one_step(case: Case, backend: str, device: str) -> float:
    """One step on `backend`, in ms (host clock between syncs: the whole step)."""
    case.use(backend if backend in OURS else "torch")
    with backend_ctx(backend, device), torch.no_grad():
        sync(device)
        t0 = time.perf_counter()
        case.step()
        sync(device)
    return (time.perf_counter() - t0) * 1e3


def hooked_step(case: Case, backend: str, device: str) -> tuple[list, dict, CallClock]:
    """One step with every attention call recorded and timed (after the timed rounds: events
    around a cold call span the host's compile time too, which made the first run report
    attention at 14x the step); fallbacks are counted on this step alone, like the calls."""
    case.use(backend if backend in OURS else "torch")
    clock, record = CallClock(device), []
    pt.reset_fallback_counts()
    with backend_ctx(backend, device), torch.no_grad():
        with attention_hook(record, case.model, clock):
            out = case.step()
        sync(device)
    return record, out, clock


def measure(case: Case, backends: list[str], reps: int, device: str, warmup: int = 2,
            seed: int = 0) -> list[dict]:
    """Every backend in the same rounds: `warmup` steps each, then `reps` rounds of one timed
    step per backend in a seeded random order (drift of clocks and of cuDNN's speed lands on
    all backends alike; a same-round ratio compares neighbours), then one hooked step each.
    A backend that raises (a torch backend that cannot run this model) becomes an error entry
    and leaves the rounds."""
    errors: dict[str, dict] = {}

    def attempt(backend, fn):
        if backend in errors:
            return None
        try:
            return fn()
        except Exception as e:
            where = traceback.extract_tb(e.__traceback__)[-1]
            errors[backend] = {"backend": backend, "error": f"{type(e).__name__}: {e}"[:500],
                               "where": f"{where.filename}:{where.lineno}"}
            return None

    for b in backends:
        for _ in range(warmup):
            attempt(b, lambda: one_step(case, b, device))
    times: dict[str, list[float]] = {b: [] for b in backends}
    order_rng = random.Random(seed)
    for _ in range(reps):
        order = [b for b in backends if b not in errors]
        order_rng.shuffle(order)
        for b in order:
            ms = attempt(b, lambda: one_step(case, b, device))
            if ms is not None:
                times[b].append(ms)
    results = []
    for b in backends:
        hooked = attempt(b, lambda: hooked_step(case, b, device))
        if b in errors:
            results.append(errors[b])
            continue
        record, out, clock = hooked
        attention_ms = sum(clock.elapsed_ms(*r.pop("clock")) for r in record)
        calls = bk.summarize_calls(record)
        step_ms = statistics.median(times[b])
        results.append({
            "backend": b, "step_ms_median": step_ms, "step_ms": times[b],
            "attention_ms_in_hooked_pass": attention_ms, "attention_share": attention_ms / step_ms,
            "attention_tflops": calls["flops"] / (attention_ms * 1e9) if attention_ms else None,
            "calls": calls, "fallbacks": pt.fallback_counts(),
            "_out": {k: v.float() for k, v in out.items()}})
    return results


@contextmanager
def nullctx():
    yield


def rel_l2(a: dict, b: dict) -> float:
    """Relative L2 difference of all outputs together (LTX-2: video and audio)."""
    num = sum(float((a[k] - b[k]).norm()) ** 2 for k in b)
    den = sum(float(b[k].norm()) ** 2 for k in b)
    return (num / den) ** 0.5


def compare(results: list[dict], torch_names) -> dict:
    """The baseline (torch's fastest backend), each backend's output difference from it, and
    ptxattn's speedup; with several outputs also the difference per output."""
    ok = [r for r in results if "error" not in r]
    torch_ok = [r for r in ok if r["backend"] in torch_names]
    if not torch_ok:
        return {}
    best = min(torch_ok, key=lambda r: r["step_ms_median"])
    ours = next((r for r in ok if r["backend"] == "ptxattn"), None)
    c = {"baseline": best["backend"],
         "torch_backends_vs_baseline_rel_l2": {
             r["backend"]: rel_l2(r["_out"], best["_out"]) for r in torch_ok if r is not best}}
    yard = list(c["torch_backends_vs_baseline_rel_l2"].values())
    c["yardstick_rel_l2"] = max(yard) if yard else None
    fp8 = next((r for r in ok if r["backend"] == "ptxattn_fp8"), None)
    if fp8 is not None:
        c["fp8"] = compare_fp8(fp8, best, ours, c["yardstick_rel_l2"])
    if ours is not None:
        c["ptxattn_vs_baseline_rel_l2"] = rel_l2(ours["_out"], best["_out"])
        if len(best["_out"]) > 1:
            c["ptxattn_vs_baseline_rel_l2_by_output"] = {
                k: rel_l2({k: ours["_out"][k]}, {k: best["_out"][k]}) for k in best["_out"]}
        ran = ours.get("calls", {}).get("by_path", {}).get("ptxattn", 0)
        if not ran:
            # every "ptxattn" call fell back to torch: a speedup would compare torch with torch
            c["speedup_step"] = None
            c["no_speedup"] = (f"ptxattn ran none of the attention calls (fallbacks "
                               f"{ours.get('fallbacks')}): no speedup to report")
            return c
        c["speedup_step"] = best["step_ms_median"] / ours["step_ms_median"]
        by_round = speedup_by_round(best, ours)
        if by_round:
            c["speedup_by_round"] = by_round
    return c


def speedup_by_round(base: dict, mine: dict) -> dict | None:
    """The same rounds: round r's `base` step over round r's `mine` step (median, range)."""
    ratios = sorted(t / o for t, o in zip(base["step_ms"], mine["step_ms"]))
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1],
            "rounds": len(ratios)}


def compare_fp8(fp8: dict, best: dict, bf16: dict | None, yardstick) -> dict:
    """The FP8 backend against the fastest torch backend (bf16) and against ptxattn's bf16
    path: step speedups (median and same-round ratios) and output differences, beside the
    yardstick (torch's backends among themselves)."""
    out = {"vs_baseline_rel_l2": rel_l2(fp8["_out"], best["_out"]), "yardstick_rel_l2": yardstick}
    if bf16 is not None:
        out["vs_ptxattn_bf16_rel_l2"] = rel_l2(fp8["_out"], bf16["_out"])
    ran = fp8.get("calls", {}).get("by_path", {}).get("ptxattn_fp8", 0)
    if not ran:
        out["speedup_step"] = None
        out["no_speedup"] = (f"the FP8 path ran none of the attention calls (fallbacks "
                             f"{fp8.get('fallbacks')}): no speedup to report")
        return out
    for name, other in (("baseline", best), ("ptxattn_bf16", bf16)):
        if other is None:
            continue
        out[f"speedup_vs_{name}"] = other["step_ms_median"] / fp8["step_ms_median"]
        by_round = speedup_by_round(other, fp8)
        if by_round:
            out[f"speedup_vs_{name}_by_round"] = by_round
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=sorted(BUILDERS))
    ap.add_argument("--layers", type=int, default=0, help="reduce depth (0: the published one)")
    ap.add_argument("--frames", type=int, default=0)
    ap.add_argument("--height", type=int, default=0)
    ap.add_argument("--width", type=int, default=0)
    ap.add_argument("--text-tokens", type=int, default=0, help="0: the model's default")
    ap.add_argument("--text-mask", action="store_true",
                    help="ltx/ltx2: pass the pipelines' text mask (attn_mask on cross-attention)")
    ap.add_argument("--tokens", type=int, default=0, help="llama: prefill length (8192)")
    ap.add_argument("--pretrained", default=None, help="PATH_OR_ID for from_pretrained")
    ap.add_argument("--reps", type=int, default=5,
                    help="rounds: one timed step per backend each, in a random order")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    ap.add_argument("--backends", default="", help="torch backends to time (default: all the "
                    "device has: cudnn,flash,efficient on cuda; math,flash on cpu)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (plumbing only)")
    ap.add_argument("--tiny", action="store_true", help="a tiny config at a few tokens")
    ap.add_argument("--fp8", action="store_true", help="video models: also time the opt-in "
                    "FP8 backend (ptxattn_fp8), against the same baseline and ptxattn's bf16")
    ap.add_argument("--out", default=None,
                    help="directory for the JSON ($OUT, else bench/results/models; a --tiny or "
                         "--device cpu run: the system's temp directory, never the results)")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.warmup < 0:
        ap.error(f"--reps: expected >= 1 (and --warmup >= 0), got {args.reps} ({args.warmup})")
    kind = args.device.split(":")[0]
    if kind not in BACKENDS:
        ap.error(f"--device: expected cuda or cpu, got {args.device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA GPU here (--tiny --device cpu runs the "
                 "plumbing without one)")
    torch_backends = BACKENDS[kind]
    names = [b for b in args.backends.split(",") if b] or list(torch_backends)
    unknown = [b for b in names if b not in torch_backends]
    if unknown:
        ap.error(f"--backends: {unknown} not among {kind}'s {list(torch_backends)}")
    if args.tiny:
        f, h, w = TINY[args.model].get("shape", (0, 0, 0))
        text, tokens = TINY[args.model].get("text", 0), TINY[args.model].get("tokens", 0)
    else:
        (f, h, w), text, tokens = DEFAULT_SHAPES[args.model], DEFAULT_TEXT[args.model], 8192
    args.frames, args.height, args.width = args.frames or f, args.height or h, args.width or w
    args.text_tokens, args.tokens = args.text_tokens or text, args.tokens or tokens

    if args.fp8 and args.model == "llama":
        ap.error("--fp8: the FP8 backend is a diffusers backend (wan, ltx, ltx2), not llama's")
    if args.model == "llama":
        pt.register_transformers()
    else:
        pt.register_diffusers()
        if args.fp8:
            pt.register_diffusers(fp8=True)
    case = BUILDERS[args.model](args)
    case.model.eval()
    if isinstance(case, DiffusersCase):
        # set_attention_backend warns "experimental feature" on every switch: once per step
        # of each round here (restore() puts the verbosity back)
        from diffusers.utils import logging as diffusers_logging
        case._found_verbosity = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity_error()
    depth = case.config.get("num_hidden_layers", case.config.get("num_layers"))
    print(f"{case.name}: {case.note}; {depth} layers"
          + (" (reduced by --layers from the published depth)" if args.layers else "")
          + (", tiny config" if args.tiny else "") + f", {args.device}", flush=True)
    try:
        ours = ["ptxattn", "ptxattn_fp8"] if args.fp8 else ["ptxattn"]
        results = measure(case, [*names, *ours], args.reps, args.device, args.warmup)
    finally:
        case.restore()
    comparison = compare(results, names)
    for r in results:
        r.pop("_out", None)
    report = {
        "model": case.name, "note": case.note, "config": case.config,
        "layers": depth, "layers_reduced": bool(args.layers), "tiny": args.tiny,
        "pretrained": args.pretrained, "weights": "pretrained" if args.pretrained else "random",
        "device": args.device, "args": vars(args), "results": results,
        "comparison": comparison, "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if kind == "cuda" else (platform.processor() or "cpu"),
        "cudnn": torch.backends.cudnn.version() if kind == "cuda" else None,
        "commit": bk.commit(), "ptxattn_takes_causal": pt.library_takes_causal(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    plumbing = args.tiny or kind == "cpu"      # not a measurement: kept out of bench/results
    default_dir = (Path(tempfile.gettempdir()) / "ptxattn-capstone" if plumbing
                   else Path(__file__).resolve().parents[1] / "results" / "models")
    out_dir = Path(args.out or os.environ.get("OUT") or default_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = (f"{args.model}{'-tiny' if args.tiny else ''}{'-fp8' if args.fp8 else ''}-"
            f"{datetime.date.today().isoformat()}")
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    for r in results:
        if "error" in r:
            print(f"{r['backend']:>9}: error {r['error'][:120]}")
            continue
        print(f"{r['backend']:>9}: {r['step_ms_median']:.1f} ms/step, attention "
              f"{100 * r['attention_share']:.0f}% ({r['attention_ms_in_hooked_pass']:.1f} ms), "
              f"{r['calls']['calls']} calls {r['calls']['by_path']}, fallbacks {r['fallbacks']}")
    shown = next((r for r in reversed(results) if "calls" in r), None)   # ptxattn's if it ran
    if shown is not None:
        print(f"calls per step ({shown['backend']}): by role {json.dumps(shown['calls']['by_role'])}")
        for key, n in shown["calls"]["by_shape"].items():
            print(f"  {n:4d} x {key}")
    print(json.dumps(comparison, indent=1))
    print(f"wrote {path}")
    return 0



if __name__ == "__main__":
    sys.exit(main())

"""One training step (forward + backward) of a Llama-architecture model, ptxattn against
torch's SDPA backends, in the same process and the same rounds (issue 26's end-to-end target).

    python bench/models/train_step_bench.py                      # Llama-3.1-8B config, 32 layers,
                                                                 # 1 x 8192 tokens, ~2 min on the H200
    python bench/models/train_step_bench.py --layers 16 --tokens 8192 --rounds 10
    python bench/models/train_step_bench.py --tiny --device cpu  (plumbing only)

The model is the published Llama-3.1-8B configuration (capstone.LLAMA_3_1_8B) with random
weights in bf16, train mode, labels = inputs (the causal LM loss); --layers reduces the depth
(the JSON and the printout say so). Memory at the full depth and 8k tokens: 16 GB of weights,
16 GB of gradients, ~45 GB of saved activations and ~6 GB of logits: it fits the H200; use
--layers if it does not. A step is: zero the gradients, loss = model(ids, labels=ids).loss,
loss.backward(); timed with CUDA events. Backends: ptxattn (attn_implementation="ptxattn":
forward and backward kernels through the autograd formula) and transformers' "sdpa" under
each torch backend asked for (cuDNN, flash; efficient refuses GQA). Each round runs one step
of every backend in a random order; the speedup per round is (the fastest torch backend's
median time / ptxattn's time) and the figure is its median with a 95% bootstrap interval.

Checks beside the timing: each backend's loss, and the relative L2 difference of a few
parameter gradients (first layer's q_proj and v_proj, last layer's o_proj, the embedding)
between ptxattn and the fastest torch backend, and between two torch backends (the
yardstick); ptxattn's fallbacks (there should be none: a fallback would time torch).
Writes train-step-<date>.json into --out, $OUT, or bench/results/models/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bookkeeping import commit  # noqa: E402  (beside this script)

TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=64)
PROBES = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight",
          "model.layers.{last}.self_attn.o_proj.weight", "model.embed_tokens.weight")


def llama_config(args) -> dict:
    from capstone import LLAMA_3_1_8B           # the published config, beside this script
    cfg = dict(TINY) if args.tiny else dict(LLAMA_3_1_8B)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    return cfg


def torch_backends(torch, device: str) -> dict:
    from torch.nn.attention import SDPBackend
    if device.startswith("cuda"):
        return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    return {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}


class Step:
    """One model, switched between attention implementations; step() times one training step
    and keeps the probe gradients of its last call."""

    def __init__(self, torch, transformers, args):
        self.torch, self.args = torch, args
        cfg = llama_config(args)
        self.config = cfg
        torch.manual_seed(0)
        with torch.device(args.device):
            self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                **cfg, attn_implementation="sdpa")).to(torch.bfloat16).train()
        g = torch.Generator(device=args.device).manual_seed(1)
        self.ids = torch.randint(0, cfg["vocab_size"], (args.batch, args.tokens),
                                 device=args.device, generator=g)
        last = cfg["num_hidden_layers"] - 1
        self.probes = [p.format(last=last) for p in PROBES]

    def run(self, backend: str, sdpa_backend=None) -> tuple[float, float, dict]:
        """(ms, loss, probe gradients) of one step on `backend`."""
        torch = self.torch
        from torch.nn.attention import sdpa_kernel
        self.model.set_attn_implementation("ptxattn" if backend == "ptxattn" else "sdpa")
        ctx = sdpa_kernel(sdpa_backend) if sdpa_backend is not None else nullcontext()
        cuda = self.args.device.startswith("cuda")
        for p in self.model.parameters():
            p.grad = None
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            import time
            t0 = time.perf_counter()
        with ctx:
            loss = self.model(self.ids, labels=self.ids).loss
            loss.backward()
        if cuda:
            stop.record()
            stop.synchronize()
            ms = start.elapsed_time(stop)
        else:
            ms = (time.perf_counter() - t0) * 1e3
        params = dict(self.model.named_parameters())
        probes = {n: params[n].grad.detach().float().clone() for n in self.probes}
        return ms, float(loss.detach()), probes


def rel_l2(a: dict, b: dict) -> dict:
    return {n: float((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30)) for n in a}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=0, help="reduce depth (0: the published 32)")
    ap.add_argument("--tokens", type=int, default=0, help="sequence length (8192)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--backends", default="cudnn,flash",
                    help="torch backends beside ptxattn (cuda: cudnn,flash,efficient)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny config (the CPU plumbing test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.tokens = args.tokens or (32 if args.tiny else 8192)
    if args.rounds < 1 or args.warmup < 0:
        ap.error("--rounds: expected >= 1 (and --warmup >= 0)")
    import torch
    import transformers

    import ptxattn.torch as pt
    from ptxattn.tools.bench import bootstrap_ci
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA GPU (--tiny --device cpu for the plumbing)")
    available = torch_backends(torch, args.device)
    names = [b for b in args.backends.split(",") if b]
    if args.device == "cpu" and names == ["cudnn", "flash"]:
        names = list(available)
    unknown = [b for b in names if b not in available]
    if unknown:
        ap.error(f"--backends: {unknown} not among {list(available)}")
    pt.register_transformers()
    step = Step(torch, transformers, args)
    cfg = step.config
    depth = cfg["num_hidden_layers"]
    print(f"Llama-3.1-8B architecture{' (tiny)' if args.tiny else ''}: {depth} layers"
          f"{' (reduced by --layers)' if args.layers else ''}, {args.batch} x {args.tokens} "
          f"tokens, {args.device}", flush=True)
    backends = {"ptxattn": None, **{n: available[n] for n in names}}
    errors, times, losses, probes = {}, {b: [] for b in backends}, {}, {}
    pt.reset_fallback_counts()
    for b, sdpa_backend in backends.items():          # warm-up (JIT, allocator, autotune)
        try:
            for _ in range(args.warmup + 1):
                _, losses[b], probes[b] = step.run(b, sdpa_backend)
        except Exception as exc:                      # a backend that refuses this model
            errors[b] = f"{type(exc).__name__}: {exc}"
            print(f"{b}: {errors[b][:160]}", flush=True)
    fallbacks = pt.fallback_counts()
    running = [b for b in backends if b not in errors]
    rng = random.Random(0)
    for _ in range(args.rounds):
        order = list(running)
        rng.shuffle(order)
        for b in order:
            ms, _, _ = step.run(b, backends[b])
            times[b].append(ms)
    results = {b: {"ms_median": statistics.median(times[b]), "ms": times[b],
                   "loss": losses[b]} for b in running}
    report = {"config": cfg, "layers": depth, "layers_reduced": bool(args.layers),
              "tiny": args.tiny, "args": vars(args), "results": results, "errors": errors,
              "ptxattn_fallbacks": fallbacks, "torch": torch.__version__,
              "transformers": transformers.__version__, "commit": commit(),
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "date": datetime.datetime.now().isoformat(timespec="seconds")}
    torch_running = [b for b in running if b != "ptxattn"]
    if "ptxattn" in running and torch_running:
        best = min(torch_running, key=lambda b: results[b]["ms_median"])
        ratios = [t / p for t, p in zip(times[best], times["ptxattn"])]
        lo, hi = bootstrap_ci(ratios)
        report["speedup"] = {"against": best, "median": statistics.median(ratios),
                             "ci95": [lo, hi], "rounds": len(ratios)}
        report["grad_rel_l2"] = {"ptxattn_vs_" + best: rel_l2(probes["ptxattn"], probes[best])}
        if len(torch_running) > 1:
            other = next(b for b in torch_running if b != best)
            report["grad_rel_l2"][f"{other}_vs_{best}"] = rel_l2(probes[other], probes[best])
    out_dir = Path(args.out or os.environ.get("OUT")
                   or Path(__file__).resolve().parents[1] / "results" / "models")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"train-step{'-tiny' if args.tiny else ''}-{datetime.date.today()}.json"
    path.write_text(json.dumps(report, indent=1))
    for b in running:
        print(f"{b:>9}: {results[b]['ms_median']:.1f} ms/step (fwd+bwd), loss "
              f"{results[b]['loss']:.4f}")
    if "speedup" in report:
        s = report["speedup"]
        print(f"speedup against {s['against']}: {s['median']:.3f} "
              f"[{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}] over {s['rounds']} rounds")
        print("gradient rel L2: " + json.dumps(report["grad_rel_l2"]))
    print(f"ptxattn fallbacks: {fallbacks or 'none'}")
    print(f"wrote {path}")
    return 0 if not fallbacks and "ptxattn" in running else 1



if __name__ == "__main__":
    sys.exit(main())

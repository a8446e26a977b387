"""The training check (issue 26): a small Llama-architecture transformer trained for 300 steps
with attn_implementation="ptxattn" and with "sdpa", same init and same data; the loss curves
must agree within the spread of two SDPA runs that differ only in their data order.

    python bench/models/train_check.py                  # the H200: 3 runs x 300 steps, ~2-3 min
    python bench/models/train_check.py --steps 300 --layers 4 --seq 1024 --batch 8
    python bench/models/train_check.py --tiny --device cpu --steps 6   (plumbing only)

The data is a learnable synthetic language: a seeded first-order Markov chain over the
vocabulary (each token has 4 possible successors with random probabilities), so the loss
falls from log(vocab) towards the chain's entropy and the curves have shape. A pool of
steps x batch sequences is drawn once; a run reads it in a seeded order ("sdpa" and
"ptxattn" in the same order, "sdpa_other_order" in another). AdamW with a linear warm-up,
bf16 weights, gradient clipping at 1. Every attention call of the ptxattn run goes through
ptxattn's forward and backward kernels (a fallback is counted and reported: there should be
none). The check itself (moving averages, the spread, the gap) is train_curves.verdict.

Writes train-check-<date>.json and train-check-<date>.svg (the figure to commit) into
--out, or $OUT, or bench/results/models/. Exit status 1 when the check fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bookkeeping import commit  # noqa: E402  (beside this script)
import train_curves  # noqa: E402  (beside this script; torch-free, tested on its own)

TINY = dict(vocab=64, hidden=128, heads=2, kv_heads=1, layers=2, seq=32, batch=4)


def markov_pool(vocab: int, count: int, length: int, seed: int) -> np.ndarray:
    """(count, length) int64 token ids from a seeded Markov chain with 4 successors a token."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, size=(vocab, 4))
    probs = rng.dirichlet(np.ones(4), size=vocab)
    cum = np.cumsum(probs, axis=1)
    ids = np.empty((count, length), np.int64)
    ids[:, 0] = rng.integers(0, vocab, size=count)
    for t in range(1, length):
        u = rng.random(count)[:, None]
        pick = (u > cum[ids[:, t - 1]]).sum(axis=1).clip(0, 3)
        ids[:, t] = successors[ids[:, t - 1], pick]
    return ids


def build(transformers, torch, args, impl: str):
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        max_position_embeddings=max(2048, args.seq), attn_implementation=impl,
        tie_word_embeddings=False)
    torch.manual_seed(args.init_seed)                    # the same init for every run
    return transformers.LlamaForCausalLM(cfg).to(args.device, torch.bfloat16).train()


def train(transformers, torch, args, impl: str, pool: np.ndarray, order_seed: int) -> dict:
    import ptxattn.torch as pt
    model = build(transformers, torch, args, impl)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.1)
    warm = max(1, args.steps // 15)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    order = np.random.default_rng(order_seed).permutation(len(pool))
    losses = []
    pt.reset_fallback_counts()
    start = time.perf_counter()
    for step in range(args.steps):
        rows = order[step * args.batch:(step + 1) * args.batch]
        ids = torch.from_numpy(pool[rows]).to(args.device)
        loss = model(ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if (step + 1) % 50 == 0 or step + 1 == args.steps:
            print(f"  {impl:8s} step {step + 1:4d}: loss {losses[-1]:.4f}", flush=True)
    seconds = time.perf_counter() - start
    return {"losses": losses, "seconds": seconds, "fallbacks": pt.fallback_counts()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=4, help="head dim = hidden / heads (128)")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--window", type=int, default=20, help="moving average of the check")
    ap.add_argument("--skip", type=int, default=20, help="steps before the check compares")
    ap.add_argument("--init-seed", type=int, default=0)
    ap.add_argument("--data-seed", type=int, default=1)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny config (the CPU plumbing test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        for name, value in TINY.items():
            setattr(args, name, value)
        args.window, args.skip = min(args.window, 2), min(args.skip, 1)
    if args.hidden % args.heads or args.heads % args.kv_heads:
        ap.error("--hidden, --heads, --kv-heads: heads must divide hidden and kv-heads heads")
    import torch
    import transformers

    import ptxattn.torch as pt
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA GPU (--tiny --device cpu for the plumbing)")
    pt.register_transformers()
    pool = markov_pool(args.vocab, args.steps * args.batch, args.seq, args.data_seed)
    print(f"train check: {args.layers} layers, hidden {args.hidden}, heads {args.heads}:"
          f"{args.kv_heads} (D={args.hidden // args.heads}), seq {args.seq}, batch "
          f"{args.batch}, {args.steps} steps, {args.device}", flush=True)
    runs, info = {}, {}
    for name, impl, order_seed in (("ptxattn", "ptxattn", 11), ("sdpa", "sdpa", 11),
                                   ("sdpa_other_order", "sdpa", 12)):
        result = train(transformers, torch, args, impl, pool, order_seed)
        runs[name] = result.pop("losses")
        info[name] = result
    check = train_curves.verdict(runs, window=args.window, skip=args.skip)
    if info["ptxattn"]["fallbacks"]:
        check = dict(check, note=f"ptxattn run fell back: {info['ptxattn']['fallbacks']}")
    stamp = datetime.date.today().isoformat()
    out_dir = Path(args.out or os.environ.get("OUT")
                   or Path(__file__).resolve().parents[1] / "results" / "models")
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"train-check{'-tiny' if args.tiny else ''}-{stamp}"
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    title = (f"{args.layers}-layer Llama, D={args.hidden // args.heads}, seq {args.seq}: "
             f"{'pass' if check['pass'] else 'FAIL'} ({gpu})")
    (out_dir / f"{stem}.svg").write_text(train_curves.svg(runs, title, window=args.window))
    report = {"args": vars(args), "runs": runs, "info": info, "check": check,
              "log_vocab": math.log(args.vocab), "torch": torch.__version__,
              "transformers": transformers.__version__, "gpu": gpu, "commit": commit(),
              "date": datetime.datetime.now().isoformat(timespec="seconds")}
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1))
    for name in runs:
        print(f"{name:18s} final (smoothed) {check.get('final_smoothed', {}).get(name, 0):.4f}"
              f"  {info[name]['seconds']:.1f} s  fallbacks {info[name]['fallbacks']}")
    print(("PASS: " if check["pass"] else "FAIL: ") + check["why"])
    print(f"wrote {out_dir / stem}.json and .svg")
    return 0 if check["pass"] else 1



if __name__ == "__main__":
    sys.exit(main())

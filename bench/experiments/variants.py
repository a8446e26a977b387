"""Same-run comparison of kernel builds on one shape: the tool for "predict, change, measure".

    python bench/experiments/variants.py --shape 2x16x16384x128 --rounds 20 --reps 10 \
        base=production 14=stage14 nomask=production:PTXATTN_NO_TAIL_MASK=1

Each variant is LABEL=KERNEL[:NAME=VALUE,...] (a kernel as `ptxattn run` names it, then build
defines). Every round times all variants interleaved launch by launch in a fresh random order;
the figure per variant is the median over rounds of its per-round median, and each ratio to the
first variant is the median over rounds of (first's time / its time) with a 95% bootstrap
interval over rounds. Outputs are checked against the reference before anything is timed
(a build that fails is reported and not timed). One JSON line per run goes to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from ptxattn import bench, driver, reference, tensors
from ptxattn.attention import prepare


def parse_variant(text: str):
    label, _, spec = text.partition("=")
    kernel, _, defs = spec.partition(":")
    defines = dict(d.split("=", 1) for d in defs.split(",") if d) if defs else {}
    if not label or not kernel:
        raise SystemExit(f"variant {text!r}: expected LABEL=KERNEL[:NAME=VALUE,...]")
    return label, kernel, defines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--shape", default="2x16x16384x128", help="BxHxLxD, or BxHxLqxLkxD")
    ap.add_argument("--layout", default="bhld")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--causal", action="store_true", help="causal (bottom-right diagonal)")
    ap.add_argument("--window", default=None, help="LEFT,RIGHT sliding window (-1: unbounded)")
    ap.add_argument("--out", default=None, help="append one JSON line here")
    args = ap.parse_args(argv)
    dims = [int(x) for x in args.shape.lower().split("x")]
    if len(dims) == 4:
        b, h, lq, d = dims
        lk = lq
    elif len(dims) == 5:
        b, h, lq, lk, d = dims
    else:
        raise SystemExit(f"--shape {args.shape!r}: expected BxHxLxD or BxHxLqxLkxD")
    variants = [parse_variant(v) for v in args.variants]
    q, k, v = reference.random_qkv(b, h, lq, lk, d, args.layout, seed=args.seed)
    qd, kd, vd = (tensors.from_numpy(x) for x in (q, k, v))
    rows = reference.sample_rows(lq, 128, seed=args.seed)
    window = tuple(int(x) for x in args.window.split(",")) if args.window else None
    mask = dict(causal=args.causal, window=window)
    ref = reference.attention_reference(q, k, v, layout=args.layout, rows=rows, **mask)
    axis = 2 if args.layout == "bhld" else 1
    runs, failed = {}, {}
    for label, kernel, defines in variants:
        out = tensors.empty(q.shape)
        out.fill_u16(0xFFFF)
        p = prepare(qd, kd, vd, stage=kernel, layout=args.layout, out=out, defines=defines or None,
                    **mask)
        p.launch()
        m = reference.error_metrics(np.take(out.to_numpy(), rows, axis=axis), ref)
        if not reference.passes(m):
            failed[label] = m
            print(f"{label}: FAILED its check {m}: not timed")
            continue
        runs[label] = p
    labels = list(runs)
    rng = np.random.default_rng(args.seed)
    per_round = {lab: [] for lab in labels}
    for _ in range(args.rounds):
        order = list(rng.permutation(labels))
        times = bench.time_interleaved([runs[lab].launch for lab in order], args.reps)
        for lab, t in zip(order, times):
            per_round[lab].append(bench.median(t))
    # FLOPs over the (query, key) pairs the mask leaves (bench's rule: causal and windows exact)
    flops = 4 * b * h * d * bench.unmasked_pairs(lq, lk, **mask)
    first = labels[0]
    result = {"shape": args.shape, "layout": args.layout, "rounds": args.rounds,
              "reps": args.reps, "gpu": driver.context().name if hasattr(driver.context(), "name")
              else None, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "source": bench.source_id(), "failed": {k: v for k, v in failed.items()},
              "variants": {}}
    result["mask"] = {"causal": args.causal, "window": window}
    print(f"shape {args.shape} {args.layout} {mask}, {args.rounds} rounds x {args.reps} reps")
    for lab in labels:
        ms = bench.median(per_round[lab])
        ratios = [a / c for a, c in zip(per_round[first], per_round[lab])]
        lo, hi = bench.bootstrap_ci(ratios, seed=args.seed)
        row = {"ms": ms, "tflops": flops / ms / 1e9, "ratio_to_first": bench.median(ratios),
               "ci": [lo, hi], "spread_pct": bench.spread_pct(per_round[lab]),
               "rounds_ms": per_round[lab]}
        result["variants"][lab] = row
        print(f"  {lab:<12} {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s  "
              f"{100 * row['ratio_to_first']:6.1f}% of {first} ({100 * lo:.1f}-{100 * hi:.1f})  "
              f"spread {row['spread_pct']:.1f}%")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

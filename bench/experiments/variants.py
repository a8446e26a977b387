"""Same-run comparison of kernel builds on one shape: the tool for "predict, change, measure".

    python bench/experiments/variants.py --shape 2x16x16384x128 --rounds 20 --reps 10 \
        base=production 14=stage14 sw1=production:SW_EXP2_PER_8=1

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

from ptxattn import driver, reference, tensors
from ptxattn.tools import bench
from ptxattn.api import prepare


def parse_variant(text: str):
    label, _, spec = text.partition("=")
    kernel, _, defs = spec.partition(":")
    pairs = [d.split("=", 1) for d in defs.split(",") if d] if defs else []
    if not label or not kernel or any(len(p) != 2 or not p[0] for p in pairs):
        raise SystemExit(f"variant {text!r}: expected LABEL=KERNEL[:NAME=VALUE,...]")
    return label, kernel, dict(pairs)


def parse_window(text: str | None):
    """--window LEFT,RIGHT -> (left, right); None: no window."""
    if text is None:
        return None
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--window {text!r}: expected LEFT,RIGHT (ints, -1: unbounded)") from None
    return left, right


def credited_flops(b: int, h: int, lq: int, lk: int, d: int, causal: bool, window) -> tuple:
    """(FLOPs, rule) as `ptxattn bench` credits them (bench.case_flops): dense 4*B*H*Lq*Lk*D,
    causal halved (the FlashAttention/cuDNN convention), windows over the exact pairs; so a
    variants figure and a bench figure of the same shape are the same TFLOP/s."""
    case = bench.Case(name="variants", batch=b, heads=h, seq_q=lq, seq_k=lk, head_dim=d,
                      causal=causal, window=window)
    return case.flops, bench.flops_rule(case)


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
    labels = [label for label, _, _ in variants]
    if len(set(labels)) != len(labels):            # a repeated label would overwrite a run
        raise SystemExit(f"variants: each LABEL once, got {', '.join(labels)}")
    window = parse_window(args.window)
    q, k, v = reference.random_qkv(b, h, lq, lk, d, args.layout, seed=args.seed)
    qd, kd, vd = (tensors.from_numpy(x) for x in (q, k, v))
    rows = reference.sample_rows(lq, 128, seed=args.seed)
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
    if not labels:
        print("every variant failed its check: nothing timed")
    rng = np.random.default_rng(args.seed)
    per_round = {lab: [] for lab in labels}
    for _ in range(args.rounds if labels else 0):
        order = list(rng.permutation(labels))
        times = bench.time_interleaved([runs[lab].launch for lab in order], args.reps)
        for lab, t in zip(order, times):
            per_round[lab].append(bench.median(t))
    flops, rule = credited_flops(b, h, lq, lk, d, args.causal, window)
    first = labels[0] if labels else None
    result = {"shape": args.shape, "layout": args.layout, "rounds": args.rounds,
              "reps": args.reps, "gpu": driver.context().name if hasattr(driver.context(), "name")
              else None, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "source": bench.source_id(), "failed": {k: v for k, v in failed.items()},
              "variants": {}}
    result["mask"] = {"causal": args.causal, "window": window}
    result["flops"], result["flops_rule"] = flops, rule
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

"""Same-run comparison of kernel builds on one shape: the tool for "predict, change, measure".

    python bench/experiments/variants.py --shape 2x16x16384x128 --rounds 20 --reps 10 \
        base=production 14=stage14 sw1=production:SW_EXP2_PER_8=1

Each variant is LABEL=KERNEL[:NAME=VALUE,...] (a kernel as `ptxattn run` names it, then build
defines); KERNEL `cudnn` is cuDNN through PyTorch's SDPA on the same inputs (needs PyTorch).
Every round times all variants interleaved launch by launch in a fresh random order; the
figure per variant is the median over rounds of its per-round median, and each ratio to the
first variant is the median over rounds of (first's time / its time) with a 95% bootstrap
interval over rounds. Outputs are checked against the reference before anything is timed
(a build that fails is reported and not timed). One JSON line per run goes to --out.

--sustained: after the rounds, each variant (in a seeded random order) also runs a sustained
window at the power cap (ptxattn/tools/sustained.py, as `ptxattn bench --sustained`): sustained
TFLOP/s, median SM clock and power, TFLOP/J, and its sustained speed in % of the first's.
--heads-kv: GQA (K/V heads). The production walk's section (its walk_section parameter) comes
from the host's rule, l2-walk (ptxattn/tile_walk.section_pairs: what attention() passes), or
the one a variant names with walk=RULE among its defines, e.g. old=production:walk=today
(tile_walk.WALKS: today, head-major, l2-walk, l2-band; or section:N, N pairs forced);
it is no build define.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from ptxattn import driver, reference, tensors, tile_walk
from ptxattn.tools import bench, sustained
from ptxattn.api import prepare


WALK_KEY = "walk"                       # a variant's section rule, not a define
RETIRED_KNOBS = ("PTXATTN_L2_WALK", "PTXATTN_HEAD_MAJOR")   # now walk=l2-walk / walk=head-major


def parse_variant(text: str):
    """LABEL=KERNEL[:NAME=VALUE,...] -> (label, kernel, defines, walk rule)."""
    label, _, spec = text.partition("=")
    kernel, _, defs = spec.partition(":")
    pairs = [d.split("=", 1) for d in defs.split(",") if d] if defs else []
    if not label or not kernel or any(len(p) != 2 or not p[0] for p in pairs):
        raise SystemExit(f"variant {text!r}: expected LABEL=KERNEL[:NAME=VALUE,...]")
    defines = dict(pairs)
    for knob in RETIRED_KNOBS:
        if knob in defines:
            raise SystemExit(f"variant {text!r}: {knob} is no build knob any more (the sectioned "
                             f"walk is every build's); walk=RULE picks the section rule "
                             f"({', '.join(tile_walk.WALKS)})")
    walk = defines.pop(WALK_KEY, "l2-walk")
    try:
        tile_walk.check_rule(walk)
    except ValueError as e:
        raise SystemExit(f"variant {text!r}: walk={walk}: {e}") from None
    return label, kernel, defines, walk


def parse_window(text: str | None):
    """--window LEFT,RIGHT -> (left, right); None: no window."""
    if text is None:
        return None
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--window {text!r}: expected LEFT,RIGHT (ints, -1: unbounded)") from None
    return left, right


def credited_flops(b: int, h: int, lq: int, lk: int, d: int, causal: bool, window,
                   heads_kv: int = 0) -> tuple:
    """(FLOPs, rule) as `ptxattn bench` credits them (bench.case_flops): dense 4*B*H*Lq*Lk*D,
    causal halved (the FlashAttention/cuDNN convention), windows over the exact pairs; so a
    variants figure and a bench figure of the same shape are the same TFLOP/s."""
    case = bench.Case(name="variants", batch=b, heads=h, seq_q=lq, seq_k=lk, head_dim=d,
                      causal=causal, window=window, heads_kv=heads_kv)
    return case.flops, bench.flops_rule(case)


class CudnnVariant:
    """The cuDNN peer as a variant: SDPA with the cuDNN backend on device copies of the inputs
    (bench._cudnn_launcher: BSHD as transposed views, GQA by enable_gqa)."""

    def __init__(self, q, k, v, layout: str, causal: bool, window):
        torch = bench._import_torch()
        if torch is None:
            raise SystemExit("variant cudnn: needs PyTorch with a CUDA device")
        if window is not None:
            raise SystemExit("variant cudnn: SDPA has no sliding window")
        axis = 2 if layout == "bhld" else 1
        if causal and q.shape[axis] != k.shape[axis]:
            raise SystemExit("variant cudnn: SDPA's causal diagonal is top-left, ours "
                             "bottom-right: they differ when Lq != Lk")
        self.torch, self.layout = torch, layout
        qt, kt, vt = (torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).to("cuda")
                      .view(torch.bfloat16) for x in (q, k, v))
        heads_axis = 1 if layout == "bhld" else 2
        gqa = "enable_gqa" if q.shape[heads_axis] != k.shape[heads_axis] else None
        self.launch = bench._cudnn_launcher(torch, qt, kt, vt, layout, causal=causal, gqa=gqa)
        self.stream = torch.cuda.current_stream().cuda_stream

    def output(self):
        """One call's output as float32 NumPy in the inputs' layout."""
        o = self.launch().float().cpu().numpy()      # BHLD (SDPA's)
        return o.transpose(0, 2, 1, 3) if self.layout == "bshd" else o


def sustained_figures(runs: dict, per_round: dict, flops: int, cfg, rng) -> dict:
    """Each variant's sustained window (sustained.figures: a seeded random order, the first
    variant the peer of the others' pct_of_peer), {label: figures}; a sampler that is missing
    stops with its one-line reason before any window."""
    kernels = {lab: sustained.Kernel(runs[lab].launch, runs[lab].stream, flops,
                                     bench.median(per_round[lab])) for lab in runs}
    return sustained.figures(kernels, cfg, rng=rng, peer=next(iter(runs)), log=print)


def arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--shape", default="2x16x16384x128", help="BxHxLxD, or BxHxLqxLkxD")
    ap.add_argument("--layout", default="bhld")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--causal", action="store_true", help="causal (bottom-right diagonal)")
    ap.add_argument("--window", default=None, help="LEFT,RIGHT sliding window (-1: unbounded)")
    ap.add_argument("--heads-kv", type=int, default=0, help="K/V heads (GQA); 0: as many as q")
    sustained.add_arguments(ap)
    ap.add_argument("--out", default=None, help="append one JSON line here")
    return ap


def main(argv=None) -> int:
    ap = arg_parser()
    args = ap.parse_args(argv)
    cfg = sustained.config_from_args(ap, args)
    dims = [int(x) for x in args.shape.lower().split("x")]
    if len(dims) == 4:
        b, h, lq, d = dims
        lk = lq
    elif len(dims) == 5:
        b, h, lq, lk, d = dims
    else:
        raise SystemExit(f"--shape {args.shape!r}: expected BxHxLxD or BxHxLqxLkxD")
    variants = [parse_variant(v) for v in args.variants]
    labels = [label for label, _, _, _ in variants]
    walks = {label: (None if kernel == "cudnn" else walk) for label, kernel, _, walk in variants}
    if len(set(labels)) != len(labels):            # a repeated label would overwrite a run
        raise SystemExit(f"variants: each LABEL once, got {', '.join(labels)}")
    window = parse_window(args.window)
    hkv = args.heads_kv or h
    if hkv < 1 or h % hkv:
        raise SystemExit(f"--heads-kv {args.heads_kv}: expected a divisor of the {h} heads")
    q, k, v = reference.random_qkv(b, h, lq, lk, d, args.layout, seed=args.seed, heads_kv=hkv)
    qd, kd, vd = (tensors.from_numpy(x) for x in (q, k, v))
    rows = reference.sample_rows(lq, 128, seed=args.seed)
    mask = dict(causal=args.causal, window=window)
    ref = reference.attention_reference(q, k, v, layout=args.layout, rows=rows, **mask)
    axis = 2 if args.layout == "bhld" else 1
    runs, failed = {}, {}
    for label, kernel, defines, walk in variants:
        if kernel == "cudnn":
            p = CudnnVariant(q, k, v, args.layout, args.causal, window)
            got = p.output()
        else:
            out = tensors.empty(q.shape)
            out.fill_u16(0xFFFF)
            p = prepare(qd, kd, vd, stage=kernel, layout=args.layout, out=out,
                        defines=defines or None, walk_rule=walk, **mask)
            p.launch()
            got = out.to_numpy()
        m = reference.error_metrics(np.take(got, rows, axis=axis), ref)
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
        times = bench.time_interleaved([runs[lab].launch for lab in order], args.reps,
                                       streams=[runs[lab].stream for lab in order])
        for lab, t in zip(order, times):
            per_round[lab].append(bench.median(t))
    flops, rule = credited_flops(b, h, lq, lk, d, args.causal, window, hkv)
    first = labels[0] if labels else None
    result = {"shape": args.shape, "layout": args.layout, "rounds": args.rounds,
              "reps": args.reps, "gpu": driver.context().name if hasattr(driver.context(), "name")
              else None, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "source": bench.source_id(), "failed": {k: v for k, v in failed.items()},
              "variants": {}}
    result["mask"] = {"causal": args.causal, "window": window}
    result["heads_kv"] = hkv
    result["flops"], result["flops_rule"] = flops, rule
    print(f"shape {args.shape} {args.layout} {mask}, {args.rounds} rounds x {args.reps} reps")
    for lab in labels:
        ms = bench.median(per_round[lab])
        ratios = [a / c for a, c in zip(per_round[first], per_round[lab])]
        lo, hi = bench.bootstrap_ci(ratios, seed=args.seed)
        row = {"ms": ms, "tflops": flops / ms / 1e9, "ratio_to_first": bench.median(ratios),
               "ci": [lo, hi], "spread_pct": bench.spread_pct(per_round[lab]),
               "rounds_ms": per_round[lab], "walk": walks[lab]}
        result["variants"][lab] = row
        print(f"  {lab:<12} {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s  "
              f"{100 * row['ratio_to_first']:6.1f}% of {first} ({100 * lo:.1f}-{100 * hi:.1f})  "
              f"spread {row['spread_pct']:.1f}%")
    if cfg is not None and labels:
        figures = sustained_figures(runs, per_round, flops, cfg, rng)
        for lab in labels:
            s = figures[lab]
            if s.get("tflops"):
                s["pct_of_first"] = 100.0 if lab == first else s.get("pct_of_peer")
            result["variants"][lab]["sustained"] = s
            print(f"  {lab:<12} sustained "
                  + (f"{s['tflops']:7.1f} TFLOP/s {s.get('pct_of_first') or 0:6.1f}% of {first}  "
                     f"{s.get('sm_mhz_median') or 0:.0f} MHz  {s.get('power_w_median') or 0:.0f} W"
                     f"  {s.get('tflop_per_j') or 0:.3f} TFLOP/J" if s.get("tflops")
                     else f"error: {s.get('error')}"))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

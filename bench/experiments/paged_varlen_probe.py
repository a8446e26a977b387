"""What the paged varlen build (flash_attn_varlen_func(..., block_table=)) loses against the
packed-key call, and which producer variant wins it back: bench/serving_bench.py's chunked
prefill case (8 sequences of 512 to 16k cached keys, chunks of up to 2048 queries, causal,
32:8 heads, D 128), one process, same data.

    python bench/experiments/paged_varlen_probe.py --pages 16,64,256 --variants today,ahead
    python bench/experiments/paged_varlen_probe.py --ncu --page 256 --out $OUT/ncu.jsonl

Timing (default): per page size, the packed call and each variant's paged call in interleaved
rounds (decode_bench.timed_rounds: CUDA events, the host never waiting); each paged output
must equal the packed one bit for bit before it is timed. Prints TFLOP/s and paged / packed
per variant, medians over rounds with a 95% bootstrap interval. --in-order: the pool's pages
in the sequences' order (a sequence's pages adjacent, as its packed keys are) instead of
shuffled: what the build costs apart from where the pages lie. --sustained: then each call back to
back at the power cap per page size (ptxattn/tools/sustained.py, as `ptxattn bench --sustained`).
--ncu: Nsight Compute on one forward launch each (packed, then each variant's paged) at
natural clocks (--clock-control none): duration, SM clock, DRAM, L2 hit rate, instructions and
issue, the top warp stalls (ncu_paged.py's figures).

A variant is extra defines of the paged build (VARIANTS below), set by building the call's
Launcher under a forward_build that adds them; the library's own choice is "today".
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

# the paged build's producer variants (kv_paged.ptxh / decode_kv_paged.ptxh)
# (session 17: the warp producer is the default; "thread" is session 16's default)
VARIANTS = {
    "today": (),
    "thread": (("PTXATTN_PAGED_WARP", "0"),),       # thread 0 alone, entries batched
    "ahead": (("PTXATTN_PAGED_WARP", "0"),          # the same, tile t + 1's entries sent
              ("PTXATTN_PAGED_TABLE_AHEAD", "1")),  # during tile t
    "warp": (("PTXATTN_PAGED_WARP", "1"),),         # the producer's warp, one lane issuing
    "warp_ahead": (("PTXATTN_PAGED_WARP", "1"), ("PTXATTN_PAGED_TABLE_AHEAD", "1")),
}
NVTX_RANGE = "ptxattn-ncu"


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"probe_{name}", HERE.parent / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def calls(torch, page: int, variants, seed: int, in_order: bool = False):
    """{label: zero-argument call}: the packed call, then each variant's paged call (over a
    pool whose pages are in the sequences' order with in_order, else shuffled)."""
    import ptxattn
    from ptxattn import driver, varlen
    sb = _sibling("serving_bench")
    c = sb.paged_varlen_data(torch, page, seed, shuffled=not in_order)
    args = (c["q"], c["k"], c["v"], c["cu_q"], c["cu_k"], c["mq"], c["mk"])
    out = {"packed": lambda: ptxattn.flash_attn_varlen_func(*args, causal=True)}
    paged = (c["q"], c["kp"], c["vp"], c["cu_q"], c["cu_k"], c["mq"], c["mk"])
    plain_build = varlen.forward_build
    for name in variants:
        extra = VARIANTS[name]

        def build(d, is_paged=False, extra=extra):
            st = plain_build(d, is_paged)
            return dataclasses.replace(st, defines=st.defines + extra)
        call = varlen.validate(*paged, causal=True, block_table=c["table"])
        varlen.forward_build = build
        try:
            launcher = varlen.Launcher(call, driver.context().sm_count)
        finally:
            varlen.forward_build = plain_build

        def run(launcher=launcher):
            call = varlen.validate(*paged, causal=True, block_table=c["table"])
            return varlen.run_call(call, launcher)[0]
        out[f"page{page}:{name}"] = run
    return out, c["flops"]


def timing(args, cfg=None) -> int:
    """cfg (a sustained.Config, --sustained): also a sustained window per call and page size
    after its rounds (power and SM clock sampled; TFLOP/s and TFLOP/J in % of the packed
    call's, same run)."""
    from ptxattn.tools import sustained
    sampler = sustained.start_sampler(cfg) if cfg is not None else None
    try:
        return _timing(args, cfg, sampler)
    finally:
        if sampler is not None:
            sampler.stop()


def _timing(args, cfg, sampler) -> int:
    import torch
    from ptxattn.tools import sustained
    db = _sibling("decode_bench")
    variants = args.variants.split(",")
    ok = True
    for page in [int(p) for p in args.pages.split(",")]:
        fns, flops = calls(torch, page, variants, args.seed, args.in_order)
        outs = {k: fn() for k, fn in fns.items()}
        torch.cuda.synchronize()
        for label, o in outs.items():
            diff = float((o.float() - outs["packed"].float()).abs().max())
            if diff:
                print(f"{label}: differs from packed by {diff:.3g}: not timed")
                ok = False
        if not ok:
            continue
        rounds = db.timed_rounds(fns, args.rounds, args.reps, np.random.default_rng(args.seed))
        row = {"page": page, "flops": flops,
               "pages": "in order" if args.in_order else "shuffled"}
        if cfg is not None:      # at the power cap: each call back to back (ptxattn bench's)
            stream = torch.cuda.current_stream().cuda_stream
            kernels = {label: sustained.Kernel(fn, stream, flops, db.median(rounds[label]))
                       for label, fn in fns.items()}
            row["sustained"] = sustained.figures(
                kernels, cfg, rng=np.random.default_rng(args.seed), peer="packed",
                sampler=sampler, log=print)
        for label, ms in rounds.items():
            ratios = [a / b for a, b in zip(rounds["packed"], ms)]
            lo, hi = db.bootstrap_ci(ratios, seed=args.seed)
            row[label] = {"ms": db.median(ms), "tflops": flops / (db.median(ms) * 1e-3) / 1e12,
                          "over_packed": db.median(ratios), "ci": [lo, hi]}
            print(f"page {page:>3} {label:<16} {row[label]['tflops']:7.1f} TFLOP/s  "
                  f"paged/packed {row[label]['over_packed']:.3f} [{lo:.3f}, {hi:.3f}]",
                  flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **row}) + "\n")
        del fns, outs
        torch.cuda.empty_cache()
    return 0 if ok else 1


def target(args) -> int:
    """What ncu runs: every call warmed up, then one call each inside the NVTX range."""
    import torch
    fns, _ = calls(torch, args.page, args.variants.split(","), args.seed)
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    for fn in fns.values():
        torch.cuda.nvtx.range_push(NVTX_RANGE)
        fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    return 0


def ncu(args) -> int:
    import ncu_bind
    spec = importlib.util.spec_from_file_location("ncu_paged", HERE / "ncu_paged.py")
    ncu_paged = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ncu_paged)
    tool = shutil.which("ncu")
    if not tool:
        raise SystemExit("--ncu: ncu is not on PATH")
    known = ncu_bind.available_metrics(tool, subprocess.run)
    metrics = [m for m in ncu_paged.METRICS if known is None or m.split(".")[0] in known]
    labels = ["packed"] + [f"page{args.page}:{v}" for v in args.variants.split(",")]
    cmd = [tool, "--clock-control", "none", "--nvtx", "--nvtx-include", f"{NVTX_RANGE}/",
           "-k", "ptxattn_fwd", "--csv", "--page", "raw", "--print-units", "base",
           "--launch-count", str(len(labels))]
    for s in ncu_paged.SECTIONS:
        cmd += ["--section", s]
    cmd += ["--metrics", ",".join(metrics), sys.executable, str(Path(__file__).resolve()),
            "--target", "--page", str(args.page), "--variants", args.variants]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    launches = ncu_bind.parse_raw_csv(proc.stdout)
    if proc.returncode or len(launches) != len(labels):
        print(f"ncu exit {proc.returncode}, {len(launches)} launches: "
              + " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-6:]))
        return 1
    rows = [{"launch": label, "clocks": "natural", **ncu_paged.figures(launch)}
            for label, launch in zip(labels, launches)]
    print(ncu_paged.format_rows(rows))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"page": args.page, "rows": rows}) + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", default="16,64,256")
    ap.add_argument("--page", type=int, default=256, help="--ncu / --target: one page size")
    ap.add_argument("--variants", default="today,ahead")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--in-order", action="store_true",
                    help="the pool's pages in the sequences' order (not shuffled)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=int, default=300)
    from ptxattn.tools import sustained
    sustained.add_arguments(ap)
    args = ap.parse_args(argv)
    cfg = sustained.config_from_args(ap, args)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: {unknown} not among {', '.join(VARIANTS)}")
    if args.target:
        return target(args)
    return ncu(args) if args.ncu else timing(args, cfg)


if __name__ == "__main__":
    sys.exit(main())

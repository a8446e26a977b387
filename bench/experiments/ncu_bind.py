"""What binds a kernel: one launch under Nsight Compute (ncu), for bench/README.md's "what binds".

Target mode (what ncu runs; bench/experiments/ncu_bind.sh's section reports):

    ncu --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        -k ptxattn_fwd --launch-skip 1 --launch-count 1 \
        python bench/experiments/ncu_bind.py stage14 --shape 4x16x8192x128 [--causal]

Launches the kernel twice on fresh random inputs (the first launch JIT-compiles and warms up;
ncu profiles the second) and checks the output against the reference, so a profile is never of
a wrong kernel. No timing here: ncu replays the kernel per metric pass. KERNEL `cudnn` is
PyTorch's SDPA with the cuDNN backend (its second call, inside the NVTX range ptxattn-ncu).

Profile mode (--profile): runs ncu itself on the target mode twice, at natural clocks
(`--clock-control none`: the clock the kernel really gets) and at locked clocks (ncu's default,
`base`), and reads per launch the L2 hit rate (lts__t_sector_hit_rate.pct), the SM clock the
kernel ran at (sm__cycles_elapsed.avg.per_second), the tensor pipe (the "Shared" pipe that the
Compute Workload Analysis names, dominated by its Tensor sub-pipe, and any tensor-op pipe
metric ncu collected), issue slots active, DRAM bytes read and written and the duration. Prints
a small table and appends one JSON line per run to --out:

    python bench/experiments/ncu_bind.py --profile production --shape 2x16x16384x128 --causal \
        --out $OUT/ncu-l2.jsonl
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ptxattn import driver, reference, tensors, tile_walk
from ptxattn.tools import bench
from ptxattn.api import prepare

NVTX_RANGE = "ptxattn-ncu"
# metrics asked for by name (each kept only when `ncu --query-metrics` lists it), beside the
# sections whose raw metrics the figures below also read
METRICS = (
    "lts__t_sector_hit_rate.pct",
    "sm__cycles_elapsed.avg.per_second",
    "sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "sm__inst_issued.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "gpu__time_duration.sum",
)
# what a run falls back to when ncu refuses the full list (a metric this ncu does not know)
SAFE_METRICS = ("lts__t_sector_hit_rate.pct", "sm__cycles_elapsed.avg.per_second",
                "dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")
SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis")
# figure -> the raw metric names that give it, first found wins
FIGURES = {
    "l2_hit_pct": ("lts__t_sector_hit_rate.pct",),
    "sm_mhz": ("sm__cycles_elapsed.avg.per_second",),
    "tensor_pipe_pct": ("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
                        "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",
                        "sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active"),
    "shared_pipe_pct": ("sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active",),
    "issue_active_pct": ("smsp__issue_active.avg.pct_of_peak_sustained_active",
                         "sm__inst_issued.avg.pct_of_peak_sustained_active"),
    "instructions": ("sm__inst_issued.sum", "smsp__inst_issued.sum"),
    "dram_read_bytes": ("dram__bytes_read.sum",),
    "dram_write_bytes": ("dram__bytes_write.sum",),
    "duration_ns": ("gpu__time_duration.sum",),
}
CLOCKS = {"natural": "none", "locked": "base"}


# ---- target mode --------------------------------------------------------------------------

def target(args) -> int:
    _, (b, h, seq, d) = bench.parse_shape(args.shape)   # the benchmark's own shape names too
    hkv = args.heads_kv or h
    window = _window(args.window)
    if args.kernel == "cudnn" and (window is not None or args.layout != "bhld"):
        raise SystemExit("cudnn: BHLD without a window only (SDPA's layout; no window there)")
    q, k, v = reference.random_qkv(b, h, seq, seq, d, args.layout, seed=1, heads_kv=hkv)
    rows = reference.sample_rows(seq, 64, seed=1)
    seq_axis = 2 if args.layout == "bhld" else 1
    ref = reference.attention_reference(q, k, v, layout=args.layout, rows=rows,
                                        causal=args.causal, window=window)
    if args.kernel == "cudnn":
        got = _cudnn(q, k, v, args.causal)
    else:
        qd, kd, vd = (tensors.from_numpy(x) for x in (q, k, v))
        out = tensors.empty(q.shape)
        out.fill_u16(0xFFFF)
        defines = dict(x.split("=", 1) for x in args.define) or None
        p = prepare(qd, kd, vd, stage=args.kernel, out=out, causal=args.causal, defines=defines,
                    walk_rule=args.walk, layout=args.layout, window=window)
        p.launch()
        p.launch()
        driver.synchronize()
        got = out.to_numpy()
    m = reference.error_metrics(np.take(got, rows, axis=seq_axis), ref)
    print(f"{args.kernel} {args.shape} {args.layout} causal={args.causal} "
          f"window={args.window or '-'}: {m}")
    return 0 if reference.passes(m) else 1


def _cudnn(q, k, v, causal):
    """cuDNN SDPA twice; the second call inside the NVTX range that --profile filters on."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (torch.from_numpy(x.astype(np.float32)).to("cuda", torch.bfloat16)
                  for x in (q, k, v))
    kw = {"is_causal": True} if causal else {}
    if kt.shape[1] != qt.shape[1]:
        kw["enable_gqa"] = True
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(qt, kt, vt, **kw)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(NVTX_RANGE)
        o = F.scaled_dot_product_attention(qt, kt, vt, **kw)
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    return o.float().cpu().numpy()


def _walk_rule(text):
    """--walk RULE: tile_walk.check_rule's, as argparse's error."""
    try:
        return tile_walk.check_rule(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _window(text):
    """--window LEFT,RIGHT as FlashAttention's (left, right), or None."""
    if not text:
        return None
    left, right = (int(x) for x in text.split(","))
    return (left, right)


# ---- profile mode -------------------------------------------------------------------------

def available_metrics(ncu: str, run=subprocess.run) -> set[str] | None:
    """The metric base names ncu knows on this GPU (`--query-metrics`), or None if it cannot
    say (then every metric is asked for and an unknown one fails the run loudly)."""
    try:
        proc = run([ncu, "--query-metrics"], capture_output=True, text=True, timeout=120,
                   check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    names = {line.split()[0] for line in proc.stdout.splitlines() if line[:1].isalpha()
             and "__" in line.split()[0]}
    return names or None


def wanted_metrics(known: set[str] | None) -> tuple[list[str], list[str]]:
    """(metrics to ask for, those ncu does not know): a metric is known when its base name
    (before the first '.') is listed."""
    if known is None:
        return list(METRICS), []
    keep = [m for m in METRICS if m.split(".")[0] in known]
    return keep, [m for m in METRICS if m not in keep]


def ncu_command(ncu: str, clocks: str, metrics, target_argv, kernel: str) -> list[str]:
    cmd = [ncu, "--clock-control", CLOCKS[clocks], "--csv", "--page", "raw",
           "--print-units", "base"]
    for s in SECTIONS:
        cmd += ["--section", s]
    if metrics:
        cmd += ["--metrics", ",".join(metrics)]
    if kernel == "cudnn":
        cmd += ["--nvtx", "--nvtx-include", f"{NVTX_RANGE}/", "--launch-count", "1"]
    else:
        cmd += ["-k", "ptxattn_fwd", "--launch-skip", "1", "--launch-count", "1"]
    return cmd + [sys.executable, str(Path(__file__).resolve()), *target_argv]


def parse_raw_csv(text: str) -> list[dict[str, str]]:
    """The launches of `ncu --csv --page raw` output: one {metric: value} per launch (the
    header row starts with "ID"; the row after it holds units; lines that are not CSV, like
    the profiled program's own output and ==PROF== lines, are skipped)."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    rows = list(csv.reader(lines))
    start = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), None)
    if start is None:
        return []
    head = rows[start]
    body = rows[start + 1:]
    if body and body[0] and not body[0][0].strip().isdigit():
        body = body[1:]                       # the units row
    return [dict(zip(head, r)) for r in body if len(r) == len(head)]


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    text = text.strip().replace(",", "")
    try:
        return float(text)
    except ValueError:
        return None


def figures(launch: dict[str, str]) -> dict:
    """The figures of one profiled launch (None where ncu gave none), and which metric each
    came from."""
    out, source = {}, {}
    for name, metrics in FIGURES.items():
        out[name] = None
        for m in metrics:
            value = _number(launch.get(m))
            if value is not None:
                out[name], source[name] = value, m
                break
    if out["sm_mhz"] is not None:
        out["sm_mhz"] /= 1e6                  # Hz (base units) -> MHz
    out["source"] = source
    out["tensor_metrics"] = {m: _number(v) for m, v in launch.items()
                             if "pipe_tensor" in m and _number(v) is not None}
    return out


def format_table(rows: list[dict]) -> str:
    head = ("kernel", "clocks", "L2 hit %", "SM MHz", "tensor %", "issue %", "DRAM rd GB",
            "DRAM wr GB", "ms")

    def f(v, spec, scale=1.0):
        return "-" if v is None else format(v / scale, spec)
    cells = [(r["kernel"], r["clocks"], f(r["l2_hit_pct"], ".1f"), f(r["sm_mhz"], ".0f"),
              f(r["tensor_pipe_pct"], ".1f"), f(r["issue_active_pct"], ".1f"),
              f(r["dram_read_bytes"], ".2f", 1e9), f(r["dram_write_bytes"], ".3f", 1e9),
              f(r["duration_ns"], ".3f", 1e6)) for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *cells)]
    return "\n".join("  ".join(f"{c:<{w}}" if i < 2 else f"{c:>{w}}"
                               for i, (c, w) in enumerate(zip(line, widths)))
                     for line in (head, *cells))


def profile(args, target_argv, *, run=subprocess.run, which=shutil.which) -> int:
    ncu = which("ncu")
    if not ncu:
        raise SystemExit("--profile: ncu (Nsight Compute) is not on PATH")
    metrics, unknown = wanted_metrics(available_metrics(ncu, run))
    if unknown:
        print(f"ncu does not know {', '.join(unknown)} on this GPU: not asked for")
    rows = []
    for clocks in args.clocks.split(","):
        cmd = ncu_command(ncu, clocks, metrics, target_argv, args.kernel)
        proc = run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
        launches = parse_raw_csv(proc.stdout)
        if proc.returncode != 0 and list(metrics) != list(SAFE_METRICS):
            print(f"{args.kernel} {clocks}: ncu exit {proc.returncode}; again with "
                  f"{', '.join(SAFE_METRICS)} only")
            cmd = ncu_command(ncu, clocks, SAFE_METRICS, target_argv, args.kernel)
            proc = run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
            launches = parse_raw_csv(proc.stdout)
        check = [line for line in proc.stdout.splitlines() if line.startswith(args.kernel)]
        if proc.returncode != 0 or len(launches) != 1:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
            print(f"{args.kernel} {clocks}: ncu exit {proc.returncode}, {len(launches)} launches "
                  f"profiled (expected 1): {' | '.join(tail)}")
            rows.append({"kernel": args.kernel, "clocks": clocks, "error": proc.returncode,
                         **{k: None for k in FIGURES}})
            continue
        rows.append({"kernel": args.kernel, "clocks": clocks, "check": check[-1] if check else None,
                     **figures(launches[0])})
    print(f"{args.kernel} {args.shape} {args.layout} causal={args.causal} "
          f"window={args.window or '-'} heads_kv={args.heads_kv or '-'} "
          f"defines={args.define or '-'} walk={args.walk}")
    print(format_table(rows))
    if args.out:
        entry = {"kernel": args.kernel, "shape": args.shape, "layout": args.layout,
                 "window": args.window, "causal": args.causal,
                 "heads_kv": args.heads_kv, "defines": args.define, "walk": args.walk,
                 "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "source": bench.source_id(),
                 "metrics": metrics, "unknown_metrics": unknown, "rows": rows}
        with open(args.out, "a") as f:
            f.write(json.dumps(entry) + "\n")
    return 0 if all("error" not in r for r in rows) else 1


def arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", help="a kernel as `ptxattn run` names it, or cudnn")
    ap.add_argument("--shape", default="4x16x8192x128", help="4k, 8k, ... or BxHxLxD")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--heads-kv", type=int, default=0, help="K/V heads (GQA); 0: as many as q")
    ap.add_argument("--layout", default="bhld", choices=("bhld", "bshd"))
    ap.add_argument("--window", default=None, help="LEFT,RIGHT sliding window (-1: unbounded)")
    ap.add_argument("-d", "--define", action="append", default=[], help="NAME=VALUE")
    ap.add_argument("--walk", default="l2-walk", type=_walk_rule,
                    help=f"the production walk's section rule ({', '.join(tile_walk.WALKS)}, "
                         f"or section:N; l2-walk: attention()'s)")
    ap.add_argument("--profile", action="store_true",
                    help="run ncu on this at natural and locked clocks; table and JSON")
    ap.add_argument("--clocks", default="natural,locked", help="--profile: natural, locked")
    ap.add_argument("--out", default=None, help="--profile: append one JSON line here")
    ap.add_argument("--timeout", type=int, default=300, help="--profile: per ncu run, seconds")
    return ap


def main(argv=None) -> int:
    ap = arg_parser()
    args = ap.parse_args(argv)
    for c in args.clocks.split(","):
        if c not in CLOCKS:
            raise SystemExit(f"--clocks: expected natural and/or locked, got {c!r}")
    if args.profile:
        target_argv = [args.kernel, "--shape", args.shape] + (["--causal"] if args.causal else []) \
            + (["--heads-kv", str(args.heads_kv)] if args.heads_kv else []) \
            + ["--layout", args.layout] + (["--window", args.window] if args.window else []) \
            + [x for d in args.define for x in ("-d", d)] + ["--walk", args.walk]
        return profile(args, target_argv)
    return target(args)


if __name__ == "__main__":
    sys.exit(main())

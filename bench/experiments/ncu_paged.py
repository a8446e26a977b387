"""What binds the paged decode at small pages: Nsight Compute on one launch each of the
contiguous-cache decode and the paged decode (today's build and a variant) of the same shape,
for issue 25's target (paged >= 0.95x contiguous at page 16; measured 0.67-0.68).

    python bench/experiments/ncu_paged.py --profile --out $OUT/ncu-paged.jsonl      # ~1.5-2 min
    python bench/experiments/ncu_paged.py --profile --case b8_32k --variant rowgroup_ahead \
        --clocks natural --no-source --out $OUT/ncu-paged.jsonl

Target mode (what ncu runs; no --profile): builds the serving benchmark's case (bench/
serving_bench.py PAGED_CASES: the contiguous caches and a shuffled paged copy at --page),
warms every launch up (JIT) outside any range, then makes the profiled calls in order, each
inside the NVTX range ptxattn-ncu: the contiguous decode, the paged one under today's build,
the paged one under --variant (PTXATTN_PAGED_VARIANT). Each paged output must equal the
contiguous one bit for bit (a profile is never of a wrong kernel).

Profile mode (--profile): ncu on the target, one run per clock setting (natural: --clock-control
none, the clock the kernel really gets; locked: ncu's base clocks), profiling the three
ptxattn_decode launches of the ranges, and prints per launch: duration, SM clock, DRAM read
bytes and GB/s, DRAM throughput % of peak, L2 hit rate, TMA load bytes, global load
(LSU) requests, instructions issued and issue slots busy, and the top warp stall reasons (all
warps: 4 consumer warps, 1 producer). Then (unless --no-source) for each paged launch one
more run at natural clocks with the SourceCounters section, read back as the SASS source page:
the stall samples of the producer's instructions (the code between the consumer's last EXIT
and the producer's, which holds every UTMALDG) by opcode and the top instructions, which is
where the producer's critical path shows. Metrics ncu does not know on this GPU are dropped
(ncu_bind.py's query). One JSON line per run goes to --out.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import ncu_bind  # noqa: E402  (its metric query and raw-CSV reader)

NVTX_RANGE = "ptxattn-ncu"
KERNEL = "ptxattn_decode"
METRICS = (
    "gpu__time_duration.sum",
    "sm__cycles_elapsed.avg.per_second",
    "dram__bytes_read.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__t_sector_hit_rate.pct",
    "l1tex__m_xbar2l1tex_read_bytes_mem_global_op_tma_ld.sum",
    "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
    "smsp__inst_executed.sum",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
)
SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "WarpStateStats", "SchedulerStats")
FIGURES = {
    "ms": ("gpu__time_duration.sum", 1e-6),
    "sm_mhz": ("sm__cycles_elapsed.avg.per_second", 1e-6),
    "dram_read_gb": ("dram__bytes_read.sum", 1e-9),
    "dram_pct": ("dram__throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
    "l2_hit_pct": ("lts__t_sector_hit_rate.pct", 1.0),
    "tma_read_gb": ("l1tex__m_xbar2l1tex_read_bytes_mem_global_op_tma_ld.sum", 1e-9),
    "lsu_ld_requests": ("l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum", 1.0),
    "instructions_m": ("smsp__inst_executed.sum", 1e-6),
    "issue_pct": ("smsp__issue_active.avg.pct_of_peak_sustained_active", 1.0),
}
STALL_PREFIX = "smsp__pcsamp_warps_issue_stalled_"


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"ncu_paged_{name}",
                                                  HERE.parent / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def labels(args) -> list[str]:
    return ["contiguous", f"page{args.page}:today", f"page{args.page}:{args.variant}"]


# ---- target mode --------------------------------------------------------------------------

def target(args) -> int:
    import torch

    import ptxattn
    from ptxattn.decode_builds import PAGED_VARIANT_ENV, PAGED_VARIANTS
    sb, db = _sibling("serving_bench"), _sibling("decode_bench")
    b, h, hkv, length = sb.PAGED_CASES[args.case]
    q, kc, vc, lens = db.make_case(torch, b, h, hkv, 1, length, args.seed)
    kp, vp, table = sb.shuffled_pages(torch, kc, vc, args.page, args.seed)

    def contiguous():
        return ptxattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)

    def paged(variant):
        def call():
            os.environ[PAGED_VARIANT_ENV] = variant
            return ptxattn.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens,
                                                   block_table=table)
        return call

    calls = [contiguous, paged("today"), paged(args.variant)]
    for fn in calls:                                  # JIT and warm-up: outside the ranges
        fn()
    torch.cuda.synchronize()
    outs = []
    for fn in calls:
        torch.cuda.nvtx.range_push(NVTX_RANGE)
        outs.append(fn())
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    ok = True
    split_factor = PAGED_VARIANTS[args.variant].split_factor
    for i, (label, out) in enumerate(zip(labels(args), outs)):
        diff = float((out.float() - outs[0].float()).abs().max())
        print(f"{label}: max |paged - contiguous| {diff:.3g}")
        # the same splits: bit for bit; other splits: the same answer to bf16 rounding
        ok &= diff == 0 or (i == 2 and split_factor > 1 and diff < 2e-2)
    return 0 if ok else 1


# ---- profile mode -------------------------------------------------------------------------

def target_argv(args) -> list[str]:
    return [str(Path(__file__).resolve()), "--case", args.case, "--page", str(args.page),
            "--variant", args.variant, "--seed", str(args.seed)]


def ncu_command(ncu, clocks, metrics, args, *, source=False, skip=0, report=None):
    cmd = [ncu, "--clock-control", ncu_bind.CLOCKS[clocks], "--nvtx", "--nvtx-include",
           f"{NVTX_RANGE}/", "-k", KERNEL]
    if source:
        cmd += ["--section", "SourceCounters", "--section", "WarpStateStats",
                "--launch-skip", str(skip), "--launch-count", "1", "-f", "-o", str(report)]
    else:
        cmd += ["--csv", "--page", "raw", "--print-units", "base", "--launch-count", "3"]
        for s in SECTIONS:
            cmd += ["--section", s]
        if metrics:
            cmd += ["--metrics", ",".join(metrics)]
    return cmd + [sys.executable, *target_argv(args)]


def figures(launch: dict) -> dict:
    out = {}
    for name, (metric, scale) in FIGURES.items():
        value = ncu_bind._number(launch.get(metric))
        out[name] = None if value is None else value * scale
    if out["ms"] and out["dram_read_gb"] is not None:
        out["dram_read_gbs"] = out["dram_read_gb"] / (out["ms"] * 1e-3)
    stalls = {k[len(STALL_PREFIX):]: ncu_bind._number(v) for k, v in launch.items()
              if k.startswith(STALL_PREFIX) and ncu_bind._number(v) is not None
              and "_not_issued" not in k}
    out["stalls_top"] = sorted(stalls.items(), key=lambda kv: -kv[1])[:6]
    return out


def format_rows(rows) -> str:
    head = ("launch", "clocks", "ms", "MHz", "DRAM GB/s", "DRAM %", "L2 hit %", "TMA GB",
            "LSU ld req", "inst M", "issue %")
    keys = ("ms", "sm_mhz", "dram_read_gbs", "dram_pct", "l2_hit_pct", "tma_read_gb",
            "lsu_ld_requests", "instructions_m", "issue_pct")
    specs = (".4f", ".0f", ".0f", ".1f", ".1f", ".2f", ".3g", ".1f", ".1f")
    cells = [(r["launch"], r["clocks"], *("-" if r.get(k) is None else format(r[k], s)
                                          for k, s in zip(keys, specs))) for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *cells)]
    lines = ["  ".join(f"{c:<{w}}" if i < 2 else f"{c:>{w}}" for i, (c, w) in
                       enumerate(zip(line, widths))) for line in (head, *cells)]
    for r in rows:
        if r.get("stalls_top"):
            lines.append(f"  {r['launch']} {r['clocks']} stalls (all warps, samples): "
                         + ", ".join(f"{k} {v:.0f}" for k, v in r["stalls_top"]))
    return "\n".join(lines)


def source_table(text: str) -> tuple[list[str], list[list[str]]]:
    """The header and rows of `ncu --page source --csv` (lines that are CSV, from the row
    that names the SASS source column)."""
    rows = list(csv.reader([line for line in text.splitlines() if line.startswith('"')]))
    start = next((i for i, r in enumerate(rows) if "Source" in r and "Address" in r), None)
    if start is None:
        return [], []
    head = rows[start]
    return head, [r for r in rows[start + 1:] if len(r) == len(head)]


def producer_summary(head, rows, top: int = 12) -> dict:
    """Stall samples of the producer's instructions: from the consumer's last EXIT before the
    first UTMALDG to the first EXIT after the last one (the producer's loop and set-up)."""
    src = head.index("Source")
    sample_cols = [i for i, h in enumerate(head) if "Sampling" in h]
    if not sample_cols:
        return {"error": f"no stall-sampling column among {head[:12]}"}
    samples = sample_cols[0]
    texts = [r[src] for r in rows]
    tma = [i for i, t in enumerate(texts) if "UTMALDG" in t]
    if not tma:
        return {"error": "no UTMALDG in the source page"}
    exits = [i for i, t in enumerate(texts) if re.search(r"\bEXIT\b", t)]
    lo = max([i for i in exits if i < tma[0]], default=-1) + 1
    hi = min([i for i in exits if i > tma[-1]], default=len(rows) - 1)

    def n(r, c=samples):
        return ncu_bind._number(r[c]) or 0.0
    total = sum(n(r) for r in rows)
    region = rows[lo:hi + 1]
    by_op: dict[str, float] = {}
    for r in region:
        op = r[src].split()[0] if r[src].split() else "?"
        if op.startswith("@"):
            op = r[src].split()[1] if len(r[src].split()) > 1 else op
        op = op.split(".")[0]
        by_op[op] = by_op.get(op, 0.0) + n(r)
    reasons = {head[c]: sum(n(r, c) for r in region) for c in range(len(head))
               if c not in sample_cols and c != src and head[c].lower().startswith("stall")}
    executed = next((i for i, h in enumerate(head) if h == "Instructions Executed"), None)
    issued = {}
    if executed is not None:                 # warp-level instructions the producer executed
        for r in region:
            words = [w for w in r[src].split() if not w.startswith("@")]
            op = words[0].split(".")[0] if words else "?"
            issued[op] = issued.get(op, 0.0) + n(r, executed)
    worst = sorted(region, key=lambda r: -n(r))[:top]
    return {"samples_column": head[samples], "kernel_samples": total,
            "producer_samples": sum(n(r) for r in region),
            "producer_instructions": len(region),
            "by_opcode": dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:10]),
            "by_reason": dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:8]),
            "producer_executed": sum(issued.values()),
            "executed_by_opcode": dict(sorted(issued.items(), key=lambda kv: -kv[1])[:10]),
            "top": [(r[head.index("Address")] if "Address" in head else "", r[src], n(r))
                    for r in worst]}


def profile(args, *, run=subprocess.run, which=shutil.which) -> int:
    ncu = which("ncu")
    if not ncu:
        raise SystemExit("--profile: ncu (Nsight Compute) is not on PATH")
    known = ncu_bind.available_metrics(ncu, run)
    metrics = [m for m in METRICS if known is None or m.split(".")[0] in known]
    unknown = [m for m in METRICS if m not in metrics]
    if unknown:
        print(f"ncu does not know {', '.join(unknown)} on this GPU: not asked for")
    rows, entry, ok = [], {"case": args.case, "page": args.page, "variant": args.variant,
                           "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                           "metrics": metrics, "unknown_metrics": unknown}, True
    for clocks in args.clocks.split(","):
        t0 = time.time()
        proc = run(ncu_command(ncu, clocks, metrics, args), capture_output=True, text=True,
                   timeout=args.timeout, check=False)
        launches = ncu_bind.parse_raw_csv(proc.stdout)
        checks = [line for line in proc.stdout.splitlines() if "max |paged" in line]
        print(f"ncu {clocks}: exit {proc.returncode}, {len(launches)} launches, "
              f"{time.time() - t0:.0f} s; " + "; ".join(checks))
        if proc.returncode != 0 or len(launches) != 3:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
            print("  " + " | ".join(tail))
            ok = False
            continue
        for label, launch in zip(labels(args), launches):
            rows.append({"launch": label, "clocks": clocks, **figures(launch)})
    print(f"{args.case} page {args.page}: contiguous / today / {args.variant}")
    print(format_rows(rows))
    entry["rows"] = rows
    if args.source:
        entry["producer"] = {}
        out_dir = Path(args.out).parent if args.out else Path(".")
        for skip, label in ((1, labels(args)[1]), (2, labels(args)[2])):
            report = out_dir / f"ncu-paged-{label.replace(':', '-')}"
            t0 = time.time()
            proc = run(ncu_command(ncu, "natural", metrics, args, source=True, skip=skip,
                                   report=report),
                       capture_output=True, text=True, timeout=args.timeout, check=False)
            show = [ncu, "-i", f"{report}.ncu-rep", "--page", "source", "--csv"]
            shown = run(show + ["--print-source", "sass"], capture_output=True, text=True,
                        timeout=args.timeout, check=False)
            if shown.returncode != 0:                 # an ncu without --print-source
                shown = run(show, capture_output=True, text=True, timeout=args.timeout,
                            check=False)
            head, srows = source_table(shown.stdout)
            summary = producer_summary(head, srows) if srows else {
                "error": f"ncu exit {proc.returncode} / {shown.returncode}: "
                         + " | ".join((proc.stderr + shown.stderr).strip().splitlines()[-4:])}
            entry["producer"][label] = summary
            print(f"producer of {label} ({time.time() - t0:.0f} s): "
                  + (summary.get("error") or
                     f"{summary['producer_samples']:.0f} of {summary['kernel_samples']:.0f} "
                     f"samples ({summary['samples_column']}) on its "
                     f"{summary['producer_instructions']} instructions"))
            if "error" not in summary:
                print("  by opcode: " + ", ".join(f"{k} {v:.0f}" for k, v in
                                                  summary["by_opcode"].items()))
                if summary["executed_by_opcode"]:
                    print(f"  executed: {summary['producer_executed']:.0f} warp instructions: "
                          + ", ".join(f"{k} {v:.0f}" for k, v in
                                      summary["executed_by_opcode"].items()))
                if summary["by_reason"]:
                    print("  by reason: " + ", ".join(f"{k} {v:.0f}" for k, v in
                                                      summary["by_reason"].items()))
                for addr, text, n in summary["top"]:
                    print(f"    {addr:>8} {n:8.0f}  {text[:90]}")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(entry) + "\n")
    return 0 if ok else 1


def arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="b64_8k", help="bench/serving_bench.py PAGED_CASES")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--variant", default="rowgroup_warp_ahead",
                    help="the paged build variant profiled beside today's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="run ncu on the target")
    ap.add_argument("--clocks", default="natural,locked")
    ap.add_argument("--no-source", dest="source", action="store_false",
                    help="--profile: skip the producer's per-instruction stall samples")
    ap.add_argument("--out", default=None, help="--profile: append one JSON line here")
    ap.add_argument("--timeout", type=int, default=240)
    return ap


def main(argv=None) -> int:
    args = arg_parser().parse_args(argv)
    for c in args.clocks.split(","):
        if c not in ncu_bind.CLOCKS:
            raise SystemExit(f"--clocks: expected natural and/or locked, got {c!r}")
    from ptxattn.decode_builds import PAGED_VARIANTS
    if args.variant not in PAGED_VARIANTS:
        raise SystemExit(f"--variant: {args.variant!r} not among {', '.join(PAGED_VARIANTS)}")
    return profile(args) if args.profile else target(args)


if __name__ == "__main__":
    sys.exit(main())

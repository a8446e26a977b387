"""Host µs per call of the plans' run() (issue 25's <= 10 µs a layer), with this process's own
speed beside it: serving_bench's host paths (queue full; PrefillPlan.run(out=), run(),
DecodePlan.run with and without the append; each with the plans' CUDA-graph replays and, as
"<label>:launches", with PTXATTN_GRAPH_RUNS=0 in the same process) and two calibration loops that ptxattn does not
touch (pure Python; torch's data_ptr() x 10), so that a slow process (the H200 host's figures
moved by up to 1.6x between processes in session 13's first call) shows as such.

    python bench/experiments/host_rounds.py --out FILE.json [--fake] [--interleave]

--interleave times every label once a repeat (one loop of --calls each), repeat after repeat,
so that a path with graphs, the same path with launches and the calibrations see the same host
speed in each repeat; it adds each path's per-repeat ratio graphs / launches (median, range).

Run it alternately from two trees (PYTHONPATH at each) pinned to one core (taskset): the
figures of one tree against the other's, round by round, and each against its calibration."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import callpath as cb                                       # noqa: E402
import serving_bench as sb                                  # noqa: E402

REPLAY_ENV = "PTXATTN_GRAPH_RUNS"     # ptxattn.replay.ENV (a tree before it ignores it)


def modes(spec: str) -> list[str]:
    """--graphs: "both" times each path with the plans' graphs (replay.py) and without, in
    this process; "graph" or "launches" one of them."""
    return {"both": ["graph", "launches"], "graph": ["graph"], "launches": ["launches"]}[spec]


LABELS = ("prefill_plan_run_out", "prefill_plan_run", "decode_plan_run_out_no_append",
          "decode_plan_run_out", "decode_plan_run")


def interleaved(fns: dict, calls: int, repeats: int, block, fake: bool) -> dict:
    """Each label's median over repeats of one loop each, the labels taken in turn within a
    repeat; beside each "<label>" that has a "<label>:launches", the per-repeat ratio."""
    loops = {label: [] for label in fns}
    for _ in range(repeats):
        for label, fn in fns.items():
            loops[label].append(cb.host_us(fn, calls, 1, block, fake)["median_us"])
    results = {}
    width = max(len(label) for label in fns)
    for label, us in loops.items():
        results[label] = {"median_us": statistics.median(us), "min_us": min(us),
                          "max_us": max(us), "loops_us": us, "calls": calls,
                          "repeats": repeats, "interleaved": True}
        line = f"host_rounds {label:{width}s} {statistics.median(us):7.2f} µs/call " \
               f"(min {min(us):.2f}, max {max(us):.2f})"
        if f"{label}:launches" in loops:
            ratios = [g / n for g, n in zip(us, loops[f"{label}:launches"])]
            results[label]["graphs_over_launches"] = {
                "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
            line += f" graphs/launches {statistics.median(ratios):.3f} " \
                    f"[{min(ratios):.3f}, {max(ratios):.3f}]"
        print(line, flush=True)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--fake", action="store_true")
    ap.add_argument("--graphs", default="both", choices=("both", "graph", "launches"))
    ap.add_argument("--interleave", action="store_true")
    args = ap.parse_args(argv)
    import torch
    with contextlib.ExitStack() as stack:
        if args.fake:
            stack.enter_context(cb.fake_driver(binding_packing=True))
        fns = {}
        for mode in modes(args.graphs):
            # the knob is read when a plan freezes its launches: at a path's second call
            os.environ[REPLAY_ENV] = "0" if mode == "launches" else "1"
            paths = sb.host_paths(args.fake, torch)
            for label in LABELS:
                paths[label]()
                paths[label]()
                fns[label if mode == "graph" else f"{label}:launches"] = paths[label]
        os.environ.pop(REPLAY_ENV, None)
        t = torch.empty(4, device="cpu")
        fns["calib_python"] = lambda: sum(range(100))
        fns["calib_data_ptr_x10"] = lambda: (
            t.data_ptr(), t.data_ptr(), t.data_ptr(), t.data_ptr(), t.data_ptr(),
            t.data_ptr(), t.data_ptr(), t.data_ptr(), t.data_ptr(), t.data_ptr())
        block = cb._blocker(args.fake, torch)
        if args.interleave:
            results = interleaved(fns, args.calls, args.repeats, block, args.fake)
        else:
            results = cb.host_table(fns, args.calls, args.repeats, block, args.fake,
                                    "host_rounds")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

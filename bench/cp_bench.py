"""Context-parallel (ring) attention on N GPUs against one GPU on the same total work.

Run with torchrun, one process per GPU (bench/cp_README.md has the exact commands):

    torchrun --nproc_per_node=2 bench/cp_bench.py --lengths 65536,131072

For each length and mask (non-causal; causal when ptxattn.attention takes causal=), with
B=1, H=16, D=128 by default:
1. Check first: the context-parallel output, gathered, and one GPU's output on the whole
   sequence, each against the NumPy float64 reference on sampled rows (the library's bar),
   and against each other. A case that fails is not timed.
2. Rounds in a seeded random order, each timing one GPU (ptxattn.prepare(...).launch() on
   the whole sequence, on every rank's GPU at once) and the ring (ring_attention on the
   shards), `--reps` calls back to back between CUDA events, the ranks synchronised before
   each. A ring call's time is the slowest rank's. Speedup = one GPU's time / the ring's,
   per round; the row reports its median over rounds with a 95% bootstrap interval.
3. One more ring call with a RingTimeline: per step, the comm interval (exchange issued to
   completed, on the comm stream) and the compute interval (local attention + LSE merge);
   the hidden share is the part of comm time that overlaps compute (hidden_share), per rank.
Rank 0 prints the table and writes the JSON (--out).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import sys
from pathlib import Path

# NVLink multicast stays off on the lent machines (it can take the host's GPUs down).
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)

import numpy as np  # noqa: E402


def _takes(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def _bf16_host(torch, x):
    """A torch bf16 tensor as an ml_dtypes.bfloat16 NumPy array (bit-exact, no float32 copy)."""
    from ptxattn.reference import BF16
    return x.contiguous().view(torch.int16).cpu().numpy().view(BF16)


def _timed_block(torch, fn, reps: int) -> float:
    """ms per call of `reps` calls back to back between two events on the current stream."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / reps


def _sync_all(torch, dist):
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()


def _max_over_ranks(torch, dist, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run_case(torch, dist, args, L: int, causal: bool, rank: int, world: int) -> dict:
    import ptxattn
    from ptxattn import reference
    from ptxattn.tools import bench
    from ptxattn import distributed as cp

    B, H, D, layout = args.batch, args.heads, args.head_dim, args.layout
    row = {"seq_len": L, "batch": B, "heads": H, "head_dim": D, "layout": layout,
           "causal": causal, "world": world}
    shape = (B, H, L, D) if layout == "bhld" else (B, L, H, D)
    gen = torch.Generator(device="cuda").manual_seed(args.seed + L + int(causal))
    q, k, v = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))                      # the same on every rank (same seed)
    plan = cp.ShardPlan(L, world, causal=causal)
    row["scheme"] = plan.scheme
    shards = [cp.shard(x, plan, rank, layout=layout) for x in (q, k, v)]
    mask = {"causal": True} if causal else {}

    def ring():
        return cp.ring_attention(*shards, seq_len=L, causal=causal, layout=layout)

    single_out = torch.empty_like(q)
    prepared = ptxattn.prepare(q, k, v, layout=layout, out=single_out, **mask)

    # 1. check (rank 0 against the reference; every rank takes part in the gather)
    ring_out = cp.gather(ring(), plan, layout=layout)
    prepared.launch()
    torch.cuda.synchronize()
    status = None
    if rank == 0:
        rows = reference.sample_rows(L, args.check_rows, seed=args.seed)
        ax = 2 if layout == "bhld" else 1
        hq, hk, hv = (_bf16_host(torch, x) for x in (q, k, v))
        ref = reference.attention_reference(hq, hk, hv, layout=layout, rows=rows, **mask)
        idx = torch.as_tensor(rows, device="cuda")
        ours = reference.error_metrics(_bf16_host(torch, ring_out.index_select(ax, idx)), ref)
        one = reference.error_metrics(_bf16_host(torch, single_out.index_select(ax, idx)), ref)
        ours["nan_count"] = int((~torch.isfinite(ring_out)).sum().item())
        row["check"] = {"context_parallel": ours, "single_gpu": one,
                        "rows": len(rows)}
        ok = reference.passes(ours) and reference.passes(one) and \
            reference.passes_against_peer(ours, one)
        status = "pass" if ok else "fail"
    status = [status]
    dist.broadcast_object_list(status, src=0)
    row["status"] = status[0]
    if status[0] != "pass":
        return row
    del ring_out

    # 2. rounds: one GPU and the ring, in a seeded random order
    for _ in range(args.warmup):
        prepared.launch()
        ring()
    single_ms, ring_ms, ratios = [], [], []
    order_rng = np.random.default_rng(args.seed)
    for _ in range(args.rounds):
        times = {}
        for what in order_rng.permutation(["single", "ring"]):
            _sync_all(torch, dist)
            ms = _timed_block(torch, prepared.launch if what == "single" else ring, args.reps)
            times[what] = _max_over_ranks(torch, dist, ms) if what == "ring" else ms
        single_ms.append(times["single"])
        ring_ms.append(times["ring"])
        ratios.append(times["single"] / times["ring"])
    flops = bench.attention_flops(B, H, L, L, D) / (2 if causal else 1)
    lo, hi = bench.bootstrap_ci(ratios, seed=args.seed)
    row.update(single_ms=single_ms, ring_ms=ring_ms, speedup_rounds=ratios,
               single_ms_median=bench.median(single_ms), ring_ms_median=bench.median(ring_ms),
               speedup=bench.median(ratios), speedup_ci=[lo, hi],
               single_tflops=flops / bench.median(single_ms) / 1e9,
               ring_tflops=flops / bench.median(ring_ms) / 1e9)

    # 3. the timeline of one ring call, every rank
    _sync_all(torch, dist)
    timeline = cp.RingTimeline()
    cp.ring_attention(*shards, seq_len=L, causal=causal, layout=layout, timeline=timeline)
    torch.cuda.synchronize()
    spans = timeline.intervals()
    mine = {"hidden": spans["hidden"],
            "comm_ms": [b - a for a, b in spans["comm"]],
            "attention_ms": [b - a for a, b in spans["attention"]],
            "merge_ms": [b - a for a, b in spans["merge"]],
            "total_ms": spans["merge"][-1][1] if spans["merge"] else None}
    every = [None] * world
    dist.all_gather_object(every, mine)
    row["timeline"] = every
    row["hidden_min"] = min(t["hidden"] for t in every)
    prepared.close()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="65536,131072")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layout", default="bhld", choices=("bhld", "bshd"))
    parser.add_argument("--masks", default="dense,causal",
                        help="dense, causal or both (causal runs when attention takes causal=)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--reps", type=int, default=2, help="calls per timed block")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--check-rows", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON path (default: bench/results/"
                        "cp-<date>-<world>gpu.json)")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    os.environ.setdefault("PTXATTN_DEVICE", str(local_rank))
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()

    import ptxattn
    from ptxattn import driver
    from ptxattn.tools import bench
    takes_causal = _takes(ptxattn.attention, "causal") and \
        _takes(ptxattn.prepare, "causal")
    rows = []
    for L in (int(x) for x in args.lengths.split(",")):
        for mask in args.masks.split(","):
            causal = mask.strip() == "causal"
            if causal and not takes_causal:
                rows.append({"seq_len": L, "causal": True, "status": "skipped",
                             "why": "ptxattn.attention takes no causal= in this checkout"})
                continue
            row = run_case(torch, dist, args, L, causal, rank, world)
            rows.append(row)
            if rank == 0:
                print(_line(row), flush=True)
            torch.cuda.empty_cache()

    if rank == 0:
        result = {"kind": "context_parallel", "date": datetime.date.today().isoformat(),
                  "world": world, "source": bench.source_id(),
                  "environment": bench.environment(driver.device_info(), torch),
                  "nccl": _nccl_version(torch),
                  "args": vars(args), "rows": rows}
        out = Path(args.out or Path(__file__).parent / "results" /
                   f"cp-{result['date']}-{world}gpu.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
        for row in rows:
            if row.get("status") == "skipped":
                print(f"L={row['seq_len']} causal: skipped ({row['why']})")
    dist.destroy_process_group()
    return 0


def _nccl_version(torch) -> str:
    v = torch.cuda.nccl.version()           # a tuple (2, 27, 3) in recent torch, an int before
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _line(row: dict) -> str:
    what = f"L={row['seq_len']} {'causal' if row['causal'] else 'dense '} {row['world']} GPUs"
    if row["status"] != "pass":
        return f"{what}: check {row['status']}, not timed: {row.get('check')}"
    lo, hi = row["speedup_ci"]
    return (f"{what}: one GPU {row['single_ms_median']:.1f} ms ({row['single_tflops']:.0f} "
            f"TFLOP/s), ring {row['ring_ms_median']:.1f} ms ({row['ring_tflops']:.0f} TFLOP/s "
            f"over {row['world']}), speedup {row['speedup']:.3f} [{lo:.3f}, {hi:.3f}], "
            f"comm hidden >= {100 * row['hidden_min']:.0f}% on every rank; check rel L2 "
            f"{row['check']['context_parallel']['rel_l2']:.2e} (one GPU "
            f"{row['check']['single_gpu']['rel_l2']:.2e})")


if __name__ == "__main__":
    sys.exit(main())

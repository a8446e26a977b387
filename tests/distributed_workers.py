"""Rank bodies for the ring-attention tests (spawned by torch.multiprocessing).

Each rank builds the same full q, k, v from a seed (NumPy, so every rank and the test
process see the same values), takes its shard with ptxattn.distributed.shard, runs
ring_attention, and saves its local out/lse and the all-gathered full output as .npz for
the test process to compare against the NumPy reference. Cases are plain dicts, so one
spawn runs many of them (each spawn costs a torch import per rank).
"""

from __future__ import annotations

import os
import traceback

import numpy as np

from ptxattn import reference


def case_inputs(case: dict):
    """Full-sequence q, k, v of a case: bf16 values, in float64 or float32 arrays."""
    rng = np.random.default_rng(case["seed"])
    b, h, hkv, lq, lk, d = (case[n] for n in ("batch", "heads", "heads_kv", "seq_len",
                                             "seq_len_k", "head_dim"))

    def one(heads, seq):
        shape = (b, heads, seq, d) if case["layout"] == "bhld" else (b, seq, heads, d)
        # bf16-valued, as the reference rounds its inputs to bf16 (float64 cases then differ
        # from it by float64 rounding alone)
        x = rng.standard_normal(shape).astype(np.float32).astype(reference.BF16)
        return x.astype(np.float64 if case["dtype"] == "float64" else np.float32)

    return one(h, lq), one(hkv, lk), one(hkv, lk)


def case_dout(case: dict):
    """The upstream gradient of a gradient case: q's shape, bf16 values (float64 or float32)."""
    rng = np.random.default_rng(case["seed"] + 1000)
    b, h, lq, d = (case[n] for n in ("batch", "heads", "seq_len", "head_dim"))
    shape = (b, h, lq, d) if case["layout"] == "bhld" else (b, lq, h, d)
    x = rng.standard_normal(shape).astype(np.float32).astype(reference.BF16)
    return x.astype(np.float64 if case["dtype"] == "float64" else np.float32)


def _run_grad_case(torch, dist, group, case: dict, out_dir: str, tag: str) -> None:
    """The ring's forward and backward on this rank's shards; saves the all-gathered full
    dq, dk, dv (and this rank's own shards of them)."""
    from ptxattn import distributed as cp
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    q, k, v = case_inputs(case)
    dout = case_dout(case)
    dtype = torch.float64 if case["dtype"] == "float64" else torch.bfloat16
    plan = cp.ShardPlan(case["seq_len"], world, causal=case["causal"], scheme=case["scheme"],
                        seq_len_k=case["seq_len_k"])
    layout = case["layout"]
    qs, ks, vs, dos = (cp.shard(torch.from_numpy(x).to(dtype), plan, rank, layout=layout,
                                keys=keys)
                       for x, keys in ((q, False), (k, True), (v, True), (dout, False)))
    for t in (qs, ks, vs):
        t.requires_grad_(True)
    out = cp.ring_attention(qs, ks, vs, seq_len=case["seq_len"], seq_len_k=case["seq_len_k"],
                            causal=case["causal"], scheme=case["scheme"], layout=layout,
                            group=group, local_attention=cp.torch_local_attention,
                            local_backward=cp.torch_local_backward)
    out.backward(dos)
    full = {name: cp.gather(t.grad, plan, group=group, layout=layout, keys=keys)
            for name, t, keys in (("dq", qs, False), ("dk", ks, True), ("dv", vs, True))}
    np.savez(os.path.join(out_dir, f"{tag}-{case['name']}-rank{rank}.npz"),
             **{n: g.to(torch.float64).numpy() for n, g in full.items()},
             grad_dtypes=str([str(t.grad.dtype) for t in (qs, ks, vs)]))


def _run_case(torch, dist, group, case: dict, out_dir: str, tag: str) -> None:
    from ptxattn import distributed as cp
    if case.get("grad"):
        return _run_grad_case(torch, dist, group, case, out_dir, tag)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    q, k, v = case_inputs(case)
    dtype = torch.float64 if case["dtype"] == "float64" else torch.bfloat16
    plan = cp.ShardPlan(case["seq_len"], world, causal=case["causal"], scheme=case["scheme"],
                        seq_len_k=case["seq_len_k"])
    layout = case["layout"]
    qs, ks, vs = (cp.shard(torch.from_numpy(x).to(dtype), plan, rank, layout=layout,
                           keys=keys) for x, keys in ((q, False), (k, True), (v, True)))
    out, lse = cp.ring_attention(qs, ks, vs, seq_len=case["seq_len"],
                                 seq_len_k=case["seq_len_k"], causal=case["causal"],
                                 scheme=case["scheme"], layout=layout, return_lse=True,
                                 group=group, local_attention=cp.torch_local_attention)
    full = cp.gather(out, plan, group=group, layout=layout)
    full_lse = cp.gather(lse, plan, group=group, layout="bhl")
    np.savez(os.path.join(out_dir, f"{tag}-{case['name']}-rank{rank}.npz"),
             out=out.to(torch.float64).numpy(), lse=lse.to(torch.float64).numpy(),
             full=full.to(torch.float64).numpy(), full_lse=full_lse.to(torch.float64).numpy(),
             out_dtype=str(out.dtype), lse_dtype=str(lse.dtype))


def group_members(size: int, world: int) -> list[int]:
    """The global ranks of the ring of `size`: the last `size` ranks, so that a sub-group's
    ranks differ from the global ones (ring peers must be translated); the world itself
    when size == world."""
    return list(range(world - size, world))


def ring_worker(rank: int, world: int, rendezvous: str, sizes: list, cases: list,
                out_dir: str) -> None:
    """One rank of `world` gloo processes (a file rendezvous). For each ring size, the ranks
    of group_members run every case on that sub-group (the default group for the whole
    world). One spawn serves every ring size: each process pays for its torch import once.
    An exception is written to rank<r>-error.txt (and re-raised) so that the test shows it."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                                world_size=world)
        try:
            for size in sizes:
                members = group_members(size, world)
                # new_group is collective over the whole world, members or not
                group = None if size == world else dist.new_group(members)
                if rank in members:
                    for case in cases:
                        _run_case(torch, dist, group, case, out_dir, f"ring{size}")
        finally:
            dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}-error.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise

"""Where a plan's run() spends its host time (issue 25's <= 10 us a layer): each part alone.

    python bench/experiments/host_parts.py [--fake] [--out FILE.json]

PrefillPlan.run on torch tensors (8 sequences of 128 tokens, 32:8 heads, D 128, causal, host
offsets: one launch) is timed whole, with a caller's out= and without, and then its parts one
by one, each in a loop of its own with the queue full (bench/callpath.py's host_us):
  torch_empty         torch.empty of the output's shape (what a run without out= allocates)
  torch_meta_x3       tensors.torch_meta of q, k and v (session 9's checks read these)
  torch_ptr_x3        tensors.torch_ptr of q, k and v (the same checks against the plan's
                      shapes and strides, without tuples: what run() pays since session 10)
  new_empty           q.new_empty of the output's shape (run()'s allocation since session 10)
  current_stream      tensors.torch_current_stream (the stream check)
  maps_at             the Launcher's four tensor maps for addresses seen before (dict lookups)
  launch              the Launcher's launch from those maps (slots rewritten, cuLaunchKernelEx:
                      through ctypes, or cuda.bindings with PTXATTN_LAUNCH=binding)
  frozen_launch       the same launch frozen (varlen.Launcher.frozen: its own parameter array,
                      nothing rewritten, no lock): what run() pays since session 11
  decode_run          DecodePlan.run of one layer (64 sequences, 32:8 heads, D 128, 8k cache,
                      one new key appended: two launches), a fresh output
  decode_run_out      the same with a caller's out=
  sdpa_small          torch's SDPA on (1, 32, 128, 128): a torch attention call's host time
The parts' sum against the whole says what is left in the glue. --fake: the pretend driver and
CPU tensors (a plumbing check; the figures are this CPU's, not the H200 host's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import callpath as cb                                       # noqa: E402

import ptxattn                                              # noqa: E402
from ptxattn import driver, tensors                         # noqa: E402

H, HKV, D, SEQS, LEN = 32, 8, 128, 8, 128


def parts(torch, device: str) -> dict:
    """{label: fn} of the whole run() and its parts."""
    total = SEQS * LEN
    q = torch.randn(total, H, D, dtype=torch.bfloat16, device=device)
    k = torch.randn(total, HKV, D, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    cu = np.arange(0, total + 1, LEN, dtype=np.int32)
    plan = ptxattn.plan_varlen(cu, cu, heads=H, heads_kv=HKV, head_dim=D, causal=True)
    plan.run(q, k, v)                                       # first run: the Launcher, the table
    ln = plan._launcher
    geometry = plan._torch_geometry
    (o_row, o_head), out_strides = geometry[3], geometry[4]
    o = torch.empty(geometry[5], dtype=torch.bfloat16, device=device)
    shapes = geometry[0]
    qp, kp, vp, op = q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr()
    maps = ln.maps_at((qp, shapes[1]), (kp, shapes[3]), (vp, shapes[5]), (op, out_strides))
    table = plan._table.ptr
    frozen = ln.frozen(maps, op, o_row, o_head, 0, table, None)

    def frozen_launch():
        for f in frozen:
            f()
    b, length = 64, 8192
    kc = torch.empty(b, length, HKV, D, dtype=torch.bfloat16, device=device)
    vc = torch.empty_like(kc)
    dq = torch.randn(b, 1, H, D, dtype=torch.bfloat16, device=device)
    kn = torch.randn(b, 1, HKV, D, dtype=torch.bfloat16, device=device)
    vn = torch.randn_like(kn)
    dout = torch.empty_like(dq)
    step = ptxattn.plan_decode(batch=b, heads=H, heads_kv=HKV, head_dim=D, cache_len=length,
                               cache_seqlens=np.full(b, length - 1, np.int32), seq_new=1,
                               causal=True)
    step.run(dq, kc, vc, k=kn, v=vn)
    sq = torch.randn(1, H, LEN, D, dtype=torch.bfloat16, device=device)
    F = torch.nn.functional
    return {
        "run": lambda: plan.run(q, k, v),
        "run_out": lambda: plan.run(q, k, v, out=out),
        "torch_empty": lambda: torch.empty(geometry[5], dtype=torch.bfloat16, device=device),
        "torch_meta_x3": lambda: (tensors.torch_meta(q), tensors.torch_meta(k),
                                  tensors.torch_meta(v)),
        "torch_ptr_x3": lambda: (tensors.torch_ptr(q, shapes[0], shapes[1], geometry[1]),
                                 tensors.torch_ptr(k, shapes[2], shapes[3], geometry[1]),
                                 tensors.torch_ptr(v, shapes[4], shapes[5], geometry[1])),
        "new_empty": lambda: q.new_empty(geometry[5]),
        "current_stream": lambda: tensors.torch_current_stream(0),
        "maps_at": lambda: ln.maps_at((qp, shapes[1]), (kp, shapes[3]), (vp, shapes[5]),
                                      (op, out_strides)),
        "launch": lambda: ln.run_at(maps, op, o_row, o_head, 0, table, None),
        "frozen_launch": frozen_launch,
        "decode_run": lambda: step.run(dq, kc, vc, k=kn, v=vn),
        "decode_run_out": lambda: step.run(dq, kc, vc, out=dout, k=kn, v=vn),
        "sdpa_small": lambda: F.scaled_dot_product_attention(sq, sq, sq, is_causal=True),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fake", action="store_true")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch
    with contextlib.ExitStack() as stack:
        if args.fake:
            stack.enter_context(cb.fake_driver(binding_packing=True))
            stack.enter_context(cb.torch_pretends_cuda(torch))
        device = "cpu" if args.fake else "cuda"
        fns = parts(torch, device)
        mode = driver.launch_mode()
        block = cb._blocker(args.fake, torch)
        results = cb.host_table(fns, args.calls, args.repeats, block, args.fake, "host_parts")
    summed = sum(results[p]["median_us"] for p in ("new_empty", "torch_ptr_x3",
                                                   "current_stream", "frozen_launch"))
    print(f"host_parts parts' sum {summed:.2f} µs against run {results['run']['median_us']:.2f}"
          f" (launches: {mode})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"fake": args.fake, "launch": mode, "parts": results,
                       "parts_sum_us": summed}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the driver's enqueue costs a plan's run() (issue 25's <= 10 µs): the frozen launch of
PrefillPlan.run's forward kernel through cuLaunchKernelEx (what run() calls) against the same
kernel, grid, block, shared memory, stream and void*[] through the legacy cuLaunchKernel, and a
ctypes call into libcuda that enqueues nothing (cuCtxGetDevice: the ctypes and driver-entry
floor), each in a loop with the queue full (bench/callpath.py's host_us).

    python bench/experiments/launch_api.py [--out FILE.json]

On the H200 only (a real driver): the figures say whether the ~4 µs a launch is the API's
form, the kernel's parameters, or the driver's enqueue itself."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import callpath as cb                                       # noqa: E402

import ptxattn                                              # noqa: E402
from ptxattn import fastlaunch                              # noqa: E402

H, HKV, D, SEQS, LEN = 32, 8, 128, 8, 128


def launches(torch) -> dict:
    total = SEQS * LEN
    q = torch.randn(total, H, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(total, HKV, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    cu = np.arange(0, total + 1, LEN, dtype=np.int32)
    plan = ptxattn.plan_varlen(cu, cu, heads=H, heads_kv=HKV, head_dim=D, causal=True)
    plan.run(q, k, v, out=out)
    plan.run(q, k, v, out=out)                              # frozen now
    (frozen,) = next(iter(plan._frozen.values()))
    config_address, handle, params, _ = frozen._args
    c = fastlaunch.LaunchConfig.from_address(config_address.value)
    if c.numAttrs:
        raise SystemExit("the forward launch carries attributes: cuLaunchKernel cannot take it")
    lib = ctypes.CDLL(fastlaunch.LIBRARY)
    legacy = lib.cuLaunchKernel
    legacy.restype = ctypes.c_int
    u = ctypes.c_uint
    legacy_args = (handle, u(c.gridDimX), u(c.gridDimY), u(c.gridDimZ), u(c.blockDimX),
                   u(c.blockDimY), u(c.blockDimZ), u(c.sharedMemBytes),
                   ctypes.c_void_p(c.hStream), params, None)
    get_device = lib.cuCtxGetDevice
    get_device.restype = ctypes.c_int
    device = ctypes.c_int()
    ref = ctypes.byref(device)

    def checked(fn, *args):
        def call():
            err = fn(*args)
            if err:
                raise RuntimeError(f"CUresult {err}")
        return call
    return {
        "frozen_ex": checked(frozen),
        "legacy": checked(legacy, *legacy_args),
        "ctypes_floor": checked(get_device, ref),
        "run_out": lambda: plan.run(q, k, v, out=out),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch
    fns = launches(torch)
    block = cb._blocker(False, torch)
    results = cb.host_table(fns, args.calls, args.repeats, block, False, "launch_api")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

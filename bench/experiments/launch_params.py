"""Does a launch's parameter size set the driver's enqueue time (issue 25's <= 10 µs)? Empty
kernels with 8 B, 96 B and 608 B of parameters (the last: four 128-byte by-value tensor maps
and twelve words, the forward kernel's form), each with the forward's block and 1 KiB or
~200 KiB of dynamic shared memory, launched frozen through cuLaunchKernelEx (fastlaunch.Frozen:
what a plan's run() calls), queue full (bench/callpath.py's host_us); beside them the forward
kernel's own frozen launch from a PrefillPlan, the same launch as a CUDA graph of one and of two
kernel nodes (cuGraphLaunch), and a ctypes call that enqueues nothing.

    python bench/experiments/launch_params.py [--out FILE.json]

If the 608-byte kernel costs clearly more than the 8-byte one, moving the tensor maps out of
the parameters (into global memory) would shorten every launch; if not, the enqueue is fixed."""

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
from ptxattn import driver, fastlaunch                      # noqa: E402

BLOCK = (384, 1, 1)
GRID = (132, 1, 1)


def ptx_of(arch: str) -> str:
    words = ", ".join(f".param .u64 w{i}" for i in range(12))
    maps = ", ".join(f".param .align 64 .b8 m{i}[128]" for i in range(4))
    return (f".version 8.0\n.target {arch}\n.address_size 64\n"
            ".visible .entry p8(.param .u64 w0) { ret; }\n"
            f".visible .entry p96({words}) {{ ret; }}\n"
            f".visible .entry p608({maps}, {words}) {{ ret; }}\n")


def frozen_of(function, sizes: list[int], smem: int, stream: int, keep: list):
    """A fastlaunch.Frozen of `function` with zeroed parameters of these byte sizes."""
    holders = [(ctypes.c_char * n)() for n in sizes]
    array = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
    if smem > 48 * 1024:
        function.set_max_dynamic_smem(smem)
    config = fastlaunch.Config(GRID, BLOCK, smem, stream)
    keep += [holders, array, config]
    return fastlaunch.Frozen(fastlaunch.raw_function(), config.address, int(function.handle),
                             ctypes.addressof(array), None, function.name)


def graph_launch(lib, frozen, nodes: int, stream: int, keep: list):
    """cuGraphLaunch of a graph of `nodes` copies of a frozen launch (captured on a stream of
    our own: the frozen config's own stream may be the legacy one, which cannot capture), as
    a zero-argument ctypes call on `stream`."""
    from cuda.bindings import driver as cud
    config_address, handle, params, _ = frozen._args
    c = fastlaunch.LaunchConfig.from_address(config_address.value)
    err, side = cud.cuStreamCreate(1)
    copy = fastlaunch.LaunchConfig()
    ctypes.memmove(ctypes.addressof(copy), ctypes.addressof(c), ctypes.sizeof(c))
    copy.hStream = int(side)
    raw = fastlaunch.raw_function()
    (err,) = cud.cuStreamBeginCapture(side, cud.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    for _ in range(nodes):
        if raw(ctypes.c_void_p(ctypes.addressof(copy)), handle, params, None):
            raise RuntimeError("capture launch failed")
    err, graph = cud.cuStreamEndCapture(side)
    err, executable = cud.cuGraphInstantiate(graph, 0)
    if int(err):
        raise RuntimeError(f"cuGraphInstantiate: {err}")
    launch = lib.cuGraphLaunch
    launch.restype = ctypes.c_int
    args = (ctypes.c_void_p(int(executable)), ctypes.c_void_p(stream))
    keep += [side, copy, graph, executable]
    return lambda: launch(*args)


def launches(torch) -> dict:
    ctx = driver.context()
    module = driver.load_module(ptx_of(ctx.arch), "launch_params")
    stream = torch.cuda.current_stream().cuda_stream
    keep: list = []
    fns = {}
    for name, sizes in (("p8", [8]), ("p96", [8] * 12), ("p608", [128] * 4 + [8] * 12)):
        for smem in (1024, 200 * 1024):
            fns[f"{name}_smem{smem // 1024}k"] = frozen_of(module.function(name), sizes,
                                                           smem, stream, keep)
    total, h, hkv, d = 1024, 32, 8, 128
    q = torch.randn(total, h, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(total, hkv, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    cu = np.arange(0, total + 1, 128, dtype=np.int32)
    plan = ptxattn.plan_varlen(cu, cu, heads=h, heads_kv=hkv, head_dim=d, causal=True)
    plan.run(q, k, v, out=out)
    plan.run(q, k, v, out=out)
    (fns["forward"],) = next(iter(plan._frozen.values()))
    keep += [plan, q, k, v, out]         # the frozen launch reads the plan's table and these
    lib = ctypes.CDLL(fastlaunch.LIBRARY)
    for nodes in (1, 2):
        fns[f"graph_{nodes}_forward"] = graph_launch(lib, fns["forward"], nodes, stream, keep)
    get_device = lib.cuCtxGetDevice
    get_device.restype = ctypes.c_int
    device = ctypes.c_int()
    fns["ctypes_floor"] = lambda: get_device(ctypes.byref(device))

    def checked(fn):
        def call():
            err = fn()
            if err:
                raise RuntimeError(f"CUresult {err}")
        return call
    return {name: checked(fn) for name, fn in fns.items()}, keep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch
    fns, keep = launches(torch)
    block = cb._blocker(False, torch)
    results = cb.host_table(fns, args.calls, args.repeats, block, False, "launch_params")
    del keep
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Host time of one decode call (flash_attn_with_kvcache through transformers' decode_step)
on the pretend driver: the Python side only (issue 24/25, session 10).

    python bench/experiments/dechost_cpu.py [--calls 2048] [--repeats 5] [--out FILE.json]
    python bench/experiments/dechost_cpu.py --gpu     # the H200: real driver, CUDA tensors

Two patterns at generate()'s batch-8 shape (B 8, H 32, Hkv 8, D 128, one query, no mask):
  dynamic   transformers' DynamicCache: every layer of every step sees key/value tensors at
            a new address, one position longer than the step before (torch.cat's result;
            here views of one buffer at moving offsets, so nothing is copied)
  static    the same caches every call (a static cache's decode step: addresses and Lmax
            fixed, the lengths on the device)
Figures: µs per call (median of the repeats), and the sizes of the decode caches (_STEADY,
_LAUNCHERS, tma._MAPS) after the run: a dynamic run must not grow them per step. CPU torch
tensors pass for CUDA ones (bench/callpath.py's torch_pretends_cuda); nothing reaches libcuda,
so the real driver's cost (cuTensorMapEncodeTiled, cuLaunchKernelEx) is not in these figures.
--gpu: the same loops on CUDA tensors and the real driver (the kernels run; at these lengths
each call's GPU time is below its host time, so the loop measures the host), the figure the
H200's generate() step pays per layer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import callpath as cb                                       # noqa: E402

from ptxattn import decode, decode_launch, tma              # noqa: E402

B, H, HKV, D, L0, LAYERS = 8, 32, 8, 128, 512, 32


def _steps(torch, calls: int, dynamic: bool, device: str = "cpu"):
    """(query, key, value, lengths) of `calls` decode calls, in (B, H/Hkv, L, D) as
    transformers passes them."""
    per = B * HKV * D
    steps = calls // LAYERS + 2
    size = per * (L0 + steps) + 8 * LAYERS * 2 + 64
    kbuf = torch.zeros(size, dtype=torch.bfloat16, device=device)
    vbuf = torch.zeros(size, dtype=torch.bfloat16, device=device)
    qs = [torch.zeros(B, H, 1, D, dtype=torch.bfloat16, device=device) for _ in range(4)]
    out = []
    for i in range(calls):
        step, layer = divmod(i, LAYERS)
        if dynamic:
            n = L0 + step
            off = 8 * ((step % 2) * LAYERS + layer)          # a new address every call
            k = kbuf[off:off + per * n].view(B, HKV, n, D)
            v = vbuf[off:off + per * n].view(B, HKV, n, D)
        else:
            n = L0 + steps
            k = kbuf[:per * n].view(B, HKV, n, D)
            v = vbuf[:per * n].view(B, HKV, n, D)
        out.append((qs[i % 4], k, v))
    return out


def measure(torch, calls: int, repeats: int, dynamic: bool, device: str = "cpu") -> dict:
    from ptxattn.torch import kvcache
    args = _steps(torch, calls, dynamic, device)
    lengths = None if dynamic else torch.full((B,), L0, dtype=torch.int32, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    mask = None if dynamic else object()                    # the static cache's plain mask

    def one(q, k, v):
        r = kvcache.decode_step(q, k, v, mask, 0.0, None, True, H // HKV,
                                cache_seqlens=lengths)
        assert r is not None
    for q, k, v in args:                                    # warm: the kernels' JIT (the
        one(q, k, v)                                        # combine's at a longer cache)
    times = []
    for _ in range(repeats):
        decode.clear_steady_cache()
        sync()
        t0 = time.perf_counter()
        for q, k, v in args:
            one(q, k, v)
        times.append((time.perf_counter() - t0) / calls * 1e6)
        sync()
    return {"us_per_call": round(statistics.median(times), 1),
            "us_all": [round(t, 1) for t in times],
            "steady": len(decode._STEADY), "launchers": len(decode._LAUNCHERS),
            "maps": len(tma._MAPS)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--gpu", action="store_true", help="CUDA tensors, the real driver")
    a = ap.parse_args(argv)
    import torch
    if a.gpu:
        import ptxattn.torch  # noqa: F401  (the decode_step path as generate() takes it)
        res = {name: measure(torch, a.calls, a.repeats, dyn, "cuda")
               for name, dyn in (("dynamic", True), ("static", False))}
        return _report(res, a.out)
    saved = dict(decode_launch._FUNCTIONS)
    try:
        with cb.fake_driver(), cb.torch_pretends_cuda(torch):
            decode_launch._FUNCTIONS.clear()
            res = {name: measure(torch, a.calls, a.repeats, dyn)
                   for name, dyn in (("dynamic", True), ("static", False))}
            decode.clear_steady_cache()
    finally:
        decode_launch._FUNCTIONS.clear()
        decode_launch._FUNCTIONS.update(saved)
    return _report(res, a.out)


def _report(res: dict, out) -> int:
    text = json.dumps(res, indent=1)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

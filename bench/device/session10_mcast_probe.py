"""Session 10 K/V multicast probe (bench/device/session10_mcast_probe.sh runs it on the GPU).

The diagnosis it checks: in a cluster launch a shared::cta address carries the CTA's cluster
rank from bit 24 up, and the first multicast build put (address >> 4) into the wgmma
descriptors unmasked, so rank 1's bit 24 landed in the LBO field: its MN-major V descriptor
read D columns 64..127 of V 256 bytes (two keys) too far. Expected per build:
  fixed  (-D PTXATTN_KV_MULTICAST=1): every block and column half bit-identical to unicast;
  old    (+ PTXATTN_MCAST_DEBUG_NO_DESC_MASK=1, the failing build): even (rank 0) blocks and
         every block's columns 0..63 identical to unicast, odd (rank 1) blocks' columns
         64..127 wrong (Lk = 1: exactly 0, rel error 1.0);
  self   (fixed + PTXATTN_MCAST_DEBUG_SELF=1: ctaMask = own CTA, each CTA loads its own K/V):
         like fixed.
One line a (build, shape): max relative error (vs the float64 reference) of rank 0 / rank 1
blocks, columns lo (0..63) / hi (64..127), the block halves bit-identical to the unicast
build, NaN count.
"""

from __future__ import annotations

import sys

import numpy as np

from ptxattn import tensors
from ptxattn.api import prepare
from ptxattn.reference import BF16, attention_reference

MC = {"PTXATTN_KV_MULTICAST": "1"}
BUILDS = {"fixed": MC,
          "old": {**MC, "PTXATTN_MCAST_DEBUG_NO_DESC_MASK": "1"},
          "self": {**MC, "PTXATTN_MCAST_DEBUG_SELF": "1"}}
SHAPES = [(1, 2, 256, 256), (1, 1, 512, 512), (2, 3, 256, 1), (2, 4, 1024, 1024)]
BLOCK_M = 128


def run(q, k, v, defines=None):
    qd, kd, vd = (tensors.from_numpy(x) for x in (q, k, v))
    out = tensors.empty(q.shape)
    out.fill_u16(0xFFFF)                                  # bf16 NaN: unwritten shows
    p = prepare(qd, kd, vd, layout="bhld", out=out, defines=defines)
    p.launch()
    o = out.to_numpy()
    p.close()
    for x in (qd, kd, vd, out):
        x.free()
    return o


def summary(o, ref, uni):
    """rel err [rank][half] (max over blocks), bit-identical block halves / all, NaN count."""
    B, H, L, D = o.shape
    of, rf = o.astype(np.float64), ref
    err = np.zeros((2, 2))
    same = total = 0
    for m in range(-(-L // BLOCK_M)):
        rows = slice(m * BLOCK_M, min(L, (m + 1) * BLOCK_M))
        for h, cols in enumerate((slice(0, D // 2), slice(D // 2, D))):
            a, r = of[:, :, rows, cols], rf[:, :, rows, cols]
            e = np.linalg.norm(np.nan_to_num(a - r, nan=1e9)) / max(np.linalg.norm(r), 1e-30)
            err[m % 2, h] = max(err[m % 2, h], e)
            same += int(np.array_equal(o[:, :, rows, cols].view(np.uint16),
                                       uni[:, :, rows, cols].view(np.uint16)))
            total += 1
    nan = int(np.count_nonzero(~np.isfinite(of)))
    return err, same, total, nan


def main() -> int:
    rng = np.random.default_rng(10)
    for B, H, Lq, Lk in SHAPES:
        q = rng.standard_normal((B, H, Lq, 128), dtype=np.float32).astype(BF16)
        k = rng.standard_normal((B, H, Lk, 128), dtype=np.float32).astype(BF16)
        v = rng.standard_normal((B, H, Lk, 128), dtype=np.float32).astype(BF16)
        ref = attention_reference(q, k, v, layout="bhld")
        uni = run(q, k, v)
        for name, defines in BUILDS.items():
            try:
                err, same, total, nan = summary(run(q, k, v, defines), ref, uni)
            except Exception as e:                         # a build that fails: say so, go on
                print(f"{name:5s} {B}x{H}x{Lq}/{Lk}: {type(e).__name__}: {str(e)[:160]}")
                continue
            print(f"{name:5s} {B}x{H}x{Lq}/{Lk}: rank0 lo {err[0, 0]:.1e} hi {err[0, 1]:.1e}"
                  f" | rank1 lo {err[1, 0]:.1e} hi {err[1, 1]:.1e} | same as unicast "
                  f"{same}/{total} | nan {nan}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What binds a kernel: one launch under Nsight Compute (ncu), for bench/README.md's "what binds".

    ncu --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        -k ptxattn_fwd --launch-skip 1 --launch-count 1 \
        python bench/experiments/ncu_bind.py stage14 --shape 4x16x8192x128 [--causal]

Launches the kernel twice on fresh random inputs (the first launch JIT-compiles and warms up;
ncu profiles the second) and checks the output against the reference, so a profile is never of
a wrong kernel. No timing here: ncu replays the kernel per metric pass.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ptxattn import driver, reference, tensors
from ptxattn.tools import bench
from ptxattn.api import prepare


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel")
    ap.add_argument("--shape", default="4x16x8192x128", help="4k, 8k, ... or BxHxLxD")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("-d", "--define", action="append", default=[], help="NAME=VALUE")
    args = ap.parse_args(argv)
    _, (b, h, seq, d) = bench.parse_shape(args.shape)   # the benchmark's own shape names too
    q, k, v = reference.random_qkv(b, h, seq, seq, d, "bhld", seed=1)
    qd, kd, vd = (tensors.from_numpy(x) for x in (q, k, v))
    out = tensors.empty(q.shape)
    out.fill_u16(0xFFFF)
    defines = dict(x.split("=", 1) for x in args.define) or None
    p = prepare(qd, kd, vd, stage=args.kernel, out=out, causal=args.causal, defines=defines)
    p.launch()
    p.launch()
    driver.synchronize()
    rows = reference.sample_rows(seq, 64, seed=1)
    ref = reference.attention_reference(q, k, v, rows=rows, causal=args.causal)
    m = reference.error_metrics(np.take(out.to_numpy(), rows, axis=2), ref)
    print(f"{args.kernel} {args.shape} causal={args.causal}: {m}")
    return 0 if reference.passes(m) else 1


if __name__ == "__main__":
    sys.exit(main())

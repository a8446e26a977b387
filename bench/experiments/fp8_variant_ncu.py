"""A launcher for Nsight Compute: the FP8 forward of one build (today's default or a
measurement variant, builds.FP8_VARIANTS) at one shape, on per-head quantized operands
(bench/fp8_bench.py --variants' operands), launched four times after a check against float64
on sampled rows (a profile is never of a wrong kernel). ncu picks a launch:

    ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section WarpStateStats -k regex:ptxattn_fwd_fp8 --launch-skip 2 --launch-count 1 \
        python bench/experiments/fp8_variant_ncu.py --variant n224
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import fp8_bench  # noqa: E402

from ptxattn import fp8, fp8_forward  # noqa: E402
from ptxattn.tools import bench  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", default="default")
    ap.add_argument("--shape", default="16k-d128", choices=list(fp8_bench.SHAPES))
    ap.add_argument("--launches", type=int, default=4)
    args = ap.parse_args(argv)
    torch = bench._import_torch()
    (b, h, length, d), layout, _, causal, _ = fp8_bench.shape_of(args.shape)
    q, k, v = fp8_bench.inputs(torch, (b, h, length, d), layout, 0)
    (q8, qs), (k8, ks), (v8, vs) = (fp8_bench.per_head_e4m3(torch, x, layout) for x in (q, k, v))
    plan = fp8.validate(q8, k8, v8, layout=layout, q_descale=qs, k_descale=ks, v_descale=vs,
                        causal=causal)
    prepared = fp8_forward.prepare(plan, fp8_forward.variant_defines(args.variant))
    prepared.launch()
    torch.cuda.synchronize()
    m = fp8_bench.check(args.variant, q, k, v, prepared.out, layout, fp8_bench.FP8_BAR,
                        causal=causal)
    if not m["passes"]:
        return 1
    for _ in range(args.launches - 1):
        prepared.launch_forward()
    torch.cuda.synchronize()
    prepared.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

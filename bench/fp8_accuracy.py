"""The FP8 accuracy study (CPU, NumPy): the FP8 forward's model against the float64 reference.

    python bench/fp8_accuracy.py                 # the table of bench/notes.md (~2 minutes)
    python bench/fp8_accuracy.py --quick         # smaller shapes, fewer variants

Every figure is ptxattn.fp8_reference.fp8_attention (the quantizer and the FP8 forward as the
kernels compute them: Q, K, V and P rounded to e4m3, fp32 accumulation) against
reference.attention_reference (float64 on the bf16 inputs), on fresh inputs per case:
relative L2, max |error| / max |reference|, non-finite outputs, and the LSE's largest error.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ptxattn import fp8_reference as fp8                                      # noqa: E402
from ptxattn.reference import BF16, attention_reference, error_metrics        # noqa: E402

# The default configuration of the FP8 path (what attention(precision="fp8") runs): P scaled
# by 2^8 with a rebase whenever a row's max grows (P <= 256 < 448), V per channel, K per
# block of 128 keys, row sums of the fp32 P.
DEFAULT = dict(rebase_log2=0.0, p_log2=8.0)
VARIANTS = {
    "default: P x 2^8, rebase on growth": {},
    "P x 1, lazy rebase past 2^8 (bf16 kernel's)": dict(rebase_log2=8.0, p_log2=0.0),
    "P x 2^4, lazy rebase past 2^4": dict(rebase_log2=4.0, p_log2=4.0),
    "P x 448, rebase on growth": dict(rebase_log2=0.0, p_log2=math.log2(448)),
    "row sums of e4m3 P": dict(sum_quantized_p=True),
    "V per head (not per channel)": dict(v_per_head=True),
    "K per head (not per 128 keys)": dict(k_block=None),
    "accumulator of 13 mantissa bits": dict(accumulator_bits=13),
}


def inputs(case: str, b: int, h: int, length: int, d: int, seed: int):
    """bf16 q, k, v (BHLD) of one case."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    q, k, v = normal(b, h, length, d), normal(b, h, length, d), normal(b, h, length, d)
    if case == "k outlier channels x20":
        k[..., rng.choice(d, 4, replace=False)] *= 20
    elif case == "k channel bias (N(0, 3^2) per channel)":
        k += 3 * normal(b, h, 1, d)
    elif case == "peaked rows (1 key ~10 above the rest)":
        # every query row aligned with one key: its score sits ~10 above the others
        target = rng.integers(0, length, (b, h, length))
        aligned = np.take_along_axis(k, target[..., None], axis=2)
        q = q * 0.3 + aligned * (10 / math.sqrt(d))
    elif case == "sparse outliers (0.1% N(0, 10^2))":
        for x in (q, k, v):
            hit = rng.random(x.shape) < 1e-3
            x[hit] = 10 * rng.standard_normal(int(hit.sum()))
    elif case != "normal":
        raise ValueError(case)
    return tuple(x.astype(BF16) for x in (q, k, v))


def measure(q, k, v, *, causal=False, smooth_k=False, **variant) -> dict:
    ref, ref_lse = attention_reference(q, k, v, causal=causal, return_lse=True)
    model = {key: val for key, val in {**DEFAULT, **variant}.items()
             if key not in ("k_block", "v_per_head")}
    out, lse = fp8.fp8_attention(q, k, v, causal=causal, smooth_k=smooth_k, return_lse=True,
                                 k_block=variant.get("k_block", 128),
                                 v_per_head=variant.get("v_per_head", False), **model)
    m = error_metrics(out, ref)
    finite = np.isfinite(ref_lse)
    m["lse_err"] = float(np.max(np.abs(lse[finite] - ref_lse[finite])))
    return m


def operand_alone(q, k, v) -> dict:
    """The error of rounding each operand alone to e4m3 (per-head scale), exact elsewhere."""
    f = [np.asarray(x).astype(np.float64) for x in (q, k, v)]
    d = f[0].shape[-1]

    def rounded(x):
        s = np.abs(x).max(axis=(-2, -1), keepdims=True) / fp8.E4M3_MAX
        return fp8.to_e4m3((x / s).astype(np.float32)).astype(np.float64) * s

    def attend(q, k, v, round_p=False):
        s = q @ np.swapaxes(k, -1, -2) / math.sqrt(d)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        total = p.sum(axis=-1, keepdims=True)
        if round_p:
            p = fp8.to_e4m3((p * 256).astype(np.float32)).astype(np.float64) / 256
        return p @ v / total

    ref = attend(*f)
    rel = lambda o: float(np.linalg.norm(o - ref) / np.linalg.norm(ref))   # noqa: E731
    return {"Q": rel(attend(rounded(f[0]), f[1], f[2])), "K": rel(attend(f[0], rounded(f[1]), f[2])),
            "V": rel(attend(f[0], f[1], rounded(f[2]))), "P": rel(attend(*f, round_p=True))}


def row(label: str, m: dict) -> str:
    return (f"| {label} | {m['rel_l2']:.4f} | {m['max_abs'] / m['ref_max_abs']:.4f} | "
            f"{m['nan_count']} | {m['lse_err']:.4f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="L = 512, the default variant only")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    length = 512 if args.quick else 2048
    b, h = 1, 4
    start = time.time()
    head = ("| case (B, H, L, D) | rel L2 | max err / max ref | non-finite | LSE max err |\n"
            "|---|---:|---:|---:|---:|")
    print(f"FP8 model against float64, (B, H, L) = ({b}, {h}, {length}), default: P x 2^8, "
          f"rebase on growth, V per channel, K per 128 keys, fp32 row sums\n")
    print(head)
    seed = args.seed
    for d in (64, 128, 256):
        seed += 1
        print(row(f"normal, D = {d}", measure(*inputs("normal", b, h, length, d, seed))))
    seed += 1
    print(row("normal, D = 128, causal", measure(*inputs("normal", b, h, length, 128, seed),
                                                  causal=True)))
    for case in ("k outlier channels x20", "k channel bias (N(0, 3^2) per channel)",
                 "peaked rows (1 key ~10 above the rest)", "sparse outliers (0.1% N(0, 10^2))"):
        seed += 1
        x = inputs(case, b, h, length, 128, seed)
        print(row(f"{case}, D = 128", measure(*x)))
        print(row(f"{case}, D = 128, smoothed K", measure(*x, smooth_k=True)))
    seed += 1
    x = inputs("normal", b, h, length, 128, seed)
    alone = operand_alone(*x)
    print(f"\nOne operand rounded to e4m3 alone (normal, D = 128, per-head scale, P x 256): "
          + ", ".join(f"{name} {err:.4f}" for name, err in alone.items()))
    if not args.quick:
        print("\nVariants (normal D = 128 | peaked rows D = 128 | k channel bias, smoothed):\n")
        print("| variant | normal rel L2 | peaked rel L2 | peaked max/ref | bias+smooth rel L2 |\n"
              "|---|---:|---:|---:|---:|")
        peaked = inputs("peaked rows (1 key ~10 above the rest)", b, h, length, 128, seed + 1)
        bias = inputs("k channel bias (N(0, 3^2) per channel)", b, h, length, 128, seed + 2)
        for label, variant in VARIANTS.items():
            a, p, s = measure(*x, **variant), measure(*peaked, **variant), \
                measure(*bias, smooth_k=True, **variant)
            print(f"| {label} | {a['rel_l2']:.4f} | {p['rel_l2']:.4f} | "
                  f"{p['max_abs'] / p['ref_max_abs']:.4f} | {s['rel_l2']:.4f} |")
    print(f"\n({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

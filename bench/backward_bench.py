"""The backward against cuDNN through PyTorch's SDPA, same run, DESIGN.md's protocol.

    python bench/backward_bench.py [--rounds 10] [--reps 10] [--out bench/results]
                                   [--cases dense,causal,d64,d256,gqa,deterministic]
                                   [--stages production,b1,b2,b3]

What is timed: our whole backward (preprocess + main kernel + postprocess, one launch() of a
prepared call) and cuDNN's backward alone (torch.autograd.grad of one SDPA forward under
sdpa_kernel(CUDNN_ATTENTION), retain_graph=True), alternating launch by launch in a random
order per round; ratio = median over rounds of (cuDNN time / ours) with a 95% bootstrap
interval. FLOPs = 2.5 x the forward's 4 B H Lq Lk D, counted over unmasked pairs (causal:
about half). Both get the same inputs: q, k, v, dO standard normal bf16; out and lse from our
forward for ours, cuDNN's own forward for cuDNN.

Before timing, each of our gradients is checked against cuDNN's on the same inputs (relative L2
<= 1e-2; both sit near 4e-3 of the float64 truth) and for NaN/Inf: a kernel that fails is not
timed. GQA 32:4: cuDNN gets enable_gqa=True where torch takes it, else K/V repeated to 32
heads before its forward (the repeat's backward, a sum, is then inside its time).
Needs a GPU and torch. Writes bench/results/<date>-h200-backward.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ptxattn  # noqa: E402
from ptxattn import backward, driver  # noqa: E402

try:                      # the tools are moving to ptxattn/tools/ (bench.py kept whole)
    from ptxattn.tools import bench as fwd_bench  # type: ignore  # noqa: E402
except ImportError:
    from ptxattn.tools import bench as fwd_bench  # noqa: E402

CASES = {  # name: (B, H, Hkv, L, D, mask kwargs, deterministic)
    "dense": (4, 16, 16, 8192, 128, {}, False),
    "causal": (4, 16, 16, 8192, 128, {"causal": True}, False),
    "d64": (4, 32, 32, 8192, 64, {}, False),
    "d256": (4, 8, 8, 8192, 256, {}, False),
    "gqa": (4, 32, 4, 8192, 128, {}, False),
    "deterministic": (4, 16, 16, 8192, 128, {}, True),
    "deterministic_causal": (4, 16, 16, 8192, 128, {"causal": True}, True),
}
CHECK_REL_L2 = 1e-2


def backward_flops(B, H, L, D, causal) -> float:
    pairs = fwd_bench.unmasked_pairs(L, L, causal=causal)
    return 2.5 * 4.0 * B * H * D * pairs


def rel_l2(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def setup(torch, name, stage):
    B, H, Hkv, L, D, mask, det = CASES[name]
    causal = bool(mask.get("causal"))
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(h):
        return torch.randn((B, h, L, D), generator=g, device="cuda", dtype=torch.float32).to(
            torch.bfloat16)

    q, k, v, dout = rnd(H), rnd(Hkv), rnd(Hkv), rnd(H)
    out, lse = ptxattn.attention(q, k, v, return_lse=True, causal=causal)
    prepared = backward.prepare_backward(q, k, v, out, lse, dout, causal=causal,
                                         deterministic=det, stage=stage)
    stream = driver.stream_handle(torch.cuda.current_stream().cuda_stream)

    # cuDNN: one forward with a graph, its backward timed again and again
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    tq, tk, tv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    gqa_how = None
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        try:
            o = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal,
                                               enable_gqa=Hkv != H)
            gqa_how = "enable_gqa" if Hkv != H else None
        except RuntimeError:
            kk = tk.repeat_interleave(H // Hkv, dim=1)
            vv = tv.repeat_interleave(H // Hkv, dim=1)
            o = F.scaled_dot_product_attention(tq, kk, vv, is_causal=causal)
            gqa_how = "repeated K/V"

    def peer():
        return torch.autograd.grad(o, (tq, tk, tv), grad_outputs=dout, retain_graph=True)

    # check ours against cuDNN before any timing
    prepared.launch()
    ours = [torch.from_dlpack(x) for x in (prepared.dq, prepared.dk, prepared.dv)]
    theirs = peer()
    torch.cuda.synchronize()
    check = {n: rel_l2(a, b) for n, a, b in zip(("dq", "dk", "dv"), ours, theirs)}
    finite = all(bool(torch.isfinite(a.float()).all()) for a in ours)
    ok = finite and all(r <= CHECK_REL_L2 for r in check.values())
    flops = backward_flops(B, H, L, D, causal)
    info = {"shape": [B, H, Hkv, L, D], "causal": causal, "deterministic": det,
            "flops": flops, "check_vs_cudnn_rel_l2": check, "finite": finite, "passed": ok,
            "cudnn_gqa": gqa_how, "stage": prepared.stage.label}
    return info, (prepared.launch, stream), (peer, stream)


def run(args) -> dict:
    torch = fwd_bench._import_torch()
    if torch is None:
        raise SystemExit("backward_bench: needs torch with a CUDA device (the cuDNN peer)")
    result = {"kind": "backward", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "source": fwd_bench.source_id(ROOT), "rounds": args.rounds, "reps": args.reps,
              "environment": fwd_bench.environment(driver.device_info(), torch), "rows": []}
    rng = np.random.default_rng(args.seed)
    for stage in args.stages:
        for name in args.cases:
            B, H, Hkv, L, D, mask, det = CASES[name]
            if stage != "production" and (D != 128 or mask or det or H != Hkv):
                continue                 # a lineage stage: D = 128, no mask, MHA, not ordered
            info, ours, peer = setup(torch, name, None if stage == "production" else stage)
            row = {"case": name, **info}
            if not info["passed"]:
                row["error"] = "failed its check: not timed"
                print(f"{stage:>10} {name:<22} FAILED its check {info['check_vs_cudnn_rel_l2']}")
                result["rows"].append(row)
                continue
            timed = fwd_bench.time_rounds({"ours": ours}, peer, rounds=args.rounds,
                                          reps=args.reps, rng=rng)
            ms_rounds = [fwd_bench.median(t) for t in timed["raw"]["ours"]]
            peer_rounds = [fwd_bench.median(t) for t in timed["peer_raw"]["ours"]]
            ratios = [p / o for p, o in zip(peer_rounds, ms_rounds)]
            lo, hi = fwd_bench.bootstrap_ci(ratios, seed=args.seed)
            ms, pms = fwd_bench.median(ms_rounds), fwd_bench.median(peer_rounds)
            row.update(ms=ms, ms_rounds=ms_rounds, tflops=info["flops"] / ms / 1e9,
                       cudnn_ms=pms, cudnn_ms_rounds=peer_rounds,
                       cudnn_tflops=info["flops"] / pms / 1e9,
                       ratio=fwd_bench.median(ratios), ratio_ci=[lo, hi],
                       clocks=timed["clocks"][-1] if timed["clocks"] else None)
            print(f"{stage:>10} {name:<22} {row['tflops']:7.1f} TFLOP/s  cuDNN "
                  f"{row['cudnn_tflops']:7.1f}  ratio {row['ratio']:.3f} [{lo:.3f}, {hi:.3f}]")
            result["rows"].append(row)
            del ours, peer
            torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", default="dense,causal,d64,d256,gqa,deterministic")
    ap.add_argument("--stages", default="production")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    for c in args.cases:
        if c not in CASES:
            ap.error(f"--cases: unknown case {c!r} (known: {', '.join(CASES)})")
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{time.strftime('%Y-%m-%d')}-h200-backward.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

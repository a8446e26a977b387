"""The backward against cuDNN through PyTorch's SDPA, same run, DESIGN.md's protocol.

    python bench/backward_bench.py [--rounds 10] [--reps 10] [--out bench/results]
                                   [--cases dense,causal,d64,d256,gqa,deterministic]
                                   [--stages production,b1,b2,b3]
                                   [--variants all | default,st_ahead,m80,qsplit,qsplit_dqred]

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

--variants: the production kernel's build-table variants (ptxattn/bwd_builds.py VARIANTS)
against today's build and cuDNN, in the same rounds: per case every named variant that has a
build at its head dim (and, for the deterministic cases, that can run deterministic=True),
each checked against cuDNN before timing; each row also gets ratio_vs_default = median over
rounds of (today's time / the variant's) with its 95% bootstrap interval. --stages is then
ignored. Writes bench/results/<date>-h200-backward-variants.json.

--sustained: after each case's rounds, each of its timed backwards and cuDNN's run a
sustained window at the power cap (ptxattn/tools/sustained.py figures(), as `ptxattn bench
--sustained`: a cool-down, seconds back to back, power and SM clock sampled; seeded order):
each row gets sustained (TFLOP/s, median clock and power, TFLOP/J, pct_of_peer),
cudnn_sustained (cuDNN's window of that case) and sustained_ratio (our sustained TFLOP/s over
cuDNN's, beside the burst `ratio`); the file's sustained_protocol says how.
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
from ptxattn import backward, bwd_builds, driver  # noqa: E402

try:                      # the tools are moving to ptxattn/tools/ (bench.py kept whole)
    from ptxattn.tools import bench as fwd_bench  # type: ignore  # noqa: E402
except ImportError:
    from ptxattn.tools import bench as fwd_bench  # noqa: E402
from ptxattn.tools import sustained  # noqa: E402

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


def setup(torch, name, stage, variants=(None,)):
    """(info per label, ours per label: (launch, stream), peer) of one case: our backward for
    each of `variants` (None: what attention_backward runs unasked, the measured default, or
    a lineage `stage`; "default": today's row), cuDNN's once."""
    B, H, Hkv, L, D, mask, det = CASES[name]
    causal = bool(mask.get("causal"))
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(h):
        return torch.randn((B, h, L, D), generator=g, device="cuda", dtype=torch.float32).to(
            torch.bfloat16)

    q, k, v, dout = rnd(H), rnd(Hkv), rnd(Hkv), rnd(H)
    out, lse = ptxattn.attention(q, k, v, return_lse=True, causal=causal)
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
    theirs = peer()
    infos, launches = {}, {}
    flops = backward_flops(B, H, L, D, causal)
    for variant in variants:
        prepared = backward.prepare_backward(q, k, v, out, lse, dout, causal=causal,
                                             deterministic=det, stage=stage, variant=variant)
        prepared.launch()
        ours = [torch.from_dlpack(x) for x in (prepared.dq, prepared.dk, prepared.dv)]
        torch.cuda.synchronize()
        check = {n: rel_l2(a, b) for n, a, b in zip(("dq", "dk", "dv"), ours, theirs)}
        finite = all(bool(torch.isfinite(a.float()).all()) for a in ours)
        ok = finite and all(r <= CHECK_REL_L2 for r in check.values())
        label = variant or (bwd_builds.chosen_variant(D, det, None) if stage is None
                            else None) or bwd_builds.DEFAULT_VARIANT
        infos[label] = {"shape": [B, H, Hkv, L, D], "causal": causal, "deterministic": det,
                        "flops": flops, "check_vs_cudnn_rel_l2": check, "finite": finite,
                        "passed": ok, "cudnn_gqa": gqa_how, "stage": prepared.stage.label,
                        "variant": label}
        launches[label] = (prepared.launch, stream)
    return infos, launches, (peer, stream)


def case_variants(name, wanted) -> list:
    """The variants of `wanted` that case `name` can run (today's build first, by name: a
    call that names none runs the measured default)."""
    B, H, Hkv, L, D, mask, det = CASES[name]
    out = [bwd_builds.DEFAULT_VARIANT]
    for v in wanted:
        if v == bwd_builds.DEFAULT_VARIANT or v not in bwd_builds.variants_for(D):
            continue
        if det and not bwd_builds.build(D, v).deterministic:
            continue
        out.append(v)
    return out


def _timed_row(row, timed, label, seed):
    """Our per-round medians of `label` and its pair's cuDNN: TFLOP/s, ratio with interval."""
    ms_rounds = [fwd_bench.median(t) for t in timed["raw"][label]]
    peer_rounds = [fwd_bench.median(t) for t in timed["peer_raw"][label]]
    ratios = [p / o for p, o in zip(peer_rounds, ms_rounds)]
    lo, hi = fwd_bench.bootstrap_ci(ratios, seed=seed)
    ms, pms = fwd_bench.median(ms_rounds), fwd_bench.median(peer_rounds)
    row.update(ms=ms, ms_rounds=ms_rounds, tflops=row["flops"] / ms / 1e9,
               cudnn_ms=pms, cudnn_ms_rounds=peer_rounds,
               cudnn_tflops=row["flops"] / pms / 1e9,
               ratio=fwd_bench.median(ratios), ratio_ci=[lo, hi],
               clocks=timed["clocks"][-1] if timed["clocks"] else None)
    return row


def add_sustained(rows: dict, ours: dict, peer, cfg, *, rng, sampler, **kw) -> list:
    """A case's sustained windows (sustained.figures, after its burst rounds, same inputs):
    rows {label: row} of its timed backwards (those with a burst `ms`), ours {label: (launch,
    stream)}, peer (launch, stream): cuDNN's backward. Each timed row gets sustained,
    cudnn_sustained and sustained_ratio (our sustained TFLOP/s / cuDNN's, the burst ratio's
    twin; None where a window failed). Returns the order the windows ran in."""
    timed = {lab: row for lab, row in rows.items() if row.get("ms")}
    if not timed:
        return []
    first = next(iter(timed.values()))
    kernels = {lab: sustained.Kernel(*ours[lab], row["flops"], row["ms"])
               for lab, row in timed.items()}
    kernels[fwd_bench.PEER] = sustained.Kernel(*peer, first["flops"], first["cudnn_ms"])
    figs = sustained.figures(kernels, cfg, rng=rng, peer=fwd_bench.PEER, sampler=sampler,
                             log=print, **kw)
    for lab, row in timed.items():
        pct = figs[lab].get("pct_of_peer")
        row.update(sustained=figs[lab], cudnn_sustained=figs[fwd_bench.PEER],
                   sustained_ratio=pct / 100.0 if pct else None)
    return list(figs)


def run(args) -> dict:
    torch = fwd_bench._import_torch()
    if torch is None:
        raise SystemExit("backward_bench: needs torch with a CUDA device (the cuDNN peer)")
    result = {"kind": "backward-variants" if args.variants else "backward",
              "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "source": fwd_bench.source_id(ROOT), "rounds": args.rounds, "reps": args.reps,
              "environment": fwd_bench.environment(driver.device_info(), torch), "rows": []}
    rng = np.random.default_rng(args.seed)
    cfg = args.sustained_cfg
    sampler = sustained.start_sampler(cfg) if cfg else None     # missing: before any case
    if sampler is not None:
        result["sustained_protocol"] = sustained.protocol(cfg, sampler)
        result["sustained_orders"] = {}
    try:
        _run_cases(args, torch, result, rng, cfg, sampler)
    finally:
        if sampler is not None:
            sampler.stop()
    return result


def _run_cases(args, torch, result, rng, cfg, sampler) -> None:
    """run()'s loop: per stage and case, the check, the burst rounds, the sustained windows."""
    sustained_rng = np.random.default_rng([args.seed, 23])
    stages = ["production"] if args.variants else args.stages
    for stage in stages:
        for name in args.cases:
            B, H, Hkv, L, D, mask, det = CASES[name]
            if stage != "production" and (D != 128 or mask or det or H != Hkv):
                continue                 # a lineage stage: D = 128, no mask, MHA, not ordered
            variants = case_variants(name, args.variants) if args.variants else [None]
            infos, ours, peer = setup(torch, name, None if stage == "production" else stage,
                                      variants)
            failed = [lab for lab, i in infos.items() if not i["passed"]]
            for lab in failed:
                row = {"case": name, **infos[lab], "error": "failed its check: not timed"}
                print(f"{stage:>10} {name:<22} {lab:<15} FAILED its check "
                      f"{infos[lab]['check_vs_cudnn_rel_l2']}")
                result["rows"].append(row)
            ours = {lab: fn for lab, fn in ours.items() if lab not in failed}
            if not ours:
                continue
            timed = fwd_bench.time_rounds(ours, peer, rounds=args.rounds, reps=args.reps,
                                          rng=rng)
            base = bwd_builds.DEFAULT_VARIANT
            case_rows = {}
            for lab in ours:
                if lab in timed["errors"]:
                    row = {"case": name, **infos[lab], "error": timed["errors"][lab]}
                    print(f"{stage:>10} {name:<22} {lab:<15} ERROR {timed['errors'][lab]}")
                    result["rows"].append(row)
                    continue
                row = _timed_row({"case": name, **infos[lab]}, timed, lab, args.seed)
                vs = ""
                if args.variants and lab != base and base in ours and base not in timed["errors"]:
                    per = [fwd_bench.median(a) / fwd_bench.median(b) for a, b in
                           zip(timed["raw"][base], timed["raw"][lab])]
                    vlo, vhi = fwd_bench.bootstrap_ci(per, seed=args.seed)
                    row.update(ratio_vs_default=fwd_bench.median(per),
                               ratio_vs_default_ci=[vlo, vhi])
                    vs = f"  vs today {row['ratio_vs_default']:.3f} [{vlo:.3f}, {vhi:.3f}]"
                label = f"{stage:>10} {name:<22}" + (f" {lab:<15}" if args.variants else "")
                print(f"{label} {row['tflops']:7.1f} TFLOP/s  cuDNN {row['cudnn_tflops']:7.1f}"
                      f"  ratio {row['ratio']:.3f} [{row['ratio_ci'][0]:.3f}, "
                      f"{row['ratio_ci'][1]:.3f}]{vs}")
                result["rows"].append(row)
                case_rows[lab] = row
            if sampler is not None and case_rows:
                result["sustained_orders"][f"{stage} {name}"] = add_sustained(
                    case_rows, ours, peer, cfg, rng=sustained_rng, sampler=sampler)
                for lab, row in case_rows.items():
                    print(f"{stage:>10} {name:<22} {lab:<15} sustained ratio "
                          f"{_fmt(row['sustained_ratio'], '.3f')} (burst {row['ratio']:.3f})")
            del ours, peer
            torch.cuda.empty_cache()


def _fmt(value, spec) -> str:
    return "-" if value is None else format(value, spec)


def parse_args(argv=None):
    """The command line, checked (unknown cases and variants, bad sustained values: ap.error
    before anything runs); args.sustained_cfg is the sustained.Config or None."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", default="dense,causal,d64,d256,gqa,deterministic")
    ap.add_argument("--stages", default="production")
    ap.add_argument("--variants", default="",
                    help="'all', or names from ptxattn.bwd_builds.VARIANT_NAMES: time them "
                         "against today's build and cuDNN (see the docstring)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    sustained.add_arguments(ap)
    args = ap.parse_args(argv)
    args.sustained_cfg = sustained.config_from_args(ap, args)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    if args.variants.strip() == "all":
        args.variants = list(bwd_builds.VARIANT_NAMES)
    else:
        args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in args.variants:
        if v not in bwd_builds.VARIANT_NAMES:
            ap.error(f"--variants: unknown variant {v!r} (known: "
                     f"{', '.join(bwd_builds.VARIANT_NAMES)})")
    for c in args.cases:
        if c not in CASES:
            ap.error(f"--cases: unknown case {c!r} (known: {', '.join(CASES)})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "-variants" if args.variants else ""
    path = out / f"{time.strftime('%Y-%m-%d')}-h200-backward{suffix}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

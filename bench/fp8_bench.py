"""The FP8 forward's benchmark (GPU, PyTorch): ptxattn precision="fp8" against our bf16 kernel
and cuDNN bf16 in the same process, by DESIGN.md's protocol.

    PTXATTN_REQUIRE_GPU=1 python bench/fp8_bench.py                    # the three shapes
    python bench/fp8_bench.py --shapes wan --rounds 10 --reps 10 --out bench/results

--shapes causal-16k-d128,causal-16k-d256: the masked builds at the targets' shapes (causal,
bottom-right; FLOPs credited halved as in `ptxattn bench`), every kernel and check causal.

Per shape, after a check of each kernel on sampled rows (one that fails is not timed):
rounds (>= 10) in which every kernel is timed once, in a random order, each interleaved launch
by launch with cuDNN (CUDA events around each launch, the host never waiting); per kernel the
median over rounds, TFLOP/s, % of cuDNN and of our bf16 kernel as medians of same-round ratios
with 95% bootstrap intervals. FP8 appears twice: the forward alone on operands quantized once
(quantization outside the figure) and quantize + forward per launch (inside), and the
quantizer alone is timed too.

--variants default,n192,n224: the FP8 measurement variants (builds.FP8_VARIANTS: wider key
tiles at D = 128, m3n96's three consumers) against today's build in the same rounds. The variants take FlashAttention-3's
(batch, heads_kv) descales, so every FP8 row here runs on the same operands quantized once per
head (torch, outside the figure): "fp8 <variant>" rows, each with x_default (its speed over
the default build's, a median of same-round ratios with a 95% interval), beside the usual
"fp8 forward" row (the quantizer's per-block operands: today's call), our bf16 and cuDNN.
With --sustained: a window for each FP8 row, our bf16 and cuDNN.

--sustained: after a shape's rounds, the FP8 forward (quantized once), our bf16 kernel and
cuDNN bf16 each run a sustained window at the power cap (ptxattn/tools/sustained.py
figures(), as `ptxattn bench --sustained`: a cool-down, seconds back to back, power and SM
clock sampled; seeded order): their rows get sustained (TFLOP/s, median clock and power,
TFLOP/J, pct_of_peer: % of cuDNN's), the FP8 row x_bf16_sustained, the shape cudnn_sustained;
the file's sustained_protocol says how.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ptxattn import fp8, fp8_forward
from ptxattn.tools import bench, sustained                   # noqa: E402
from ptxattn import api as attn_module                                    # noqa: E402
from ptxattn.reference import attention_reference, error_metrics, sample_rows   # noqa: E402

SHAPES = {   # name: (B, H, L, D, layout), the targets in TFLOP/s or x our bf16
    "16k-d128": ((2, 16, 16384, 128), "bhld", "FP8 >= 1000 TFLOP/s"),
    "16k-d256": ((2, 8, 16384, 256), "bhld", "FP8 >= 1150 TFLOP/s"),
    "wan": ((1, 12, 32760, 128), "bshd", ">= 1.6x our bf16, quantization included"),
    # the masked builds (no target of their own): FLOPs credited halved, as ptxattn bench does
    "causal-16k-d128": ((2, 16, 16384, 128), "bhld", "the masked build, beside 16k-d128"),
    "causal-16k-d256": ((2, 8, 16384, 256), "bhld", "the masked build, beside 16k-d256"),
}


def shape_of(name):
    """(dims, layout, target, causal, FLOPs credited) of a SHAPES entry: causal for the
    causal- ones, whose FLOPs are halved."""
    (b, h, length, d), layout, target = SHAPES[name]
    causal = name.startswith("causal-")
    return (b, h, length, d), layout, target, causal, \
        4 * b * h * length * length * d // (2 if causal else 1)
FP8_BAR = 0.075          # rel L2 on sampled rows: the model's ~0.053 x 1.25 + 5e-3 (notes.md)
LABELS = ("fp8 forward", "fp8 + quantize", "quantize alone", "bf16 production")
SUSTAINED = ("fp8 forward", "bf16 production")   # and cuDNN: attention FLOPs, no quantizer


def inputs(torch, shape, layout, seed):
    b, h, length, d = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dims = (b, h, length, d) if layout == "bhld" else (b, length, h, d)
    return [torch.randn(dims, generator=gen, device="cuda", dtype=torch.bfloat16)
            for _ in range(3)]


def reference_rows(q, k, v, layout, causal=False):
    """(rows, float64 reference on them): 128 sampled rows of every head (check's)."""
    seq_axis = 2 if layout == "bhld" else 1
    host = [x.float().cpu().numpy() for x in (q, k, v)]
    rows = sample_rows(host[0].shape[seq_axis], 128, seed=1)
    return rows, attention_reference(*host, layout=layout, rows=rows, causal=causal)


def check(name, q, k, v, out, layout, bar, reference=None, causal=False):
    """rel L2 and NaN of `out` against float64 on 128 sampled rows of every head (reference:
    reference_rows' result, computed here when not given)."""
    seq_axis = 2 if layout == "bhld" else 1
    rows, ref = reference if reference is not None else reference_rows(q, k, v, layout,
                                                                        causal)
    got = out.float().cpu().numpy() if hasattr(out, "float") else \
        out.to_numpy().astype(np.float32)
    m = error_metrics(np.take(got, rows, axis=seq_axis), ref)
    m["nan_total"] = int(np.count_nonzero(~np.isfinite(got)))
    m["passes"] = m["nan_total"] == 0 and m["rel_l2"] <= bar
    print(f"  check {name}: rel L2 {m['rel_l2']:.4f} (bar {bar}), max {m['max_abs']:.4f}, "
          f"non-finite {m['nan_total']}: {'PASS' if m['passes'] else 'FAIL'}")
    return m


def add_sustained(record: dict, ours: dict, peer, cfg, *, rng, sampler, **kw) -> list:
    """A shape's sustained windows (sustained.figures, after its rounds, same inputs): the
    SUSTAINED kernels of ours {label: (launch, stream)} that have a burst row, and peer
    (launch, stream), cuDNN, when it was timed. Into record (run_shape's): rows[label]
    ["sustained"], the FP8 row's x_bf16_sustained (its sustained TFLOP/s over our bf16's),
    cudnn_sustained. Returns the order the windows ran in."""
    rows, flops = record["rows"], record["flops"]
    kernels = {lab: sustained.Kernel(*ours[lab], flops, rows[lab]["ms"]) for lab in SUSTAINED
               if lab in ours and rows.get(lab, {}).get("ms")}
    with_peer = peer is not None and record.get("cudnn_ms")
    if with_peer:
        kernels[bench.PEER] = sustained.Kernel(*peer, flops, record["cudnn_ms"])
    if not kernels:
        return []
    figs = sustained.figures(kernels, cfg, rng=rng, peer=bench.PEER if with_peer else None,
                             sampler=sampler, log=print, **kw)
    for lab in kernels:
        if lab != bench.PEER:
            rows[lab]["sustained"] = figs[lab]
    if with_peer:
        record["cudnn_sustained"] = figs[bench.PEER]
    f8, bf = (figs.get(lab, {}).get("tflops") for lab in SUSTAINED)
    if "fp8 forward" in kernels:
        rows["fp8 forward"]["x_bf16_sustained"] = f8 / bf if f8 and bf else None
    return list(figs)


def run_shape(torch, name, rounds, reps, seed, defines=None, cfg=None, sampler=None):
    (b, h, length, d), layout, target, causal, flops = shape_of(name)
    print(f"{name}: (B, H, L, D) = {(b, h, length, d)} {layout.upper()}; target {target}")
    q, k, v = inputs(torch, (b, h, length, d), layout, seed)
    ref = reference_rows(q, k, v, layout, causal)  # one float64 reference for every row
    plan = fp8.validate(q, k, v, layout=layout, causal=causal)
    prepared = fp8_forward.prepare(plan, defines or None)
    prepared.launch()
    torch.cuda.synchronize()
    checks = {"fp8": check("fp8", q, k, v, prepared.out, layout, FP8_BAR, ref)}
    bf16 = attn_module.prepare(q, k, v, layout=layout, causal=causal)
    bf16.launch()
    torch.cuda.synchronize()
    checks["bf16 production"] = check("bf16 production", q, k, v, bf16.out, layout, 4e-3,
                                      ref)
    cudnn = bench._cudnn_launcher(torch, q, k, v, layout, causal=causal)
    peer_out = cudnn()                              # BHLD views: back to the layout
    peer_out = peer_out.transpose(1, 2) if layout == "bshd" else peer_out
    checks["cudnn"] = check("cuDNN", q, k, v, peer_out, layout, 4e-3, ref)
    stream = torch.cuda.current_stream().cuda_stream
    ours = {}
    if checks["fp8"]["passes"]:
        ours.update({"fp8 forward": (prepared.launch_forward, stream),
                     "fp8 + quantize": (prepared.launch, stream),
                     "quantize alone": (prepared.launch_prepare, stream)})
    if checks["bf16 production"]["passes"]:
        ours["bf16 production"] = (bf16.launch, stream)
    peer = (cudnn, stream) if checks["cudnn"]["passes"] else None
    timed = bench.time_rounds(ours, peer, rounds=rounds, reps=reps,
                              rng=np.random.default_rng(seed))
    rows = {}
    for label in ours:
        if label in timed["errors"]:
            rows[label] = {"error": timed["errors"][label]}
            continue
        ms_rounds = [bench.median(t) for t in timed["raw"][label]]
        row = {"ms_rounds": ms_rounds, "ms": bench.median(ms_rounds),
               "spread_pct": bench.spread_pct(ms_rounds)}
        row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12 if label != "quantize alone" else None
        if peer is not None:
            bench.pair_figures(row, timed["peer_raw"][label], seed=seed)
        rows[label] = row
    base = rows.get("bf16 production")
    for label in ("fp8 forward", "fp8 + quantize"):
        if label in rows and base and "ms_rounds" in rows[label]:
            ratio = [bf / f8 for bf, f8 in zip(base["ms_rounds"], rows[label]["ms_rounds"])]
            rows[label]["x_bf16"] = bench.median(ratio)
            rows[label]["x_bf16_ci"] = list(bench.bootstrap_ci(ratio, seed=seed))
    cudnn_ms = bench.median([bench.median(t) for t in timed["peer_all"]]) if timed["peer_all"] \
        else None
    for label, row in rows.items():
        if "error" in row:
            print(f"  {label:16s} ERROR {row['error']}")
            continue
        parts = [f"{row['ms']:8.3f} ms"]
        if row.get("tflops"):
            parts.append(f"{row['tflops']:7.1f} TFLOP/s")
        if "pct_of_peer" in row:
            lo, hi = row["pct_of_peer_ci"]
            parts.append(f"{row['pct_of_peer']:6.1f}% of cuDNN ({lo:.1f}-{hi:.1f})")
        if "x_bf16" in row:
            lo, hi = row["x_bf16_ci"]
            parts.append(f"{row['x_bf16']:.3f}x our bf16 ({lo:.3f}-{hi:.3f})")
        parts.append(f"spread {row['spread_pct']:.1f}%")
        print(f"  {label:16s} " + ", ".join(parts))
    if cudnn_ms:
        print(f"  {'cuDNN bf16':16s} {cudnn_ms:8.3f} ms, {flops / (cudnn_ms * 1e-3) / 1e12:7.1f} "
              f"TFLOP/s")
    record = {"shape": [b, h, length, d], "layout": layout, "target": target, "flops": flops,
              "causal": causal, "checks": checks, "rows": rows, "cudnn_ms": cudnn_ms, "orders": timed["orders"],
              "clocks": timed["clocks"]}
    if sampler is not None:
        record["sustained_order"] = add_sustained(record, ours, peer, cfg, sampler=sampler,
                                                  rng=np.random.default_rng([seed, 23]))
        f8 = rows.get("fp8 forward", {})
        if f8.get("x_bf16_sustained"):
            print(f"  fp8 forward sustained: {f8['x_bf16_sustained']:.3f}x our bf16 "
                  f"(burst {f8.get('x_bf16') or 0:.3f}x)")
    prepared.close()
    bf16.close()
    return record


def per_head_e4m3(torch, x, layout):
    """bf16 -> (e4m3, float32 (batch, heads) descale): amax / 448 per (batch, head), torch on
    the GPU (FlashAttention-3's descale convention: the variants' operands)."""
    dims = (2, 3) if layout == "bhld" else (1, 3)
    amax = x.float().abs().amax(dim=dims)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)).float()
    view = scale[:, :, None, None] if layout == "bhld" else scale[:, None, :, None]
    return (x.float() / view).to(torch.float8_e4m3fn), scale.contiguous()


def variant_sustained(record: dict, ours: dict, peer, cfg, *, rng, sampler, **kw) -> list:
    """--variants' sustained windows (sustained.figures, after the rounds): every timed row of
    ours {label: (launch, stream)} but today's call ("fp8 forward": the default build's
    speed on other operands), and peer (cuDNN) when timed. Into record: rows[label]
    ["sustained"], their x_default_sustained (over "fp8 default"'s), cudnn_sustained,
    sustained_order; prints a line a row."""
    rows, flops = record["rows"], record["flops"]
    kernels = {lab: sustained.Kernel(*ours[lab], flops, rows[lab]["ms"]) for lab in ours
               if rows.get(lab, {}).get("ms") and lab != "fp8 forward"}
    with_peer = peer is not None and record.get("cudnn_ms")
    if with_peer:
        kernels[bench.PEER] = sustained.Kernel(*peer, flops, record["cudnn_ms"])
    if not kernels:
        return []
    figs = sustained.figures(kernels, cfg, rng=rng, peer=bench.PEER if with_peer else None,
                             sampler=sampler, log=print, **kw)
    base = figs.get("fp8 default", {}).get("tflops")
    for lab in kernels:
        if lab == bench.PEER:
            continue
        rows[lab]["sustained"] = f = figs[lab]
        if base and f.get("tflops"):
            rows[lab]["x_default_sustained"] = f["tflops"] / base
        if f.get("tflops"):
            print(f"  {lab:16s} sustained {f['tflops']:7.1f} TFLOP/s"
                  + (f" at {f['sm_mhz_median']:.0f} MHz" if f.get("sm_mhz_median") else "")
                  + (f", {rows[lab]['x_default_sustained']:.3f}x fp8 default"
                     if "x_default_sustained" in rows[lab] else ""))
    if with_peer:
        record["cudnn_sustained"] = figs[bench.PEER]
    record["sustained_order"] = list(figs)
    return list(figs)


def variant_defines(name: str) -> dict:
    """--variants' name: a variant (fp8_forward.variant_defines), optionally with knobs of its
    own after colons ("m3n96:SW_EXP2_PER_8=1": that build with the knob)."""
    base, *knobs = name.split(":")
    out = dict(fp8_forward.variant_defines(base))
    out.update(knob.split("=", 1) for knob in knobs)
    return out


def _bad_variant(name: str) -> bool:
    """Whether a --variants name is no variant, or a knob of it no NAME=VALUE."""
    try:
        defines = variant_defines(name)
    except ValueError:                           # an unknown variant, or a knob without "="
        return True
    return not all(key.isidentifier() for key in defines)


def run_variants(torch, name, variants, rounds, reps, seed, defines=None, cfg=None,
                 sampler=None):
    """One shape, the FP8 variants (names: "default" and builds.FP8_VARIANTS keys) against each
    other in the same rounds, on per-head quantized operands; plus today's call ("fp8
    forward", the quantizer's operands), our bf16 and cuDNN. The record run_shape makes, with
    rows "fp8 <variant>" (x_default: speed over "fp8 default")."""
    (b, h, length, d), layout, target, causal, flops = shape_of(name)
    print(f"{name}: (B, H, L, D) = {(b, h, length, d)} {layout.upper()}; variants "
          f"{', '.join(variants)}")
    q, k, v = inputs(torch, (b, h, length, d), layout, seed)
    (q8, qs), (k8, ks), (v8, vs) = (per_head_e4m3(torch, x, layout) for x in (q, k, v))
    stream = torch.cuda.current_stream().cuda_stream
    ours, checks, prepared_all = {}, {}, []
    ref = reference_rows(q, k, v, layout, causal)  # one float64 reference for every row
    for var in variants:
        label = f"fp8 {var}"
        try:
            plan = fp8.validate(q8, k8, v8, layout=layout, q_descale=qs, k_descale=ks,
                                v_descale=vs, causal=causal)
            prep = fp8_forward.prepare(plan, {**(defines or {}),
                                              **variant_defines(var)})
            prep.launch()                        # V's transpose, then the forward
            torch.cuda.synchronize()
        except Exception as exc:                 # a build that fails is reported, not timed
            print(f"  {label}: ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            checks[label] = {"error": f"{type(exc).__name__}: {exc}"[:400], "passes": False}
            continue
        prepared_all.append(prep)
        checks[label] = check(label, q, k, v, prep.out, layout, FP8_BAR, ref)
        if checks[label]["passes"]:
            ours[label] = (prep.launch_forward, stream)
    plan = fp8.validate(q, k, v, layout=layout, causal=causal)
    today = fp8_forward.prepare(plan, defines or None)
    today.launch()
    torch.cuda.synchronize()
    prepared_all.append(today)
    checks["fp8 forward"] = check("fp8 forward", q, k, v, today.out, layout, FP8_BAR, ref)
    if checks["fp8 forward"]["passes"]:
        ours["fp8 forward"] = (today.launch_forward, stream)
    bf16 = attn_module.prepare(q, k, v, layout=layout, causal=causal)
    bf16.launch()
    torch.cuda.synchronize()
    checks["bf16 production"] = check("bf16 production", q, k, v, bf16.out, layout, 4e-3,
                                      ref)
    if checks["bf16 production"]["passes"]:
        ours["bf16 production"] = (bf16.launch, stream)
    cudnn = bench._cudnn_launcher(torch, q, k, v, layout, causal=causal)
    peer_out = cudnn()
    peer_out = peer_out.transpose(1, 2) if layout == "bshd" else peer_out
    checks["cudnn"] = check("cuDNN", q, k, v, peer_out, layout, 4e-3, ref)
    peer = (cudnn, stream) if checks["cudnn"]["passes"] else None
    timed = bench.time_rounds(ours, peer, rounds=rounds, reps=reps,
                              rng=np.random.default_rng(seed))
    rows = {}
    for label in ours:
        if label in timed["errors"]:
            rows[label] = {"error": timed["errors"][label]}
            continue
        ms_rounds = [bench.median(t) for t in timed["raw"][label]]
        row = {"ms_rounds": ms_rounds, "ms": bench.median(ms_rounds),
               "spread_pct": bench.spread_pct(ms_rounds)}
        row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
        if peer is not None:
            bench.pair_figures(row, timed["peer_raw"][label], seed=seed)
        rows[label] = row
    base = rows.get("fp8 default", {})
    for label, row in rows.items():
        if "ms_rounds" in row and "ms_rounds" in base:
            ratio = [a / x for a, x in zip(base["ms_rounds"], row["ms_rounds"])]
            row["x_default"] = bench.median(ratio)
            row["x_default_ci"] = list(bench.bootstrap_ci(ratio, seed=seed))
    cudnn_ms = bench.median([bench.median(t) for t in timed["peer_all"]]) if timed["peer_all"] \
        else None
    for label, row in rows.items():
        if "error" in row:
            print(f"  {label:16s} ERROR {row['error']}")
            continue
        parts = [f"{row['ms']:8.3f} ms", f"{row['tflops']:7.1f} TFLOP/s"]
        if "x_default" in row:
            lo, hi = row["x_default_ci"]
            parts.append(f"{row['x_default']:.3f}x fp8 default ({lo:.3f}-{hi:.3f})")
        if "pct_of_peer" in row:
            parts.append(f"{row['pct_of_peer']:6.1f}% of cuDNN")
        parts.append(f"spread {row['spread_pct']:.1f}%")
        print(f"  {label:16s} " + ", ".join(parts))
    if cudnn_ms:
        print(f"  {'cuDNN bf16':16s} {cudnn_ms:8.3f} ms, {flops / (cudnn_ms * 1e-3) / 1e12:7.1f} "
              f"TFLOP/s")
    record = {"shape": [b, h, length, d], "layout": layout, "target": target, "flops": flops,
              "causal": causal, "variants": list(variants), "checks": checks, "rows": rows,
              "cudnn_ms": cudnn_ms, "orders": timed["orders"], "clocks": timed["clocks"]}
    if sampler is not None:
        variant_sustained(record, ours, peer, cfg, sampler=sampler,
                          rng=np.random.default_rng([seed, 29]))
    for prep in prepared_all:
        prep.close()
    bf16.close()
    return record


def parse_args(argv=None):
    """The command line, checked (ap.error before anything runs): args.names (the shapes),
    args.defines {NAME: VALUE}, args.sustained_cfg (a sustained.Config or None)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(n for n in SHAPES if not n.startswith("causal-")),
                    help=f"comma-separated, of {', '.join(SHAPES)} (default: all but the "
                         "causal ones)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="a folder for the results JSON")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="a preprocessor define of the FP8 build (a measurement knob, e.g. "
                         "SW_EXP2_PER_8=1); repeatable")
    ap.add_argument("--variants", default=None, metavar="NAMES",
                    help="comma-separated FP8 builds to time against each other: default and "
                         "any of builds.FP8_VARIANTS (e.g. default,n192,n224,m3n96), each "
                         "optionally with knobs of its own after colons "
                         "(m3n96:SW_EXP2_PER_8=1)")
    sustained.add_arguments(ap)
    args = ap.parse_args(argv)
    args.sustained_cfg = sustained.config_from_args(ap, args)
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        ap.error(f"--shapes: unknown {unknown}; expected some of {list(SHAPES)}")
    if args.rounds < 10 or args.reps < 1:
        ap.error("--rounds: at least 10 (the protocol); --reps: at least 1")
    defines = {}
    for text in args.define:
        key, sep, value = text.partition("=")
        if not sep or not key.isidentifier():
            ap.error(f"--define: expected NAME=VALUE, got {text!r}")
        defines[key] = value
    text, args.variants = args.variants, None
    if text:
        from ptxattn import builds
        wanted = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in wanted if _bad_variant(x)]
        if bad:
            ap.error(f"--variants: unknown {bad}; expected default or some of "
                     f"{list(builds.FP8_VARIANTS)}")
        args.variants = wanted
    args.names, args.defines = names, defines
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    names, defines, cfg = args.names, args.defines, args.sustained_cfg
    torch = bench._import_torch()
    from ptxattn import driver
    info = driver.device_info()
    result = {"date": datetime.date.today().isoformat(), "gpu": info.get("name"),
              "environment": bench.environment(info, torch), "source": bench.source_id(),
              "rounds": args.rounds, "reps": args.reps, "fp8_bar": FP8_BAR, "defines": defines,
              "shapes": {}}
    sampler = sustained.start_sampler(cfg) if cfg else None     # missing: before any shape
    if sampler is not None:
        result["sustained_protocol"] = sustained.protocol(cfg, sampler)
    try:
        for name in names:
            if args.variants:
                result["variants"] = args.variants
                result["shapes"][name] = run_variants(torch, name, args.variants, args.rounds,
                                                      args.reps, args.seed, defines, cfg,
                                                      sampler)
                continue
            result["shapes"][name] = run_shape(torch, name, args.rounds, args.reps, args.seed,
                                               defines, cfg, sampler)
    finally:
        if sampler is not None:
            sampler.stop()
    if args.out:
        knobs = "".join(f"-{k}{v}" for k, v in sorted(defines.items()))
        knobs += "-variants" if args.variants else ""
        path = Path(args.out) / f"{result['date']}-h200-fp8{knobs}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1, default=float))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Decode benchmark (issue 24): K+V bytes read per second, ours against cuDNN through SDPA.

    python bench/decode_bench.py --out bench/results            # every case, ~3-4 minutes
    python bench/decode_bench.py --out /tmp/d --cases b1_8k --rounds 10
    python bench/decode_bench.py --out /tmp/d --cases b1_8k,b1_128k --splits 8,24,32

DESIGN.md's protocol: each case is checked first (ours and cuDNN against the float64 reference
on sampled sequences, every head and query; a kernel that fails is not timed), then timed in
rounds, ours and cuDNN alternating launch by launch in a random order each round, CUDA events
around every call and the host never waiting between them; the ratio is the median over rounds
of cuDNN time / our time with a 95% bootstrap interval. Twice: plain calls, and each call
captured once into a torch.cuda.CUDAGraph and replayed. Then the host time per call with the
queue full (a long kernel queued first so no call waits; perf_counter over N calls): ours
(flash_attn_with_kvcache), a DecodePlan's run() on the same call (checked against it first) and
cuDNN's SDPA.

Figures: K+V bytes = 2 x B x Hkv x L x D x 2 (every cached key and value read once: what a
decode step must read) per second, against the H200's 4.8 TB/s; the speculative case also in
TFLOP/s over the unmasked pairs. Cases (B, H:Hkv, Lq, L), D = 128, BSHD caches (B, L, Hkv, D):
    b64_8k (64, 32:8, 1, 8192)   b8_32k (8, 32:8, 1, 32768)   b1_128k (1, 32:8, 1, 131072)
    b1_8k (1, 32:8, 1, 8192)     spec_b16_8k (16, 32:8, 8, 8192) causal (bottom-right)
    b8_32k_hf, b1_32k_hf: (8 or 1, 32:8, 1, 32768) with the caches in transformers' dynamic
    cache memory order, (B, Hkv, L, D), read through (B, L, Hkv, D) views (not run by default)
cuDNN (SDPA's backends restricted to it by the global flags for the run, so no per-call
context manager counts against its host time) takes q (B, H, Lq, D) and the caches as
(B, Hkv, L, D) views (enable_gqa=True); the
speculative case's bottom-right causal mask goes to it as a boolean attn_mask when it takes one,
else that peer is timed unmasked (the same bytes) and says so. Needs torch with CUDA.
Results: <out>/<date>-<gpu>-decode.json.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ptxattn  # noqa: E402
from ptxattn import driver  # noqa: E402
from ptxattn.tools.bench import (bootstrap_ci, environment, gpu_clocks, median,  # noqa: E402
                                 restrict_sdpa, source_id, time_interleaved, write_results)
from ptxattn.decode import plan_splits  # noqa: E402
from ptxattn.decode_reference import kvcache_reference  # noqa: E402
from ptxattn.reference import error_metrics, passes, passes_against_peer, peer_bound  # noqa: E402

HBM_PEAK_TBS = 4.8
D = 128
# name: (B, H, Hkv, Lq, L, causal)
CASES = {
    "b64_8k": (64, 32, 8, 1, 8192, False),
    "b8_32k": (8, 32, 8, 1, 32768, False),
    "b1_128k": (1, 32, 8, 1, 131072, False),
    "b1_8k": (1, 32, 8, 1, 8192, False),
    "spec_b16_8k": (16, 32, 8, 8, 8192, True),
}
# transformers' dynamic cache keeps each layer's keys (B, Hkv, L, D) contiguous and hands the
# attention function transposed views: the same shapes with the caches in that memory order
# (ours reads the (B, L, Hkv, D) views in place, as ptxattn.torch's decode step does)
HEAD_MAJOR_CASES = {"b8_32k_hf": (8, 32, 8, 1, 32768, False),
                    "b1_32k_hf": (1, 32, 8, 1, 32768, False)}
DEFAULT_CASES = tuple(CASES)
CASES.update(HEAD_MAJOR_CASES)
TARGETS = {"b64_8k": "4.3 TB/s and 1.05x cuDNN", "b8_32k": "4.3 TB/s and 1.05x cuDNN",
           "b1_128k": "4.3 TB/s and 1.05x cuDNN", "b1_8k": "85% of 4.8 TB/s",
           "spec_b16_8k": "3x 48 TFLOP/s", "b8_32k_hf": "level with b8_32k",
           "b1_32k_hf": "4.3 TB/s and 1.05x cuDNN"}
CHECKED_SEQUENCES = 3


def kv_bytes(b, hkv, length) -> int:
    return 2 * b * hkv * length * D * 2


def unmasked_pairs(lq, length, causal) -> int:
    if not causal:
        return lq * length
    return sum(max(0, min(length, length - lq + i + 1)) for i in range(lq))


def make_case(torch, b, h, hkv, lq, length, seed, head_major=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, lq, h, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    if head_major:              # (B, Hkv, L, D) memory, (B, L, Hkv, D) views
        kc, vc = (torch.randn(b, hkv, length, D, generator=gen, device="cuda",
                              dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    else:
        kc = torch.randn(b, length, hkv, D, generator=gen, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn(b, length, hkv, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    return q, kc, vc, lens


def peer_launcher(torch, q, kc, vc, causal):
    """cuDNN SDPA on (B, H, Lq, D) q and (B, Hkv, L, D) views of the caches (or, when it
    refuses those strides, contiguous copies: the same bytes); (launch, note, masked, out)."""
    try:
        return _peer_launcher(torch, q, kc.transpose(1, 2), vc.transpose(1, 2), causal, "")
    except RuntimeError as first:
        kh, vh = (c.transpose(1, 2).contiguous() for c in (kc, vc))
        try:
            return _peer_launcher(torch, q, kh, vh, causal,
                                  "; on contiguous (B, Hkv, L, D) copies of the caches (it "
                                  f"refused the views: {str(first)[:160]})")
        except RuntimeError as second:
            raise RuntimeError(f"views: {first}; copies: {second}") from None


def only_cudnn(torch):
    """SDPA's backends restricted to cuDNN for the whole run (global flags rather than an
    sdpa_kernel context around every call, whose own host time would count against SDPA);
    returns a function that restores the previous flags."""
    return restrict_sdpa(torch, "cudnn")


def _peer_launcher(torch, q, kh, vh, causal, where):
    import torch.nn.functional as F
    qh = q.transpose(1, 2)
    lq, length = q.shape[1], kh.shape[2]
    attempts = []
    if causal:
        i = torch.arange(lq, device="cuda")[:, None]
        j = torch.arange(length, device="cuda")[None, :]
        mask = j <= i + (length - lq)                       # bottom-right, as ours
        attempts.append(({"attn_mask": mask}, "bottom-right causal as a boolean attn_mask"))
        attempts.append(({}, "unmasked (cuDNN took no bottom-right mask): the same K+V bytes, "
                             "checked against the unmasked reference"))
    else:
        attempts.append(({}, "plain"))
    errors = []
    for kwargs, note in attempts:
        def launch(kwargs=kwargs):          # cuDNN only: see only_cudnn
            return F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True, **kwargs)
        try:
            o = launch()
            torch.cuda.synchronize()
            return launch, note + where, "attn_mask" in kwargs, o
        except Exception as exc:                    # noqa: BLE001
            errors.append(f"{note}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    raise RuntimeError("cuDNN SDPA refused every form: " + " | ".join(errors))


def check(torch, q, kc, vc, length, causal, ours_out, peer_out, peer_masked, seed):
    """Metrics of ours and the peer against the reference on sampled sequences."""
    b = q.shape[0]
    rng = np.random.default_rng(seed)
    seqs = sorted({0, b - 1, *rng.choice(b, min(b, CHECKED_SEQUENCES), replace=False).tolist()})
    seqs = seqs[:CHECKED_SEQUENCES + 1]

    def host(t):
        return t.float().cpu().numpy()

    qs, ks, vs = host(q[seqs]), host(kc[seqs]), host(vc[seqs])
    ref, _ = kvcache_reference(qs, ks, vs, [length] * len(seqs), causal=causal)
    ours = error_metrics(host(ours_out[seqs]), ref)
    peer = None
    if peer_out is not None:
        peer_ref = ref if (peer_masked or not causal) else kvcache_reference(
            qs, ks, vs, [length] * len(seqs))[0]
        peer = error_metrics(host(peer_out.transpose(1, 2)[seqs]), peer_ref)
    ok = passes(ours) and (peer is None or passes_against_peer(ours, peer) or
                           not (peer_masked or not causal))
    return {"sequences": seqs, "ours": ours, "peer": peer, "pass": bool(ok),
            "peer_bound": peer_bound(peer["rel_l2"]) if peer else None}


def graph_of(torch, fn):
    """fn captured once into a CUDA graph (after a warm-up outside the capture)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay, graph


def timed_rounds(fns, rounds, reps, rng):
    """{label: [per-round median ms]} with the labels' order drawn anew each round."""
    labels = list(fns)
    out = {label: [] for label in labels}
    for r in range(rounds):
        order = list(rng.permutation(labels))
        times = time_interleaved([fns[label] for label in order], reps, block=1,
                                 warmup=3 if r == 0 else 1)
        for label, t in zip(order, times):
            out[label].append(median(t))
    return out


def host_us(torch, fn, calls=50, repeats=7):
    """Median host µs per call with the queue full: a long kernel first, then `calls` calls."""
    fn()
    torch.cuda.synchronize()
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    per_call = []
    for _ in range(repeats):
        for _ in range(6):
            big @ big                                   # ~2 ms of GPU work queued first
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return {"median_us": statistics.median(per_call), "min_us": min(per_call),
            "max_us": max(per_call), "calls": calls, "repeats": repeats}


def plan_launcher(q, kc, vc, lens, causal, expect, seqs):
    """A DecodePlan's run() on the same call (the engine's path: the host work done once, one
    call per layer), checked against the plain call's output on the checked sequences;
    (launch or None, record)."""
    b, lq, h, _ = q.shape
    plan = ptxattn.plan_decode(batch=b, heads=h, heads_kv=kc.shape[2], head_dim=D, seq_q=lq,
                               cache_seqlens=lens, cache_len=kc.shape[1], causal=causal)

    def launch():
        return plan.run(q, kc, vc)
    err = error_metrics(launch()[seqs].float().cpu().numpy(),
                        expect[seqs].float().cpu().numpy())
    record = {"splits": plan.splits, "vs_plain_call": err}
    if not err["rel_l2"] <= 4e-3 or err["nan_count"]:
        record["status"] = "differs from the plain call (not timed)"
        return None, record
    return launch, record


def figures(ms_rounds, peer_rounds, nbytes, flops, seed):
    row = {"ms_rounds": ms_rounds, "ms": median(ms_rounds)}
    row["tbs"] = nbytes / (row["ms"] * 1e-3) / 1e12
    row["pct_of_hbm_peak"] = 100 * row["tbs"] / HBM_PEAK_TBS
    row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
    if peer_rounds:
        ratios = [p / o for p, o in zip(peer_rounds, ms_rounds)]
        lo, hi = bootstrap_ci(ratios, seed=seed)
        row.update(peer_ms_rounds=peer_rounds, peer_ms=median(peer_rounds),
                   peer_tbs=nbytes / (median(peer_rounds) * 1e-3) / 1e12,
                   ratio=median(ratios), ratio_ci=[lo, hi])
    return row


def run_case(torch, name, rounds, reps, seed, sweep=()):
    b, h, hkv, lq, length, causal = CASES[name]
    q, kc, vc, lens = make_case(torch, b, h, hkv, lq, length, seed,
                                head_major=name in HEAD_MAJOR_CASES)
    nbytes = kv_bytes(b, hkv, length)
    flops = 4 * b * h * D * unmasked_pairs(lq, length, causal)
    record = {"name": name, "shape": {"B": b, "H": h, "Hkv": hkv, "Lq": lq, "L": length,
                                      "D": D, "causal": causal},
              "kv_bytes": nbytes, "flops": flops, "target": TARGETS[name],
              "splits": plan_splits(q.shape, kc.shape)}

    def ours():
        return ptxattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=causal)

    out = ours()
    torch.cuda.synchronize()
    try:
        peer, note, peer_masked, peer_out = peer_launcher(torch, q, kc, vc, causal)
        record["peer"] = {"name": "cudnn", "form": note}
    except Exception as exc:                            # noqa: BLE001
        peer, peer_masked, peer_out = None, False, None
        record["peer"] = {"name": "cudnn", "error": str(exc)}
    record["check"] = check(torch, q, kc, vc, length, causal, out, peer_out, peer_masked, seed)
    if not record["check"]["pass"]:
        record["status"] = "FAILED (not timed)"
        return record
    rng = np.random.default_rng(seed)
    fns = {"ours": ours}
    if peer is not None:
        fns["cudnn"] = peer
    # other split counts (--splits): timed in the same rounds, beside the heuristic's choice
    swept = {}
    for n in sweep:
        if n == record["splits"]:
            continue
        def other(n=n):
            return ptxattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=causal,
                                                   num_splits=n)
        got = other()
        err = error_metrics(got[record["check"]["sequences"]].float().cpu().numpy(),
                            out[record["check"]["sequences"]].float().cpu().numpy())
        if err["rel_l2"] > 4e-3:
            record.setdefault("sweep_errors", {})[n] = err
            continue
        swept[f"ours_splits{n}"] = other
    plain = timed_rounds({**fns, **swept}, rounds, reps, rng)
    record["plain"] = figures(plain["ours"], plain.get("cudnn"), nbytes, flops, seed)
    if swept:
        record["sweep"] = {label: figures(plain[label], plain.get("cudnn"), nbytes, flops, seed)
                           for label in swept}
    graphs = {}
    keep = []
    for label, fn in fns.items():
        replay, g = graph_of(torch, fn)
        graphs[label] = replay
        keep.append(g)
    graphed = timed_rounds(graphs, rounds, reps, rng)
    record["graph"] = figures(graphed["ours"], graphed.get("cudnn"), nbytes, flops, seed)
    record["host_us"] = {label: host_us(torch, fn) for label, fn in fns.items()}
    try:                          # an error here costs the plan's line, not the case's
        plan_run, record["plan"] = plan_launcher(q, kc, vc, lens, causal, out,
                                                 record["check"]["sequences"])
        if plan_run is not None:
            record["host_us"]["ours_plan"] = host_us(torch, plan_run)
    except Exception as exc:                            # noqa: BLE001
        record["plan"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    record["status"] = "ok"
    del keep
    return record


def line(rec) -> str:
    if rec.get("status") != "ok":
        return f"{rec['name']:<12} {rec.get('status')} {rec.get('check', {})}"
    p, g, hu = rec["plain"], rec["graph"], rec["host_us"]
    peer = (f"cuDNN {p.get('peer_tbs', float('nan')):.2f} TB/s, ours/cuDNN {p.get('ratio', 0):.3f}"
            f" [{p.get('ratio_ci', [0, 0])[0]:.3f}, {p.get('ratio_ci', [0, 0])[1]:.3f}]")
    return (f"{rec['name']:<12} splits {rec['splits']:>3}  plain {p['tbs']:.2f} TB/s "
            f"({p['pct_of_hbm_peak']:.0f}% peak, {p['tflops']:.0f} TFLOP/s), {peer}; graph "
            f"{g['tbs']:.2f} TB/s ratio {g.get('ratio', float('nan')):.3f}; host us ours "
            f"{hu['ours']['median_us']:.1f} (DecodePlan.run "
            f"{hu.get('ours_plan', {}).get('median_us', float('nan')):.1f}) cuDNN "
            f"{hu.get('cudnn', {}).get('median_us', float('nan')):.1f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for the results JSON")
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), help="comma-separated case "
                    f"names ({', '.join(CASES)})")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--splits", default="", help="also time ours at these split counts "
                    "(comma-separated), in the same rounds: data for the heuristic")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {list(CASES)}")
    if args.rounds < 10:
        print(f"note: {args.rounds} rounds; DESIGN.md's protocol asks for >= 10",
              file=sys.stderr)
    sweep = [int(n) for n in args.splits.split(",") if n.strip()]
    import torch
    if not torch.cuda.is_available():
        print("decode_bench: needs torch with CUDA", file=sys.stderr)
        return 2
    info = driver.device_info()
    result = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "set": "decode",
              "env": environment(info, torch), "source": source_id(ROOT),
              "protocol": {"rounds": args.rounds, "reps": args.reps, "block": 1,
                           "hbm_peak_tbs": HBM_PEAK_TBS},
              "clocks_before": gpu_clocks(), "cases": []}
    restore = only_cudnn(torch)
    try:
        for name in names:
            try:
                rec = run_case(torch, name, args.rounds, args.reps, args.seed, sweep)
            except Exception as exc:                    # noqa: BLE001
                rec = {"name": name, "status": f"error: {type(exc).__name__}: {exc}"}
            result["cases"].append(rec)
            print(line(rec), flush=True)
            for label, row in rec.get("sweep", {}).items():
                print(f"    {label}: {row['tbs']:.2f} TB/s, ratio to cuDNN "
                      f"{row.get('ratio', float('nan')):.3f}", flush=True)
            torch.cuda.empty_cache()
    finally:
        restore()
    result["clocks_after"] = gpu_clocks()
    gpu = (result["env"].get("gpu") or "gpu").lower().replace("nvidia", "").strip()
    slug = "-".join(part for part in gpu.replace("_", " ").split() if part) or "gpu"
    path = Path(args.out) / f"{result['date'][:10]}-{slug}-decode.json"
    write_results(result, path)
    print(f"wrote {path}")
    return 0 if all(r.get("status") == "ok" for r in result["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())

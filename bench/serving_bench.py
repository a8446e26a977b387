#!/usr/bin/env python3
"""Serving benchmark (issue 25): the paged cache, variable-length prefill, and run()'s host time.

    python bench/serving_bench.py --out bench/results                 # GPU: every part, ~6 min
    python bench/serving_bench.py --out /tmp/s --parts paged --pages 16,64
    python bench/serving_bench.py --out /tmp/s --parts host --fake     # no GPU: host time only
    python bench/serving_bench.py --out /tmp/s --parts paged --variants all   # ~1.5 min

Parts (DESIGN.md's protocol: every case checked before it is timed, then rounds of
interleaved launches with CUDA events, the host never waiting; ratios are medians over rounds
with a 95% bootstrap interval; plain calls and CUDA-graph replays):
  paged   the paged decode against the contiguous-cache decode of the same shapes (same run,
          same data: every paged case's pages are a shuffled copy of the contiguous cache, and
          its output must equal the contiguous call's): (64, 32:8, 1, 8192) and
          (8, 32:8, 1, 32768) at page sizes 16, 64, 256. K+V TB/s, paged / contiguous.
          Targets: >= 0.95 at page 16, >= 0.98 at >= 64.
          --variants all|NAME,...: instead, contiguous and every named paged build variant
          (ptxattn/decode_builds.PAGED_VARIANTS, today's always first) at pages 16, 32, 64
          (or --pages), interleaved in one process: each variant's TB/s and its ratio to
          contiguous and to today's, plain and graphed. A variant is checked before it is
          timed (bit for bit against contiguous at the same split count, else the reference).
  varlen  flash_attn_varlen_func on 8 sequences of 512 to 16k (64k tokens, causal, 32:8 heads,
          D 128) against the production kernel on an equal-length causal batch of the same
          FLOPs (B' sequences of 8192), TFLOP/s over the unmasked pairs; and against the
          padded call a user would otherwise make: SDPA (default backend) on the batch padded
          to 16k with a padding-and-causal boolean mask. Target: >= 0.95 of the equal-length
          TFLOP/s; the padded speedup is reported.
  paged_varlen  chunked prefill against a paged cache: flash_attn_varlen_func(...,
          block_table=) against the same call on the packed keys (same run, same data: the
          pages a shuffled copy; outputs must be equal), 8 sequences of 512 to 16k cached keys,
          each a chunk of up to 2048 new queries at its end (causal, 32:8 heads, D 128), pages
          16, 64, 256 (or --pages). TFLOP/s, paged / packed. Targets as the paged decode's.
  host    host µs per call with the queue full: a DecodePlan's run() (paged, 64 sequences),
          a PrefillPlan's run() (host offsets: one launch), flash_attn_with_kvcache and
          flash_attn_varlen_func on the same arguments. Target: run() <= 10 µs per layer.
          --fake: a pretend driver (bench/callpath.py's; CPU torch tensors or DLPack producers
          stand in, the binding's own packing of a launch's parameters included), the Python
          side only, on this machine's CPU.
  integration  host µs per layer call of the transformers integration ("paged|ptxattn",
          transformers_paged.py) with the arguments transformers 5.17 and 5.24 pass: one
          forward of 32 layers per step layout (bench/serving_integration.py lists the
          cases). Needs torch (not transformers); with --fake, CPU torch tensors pass for
          CUDA ones. PYTHONPATH at another tree's copy of ptxattn times that tree's
          integration (before / after in one run: bench/device/session8_host.sh).
Results: <out>/<date>-<gpu>-serving.json (-serving-variants.json with --variants; or
serving-host-fake.json).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib.util
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ptxattn  # noqa: E402
from ptxattn import driver, tensors  # noqa: E402
from ptxattn.tools.bench import environment, gpu_clocks, source_id, write_results  # noqa: E402


def _sibling(name: str):
    """A benchmark module beside this one (decode_bench, callpath), imported by path."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


D = 128
PAGED_CASES = {"b64_8k": (64, 32, 8, 8192), "b8_32k": (8, 32, 8, 32768)}
PAGE_SIZES = (16, 64, 256)
PAGED_TARGET = {16: 0.95, 64: 0.98, 256: 0.98}
VARLEN_LENGTHS = (16384, 14336, 10240, 8192, 7168, 5120, 3584, 512)     # 64k tokens
VARLEN_HEADS = (32, 8)
EQUAL_LEN = 8192
VARLEN_TARGET = 0.95
HOST_TARGET_US = 10.0


def causal_pairs(lq: int, lk: int) -> int:
    """Unmasked (query, key) pairs of a bottom-right causal sequence."""
    return sum(max(0, min(lk, lk - lq + i + 1)) for i in range(lq))


# --------------------------------------------------------------------------- paged decode

def shuffled_pages(torch, kc, vc, page: int, seed: int):
    """The caches (B, L, Hkv, D) as pages (num_pages, page, Hkv, D) in a shuffled order, with
    the block table that reads them back; a few spare pages no sequence uses."""
    b, length, hkv, d = kc.shape
    per = length // page
    gen = torch.Generator(device="cpu").manual_seed(seed)
    order = torch.randperm(b * per + 7, generator=gen)
    kp = torch.empty((b * per + 7, page, hkv, d), dtype=kc.dtype, device=kc.device)
    vp = torch.empty_like(kp)
    table = order[:b * per].reshape(b, per).to(torch.int32)
    kp[table.reshape(-1).long().cuda()] = kc.reshape(b * per, page, hkv, d)
    vp[table.reshape(-1).long().cuda()] = vc.reshape(b * per, page, hkv, d)
    return kp, vp, table.cuda()


def run_paged(torch, db, name, page, rounds, reps, seed):
    b, h, hkv, length = PAGED_CASES[name]
    q, kc, vc, lens = db.make_case(torch, b, h, hkv, 1, length, seed)
    kp, vp, table = shuffled_pages(torch, kc, vc, page, seed)
    nbytes = db.kv_bytes(b, hkv, length)
    rec = {"name": f"{name}_page{page}", "shape": {"B": b, "H": h, "Hkv": hkv, "L": length,
                                                   "D": D, "page": page},
           "kv_bytes": nbytes, "target": f">= {PAGED_TARGET[page]} x contiguous"}

    def contiguous():
        return ptxattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)

    def paged():
        return ptxattn.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table)

    a, p = contiguous(), paged()
    torch.cuda.synchronize()
    diff = float((a.float() - p.float()).abs().max())
    rec["check"] = db.check(torch, q, kc, vc, length, False, p, None, False, seed)
    rec["check"]["paged_vs_contiguous_max_abs"] = diff
    if not rec["check"]["pass"] or diff > 0:
        rec["status"] = f"FAILED (not timed): paged differs from contiguous by {diff:.3g}"
        return rec
    rng = np.random.default_rng(seed)
    fns = {"contiguous": contiguous, "paged": paged}
    plain = db.timed_rounds(fns, rounds, reps, rng)
    rec["plain"] = _ratio_rows(db, plain, nbytes, seed)
    graphs, keep = {}, []
    for label, fn in fns.items():
        replay, g = db.graph_of(torch, fn)
        graphs[label] = replay
        keep.append(g)
    rec["graph"] = _ratio_rows(db, db.timed_rounds(graphs, rounds, reps, rng), nbytes, seed)
    rec["status"] = "ok"
    return rec


# ---- the paged build's variants (decode_builds.PAGED_VARIANTS), one process, same run ---------

VARIANT_PAGES = (16, 32, 64)


def variant_names(spec: str) -> list[str]:
    """--variants: "all" or names of decode_builds.PAGED_VARIANTS (today's first, always)."""
    from ptxattn.decode_builds import DEFAULT_PAGED_VARIANT, PAGED_VARIANTS
    names = list(PAGED_VARIANTS) if spec.strip() == "all" else \
        [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in PAGED_VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: {', '.join(unknown)} not among "
                         f"{', '.join(PAGED_VARIANTS)}")
    first = "today" if "today" in PAGED_VARIANTS else DEFAULT_PAGED_VARIANT
    return [first] + [n for n in names if n != first]


@contextlib.contextmanager
def _restored_env(name: str):
    import os
    saved = os.environ.get(name)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def run_paged_variants(torch, db, name, page, variants, rounds, reps, seed):
    """Contiguous decode and every variant of the paged one on the same data (the pages a
    shuffled copy of the contiguous cache), timed interleaved in one process: per variant
    TB/s, its ratio to contiguous and to today's paged build, each a median over rounds with
    a 95% bootstrap interval, plain calls and CUDA-graph replays. Each variant is checked
    first: bit for bit equal to the contiguous call when its split count is the same (its
    tiles arrive differently, the math is the same), else against the reference."""
    import os
    from ptxattn.decode_builds import PAGED_VARIANT_ENV, PAGED_VARIANTS
    b, h, hkv, length = PAGED_CASES[name]
    q, kc, vc, lens = db.make_case(torch, b, h, hkv, 1, length, seed)
    kp, vp, table = shuffled_pages(torch, kc, vc, page, seed)
    nbytes = db.kv_bytes(b, hkv, length)
    rec = {"name": f"{name}_page{page}_variants", "shape": {"B": b, "H": h, "Hkv": hkv,
                                                             "L": length, "D": D, "page": page},
           "kv_bytes": nbytes, "variants": {}, "target": f">= {PAGED_TARGET.get(page, 0.98)} "
                                                         "x contiguous"}

    def contiguous():
        return ptxattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)

    def paged_under(variant):
        def call():
            os.environ[PAGED_VARIANT_ENV] = variant
            return ptxattn.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens,
                                                   block_table=table)
        return call

    want = contiguous()
    torch.cuda.synchronize()
    fns = {"contiguous": contiguous}
    for variant in variants:
        fn = paged_under(variant)
        got = fn()
        torch.cuda.synchronize()
        diff = float((want.float() - got.float()).abs().max())
        same_splits = PAGED_VARIANTS[variant].split_factor == 1 or page >= 128
        check = {"paged_vs_contiguous_max_abs": diff, "bitwise_expected": same_splits}
        if variant == variants[0] or not same_splits:
            check.update(db.check(torch, q, kc, vc, length, False, got, None, False, seed))
        ok = (diff == 0 if same_splits else True) and check.get("pass", True)
        rec["variants"][variant] = {"check": check, "status": "ok" if ok else
                                    f"FAILED (not timed): differs from contiguous by {diff:.3g}"
                                    + ("" if check.get("pass", True) else "; fails the bar")}
        if ok:
            fns[variant] = fn
    if len(fns) < 2:
        rec["status"] = "FAILED: no variant passed its check"
        return rec
    rng = np.random.default_rng(seed)
    rec["plain"] = _variant_rows(db, db.timed_rounds(fns, rounds, reps, rng), nbytes, seed,
                                 variants[0])
    graphs, keep = {}, []
    for label, fn in fns.items():
        replay, g = db.graph_of(torch, fn)
        graphs[label] = replay
        keep.append(g)
    rec["graph"] = _variant_rows(db, db.timed_rounds(graphs, rounds, reps, rng), nbytes, seed,
                                 variants[0])
    rec["status"] = "ok" if all(v["status"] == "ok" for v in rec["variants"].values()) \
        else "some variants failed their check"
    return rec


def _variant_rows(db, rounds_ms, nbytes, seed, today):
    """TB/s of each label; each variant over contiguous and over today's (time ratios
    contiguous / variant and today / variant, per round) with 95% intervals."""
    row = {label: {"ms": db.median(ms), "tbs": nbytes / (db.median(ms) * 1e-3) / 1e12,
                   "ms_rounds": ms} for label, ms in rounds_ms.items()}
    for label, ms in rounds_ms.items():
        if label == "contiguous":
            continue
        for ref, key in (("contiguous", "over_contiguous"), (today, "over_today")):
            if ref not in rounds_ms or ref == label:
                continue
            ratios = [r / t for r, t in zip(rounds_ms[ref], ms)]
            lo, hi = db.bootstrap_ci(ratios, seed=seed)
            row[label][key] = {"median": db.median(ratios), "ci": [lo, hi]}
    return row


def print_variant_table(rec) -> None:
    print(f"{rec['name']}: {rec.get('status')}", flush=True)
    plain, graph = rec.get("plain", {}), rec.get("graph", {})
    for label, v in rec.get("variants", {}).items():
        p, g = plain.get(label, {}), graph.get(label, {})
        oc, ot = p.get("over_contiguous", {}), p.get("over_today", {})
        goc = g.get("over_contiguous", {})
        print(f"  {label:<22} {v['status'] if v['status'] != 'ok' else ''}"
              f"{p.get('tbs', float('nan')):6.2f} TB/s  /contig plain "
              f"{oc.get('median', float('nan')):.3f} {_ci(oc)}  graph "
              f"{goc.get('median', float('nan')):.3f} {_ci(goc)}  /today "
              f"{ot.get('median', float('nan')):.3f} {_ci(ot)}", flush=True)
    c = plain.get("contiguous", {})
    print(f"  {'contiguous':<22} {c.get('tbs', float('nan')):6.2f} TB/s", flush=True)


def _ci(r) -> str:
    ci = r.get("ci")
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "[-]"


def _ratio_rows(db, rounds_ms, nbytes, seed):
    """TB/s of each, and paged / contiguous (time ratio contiguous / paged) with its CI."""
    row = {label: {"ms": db.median(ms), "tbs": nbytes / (db.median(ms) * 1e-3) / 1e12,
                   "ms_rounds": ms} for label, ms in rounds_ms.items()}
    ratios = [c / p for c, p in zip(rounds_ms["contiguous"], rounds_ms["paged"])]
    lo, hi = db.bootstrap_ci(ratios, seed=seed)
    row["paged_over_contiguous"] = {"median": db.median(ratios), "ci": [lo, hi]}
    return row


# --------------------------------------------------------------------------- varlen prefill

def run_varlen(torch, db, rounds, reps, seed):
    h, hkv = VARLEN_HEADS
    lens = np.array(VARLEN_LENGTHS)
    total = int(lens.sum())
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(total, h, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, hkv, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(total, hkv, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    pairs = sum(causal_pairs(int(n), int(n)) for n in lens)
    flops = 4 * h * D * pairs
    b_eq = max(1, round(pairs / causal_pairs(EQUAL_LEN, EQUAL_LEN)))
    eq_flops = 4 * b_eq * h * D * causal_pairs(EQUAL_LEN, EQUAL_LEN)
    qe = torch.randn(b_eq, EQUAL_LEN, h, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    ke = torch.randn(b_eq, EQUAL_LEN, hkv, D, generator=gen, device="cuda",
                     dtype=torch.bfloat16)
    ve = torch.randn(b_eq, EQUAL_LEN, hkv, D, generator=gen, device="cuda",
                     dtype=torch.bfloat16)
    rec = {"name": "varlen_8x_mixed_64k", "lengths": lens.tolist(), "heads": [h, hkv], "D": D,
           "flops": flops, "equal_length_batch": [b_eq, EQUAL_LEN], "equal_flops": eq_flops,
           "target": f">= {VARLEN_TARGET} x the equal-length production TFLOP/s"}

    def ours():
        return ptxattn.flash_attn_varlen_func(q, k, v, cu, cu, int(lens.max()), int(lens.max()),
                                              causal=True)

    def equal():
        return ptxattn.attention(qe, ke, ve, layout="bshd", causal=True)

    out = ours()
    torch.cuda.synchronize()
    rec["check"] = _check_varlen(torch, q, k, v, lens, out, seed)
    if not rec["check"]["pass"]:
        rec["status"] = "FAILED (not timed)"
        return rec
    fns = {"varlen": ours, "equal": equal}
    padded, note = _padded_sdpa(torch, q, k, v, lens)
    rec["padded_sdpa"] = note
    if padded is not None:
        fns["padded_sdpa"] = padded
    rng = np.random.default_rng(seed)
    plain = db.timed_rounds(fns, rounds, reps, rng)
    tf = {"varlen": flops, "equal": eq_flops, "padded_sdpa": flops}
    rec["plain"] = {label: {"ms": db.median(ms), "tflops": tf[label] / (db.median(ms) * 1e-3)
                            / 1e12, "ms_rounds": ms} for label, ms in plain.items()}
    ratios = [(flops / v_ms) / (eq_flops / e_ms)
              for v_ms, e_ms in zip(plain["varlen"], plain["equal"])]
    lo, hi = db.bootstrap_ci(ratios, seed=seed)
    rec["varlen_over_equal_tflops"] = {"median": db.median(ratios), "ci": [lo, hi]}
    if "padded_sdpa" in plain:
        sp = [p / v_ms for p, v_ms in zip(plain["padded_sdpa"], plain["varlen"])]
        lo, hi = db.bootstrap_ci(sp, seed=seed)
        rec["speedup_over_padded_sdpa"] = {"median": db.median(sp), "ci": [lo, hi]}
    rec["status"] = "ok"
    return rec


# ---- chunked prefill against pages (flash_attn_varlen_func(..., block_table=)) --------------

CHUNK = 2048


def paged_varlen_data(torch, page, seed, shuffled=True):
    """The chunked-prefill case: packed q, k, v with their offsets, and k, v as pages of a
    shuffled pool (sequence i's keys padded to whole pages) with the block table.
    shuffled=False: the pool's pages in the sequences' order (a sequence's pages adjacent,
    as the packed keys are), to tell the build's cost from the scattered pages' (the probe)."""
    h, hkv = VARLEN_HEADS
    lens_k = np.array(VARLEN_LENGTHS)
    lens_q = np.minimum(lens_k, CHUNK)
    b = len(lens_k)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32,
                        device="cuda")
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32,
                        device="cuda")
    q = torch.randn(int(lens_q.sum()), h, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(int(lens_k.sum()), hkv, D, generator=gen, device="cuda",
                    dtype=torch.bfloat16)
    v = torch.randn_like(k)
    need = -(-lens_k // page)
    order = (torch.randperm(int(need.sum()) + 7, generator=torch.Generator().manual_seed(seed))
             if shuffled else torch.arange(int(need.sum()) + 7))
    kp = torch.zeros((int(need.sum()) + 7, page, hkv, D), dtype=k.dtype, device="cuda")
    vp = torch.zeros_like(kp)
    table = torch.full((b, int(need.max())), -1, dtype=torch.int32)
    at, row = 0, 0
    for i, n in enumerate(lens_k.tolist()):
        pages = order[at:at + need[i]]
        table[i, :need[i]] = pages.to(torch.int32)
        padded = torch.zeros((need[i] * page, hkv, D), dtype=k.dtype, device="cuda")
        padded[:n] = k[row:row + n]
        kp[pages.cuda()] = padded.reshape(-1, page, hkv, D)
        padded[:n] = v[row:row + n]
        vp[pages.cuda()] = padded.reshape(-1, page, hkv, D)
        at, row = at + need[i], row + n
    flops = 4 * h * D * sum(causal_pairs(int(a), int(c)) for a, c in zip(lens_q, lens_k))
    return dict(q=q, k=k, v=v, kp=kp, vp=vp, table=table.cuda(), cu_q=cu_q, cu_k=cu_k,
                lens_q=lens_q, lens_k=lens_k, mq=int(lens_q.max()), mk=int(lens_k.max()),
                flops=flops)


def run_paged_varlen(torch, db, page, rounds, reps, seed):
    c = paged_varlen_data(torch, page, seed)
    q, k, v, kp, vp, table = (c[n] for n in ("q", "k", "v", "kp", "vp", "table"))
    cu_q, cu_k, lens_q, lens_k, mq, mk, flops = (c[n] for n in (
        "cu_q", "cu_k", "lens_q", "lens_k", "mq", "mk", "flops"))
    h, hkv = VARLEN_HEADS
    rec = {"name": f"paged_varlen_chunk{CHUNK}_page{page}", "lengths_q": lens_q.tolist(),
           "lengths_k": lens_k.tolist(), "heads": [h, hkv], "D": D, "page": page,
           "flops": flops, "target": f">= {PAGED_TARGET[page]} x the packed-key call"}

    def contiguous():
        return ptxattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True)

    def paged():
        return ptxattn.flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, mq, mk, causal=True,
                                              block_table=table)

    a, p = contiguous(), paged()
    torch.cuda.synchronize()
    diff = float((a.float() - p.float()).abs().max())
    rec["check"] = _check_varlen_chunks(torch, q, k, v, lens_q, lens_k, p)
    rec["check"]["paged_vs_contiguous_max_abs"] = diff
    if not rec["check"]["pass"] or diff > 0:
        rec["status"] = f"FAILED (not timed): paged differs from packed by {diff:.3g}"
        return rec
    rng = np.random.default_rng(seed)
    plain = db.timed_rounds({"contiguous": contiguous, "paged": paged}, rounds, reps, rng)
    rec["plain"] = {label: {"ms": db.median(ms), "tflops": flops / (db.median(ms) * 1e-3)
                            / 1e12, "ms_rounds": ms} for label, ms in plain.items()}
    ratios = [a_ms / p_ms for a_ms, p_ms in zip(plain["contiguous"], plain["paged"])]
    lo, hi = db.bootstrap_ci(ratios, seed=seed)
    rec["plain"]["paged_over_contiguous"] = {"median": db.median(ratios), "ci": [lo, hi]}
    rec["status"] = "ok"
    return rec


def _check_varlen_chunks(torch, q, k, v, lens_q, lens_k, out):
    """The reference on the last 64 query rows of the shortest and the longest sequence (every
    head): a chunk's rows sit at the end of its keys (bottom-right causal)."""
    from ptxattn.reference import attention_reference, error_metrics, passes
    h, hkv = q.shape[1], k.shape[1]
    cq, ck = np.concatenate([[0], np.cumsum(lens_q)]), np.concatenate([[0], np.cumsum(lens_k)])
    worst = None
    for i in (int(np.argmin(lens_k)), int(np.argmax(lens_k))):
        rows = min(64, int(lens_q[i]))
        q1 = int(cq[i + 1])
        qs = q[q1 - rows:q1].float().cpu().numpy().transpose(1, 0, 2)[None]
        ks = k[int(ck[i]):int(ck[i + 1])].float().cpu().numpy()
        vs = v[int(ck[i]):int(ck[i + 1])].float().cpu().numpy()
        ks, vs = (np.repeat(x, h // hkv, axis=1).transpose(1, 0, 2)[None] for x in (ks, vs))
        ref = attention_reference(qs, ks, vs, causal=True)[0].transpose(1, 0, 2)
        m = error_metrics(out[q1 - rows:q1].float().cpu().numpy(), ref)
        if worst is None or m["rel_l2"] > worst["rel_l2"]:
            worst = m
    return {"pass": bool(passes(worst)), **worst}


def _check_varlen(torch, q, k, v, lens, out, seed):
    """The reference on sampled rows of the shortest and the longest sequence (every head)."""
    from ptxattn.reference import attention_reference, error_metrics, passes
    cu = np.concatenate([[0], np.cumsum(lens)])
    rng = np.random.default_rng(seed)
    results = {}
    for b in (int(np.argmin(lens)), int(np.argmax(lens))):
        q0, q1 = int(cu[b]), int(cu[b + 1])
        rows = np.sort(rng.choice(q1 - q0, min(64, q1 - q0), replace=False))
        bhld = (lambda t: t.float().cpu().numpy().transpose(1, 0, 2)[None])
        ref = attention_reference(bhld(q[q0:q1]), bhld(k[q0:q1]), bhld(v[q0:q1]), causal=True,
                                  rows=rows)
        got = bhld(out[q0:q1])[:, :, rows]
        results[f"sequence {b} ({q1 - q0})"] = error_metrics(got, ref)
    return {"metrics": results, "pass": all(passes(m) for m in results.values())}


def _padded_sdpa(torch, q, k, v, lens):
    """SDPA (default backend) on the batch padded to the longest sequence, with a boolean
    padding-and-causal mask: what a user without varlen calls."""
    import torch.nn.functional as F
    b, lmax = len(lens), int(lens.max())
    h, hkv = q.shape[1], k.shape[1]
    cu = np.concatenate([[0], np.cumsum(lens)])
    qp = torch.zeros(b, h, lmax, D, device="cuda", dtype=torch.bfloat16)
    kp = torch.zeros(b, hkv, lmax, D, device="cuda", dtype=torch.bfloat16)
    vp = torch.zeros_like(kp)
    for i, n in enumerate(lens):
        qp[i, :, :n] = q[cu[i]:cu[i + 1]].transpose(0, 1)
        kp[i, :, :n] = k[cu[i]:cu[i + 1]].transpose(0, 1)
        vp[i, :, :n] = v[cu[i]:cu[i + 1]].transpose(0, 1)
    ln = torch.tensor(lens, device="cuda")
    idx = torch.arange(lmax, device="cuda")
    mask = (idx[None, None, :] <= idx[None, :, None]) & (idx[None, None, :] < ln[:, None, None])
    mask = mask[:, None]                                  # (B, 1, L, L)

    def padded():
        return F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=True)
    try:
        padded()
        torch.cuda.synchronize()
    except Exception as exc:                              # noqa: BLE001
        return None, f"refused: {type(exc).__name__}: {str(exc)[:200]}"
    return padded, f"SDPA default backend, padded to ({b}, {h}, {lmax}, {D}), boolean mask"


# --------------------------------------------------------------------------- host time

def host_paths(fake: bool, torch):
    """{label: fn} of the calls whose host time is measured: plans' run() and the plain calls
    on the same arguments. Paged decode of 64 sequences (32:8 heads, 8192 keys, page 16); a
    prefill of 8 sequences of 128 (host offsets)."""
    b, h, hkv, length, page = 64, 32, 8, 8192, 16
    per = length // page
    rng = np.random.default_rng(0)
    table_host = rng.permutation(b * per).reshape(b, per).astype(np.int32)
    lens_host = np.full(b, length - 1, np.int32)
    if torch is not None and not fake:
        q = torch.randn(b, 1, h, D, device="cuda", dtype=torch.bfloat16)
        kn = torch.randn(b, 1, hkv, D, device="cuda", dtype=torch.bfloat16)
        vn = torch.randn_like(kn)
        kp = torch.randn(b * per, page, hkv, D, device="cuda", dtype=torch.bfloat16)
        vp = torch.randn_like(kp)
        table = torch.from_numpy(table_host).cuda()
        lens = torch.from_numpy(lens_host).cuda()
        pq = torch.randn(1024, h, D, device="cuda", dtype=torch.bfloat16)
        pk = torch.randn(1024, hkv, D, device="cuda", dtype=torch.bfloat16)
        pv = torch.randn_like(pk)
        cu_dev = torch.arange(0, 1025, 128, dtype=torch.int32, device="cuda")
        pout = torch.empty_like(pq)
    else:
        # ptxattn's own DeviceArrays (what a non-torch caller holds; a DLPack producer's
        # capsule, built per call on its side, would dominate a pretend driver's figures)
        wrap = (lambda a: a)
        q, kn, vn = (wrap(tensors.empty(s)) for s in ((b, 1, h, D), (b, 1, hkv, D),
                                                       (b, 1, hkv, D)))
        kp, vp = (wrap(tensors.empty((b * per, page, hkv, D))) for _ in range(2))
        pq, pk, pv = (wrap(tensors.empty(s)) for s in ((1024, h, D), (1024, hkv, D),
                                                       (1024, hkv, D)))
        pout = wrap(tensors.empty((1024, h, D)))
        table, lens = _DeviceInt32(table_host), _DeviceInt32(lens_host)
        cu_dev = _DeviceInt32(np.arange(0, 1025, 128, dtype=np.int32))
    cu_host = np.arange(0, 1025, 128, dtype=np.int32)
    step = ptxattn.plan_decode(batch=b, heads=h, heads_kv=hkv, head_dim=D, cache_seqlens=lens,
                               block_table=table, page_size=page, num_pages=b * per, seq_new=1,
                               causal=True, host_lengths=lens_host)
    # the same step without the append (an engine that writes its pages itself, as
    # FlashInfer's decode run() takes them): one launch at this shape's one split
    read_only = ptxattn.plan_decode(batch=b, heads=h, heads_kv=hkv, head_dim=D,
                                    cache_seqlens=lens, block_table=table, page_size=page,
                                    num_pages=b * per, causal=True, host_lengths=lens_host)
    dout = _like(q, torch, fake)
    prefill = ptxattn.plan_varlen(cu_host, cu_host, heads=h, heads_kv=hkv, head_dim=D,
                                  causal=True)
    return {
        "decode_plan_run": lambda: step.run(q, kp, vp, k=kn, v=vn),
        "decode_plan_run_out": lambda: step.run(q, kp, vp, out=dout, k=kn, v=vn),
        "decode_plan_run_out_no_append": lambda: read_only.run(q, kp, vp, out=dout),
        "flash_attn_with_kvcache_paged": lambda: ptxattn.flash_attn_with_kvcache(
            q, kp, vp, k=kn, v=vn, cache_seqlens=lens, block_table=table, causal=True),
        "prefill_plan_run": lambda: prefill.run(pq, pk, pv),
        "prefill_plan_run_out": lambda: prefill.run(pq, pk, pv, out=pout),
        "flash_attn_varlen_func": lambda: ptxattn.flash_attn_varlen_func(
            pq, pk, pv, cu_dev, cu_dev, 128, 128, causal=True),
    }


def _like(q, torch, fake: bool):
    """An output of q's shape: torch's empty_like, or ptxattn's own array (--fake)."""
    if torch is not None and not fake:
        return torch.empty_like(q)
    return tensors.empty(tuple(q.shape))


class _DeviceInt32:
    """An int32 device array through __cuda_array_interface__ (for the --fake paths)."""

    def __init__(self, values):
        values = np.ascontiguousarray(values, np.int32)
        self.buffer = driver.DeviceBuffer(max(values.nbytes, 4))
        self.__cuda_array_interface__ = {"shape": values.shape, "typestr": "<i4",
                                         "data": (self.buffer.ptr, False), "strides": None,
                                         "version": 3}


def run_host(fake: bool, torch, calls: int, repeats: int) -> dict:
    cb = _sibling("callpath")
    out = {}
    ctx = cb.fake_driver(binding_packing=True) if fake else contextlib.nullcontext()
    with ctx:
        paths = host_paths(fake, torch)
        block = cb._blocker(fake, torch) if not fake else (lambda: None)
        for label, fn in paths.items():
            out[label] = cb.host_us(fn, calls, repeats, block, fake)
            h = out[label]
            print(f"host  {label:32s} {h['median_us']:8.1f} µs/call (cpu "
                  f"{h['cpu_median_us']:.1f})", flush=True)
    out["target_us"] = HOST_TARGET_US
    return out


def run_integration(fake: bool, repeats: int, names=None) -> dict:
    """serving_integration's cases (torch needed; with fake, CPU tensors passing for CUDA
    ones under the pretend driver)."""
    import torch
    cb = _sibling("callpath")
    integration = _sibling("serving_integration")
    threads = torch.get_num_threads()
    with contextlib.ExitStack() as stack:
        if fake:
            stack.enter_context(cb.fake_driver(binding_packing=True))
            stack.enter_context(cb.torch_pretends_cuda(torch))
            torch.set_num_threads(1)             # torch's CPU ops: no thread pool noise
            stack.callback(torch.set_num_threads, threads)
        out = integration.run(cb, torch, fake, repeats, names)
    import ptxattn.torch.transformers_paged as tp
    out["ptxattn"] = str(Path(tp.__file__).resolve().parents[2])
    out["target_us"] = HOST_TARGET_US
    return out


# --------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="paged,varlen,paged_varlen,host,integration")
    ap.add_argument("--pages", default=None,
                    help=f"page sizes (default {','.join(map(str, PAGE_SIZES))}; with "
                         f"--variants {','.join(map(str, VARIANT_PAGES))})")
    ap.add_argument("--variants", default=None,
                    help="paged part: time these paged build variants (all, or names of "
                         "decode_builds.PAGED_VARIANTS; today's always) against contiguous "
                         "in one process")
    ap.add_argument("--cases", default=",".join(PAGED_CASES))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--fake", action="store_true",
                    help="host and integration parts only, a pretend driver")
    ap.add_argument("--integration-cases", default=None,
                    help="integration part: these cases only (comma-separated)")
    args = ap.parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    variants = variant_names(args.variants) if args.variants else None
    result = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "set": "serving",
              "source": source_id(ROOT), "fake_driver": args.fake,
              "protocol": {"rounds": args.rounds, "reps": args.reps}}
    cases = args.integration_cases.split(",") if args.integration_cases else None
    if args.fake:
        if "host" in parts:
            result["host"] = run_host(True, None, args.calls, args.repeats)
        if "integration" in parts:
            result["integration"] = run_integration(True, args.repeats, cases)
        path = Path(args.out) / "serving-host-fake.json"
        write_results(result, path)
        print(f"wrote {path}")
        return 0
    import torch
    if not torch.cuda.is_available():
        print("serving_bench: needs torch with CUDA (or --fake for the host part)",
              file=sys.stderr)
        return 2
    db = _sibling("decode_bench")
    info = driver.device_info()
    result.update(env=environment(info, torch), clocks_before=gpu_clocks(), cases=[])
    ok = True
    pages = args.pages or ",".join(map(str, VARIANT_PAGES if variants else PAGE_SIZES))
    if "paged" in parts and variants:
        from ptxattn.decode_builds import PAGED_VARIANT_ENV
        result["variants"] = variants
        with _restored_env(PAGED_VARIANT_ENV):
            for name in [c for c in args.cases.split(",") if c]:
                for page in [int(p) for p in pages.split(",") if p]:
                    try:
                        rec = run_paged_variants(torch, db, name, page, variants,
                                                 args.rounds, args.reps, args.seed)
                    except Exception as exc:               # noqa: BLE001
                        rec = {"name": f"{name}_page{page}_variants",
                               "status": f"error: {exc!r}"}
                    result["cases"].append(rec)
                    ok &= rec.get("status") == "ok"
                    print_variant_table(rec)
                    torch.cuda.empty_cache()
    elif "paged" in parts:
        for name in [c for c in args.cases.split(",") if c]:
            for page in [int(p) for p in pages.split(",") if p]:
                try:
                    rec = run_paged(torch, db, name, page, args.rounds, args.reps, args.seed)
                except Exception as exc:                   # noqa: BLE001
                    rec = {"name": f"{name}_page{page}", "status": f"error: {exc!r}"}
                result["cases"].append(rec)
                ok &= rec.get("status") == "ok"
                r = rec.get("plain", {}).get("paged_over_contiguous", {})
                g = rec.get("graph", {}).get("paged_over_contiguous", {})
                print(f"{rec['name']:<18} {rec.get('status')}: paged/contiguous plain "
                      f"{r.get('median', float('nan')):.3f} {r.get('ci')}, graph "
                      f"{g.get('median', float('nan')):.3f}", flush=True)
                torch.cuda.empty_cache()
    if "varlen" in parts:
        try:
            rec = run_varlen(torch, db, args.rounds, args.reps, args.seed)
        except Exception as exc:                           # noqa: BLE001
            rec = {"name": "varlen", "status": f"error: {exc!r}"}
        result["cases"].append(rec)
        ok &= rec.get("status") == "ok"
        print(f"varlen: {rec.get('status')}: varlen/equal TFLOP/s "
              f"{rec.get('varlen_over_equal_tflops')}, speedup over padded SDPA "
              f"{rec.get('speedup_over_padded_sdpa')}", flush=True)
        torch.cuda.empty_cache()
    if "paged_varlen" in parts:
        for page in [int(p) for p in (args.pages or ",".join(map(str, PAGE_SIZES))).split(",")
                     if p]:
            try:
                rec = run_paged_varlen(torch, db, page, args.rounds, args.reps, args.seed)
            except Exception as exc:                       # noqa: BLE001
                rec = {"name": f"paged_varlen_page{page}", "status": f"error: {exc!r}"}
            result["cases"].append(rec)
            ok &= rec.get("status") == "ok"
            r = rec.get("plain", {})
            print(f"{rec['name']:<30} {rec.get('status')}: paged/packed "
                  f"{r.get('paged_over_contiguous')}, TFLOP/s paged "
                  f"{r.get('paged', {}).get('tflops')}, packed "
                  f"{r.get('contiguous', {}).get('tflops')}", flush=True)
            torch.cuda.empty_cache()
    if "host" in parts:
        result["host"] = run_host(False, torch, args.calls, args.repeats)
    if "integration" in parts:
        result["integration"] = run_integration(False, args.repeats, cases)
    result["clocks_after"] = gpu_clocks()
    gpu = (result["env"].get("gpu") or "gpu").lower().replace("nvidia", "").strip()
    slug = "-".join(part for part in gpu.replace("_", " ").split() if part) or "gpu"
    kind = "serving-variants" if variants and "paged" in parts else "serving"
    path = Path(args.out) / f"{result['date'][:10]}-{slug}-{kind}.json"
    write_results(result, path)
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""One stage, one launch, one small shape: what bench/sanitize.sh runs under compute-sanitizer.

    python3 bench/sanitize_case.py --list [--stages 1,14]
        the cases, one a line: STAGE B H L CTAS LAYOUT (CTAS 0: the stage's own grid; else
        the PTXATTN_PERSISTENT_CTAS cap the script sets for that case)
    python3 bench/sanitize_case.py --controls
        the negative controls, one a line: STAGE B H L CTAS LAYOUT DEFINE (builds with a
        planted hazard that the sanitizer is expected to flag; see CONTROLS)
    python3 bench/sanitize_case.py --stage N -b B -H H -L L [--layout bhld] [--seed S]
                                   [-D NAME=VALUE ...]
        random normal bf16 inputs copied in, the output poisoned with NaN (a memset, so it is
        initialised memory as far as initcheck is concerned and an unwritten tile shows as
        NaN), one prepare + launch, a check against the float64 reference, then every
        buffer freed and the primary context released, so that memcheck's leak check sees
        the context end with nothing left allocated. Prints one line "case ...: PASS|FAIL".
        Exit status 0: PASS, 1: FAIL, 2: bad arguments.

Cases: every stage at B=1 H=2 L=256 in BHLD and in BSHD (other strides in the tensor maps);
the production kernel's build for each head dim (STAGE production:64, :128, :256) at the same
shape and at the persistent one below;
a stage with BLOCK_M 128 also at L=512 (4 or 8 K/V tiles: the 2-slot K/V ring wraps); a
persistent stage also at B=2 H=2 L=512 with its grid capped at 2 CTAs (16 tiles: 8 per CTA, so
the multi-tile path with its carried barrier phases runs), in both layouts. At those shapes a
132-SM grid would give every CTA at most one tile.

Decode (flash_attn_with_kvcache, issue 24), outside the --list table (its columns are the
forward's): `--decode-cases` lists them as STAGE B H L, STAGE decode:D, and
`--stage decode:D -b B -H H -L L` runs one: Lq = 2 causal queries against caches of L positions
(H / 4 K/V heads), two new keys appended, lengths planted on the device at -5, L + 1000 and
L // 2 (clamped by the kernels: memcheck must see no access outside the caches, the lengths
array or the workspace), three splits and the combine, checked against the clamped reference:
    compute-sanitizer --tool memcheck python3 bench/sanitize_case.py --stage decode:128 \
        -b 3 -H 8 -L 600

Negative controls (CONTROLS): stage 1 built with -D PTXATTN_PLANT_HAZARD=1 (the bar.sync
between the P stores and the PV wgmma dropped, plus an ordinary ld.shared of a word another
warp stored: racecheck must flag it) and =2 (the barrier dropped only: the unordered reader is
wgmma through the async proxy; whether racecheck sees that is what the run records).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

SMALL = (1, 2, 256)
RING = (1, 2, 512)
PERSISTENT = (2, 2, 512)
PERSISTENT_CTAS = 2
HAZARD = "PTXATTN_PLANT_HAZARD"
# (stage, B, H, L, CTAS, layout, define): the planted hazards of ptx/sm90/01_baseline.ptx
CONTROLS = ((1, *SMALL, 0, "bhld", f"{HAZARD}=1"),
            (1, *SMALL, 0, "bhld", f"{HAZARD}=2"))


def cases(stage_filter=None):
    """The lineage's stages, then the production kernel, one build per head dim (its STAGE
    column is production:D; --stages takes "production" or 0 for it)."""
    from ptxattn import stages
    for s in stages.all_stages():
        if stage_filter and s.number not in stage_filter:
            continue
        for layout in ("bhld", "bshd"):
            yield (s.number, *SMALL, 0, layout)
        if s.block_m == 128:
            yield (s.number, *RING, 0, "bhld")
        if s.persistent:
            for layout in ("bhld", "bshd"):
                yield (s.number, *PERSISTENT, PERSISTENT_CTAS, layout)
    if stage_filter and PRODUCTION_NUMBER not in stage_filter:
        return
    # The kernel attention() runs: each head dim is its own CTA (D = 64: three consumers, 512
    # threads, 192-row tiles) and carve-up. L=256 leaves a ragged last Q tile at D = 64 (one
    # 192-row tile and 64 rows); B=2 H=2 L=512 under 2 CTAs walks 6 (D = 64) or 8 tiles a CTA.
    for d in stages.PRODUCTION.head_dims:
        key = f"{PRODUCTION_KEY}:{d}"
        for layout in ("bhld", "bshd"):
            yield (key, *SMALL, 0, layout)
        for layout in ("bhld", "bshd"):
            yield (key, *PERSISTENT, PERSISTENT_CTAS, layout)


# flash_attn_with_kvcache: STAGE B H L (see the docstring), one head dim each
DECODE_CASES = tuple((f"decode:{d}", 3, 8, 600) for d in (64, 128, 256))


def run_decode(head_dim, b, h, length, seed) -> bool:
    """One flash_attn_with_kvcache call with out-of-range device lengths (see the docstring)."""
    import numpy as np

    import ptxattn
    from ptxattn import decode_reference, driver, reference, tensors

    rng = np.random.default_rng(seed)
    hkv, lq, new = max(1, h // 4), 2, 2

    def bf16(*shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(reference.BF16)
    q, kc, vc = bf16(b, lq, h, head_dim), bf16(b, length, hkv, head_dim), bf16(b, length, hkv,
                                                                           head_dim)
    kn, vn = bf16(b, new, hkv, head_dim), bf16(b, new, hkv, head_dim)
    raw = np.array(([-5, length + 1000, length // 2] * b)[:b], np.int32)
    devs = [tensors.from_numpy(x) for x in (q, kc, vc, kn, vn)]
    lens = driver.DeviceBuffer(raw.nbytes)
    driver.memcpy_htod(lens.ptr, raw)

    class Lengths:
        __cuda_array_interface__ = {"shape": (b,), "typestr": "<i4", "data": (lens.ptr, False),
                                    "strides": None, "version": 3}
    out = tensors.empty(q.shape)
    out.fill_u16(0xFFFF)
    lse = tensors.empty((b, h, lq), dtype=np.float32)
    driver.memset_u16(lse.ptr, 0xFFFF, 2 * lse.size)
    ptxattn.flash_attn_with_kvcache(*devs[:3], k=devs[3], v=devs[4], cache_seqlens=Lengths(),
                                    causal=True, num_splits=3, return_lse=True, out=out,
                                    lse_out=lse)
    driver.synchronize()
    got, got_lse = out.to_numpy(), lse.to_numpy()
    kc2, vc2 = decode_reference.appended_caches(kc, vc, kn, vn, raw)
    eff = decode_reference.clamped_lengths(raw, new, length)
    ref, ref_lse = decode_reference.kvcache_reference(q, kc2, vc2, eff, causal=True)
    m = reference.error_metrics(got, ref)
    fin = np.isfinite(ref_lse)
    lse_ok = bool((np.isneginf(got_lse) == ~fin).all()
                  and np.abs(got_lse[fin] - ref_lse[fin]).max(initial=0) <= 2e-3)
    ok = reference.passes(m) and lse_ok
    print(f"case decode:{head_dim} B={b} H={h}:{hkv} L={length} lengths={raw.tolist()} "
          f"splits=3 append={new}: rel_l2={m['rel_l2']:.2e} max_abs={m['max_abs']:.2e} "
          f"nan={m['nan_count']} lse={'ok' if lse_ok else 'WRONG'} {'PASS' if ok else 'FAIL'}",
          flush=True)
    for x in (*devs, out, lse):
        x.free()
    lens.close()
    gc.collect()
    ctx = driver.context()
    driver.synchronize()
    ctx.alive = False
    driver.check(driver.cu().cuDevicePrimaryCtxRelease(ctx.device), "cuDevicePrimaryCtxRelease")
    return ok


PRODUCTION_KEY = "production"
PRODUCTION_NUMBER = 0          # what --stages calls it besides its name


def stage_and_head_dim(key: str) -> tuple[str, int]:
    """--stage KEY: a lineage stage (number or name) runs at D = 128; production:D the
    production kernel's build for head dim D (plain "production": D = 128)."""
    name, sep, d = str(key).partition(":")
    if not sep:
        return name, 128
    if not d.isdigit():
        raise argparse.ArgumentTypeError(f"--stage: expected STAGE or production:D, got {key!r}")
    return name, int(d)


def parse_stages(text: str) -> set[int] | None:
    """--stages "1,14,production" -> {1, 14, 0}; empty -> None (every stage)."""
    wanted = set()
    for word in text.replace(",", " ").split():
        wanted.add(PRODUCTION_NUMBER if word == PRODUCTION_KEY else int(word))
    return wanted or None


def parse_define(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def run(stage_key, b, h, length, layout, seed, defines=None) -> bool:
    from ptxattn import api as attn
    from ptxattn import driver, launch, reference, stages, tensors

    key, head_dim = stage_and_head_dim(stage_key)
    if key == "decode":
        return run_decode(head_dim, b, h, length, seed)
    stage = stages.get_stage(key)
    q, k, v = reference.random_qkv(b, h, length, length, head_dim, layout, seed=seed)
    qd, kd, vd = (tensors.from_numpy(x) for x in (q, k, v))
    out = tensors.empty(q.shape)
    out.fill_u16(0xFFFF)                        # bf16 NaN on the legacy stream, like the launch
    prepared = attn.prepare(qd, kd, vd, stage=stage, layout=layout, out=out,
                            defines=defines or None)
    prepared.launch()
    driver.synchronize()
    got = out.to_numpy()
    m = reference.error_metrics(got, reference.attention_reference(q, k, v, layout=layout))
    ok = reference.passes(m)
    cap = os.environ.get(launch.PERSISTENT_CTAS_ENV, "")
    print(f"case {stage.label} B={b} H={h} L={length} D={head_dim} {layout} grid={prepared.grid} "
          f"block={prepared.block} smem={prepared.smem_bytes}"
          f"{f' {launch.PERSISTENT_CTAS_ENV}={cap}' if cap else ''}"
          f"{''.join(f' -D{k}={v}' for k, v in (defines or {}).items())}: rel_l2={m['rel_l2']:.2e} "
          f"max_abs={m['max_abs']:.2e} nan={m['nan_count']} {'PASS' if ok else 'FAIL'}",
          flush=True)

    # Free everything, then end the context: memcheck --leak-check reports what is still
    # allocated when the context is destroyed (the primary context lives until released).
    # Released explicitly: under compute-sanitizer the `del` + gc.collect() below was seen
    # not to run the buffers' finalizers (H200, 2026-11-29; without the sanitizer the same
    # sequence frees all four), and memcheck then reported them as leaked.
    prepared.close()
    for array in (qd, kd, vd, out):
        array.free()
    del prepared, qd, kd, vd, out
    gc.collect()
    ctx = driver.context()
    driver.synchronize()
    ctx.alive = False                           # later destructors must not call the driver
    driver.check(driver.cu().cuDevicePrimaryCtxRelease(ctx.device), "cuDevicePrimaryCtxRelease")
    return ok


def _report_unraisable(info) -> None:
    # A failed cuMemFree in a destructor is otherwise silent; a leak report without a
    # reason is no use.
    print(f"unraisable in {info.object!r}: {info.exc_type.__name__}: {info.exc_value}",
          file=sys.stderr, flush=True)


def main(argv=None) -> int:
    sys.unraisablehook = _report_unraisable
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument("--stages", default="", help="with --list: only these stage numbers "
                    "(1,14; production or 0: the production kernel's builds)")
    ap.add_argument("--stage", help="the stage to run (number or name; production:D, the "
                    "production kernel at head dim D)")
    ap.add_argument("-b", "--batch", type=int, default=SMALL[0])
    ap.add_argument("-H", "--heads", type=int, default=SMALL[1])
    ap.add_argument("-L", "--seq-len", type=int, default=SMALL[2])
    ap.add_argument("--layout", default="bhld", choices=("bhld", "bshd"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--controls", action="store_true", help="print the negative controls")
    ap.add_argument("--decode-cases", action="store_true",
                    help="print the flash_attn_with_kvcache cases (STAGE B H L)")
    ap.add_argument("-D", "--define", action="append", type=parse_define, default=[],
                    help="a build variant's preprocessor define, NAME=VALUE")
    args = ap.parse_args(argv)
    if args.list:
        wanted = parse_stages(args.stages)
        for case in cases(wanted):
            print(*case)
        return 0
    if args.controls:
        for case in CONTROLS:
            print(*case)
        return 0
    if args.decode_cases:
        for case in DECODE_CASES:
            print(*case)
        return 0
    if args.stage is None:
        ap.error("--stage is required (or --list)")
    return 0 if run(args.stage, args.batch, args.heads, args.seq_len, args.layout,
                    args.seed, dict(args.define)) else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""One kernel, one launch, one small case: what bench/sanitize.sh runs under compute-sanitizer.

    python3 bench/sanitize_case.py --list [--stages 1,14,production,decode]
        the cases, one a line, three tab-separated fields: NAME, CTAS (0: the kernel's own
        grid; else the PTXATTN_PERSISTENT_CTAS cap the script sets for that case) and the
        arguments of this script that run it
    python3 bench/sanitize_case.py --controls
        the negative controls in the same form (builds with a planted hazard that the
        sanitizer is expected to flag; see CONTROLS)
    python3 bench/sanitize_case.py --stage KERNEL -b B -H H [--heads-kv HKV] -L LQ [--seq-k LK]
                                   [--layout bhld|bshd] [--causal] [--window L,R]
                                   [--diagonal top_left] [--lse] [--seed S] [-D NAME=VALUE ...]
        random normal bf16 inputs copied in, the output (and the LSE) poisoned with NaN (a
        memset, so it is initialised memory as far as initcheck is concerned and an unwritten
        tile or row shows as NaN), one prepare + launch, a check against the float64 reference
        (the LSE too), then every buffer freed and the primary context released, so that
        memcheck's leak check sees the context end with nothing left allocated. Prints one
        line "case ...: PASS|FAIL". Exit status 0: PASS, 1: FAIL, 2: bad arguments.

The cases are one table (CASES, built by cases()): every lineage stage at B=1 H=2 L=256 in
BHLD and in BSHD (other strides in the tensor maps); a stage with BLOCK_M 128 also at L=512
(4 or 8 K/V tiles: the 2-slot K/V ring wraps); a persistent stage also at B=2 H=2 L=512 with
its grid capped at 2 CTAs (16 tiles: 8 per CTA, so the multi-tile path with its carried
barrier phases runs), in both layouts. At those shapes a 132-SM grid would give every CTA at
most one tile. Then the production kernel (PRODUCTION_ROWS): per head dim (its own CTA and
carve-up; D = 64: three consumers, 192-row tiles) the unmasked build small and persistent in
both layouts and the masked build (causal); and, at small shapes, a sliding window, a
two-sided window, a masked persistent walk, GQA and MQA, ragged tails (Lq and Lk not tile
multiples, Lq < Lk and Lq > Lk), the top-left diagonal, and the LSE written (alone and with
the other features). Then decode (flash_attn_with_kvcache, DECODE_ROWS, one per head dim):
Lq = 2 causal queries against caches of L positions (H / 4 K/V heads), two new keys appended,
lengths planted on the device at -5, L + 1000 and L // 2 (clamped by the kernels: memcheck must
see no access outside the caches, the lengths array or the workspace), three splits and the
combine, checked against the clamped reference. Then paged decode (PAGED_ROWS), varlen prefill
(VARLEN_ROWS) and the FP8 forward with its quantizer (FP8_ROWS), each with its runner in
RUNNERS; the backward has its own script (bench/sanitize_bwd_case.py).

Negative controls (CONTROLS): stage 1 built with -D PTXATTN_PLANT_HAZARD=1 (the bar.sync
between the P stores and the PV wgmma dropped, plus an ordinary ld.shared of a word another
warp stored: racecheck must flag it) and =2 (the barrier dropped only: the unordered reader is
wgmma through the async proxy; whether racecheck sees that is what the run records).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys

HAZARD = "PTXATTN_PLANT_HAZARD"
PERSISTENT_CTAS = 2
PRODUCTION_KEY = "production"
PRODUCTION_NUMBER = 0          # what --stages calls it besides its name
DECODE_KEY = "decode"
LAYOUTS = ("bhld", "bshd")


@dataclasses.dataclass(frozen=True)
class Case:
    """One sanitizer case: a kernel (a lineage stage number, or KIND:D such as production:64)
    on one small problem. seq_k 0: as seq_q; heads_kv 0: as heads."""
    kernel: str
    batch: int = 1
    heads: int = 2
    seq_q: int = 256
    seq_k: int = 0
    heads_kv: int = 0
    layout: str = "bhld"
    causal: bool = False
    window: tuple[int, int] | None = None
    diagonal: str = "bottom_right"
    lse: bool = False
    ctas: int = 0
    define: str | None = None
    page: int = 0                  # paged:D cases: the page size

    @property
    def lk(self) -> int:
        return self.seq_k or self.seq_q

    @property
    def hkv(self) -> int:
        return self.heads_kv or self.heads

    def args(self) -> list[str]:
        """This script's arguments for the case (what --stage ... takes)."""
        out = ["--stage", self.kernel, "-b", str(self.batch), "-H", str(self.heads),
               "-L", str(self.seq_q), "--layout", self.layout]
        if self.hkv != self.heads:
            out += ["--heads-kv", str(self.hkv)]
        if self.lk != self.seq_q:
            out += ["--seq-k", str(self.lk)]
        if self.causal:
            out.append("--causal")
        if self.window is not None:
            out += ["--window", f"{self.window[0]},{self.window[1]}"]
        if self.diagonal != "bottom_right":
            out += ["--diagonal", self.diagonal]
        if self.lse:
            out.append("--lse")
        if self.define:
            out += ["-D", self.define]
        if self.page:
            out += ["--page", str(self.page)]
        return out

    def name(self) -> str:
        """stage14 2x2x512 bshd ctas=2; production:128 1x4:1x200x333 bhld causal lse"""
        kernel = f"stage{int(self.kernel):02d}" if self.kernel.isdigit() else self.kernel
        heads = f"{self.heads}" + (f":{self.hkv}" if self.hkv != self.heads else "")
        seq = f"{self.seq_q}" + (f"x{self.lk}" if self.lk != self.seq_q else "")
        words = [kernel, f"{self.batch}x{heads}x{seq}", self.layout]
        if self.causal:
            words.append("causal")
        if self.window is not None:
            words.append(f"window={self.window[0]},{self.window[1]}")
        if self.diagonal != "bottom_right":
            words.append("top-left")
        if self.lse:
            words.append("lse")
        if self.ctas:
            words.append(f"ctas={self.ctas}")
        if self.define:
            words.append(self.define)
        if self.page:
            words.append(f"page={self.page}")
        return " ".join(words)

    def line(self) -> str:
        return "\t".join((self.name(), str(self.ctas), " ".join(self.args())))


def lineage_rows(stage) -> list[Case]:
    rows = [Case(str(stage.number), layout=layout) for layout in LAYOUTS]
    if stage.block_m == 128:
        rows.append(Case(str(stage.number), seq_q=512))
    if stage.persistent:
        rows += [Case(str(stage.number), batch=2, seq_q=512, ctas=PERSISTENT_CTAS, layout=layout)
                 for layout in LAYOUTS]
    return rows


def production_rows(head_dims) -> list[Case]:
    """The production kernel: the builds attention() picks, and each feature it takes."""
    rows = []
    for d in head_dims:
        key = f"{PRODUCTION_KEY}:{d}"
        # L=256 leaves a ragged last Q tile at D = 64 (one 192-row tile and 64 rows); B=2 H=2
        # L=512 under 2 CTAs walks 6 (D = 64) or 8 tiles a CTA
        rows += [Case(key, layout=layout) for layout in LAYOUTS]
        rows += [Case(key, batch=2, seq_q=512, ctas=PERSISTENT_CTAS, layout=layout)
                 for layout in LAYOUTS]
        rows.append(Case(key, causal=True))                        # the masked build of each D
    p64, p128, p256 = (f"{PRODUCTION_KEY}:{d}" for d in (64, 128, 256))
    rows += [
        Case(p128, window=(64, 0)),                                # a sliding window
        Case(p128, seq_q=200, seq_k=333, window=(32, 32), layout="bshd"),   # two-sided, ragged
        Case(p128, batch=2, seq_q=512, causal=True, ctas=PERSISTENT_CTAS),  # masked walk
        Case(p128, heads=4, heads_kv=2),                           # GQA
        Case(p128, heads=4, heads_kv=1, layout="bshd"),            # MQA
        Case(p128, seq_q=200, seq_k=333),                          # ragged tails, Lq < Lk
        Case(p128, seq_q=333, seq_k=200, layout="bshd"),           # ragged tails, Lq > Lk
        Case(p64, seq_q=200, seq_k=333, causal=True),              # D = 64: 192-row tiles, masked
        Case(p128, lse=True),                                      # the LSE written
        Case(p256, heads=4, heads_kv=1, seq_q=130, seq_k=300, causal=True,
             diagonal="top_left", lse=True),                       # all at once, top-left
        Case(p64, heads=4, heads_kv=2, seq_q=333, seq_k=200, window=(40, 8), lse=True,
             layout="bshd"),                                       # rows that see no key
    ]
    return rows


# flash_attn_with_kvcache (see the docstring): B H L are the caches' batch, heads and length
DECODE_ROWS = tuple(Case(f"{DECODE_KEY}:{d}", batch=3, heads=8, seq_q=600) for d in (64, 128, 256))
# paged decode (run_paged): B H L as decode's, the page size below a K/V tile (a box per page)
# and above it (a box per tile), with shuffled pages, a -1-padded table and one planted bad
# entry in a reached page (its keys read as zeros, nothing outside the caches)
PAGED_KEY, VARLEN_KEY, FP8_KEY, PAGED_VARLEN_KEY = "paged", "varlen", "fp8", "paged_varlen"
PAGED_ROWS = tuple(Case(f"{PAGED_KEY}:{d}", batch=3, heads=8, seq_q=600, page=page)
                   for d, page in ((64, 16), (128, 16), (128, 256), (256, 64)))
# varlen prefill (run_varlen): H:Hkv, and sequences of 0, 1, 129, 300 and 77 tokens (an empty
# one, a ragged tile, Lq = Lk); causal on the D 128 row, a window on the D 64 row
VARLEN_ROWS = (Case(f"{VARLEN_KEY}:128", heads=4, heads_kv=2, causal=True, lse=True),
               Case(f"{VARLEN_KEY}:64", heads=4, heads_kv=1, window=(40, 8)),
               Case(f"{VARLEN_KEY}:256", heads=2, heads_kv=2))
# the FP8 forward (run_fp8: the quantizer's kernel, then the FP8 build), checked against the
# float64 reference on the bf16 inputs under the FP8 bar
FP8_ROWS = (Case(f"{FP8_KEY}:128", seq_q=300, seq_k=333, causal=True, lse=True),
            Case(f"{FP8_KEY}:64", heads=4, heads_kv=2, layout="bshd"),
            Case(f"{FP8_KEY}:256", seq_q=200, window=(64, 0)))
# varlen prefill over a paged cache (run_paged_varlen: flash_attn_varlen_func(...,
# block_table=)): chunks of VARLEN_LENGTHS queries at the end of longer cached sequences, pages
# shuffled, the table padded with -1 and a bad entry planted in a reached page
PAGED_VARLEN_ROWS = tuple(Case(f"{PAGED_VARLEN_KEY}:{d}", heads=4, heads_kv=hkv, causal=True,
                               lse=True, page=page)
                          for d, page, hkv in ((64, 16, 1), (128, 64, 2), (256, 256, 2)))
NEW_KERNEL_ROWS = {PAGED_KEY: PAGED_ROWS, VARLEN_KEY: VARLEN_ROWS, FP8_KEY: FP8_ROWS,
                   PAGED_VARLEN_KEY: PAGED_VARLEN_ROWS}


def cases(stage_filter=None) -> list[Case]:
    """CASES: the lineage's stages, then the production kernel's rows, then decode's
    (--stages takes "production" or 0, and "decode", for those)."""
    from ptxattn import stages
    rows = []
    for s in stages.all_stages():
        if not stage_filter or s.number in stage_filter:
            rows += lineage_rows(s)
    if not stage_filter or PRODUCTION_NUMBER in stage_filter:
        rows += [c for c in production_rows(stages.PRODUCTION.head_dims)
                 if int(c.kernel.partition(":")[2]) in stages.PRODUCTION.head_dims]
    if not stage_filter or DECODE_KEY in stage_filter:
        rows += DECODE_ROWS
    for key, extra in NEW_KERNEL_ROWS.items():
        if not stage_filter or key in stage_filter:
            rows += extra
    return rows


# the planted hazards of ptx/sm90/01_baseline.ptx
CONTROLS = (Case("1", define=f"{HAZARD}=1"), Case("1", define=f"{HAZARD}=2"))


def stage_and_head_dim(key: str) -> tuple[str, int]:
    """--stage KEY: a lineage stage (number or name) runs at D = 128; production:D the
    production kernel's build for head dim D (plain "production": D = 128)."""
    name, sep, d = str(key).partition(":")
    if not sep:
        return name, 128
    if not d.isdigit():
        raise argparse.ArgumentTypeError(f"--stage: expected STAGE or production:D, got {key!r}")
    return name, int(d)


def parse_stages(text: str) -> set | None:
    """--stages "1,14,production,decode,paged" -> {1, 14, 0, "decode", "paged"}; empty -> None
    (all). The new kernels' keys: decode, paged, varlen, fp8."""
    wanted = set()
    for word in text.replace(",", " ").split():
        wanted.add(PRODUCTION_NUMBER if word == PRODUCTION_KEY else
                   word if word in (DECODE_KEY, *NEW_KERNEL_ROWS) else int(word))
    return wanted or None


def parse_define(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def parse_window(text: str) -> tuple[int, int]:
    left, sep, right = text.partition(",")
    try:
        return int(left), int(right)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window: expected LEFT,RIGHT, got {text!r}") from None


def _inputs(case: Case, head_dim: int, seed: int):
    """q (B, H, Lq, D), k and v (B, Hkv, Lk, D) in the case's layout, bf16 normal."""
    from ptxattn import reference
    q, k, v = reference.random_qkv(case.batch, case.heads, case.seq_q, case.lk, head_dim,
                                   case.layout, seed=seed)
    axis = 1 if case.layout == "bhld" else 2
    k, v = (x.take(range(case.hkv), axis=axis) for x in (k, v))
    return q, k, v


def run_attention(case: Case, seed: int, defines=None) -> bool:
    """The forward kernels (a lineage stage, the production kernel): prepare + one launch."""
    from ptxattn import api as attn
    from ptxattn import driver, launch, reference, stages, tensors

    key, head_dim = stage_and_head_dim(case.kernel)
    stage = stages.get_stage(key)
    q, k, v = _inputs(case, head_dim, seed)
    qd, kd, vd = (tensors.from_numpy(x) for x in (q, k, v))
    out = tensors.empty(q.shape)
    out.fill_u16(0xFFFF)                        # bf16 NaN on the legacy stream, like the launch
    masks = dict(causal=case.causal, window=case.window, diagonal=case.diagonal)
    prepared = attn.prepare(qd, kd, vd, stage=stage, layout=case.layout, out=out,
                            defines=defines or None, return_lse=case.lse, **masks)
    if case.lse:
        driver.memset_u16(prepared.lse.ptr, 0xFFFF, 2 * prepared.lse.size)   # float32 NaN
    prepared.launch()
    driver.synchronize()
    got = out.to_numpy()
    ref, ref_lse = reference.attention_reference(q, k, v, layout=case.layout,
                                                 return_lse=True, **masks)
    m = reference.error_metrics(got, ref)
    ok = reference.passes(m)
    lse_note = ""
    if case.lse:
        import numpy as np
        lse = prepared.lse.to_numpy().astype(np.float64)
        both_empty = np.isneginf(lse) & np.isneginf(ref_lse)
        err = float(np.max(np.where(both_empty, 0.0, np.abs(lse - ref_lse))))
        lse_nan = int(np.count_nonzero(np.isnan(lse)))
        ok = ok and lse_nan == 0 and err <= 2e-3
        lse_note = f" lse_max_abs={err:.2e} lse_nan={lse_nan}"
    cap = os.environ.get(launch.PERSISTENT_CTAS_ENV, "")
    print(f"case {case.name()} D={head_dim} kernel={stage.label} grid={prepared.grid} "
          f"block={prepared.block} smem={prepared.smem_bytes}"
          f"{f' {launch.PERSISTENT_CTAS_ENV}={cap}' if cap else ''}"
          f"{''.join(f' -D{k}={v}' for k, v in (defines or {}).items())}: rel_l2={m['rel_l2']:.2e} "
          f"max_abs={m['max_abs']:.2e} nan={m['nan_count']}{lse_note} {'PASS' if ok else 'FAIL'}",
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
    release_context()
    return ok


def release_context() -> None:
    """End the primary context once every buffer is freed, so that memcheck's leak check sees
    what the call left allocated."""
    from ptxattn import driver
    gc.collect()
    ctx = driver.context()
    driver.synchronize()
    ctx.alive = False                           # later destructors must not call the driver
    driver.check(driver.cu().cuDevicePrimaryCtxRelease(ctx.device), "cuDevicePrimaryCtxRelease")


class DeviceInt32:
    """An int32 device vector or table offered through __cuda_array_interface__ (the library's
    DeviceArray holds bf16 and float32 only); closed explicitly, like every buffer here."""

    def __init__(self, values):
        import numpy as np

        from ptxattn import driver
        values = np.ascontiguousarray(values, dtype=np.int32)
        self.buffer = driver.DeviceBuffer(max(values.nbytes, 4))
        driver.memcpy_htod(self.buffer.ptr, values)
        self.__cuda_array_interface__ = {"shape": values.shape, "typestr": "<i4",
                                         "data": (self.buffer.ptr, False), "strides": None,
                                         "version": 3}

    def close(self):
        self.buffer.close()


def _bf16(rng, *shape):
    import numpy as np

    from ptxattn import reference
    return rng.standard_normal(shape, dtype=np.float32).astype(reference.BF16)


def _poisoned(shape, dtype=None):
    """A NaN-filled output (bf16 by default, float32 for an LSE)."""
    import numpy as np

    from ptxattn import driver, tensors
    if dtype is None:
        out = tensors.empty(shape)
        out.fill_u16(0xFFFF)
        return out
    out = tensors.empty(shape, dtype=np.float32)
    driver.memset_u16(out.ptr, 0xFFFF, 2 * out.size)
    return out


def _lse_check(got, want, tol):
    """-inf exactly where no key is seen, elsewhere within tol; (ok, max error)."""
    import numpy as np
    empty = np.isneginf(want)
    if np.isnan(got).any() or (np.isneginf(got) != empty).any():
        return False, float("nan")
    err = float(np.abs(got[~empty] - want[~empty]).max(initial=0.0))
    return err <= tol, err


def run_decode(head_dim, b, h, length, seed) -> bool:
    """One flash_attn_with_kvcache call with out-of-range device lengths (see the docstring)."""
    import numpy as np

    import ptxattn
    from ptxattn import decode_reference, driver, reference, tensors

    rng = np.random.default_rng(seed)
    hkv, lq, new = max(1, h // 4), 2, 2
    q = _bf16(rng, b, lq, h, head_dim)
    kc, vc = _bf16(rng, b, length, hkv, head_dim), _bf16(rng, b, length, hkv, head_dim)
    kn, vn = _bf16(rng, b, new, hkv, head_dim), _bf16(rng, b, new, hkv, head_dim)
    raw = np.array(([-5, length + 1000, length // 2] * b)[:b], np.int32)
    devs = [tensors.from_numpy(x) for x in (q, kc, vc, kn, vn)]
    lens = DeviceInt32(raw)
    out, lse = _poisoned(q.shape), _poisoned((b, h, lq), np.float32)
    ptxattn.flash_attn_with_kvcache(*devs[:3], k=devs[3], v=devs[4], cache_seqlens=lens,
                                    causal=True, num_splits=3, return_lse=True, out=out,
                                    lse_out=lse)
    driver.synchronize()
    got, got_lse = out.to_numpy(), lse.to_numpy()
    kc2, vc2 = decode_reference.appended_caches(kc, vc, kn, vn, raw)
    eff = decode_reference.clamped_lengths(raw, new, length)
    ref, ref_lse = decode_reference.kvcache_reference(q, kc2, vc2, eff, causal=True)
    m = reference.error_metrics(got, ref)
    lse_ok = _lse_check(got_lse, ref_lse, 2e-3)[0]
    ok = reference.passes(m) and lse_ok
    print(f"case decode:{head_dim} B={b} H={h}:{hkv} L={length} lengths={raw.tolist()} "
          f"splits=3 append={new}: rel_l2={m['rel_l2']:.2e} max_abs={m['max_abs']:.2e} "
          f"nan={m['nan_count']} lse={'ok' if lse_ok else 'WRONG'} {'PASS' if ok else 'FAIL'}",
          flush=True)
    for x in (*devs, out, lse):
        x.free()
    lens.close()
    release_context()
    return ok


def run_decode_case(case: Case, seed: int, defines=None) -> bool:
    return run_decode(stage_and_head_dim(case.kernel)[1], case.batch, case.heads, case.seq_q,
                      seed)


def shuffled_block_table(rng, need, num_pages: int):
    """A (B, max(need) + 1) block table: sequence i's need[i] pages drawn in a random order
    from a pool of num_pages without repeats, -1 past them (one spare column of -1)."""
    import numpy as np
    table = np.full((len(need), int(need.max()) + 1), -1, np.int32)
    pool, at = rng.permutation(num_pages), 0
    for i, n in enumerate(need):
        table[i, :n] = pool[at:at + n]
        at += n
    return table


def run_paged_case(case: Case, seed: int, defines=None) -> bool:
    """One paged flash_attn_with_kvcache call (see PAGED_ROWS): lengths L, L // 2 + 3 and 1
    from the device, two causal queries, three splits and the combine, pages shuffled, the
    table padded with -1 and a bad entry planted in a reached page of sequence 0."""
    import numpy as np

    import ptxattn
    from ptxattn import decode_reference, driver, reference

    d, page = stage_and_head_dim(case.kernel)[1], case.page
    rng = np.random.default_rng(seed)
    b, h, hkv, lq = case.batch, case.heads, max(1, case.heads // 4), 2
    lengths = np.array(([case.seq_q, case.seq_q // 2 + 3, 1] * b)[:b], np.int64)
    need = -(-lengths // page)
    num_pages = int(need.sum()) + 3
    table = shuffled_block_table(rng, need, num_pages)
    table[0, need[0] // 2] = num_pages + 7           # read as zeros, never out of bounds
    q = _bf16(rng, b, lq, h, d)
    k_pages, v_pages = _bf16(rng, num_pages, page, hkv, d), _bf16(rng, num_pages, page, hkv, d)
    from ptxattn import tensors
    devs = [tensors.from_numpy(x) for x in (q, k_pages, v_pages)]
    lens_dev, table_dev = DeviceInt32(lengths), DeviceInt32(table)
    out, lse = _poisoned(q.shape), _poisoned((b, h, lq), np.float32)
    ptxattn.flash_attn_with_kvcache(*devs, cache_seqlens=lens_dev, block_table=table_dev,
                                    causal=True, num_splits=3, return_lse=True, out=out,
                                    lse_out=lse)
    driver.synchronize()
    got, got_lse = out.to_numpy(), lse.to_numpy()
    kc, vc = decode_reference.contiguous_from_pages(k_pages, v_pages, table, lengths)
    ref, ref_lse = decode_reference.kvcache_reference(q, kc, vc, lengths, causal=True)
    m = reference.error_metrics(got, ref)
    lse_ok, lse_err = _lse_check(got_lse, ref_lse, 2e-3)
    ok = reference.passes(m) and lse_ok
    print(f"case {case.name()} B={b} H={h}:{hkv} lengths={lengths.tolist()} pages={num_pages} "
          f"planted=table[0,{need[0] // 2}]={num_pages + 7} splits=3: rel_l2={m['rel_l2']:.2e} "
          f"max_abs={m['max_abs']:.2e} nan={m['nan_count']} lse_max_abs={lse_err:.2e} "
          f"{'PASS' if ok else 'FAIL'}", flush=True)
    for x in (*devs, out, lse, lens_dev, table_dev):
        (x.close if isinstance(x, DeviceInt32) else x.free)()
    release_context()
    return ok


VARLEN_LENGTHS = (0, 1, 129, 300, 77)


def run_varlen_case(case: Case, seed: int, defines=None) -> bool:
    """One flash_attn_varlen_func call over VARLEN_LENGTHS packed end to end, offsets on the
    device, every sequence against the float64 reference (and its LSE with --lse)."""
    import numpy as np

    import ptxattn
    from ptxattn import driver, reference, tensors

    d = stage_and_head_dim(case.kernel)[1]
    rng = np.random.default_rng(seed)
    lens = np.array(VARLEN_LENGTHS, np.int64)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    total = int(cu[-1])
    q = _bf16(rng, total, case.heads, d)
    k, v = _bf16(rng, total, case.hkv, d), _bf16(rng, total, case.hkv, d)
    devs = [tensors.from_numpy(x) for x in (q, k, v)]
    cu_q, cu_k = DeviceInt32(cu), DeviceInt32(cu)
    out = _poisoned(q.shape)
    window = case.window or (-1, -1)
    res = ptxattn.flash_attn_varlen_func(*devs, cu_q, cu_k, int(lens.max()), int(lens.max()),
                                         causal=case.causal, window_size=window,
                                         return_lse=case.lse, out=out)
    driver.synchronize()
    got = out.to_numpy()
    got_lse = res[1].to_numpy() if case.lse else None
    ok, worst, lse_err = True, 0.0, 0.0
    bhld = (lambda x: x.transpose(1, 0, 2)[None])
    for i, n in enumerate(lens):
        if n == 0:
            continue
        s = slice(int(cu[i]), int(cu[i + 1]))
        ref, ref_lse = reference.attention_reference(
            bhld(q[s]), bhld(k[s]), bhld(v[s]), causal=case.causal, window=case.window,
            return_lse=True)
        m = reference.error_metrics(got[s], ref[0].transpose(1, 0, 2))
        ok = ok and (reference.passes(m) if np.abs(ref).max() > 0 else m["max_abs"] == 0)
        worst = max(worst, m["rel_l2"] if m["nan_count"] == 0 else float("inf"))
        if got_lse is not None:
            good, err = _lse_check(got_lse[:, s], ref_lse[0], 2e-3)
            ok, lse_err = ok and good, max(lse_err, err)
    print(f"case {case.name()} lengths={lens.tolist()}: worst rel_l2={worst:.2e}"
          f"{f' lse_max_abs={lse_err:.2e}' if case.lse else ''} {'PASS' if ok else 'FAIL'}",
          flush=True)
    for x in (*devs, out, cu_q, cu_k):
        (x.close if isinstance(x, DeviceInt32) else x.free)()
    if case.lse:
        res[1].free()
    release_context()
    return ok


FP8_MODEL_BAR, FP8_LSE_TOL = 1e-2, 2e-2     # against the FP8 model (tests/fp8_checks.py's)


def run_fp8_case(case: Case, seed: int, defines=None) -> bool:
    """One attention(precision="fp8") call (the quantizer's launch, then the FP8 build) on
    random normal bf16 inputs, against the NumPy model of the FP8 path on the same inputs
    (ptxattn/fp8_reference.py: rel L2 <= 1e-2, LSE within 2e-2); the float64 reference's error
    is printed beside it (e4m3 rounding alone costs ~5% there: bench/notes.md)."""
    import numpy as np

    import ptxattn
    from ptxattn import driver, fp8_reference, reference, tensors

    d = stage_and_head_dim(case.kernel)[1]
    q, k, v = _inputs(case, d, seed)
    devs = [tensors.from_numpy(x) for x in (q, k, v)]
    out = _poisoned(q.shape)
    masks = dict(causal=case.causal, window=case.window, diagonal=case.diagonal)
    res = ptxattn.attention(*devs, layout=case.layout, out=out, return_lse=case.lse,
                            precision="fp8", **masks)
    driver.synchronize()
    got = out.to_numpy()
    ref = reference.attention_reference(q, k, v, layout=case.layout, **masks)
    want, want_lse = fp8_reference.fp8_attention_model(
        fp8_reference.quantize_inputs(q, k, v, case.layout), return_lse=True, **masks)
    if case.layout == "bshd":
        want = want.transpose(0, 2, 1, 3)
    m, vs_ref = reference.error_metrics(got, want), reference.error_metrics(got, ref)
    ok = m["nan_count"] == 0 and m["rel_l2"] <= FP8_MODEL_BAR
    lse_note = ""
    if case.lse:
        good, err = _lse_check(res[1].to_numpy(), want_lse, FP8_LSE_TOL)
        ok, lse_note = ok and good, f" lse_max_abs={err:.2e}"
        res[1].free()
    print(f"case {case.name()}: vs the FP8 model rel_l2={m['rel_l2']:.2e} (bar {FP8_MODEL_BAR}) "
          f"nan={m['nan_count']}{lse_note}; vs float64 rel_l2={vs_ref['rel_l2']:.2e} "
          f"{'PASS' if ok else 'FAIL'}", flush=True)
    for x in (*devs, out):
        x.free()
    release_context()
    return ok


def run_paged_varlen_case(case: Case, seed: int, defines=None) -> bool:
    """One flash_attn_varlen_func(..., block_table=) call (see PAGED_VARLEN_ROWS): sequence i
    a chunk of VARLEN_LENGTHS[i] queries at the end of VARLEN_LENGTHS[i] + 40 * i cached keys,
    every sequence (and its LSE) against the float64 reference on the keys the pages hold
    (the planted entry's page read as zeros)."""
    import numpy as np

    import ptxattn
    from ptxattn import decode_reference, driver, reference, tensors

    d, page = stage_and_head_dim(case.kernel)[1], case.page
    rng = np.random.default_rng(seed)
    lens_q = np.array(VARLEN_LENGTHS, np.int64)
    lens_k = lens_q + 40 * np.arange(len(lens_q))
    b = len(lens_q)
    need = -(-lens_k // page)
    num_pages = int(need.sum()) + 3
    table = shuffled_block_table(rng, need, num_pages)
    longest = int(np.argmax(lens_k))
    table[longest, need[longest] // 2] = num_pages + 7   # read as zeros, never out of bounds
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = _bf16(rng, int(cu_q[-1]), case.heads, d)
    k_pages, v_pages = _bf16(rng, num_pages, page, case.hkv, d), _bf16(rng, num_pages, page,
                                                                       case.hkv, d)
    devs = [tensors.from_numpy(x) for x in (q, k_pages, v_pages)]
    dq, dk, dt = DeviceInt32(cu_q), DeviceInt32(cu_k), DeviceInt32(table)
    out = _poisoned(q.shape)
    res = ptxattn.flash_attn_varlen_func(*devs, dq, dk, int(lens_q.max()), int(lens_k.max()),
                                         causal=True, return_lse=True, out=out,
                                         block_table=dt)
    driver.synchronize()
    got, got_lse = out.to_numpy(), res[1].to_numpy()
    kc, vc = decode_reference.contiguous_from_pages(k_pages, v_pages, table, lens_k)
    ok, worst, lse_err = True, 0.0, 0.0
    bhld = (lambda x: x.transpose(1, 0, 2)[None])
    for i in range(b):
        if lens_q[i] == 0:
            continue
        s = slice(int(cu_q[i]), int(cu_q[i + 1]))
        n = int(lens_k[i])
        ref, ref_lse = reference.attention_reference(bhld(q[s]), bhld(kc[i, :n]),
                                                     bhld(vc[i, :n]), causal=True,
                                                     return_lse=True)
        m = reference.error_metrics(got[s], ref[0].transpose(1, 0, 2))
        ok = ok and reference.passes(m)
        worst = max(worst, m["rel_l2"] if m["nan_count"] == 0 else float("inf"))
        good, err = _lse_check(got_lse[:, s], ref_lse[0], 2e-3)
        ok, lse_err = ok and good, max(lse_err, err)
    print(f"case {case.name()} lengths_q={lens_q.tolist()} lengths_k={lens_k.tolist()} "
          f"pages={num_pages} planted=table[{longest},{need[longest] // 2}]: worst "
          f"rel_l2={worst:.2e} lse_max_abs={lse_err:.2e} {'PASS' if ok else 'FAIL'}",
          flush=True)
    for x in (*devs, out, dq, dk, dt):
        (x.close if isinstance(x, DeviceInt32) else x.free)()
    res[1].free()
    release_context()
    return ok


# KIND (the part of --stage before ":"; lineage stages have none) -> how a case of it runs.
# The backward has its own runner (bench/sanitize_bwd_case.py).
RUNNERS = {PRODUCTION_KEY: run_attention, DECODE_KEY: run_decode_case, PAGED_KEY: run_paged_case,
           VARLEN_KEY: run_varlen_case, FP8_KEY: run_fp8_case,
           PAGED_VARLEN_KEY: run_paged_varlen_case}


def run(case: Case, seed: int = 0, defines=None) -> bool:
    kind = case.kernel.partition(":")[0]
    return RUNNERS.get(kind, run_attention)(case, seed, defines)


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
                    "(1,14; production or 0: the production kernel's cases)")
    ap.add_argument("--controls", action="store_true", help="print the negative controls")
    ap.add_argument("--stage", help="the kernel to run (a stage number or name; production:D, "
                    "the production kernel at head dim D)")
    ap.add_argument("-b", "--batch", type=int, default=1)
    ap.add_argument("-H", "--heads", type=int, default=2)
    ap.add_argument("--heads-kv", type=int, default=0, help="k/v heads (GQA/MQA; default H)")
    ap.add_argument("-L", "--seq-len", type=int, default=256, help="query length")
    ap.add_argument("--seq-k", type=int, default=0, help="key length (default: -L)")
    ap.add_argument("--layout", default="bhld", choices=LAYOUTS)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--window", type=parse_window, default=None, help="LEFT,RIGHT (-1: none)")
    ap.add_argument("--diagonal", default="bottom_right", choices=("bottom_right", "top_left"))
    ap.add_argument("--lse", action="store_true", help="also write and check the LSE")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--page", type=int, default=0, help="paged:D cases: the page size")
    ap.add_argument("-D", "--define", action="append", type=parse_define, default=[],
                    help="a build variant's preprocessor define, NAME=VALUE")
    args = ap.parse_args(argv)
    if args.list:
        for case in cases(parse_stages(args.stages)):
            print(case.line())
        return 0
    if args.controls:
        for case in CONTROLS:
            print(case.line())
        return 0
    if args.stage is None:
        ap.error("--stage is required (or --list)")
    case = Case(args.stage, batch=args.batch, heads=args.heads, seq_q=args.seq_len,
                seq_k=args.seq_k, heads_kv=args.heads_kv, layout=args.layout,
                causal=args.causal, window=args.window, diagonal=args.diagonal, lse=args.lse,
                page=args.page)
    return 0 if run(case, args.seed, dict(args.define)) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Write the backward's per-fragment PTX macros and its layout header (what pcpp cannot compute).

    python -m ptxattn.tools.ptxgen_bwd            # rewrite ptx/sm90/include/gen_bwd_*.ptxh
    python -m ptxattn.tools.ptxgen_bwd --check    # exit 1 if a committed header differs

The backward computes its score tiles transposed, keys in rows: S^T = K Q^T and dP^T = V dO^T
are m64nN accumulators of one consumer's 64 keys x N query columns (N = BLOCK_M), so that P^T and
dS^T, packed to bf16 pairs, are directly the A fragments of dV += P^T dO and dK += dS^T Q
(wgmma RS). The fragment layout is the forward's (ptxgen.py's docstring, fragments.ptxh):
value i of a thread sits at row w*16 + l/4 + 8*((i >> 1) & 1) and column
8*(i >> 2) + 2*(l % 4) + (i & 1). Here rows are keys and columns are queries.

Registers the macros name (each kernel declares those it uses):
  %st<N/2> S^T then P^T, %dpt<N/2> dP^T then dS^T (fp32), %pt<N/4> P^T and %dst<N/4> dS^T
  (bf16 pairs), %dv<C/2>, %dk<C/2> the dV, dK accumulators (C: their columns), %dq<C/2> one
  consumer's dQ slice; %p_mask for masks; %pk0-%pk3, %st_swz, %st_addr, %tmp and row bases
  %kv_row_<h>, %ds_row_<h> for stmatrix; %dq_swz, %dq_off, %dq_addr, %dq_row (b32) and
  %dq_off64, %dq_gaddr, %dq_grow (b64) for the dQ stores.
gen_bwd_layout.ptxh is ptxattn/bwd_builds.py's table as #defines, one block per HEAD_DIM.
"""

from __future__ import annotations

import sys

from .. import bwd_builds
from .ptxgen import INCLUDE, NEG_INF, _macro, _reg_list, col, half, run_generator
from .ptxgen import _guarded as _forward_guarded

K_STEP = 16                   # bf16 wgmma K
DESC_UNIT = 16                # descriptor addresses count 16-byte units
ROW_BYTES = 128               # one 128-byte swizzled row: 64 bf16
ACC_WIDTHS = (64, 128)        # columns of every accumulator the builds use (S^T, dK/dV, dQ)


def _guarded(name: str, about: str, body: list[str]) -> str:
    """ptxgen's include guard and banner, naming this generator."""
    return _forward_guarded(name, about, body).replace(
        "`python -m ptxattn.tools.ptxgen` (ptxattn/tools/ptxgen.py)",
        "`python -m ptxattn.tools.ptxgen_bwd` (ptxattn/tools/ptxgen_bwd.py)", 1)


def _wgmma(n: int) -> str:
    return f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16"


# ---- per accumulator width N: fragments ------------------------------------------------------

def _accumulators(n: int, names) -> list[str]:
    regs = n // 2
    out: list[str] = []
    for name, prefix, what in names:
        out += _macro(f"{name}_ACC_N{n}", None, _reg_list(prefix, regs),
                      f"{what}: 64 rows x {n} columns, {regs} fp32 accumulators per thread")
    return out


def _score_math(n: int) -> list[str]:
    """The score tile's math (keys x N queries): probabilities, dS, packing, masks."""
    regs = n // 2
    out: list[str] = []
    body = []
    for j in range(n // 8):
        body.append(f"ld.shared.v2.f32 {{T0, T1}}, [ADDR+{32 * j}];")
        for i in range(4 * j, 4 * j + 4):
            body += [f"fma.rn.f32 %st{i}, %st{i}, SCALE_LOG2, T{i & 1};",
                     f"ex2.approx.ftz.f32 %st{i}, %st{i};"]
    out += _macro(f"SOFTMAX_PT_N{n}", "ADDR, SCALE_LOG2, T0, T1", body,
                  "P^T <- 2^(S^T * SCALE_LOG2 + neg_lse[query]) in place: the probabilities from "
                  "the saved log-sum-exp.\nADDR (b32, shared): this thread's first column of the "
                  "tile's neg_lse row (-lse * log2 e,\n-inf for a row that sees no key or lies "
                  "past Lq: P = 0 there); T0, T1 (f32) scratch")
    body = []
    for j in range(n // 8):
        body.append(f"ld.shared.v2.f32 {{T0, T1}}, [ADDR+{32 * j}];")
        for i in range(4 * j, 4 * j + 4):
            body += [f"sub.f32 %dpt{i}, %dpt{i}, T{i & 1};", f"mul.f32 %dpt{i}, %dpt{i}, %st{i};"]
    out += _macro(f"DS_N{n}", "ADDR, T0, T1", body,
                  "dS^T <- P^T * (dP^T - delta[query]) in place. ADDR (b32, shared): this "
                  "thread's first column\nof the tile's delta row; T0, T1 (f32) scratch")
    for name, dst, src in (("PT", "pt", "st"), ("DST", "dst", "dpt")):
        out += _macro(f"PACK_{name}_N{n}", None,
                      [f"cvt.rn.bf16x2.f32 %{dst}{j}, %{src}{2 * j + 1}, %{src}{2 * j};"
                       for j in range(regs // 2)],
                      f"%{dst} (bf16 pairs) <- %{src}: the A fragments of an RS wgmma, k-step t "
                      f"in %{dst}4t..%{dst}4t+3")
    body = []
    for i in range(regs):
        lo, hi = ("LO_HI", "HI_HI") if half(i) == "hi" else ("LO_LO", "HI_LO")
        body += [f"setp.gt.s32 %p_mask, {col(i)}, {hi};",
                 f"setp.lt.or.s32 %p_mask, {col(i)}, {lo}, %p_mask;",
                 f"selp.f32 %st{i}, {NEG_INF}, %st{i}, %p_mask;"]
    out += _macro(f"MASK_ST_N{n}", "LO_LO, HI_LO, LO_HI, HI_HI", body,
                  "S^T scores outside [LO, HI] of their key row become -inf (causal, windows, "
                  "keys past Lk).\nBounds are b32 query columns relative to this thread's "
                  "first column, 2 * (lane % 4):\n_LO for the thread's first key row, _HI for "
                  "the row 8 below")
    return out


def _stmatrix_tile(name: str, frag: str, n: int, swz: str, rows: str, about: str) -> list[str]:
    """A score tile's bf16 fragments (%frag) -> shared memory, keys in rows, 128-byte swizzled:
    n / 16 stmatrix x4, 16 queries each; %<rows>_<b> the lane's key row in query block b."""
    body = []
    for t in range(n // 16):
        body += [f"xor.b32 %tmp, {swz}, {2 * (t % 4)};",
                 f"mad.lo.u32 %st_addr, %tmp, 16, %{rows}_{t // 4};",
                 "stmatrix.sync.aligned.m8n8.x4.shared.b16 [%st_addr], "
                 f"{{%{frag}{4 * t}, %{frag}{4 * t + 1}, %{frag}{4 * t + 2}, %{frag}{4 * t + 3}}};"]
    return _macro(name, None, body, about)


def fragment_header(n: int) -> str:
    regs = n // 2
    out = _accumulators(n, (("ST", "st", "S^T (then P^T)"), ("DPT", "dpt", "dP^T (then dS^T)"),
                            ("DV", "dv", "dV"), ("DK", "dk", "dK"), ("DQ", "dq", "dQ")))
    out += _score_math(n)
    out += _stmatrix_tile(f"STMATRIX_DST_N{n}", "dst", n, "%st_swz", "ds_row",
                          f"dS^T (bf16) -> shared, 128-byte swizzled, keys in rows: {n // 16} "
                          "stmatrix x4; %ds_row_b: this lane's key\nrow in query block b (64 "
                          "columns), %st_swz: (lane / 16) ^ (row % 8). dQ reads the tile MN-major")
    # -- the dK / dV / dQ accumulators (64 rows x N columns)
    out += _macro(f"ZERO_DKV_N{n}", None,
                  [f"mov.f32 %{p}{i}, 0f00000000;" for p in ("dv", "dk") for i in range(regs)],
                  "dV, dK <- 0")
    out += _macro(f"SCALE_DK_N{n}", "F", [f"mul.f32 %dk{i}, %dk{i}, F;" for i in range(regs)],
                  "dK *= F (the softmax scale)")
    per_block = 64 // 16                             # stmatrix groups per 64 columns
    for name, prefix in (("DK", "dk"), ("DV", "dv")):
        body = []
        for g in range(regs // 8):
            body += [f"cvt.rn.bf16x2.f32 %pk{j}, %{prefix}{8 * g + 2 * j + 1}, "
                     f"%{prefix}{8 * g + 2 * j};" for j in range(4)]
            body += [f"xor.b32 %tmp, %st_swz, {2 * (g % per_block)};",
                     f"mad.lo.u32 %st_addr, %tmp, 16, %kv_row_{g // per_block};",
                     "stmatrix.sync.aligned.m8n8.x4.shared.b16 [%st_addr], "
                     "{%pk0, %pk1, %pk2, %pk3};"]
        out += _macro(f"STMATRIX_{name}_N{n}", None, body,
                      f"{name[1]} grad (bf16) -> shared for its TMA store, 128-byte swizzled: "
                      f"{regs // 8} stmatrix x4;\n%kv_row_h: this lane's row in column block h "
                      "(64 columns), %st_swz: (lane / 16) ^ (row % 8)")
    body = []
    for j in range(n // 8):
        body += [f"xor.b32 %dq_off, %dq_swz, {j % 8};", "shl.b32 %dq_off, %dq_off, 5;",
                 "add.u32 %dq_addr, %dq_row, %dq_off;",
                 f"st.shared.v2.f32 [%dq_addr+{(j // 8) * 256}], {{%dq{4 * j}, %dq{4 * j + 1}}};",
                 f"st.shared.v2.f32 [%dq_addr+{(j // 8) * 256 + 8 * n * 4}], "
                 f"{{%dq{4 * j + 2}, %dq{4 * j + 3}}};"]
    out += _macro(f"DQ_TO_SHARED_N{n}", None, body,
                  "dQ slice (fp32) -> shared in the accumulator's layout (bwd_builds."
                  "dq_accum_offset): 8-float chunk c of\nslice row r at (c ^ r % 8) * 32 bytes. "
                  "%dq_row: this thread's first row, first column; %dq_swz: row % 8")
    body = []
    for j in range(n // 8):
        body += [f"xor.b32 %dq_off, %dq_swz, {j % 8};", "shl.b32 %dq_off, %dq_off, 5;",
                 "cvt.u64.u32 %dq_off64, %dq_off;", "add.s64 %dq_gaddr, %dq_grow, %dq_off64;",
                 f"red.global.add.v2.f32 [%dq_gaddr+{(j // 8) * 256}], "
                 f"{{%dq{4 * j}, %dq{4 * j + 1}}};",
                 f"red.global.add.v2.f32 [%dq_gaddr+{(j // 8) * 256 + 8 * n * 4}], "
                 f"{{%dq{4 * j + 2}, %dq{4 * j + 3}}};"]
    out += _macro(f"DQ_RED_GLOBAL_N{n}", None, body,
                  "dQ slice (fp32) += into the global accumulator, same layout as "
                  "DQ_TO_SHARED; %dq_grow (b64):\nthis thread's first row and column there")
    return _guarded(f"gen_bwd_n{n}.ptxh",
                    f"Backward fragments of {n}-column accumulators (S^T and dP^T of {n} queries; "
                    f"dK, dV, dQ of {n} columns).", out)


HALF = 32                     # query columns of one consumer's scores in a query-split build


def half_fragment_header() -> str:
    """The score tile of a query-split build (bwd_builds.Build.query_split): one consumer's 64
    keys x its 32 queries of the block, and its two halves' stores into the P^T and dS^T tiles
    (the columns 32c..32c+31 of every 128-byte row: %q_swz = %st_swz ^ 4c)."""
    n = HALF
    out = _accumulators(n, (("ST", "st", "S^T (then P^T)"), ("DPT", "dpt", "dP^T (then dS^T)")))
    out += _score_math(n)
    for name, frag, rows, what in (("PT", "pt", "p_row", "P^T"), ("DST", "dst", "ds_row", "dS^T")):
        out += _stmatrix_tile(f"STMATRIX_{name}_N{n}", frag, n, "%q_swz", rows,
                              f"{what} half (bf16) -> its tile, 128-byte swizzled, keys in rows: "
                              f"{n // 16} stmatrix x4 into\nthis consumer's 32 columns; "
                              f"%{rows}_0: this lane's key row, %q_swz: ((lane / 16) ^ (row % 8))"
                              " ^ 4c")
    return _guarded(f"gen_bwd_n{n}.ptxh",
                    f"Backward fragments of {n}-column score tiles (a query-split consumer's half "
                    "of the block).", out)


def transposed_fragment_header(n: int) -> str:
    """The score tile of a dq_t build (bwd_builds.Build.dq_t): one consumer's 64 keys x the
    block's n queries, dS^T stored transposed (query rows, keys contiguous: the K-major B of
    dQ^T = K^T dS^T), and the dQ^T slice (64 columns of D x n queries) into the staging
    tile's query rows (bwd_builds.dq_accum_offset with dq_t)."""
    out = _accumulators(n, (("ST", "st", "S^T (then P^T)"), ("DPT", "dpt", "dP^T (then dS^T)"),
                            ("DQ", "dq", "dQ^T")))
    out += _score_math(n)
    body = []
    for j in range(n // 8):
        body.append(f"ld.shared.v2.f32 {{T0, T1}}, [ADDR+{32 * j}];")
        for i in range(4 * j, 4 * j + 4):
            # value 2k is the low half of %pt<k> (cvt.rn.bf16x2's second source), 2k + 1 the high
            unpack = (f"and.b32 %pt_f32, %pt{i // 2}, -65536;" if i & 1 else
                      f"shl.b32 %pt_f32, %pt{i // 2}, 16;")
            body += [unpack, f"sub.f32 %dpt{i}, %dpt{i}, T{i & 1};",
                     f"mul.f32 %dpt{i}, %dpt{i}, %pt_f32;"]
    out += _macro(f"DS_PT_N{n}", "ADDR, T0, T1", body,
                  "dS^T <- P^T * (dP^T - delta[query]) in place, P^T read from its packed bf16 "
                  "pairs %pt (PACK_PT's,\nthe A fragments of dV), so that the fp32 %st may die "
                  "at the packing. ADDR (b32, shared): this\nthread's first column of the tile's "
                  "delta row; T0, T1 (f32) scratch; %pt_f32 (b32) one P value")
    body = ["stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 "
            f"[%ds_row_0+{t * K_STEP * ROW_BYTES}], "
            f"{{%dst{4 * t}, %dst{4 * t + 1}, %dst{4 * t + 2}, %dst{4 * t + 3}}};"
            for t in range(n // K_STEP)]
    out += _macro(f"STMATRIX_DST_T_N{n}", None, body,
                  "dS^T (bf16) -> shared transposed: query rows of 128 bytes, this consumer's 64 "
                  f"keys contiguous,\n128-byte swizzled: {n // 16} stmatrix .trans x4, 16 "
                  "queries each. %ds_row_0: this lane's row address\n(matrix j = lane / 8 of a "
                  "step holds keys 8 (j & 1).. of the warp's 16 and queries 8 (j >> 1)..)")
    body = []
    slice_floats = 64                                # a slice row: one consumer's columns
    for h in (0, 1):
        for e in (0, 1):
            body += [f"xor.b32 %dq_off, %dq_swz, {h + 4 * e};", "shl.b32 %dq_off, %dq_off, 5;",
                     "add.u32 %dq_addr, %dq_row, %dq_off;"]
            body += [f"st.shared.f32 [%dq_addr+{(e + 8 * j) * slice_floats * 4}], "
                     f"%dq{4 * j + 2 * h + e};" for j in range(n // 8)]
    out += _macro(f"DQT_TO_SHARED_N{n}", None, body,
                  "dQ^T slice (fp32) -> shared in the accumulator's layout (bwd_builds."
                  "dq_accum_offset, dq_t):\nvalue 4j + 2h + e of a thread is column 16w + 8h + "
                  "l/4 of row 8j + 2q + e (q = l % 4); chunk c of\nrow r at (c ^ perm(r % 8)) "
                  "* 32 bytes, perm(2q + e) = q + 4e. %dq_row: this thread's row 2q,\ncolumn "
                  "l/4; %dq_swz: 2w ^ q. Every store hits 32 banks")
    return _guarded(f"gen_bwd_n{n}.ptxh",
                    f"Backward fragments of {n}-query score tiles with dQ transposed (dS^T "
                    "stored transposed, dQ^T stores).", out)


# ---- per head dim: the five GEMMs ----------------------------------------------------------

def _score_gemm(n: int, d: int, acc: str, jumps: tuple[int, int]) -> list[str]:
    """S^T or dP^T (acc ST / DPT) of N queries: D / 16 k-steps, both operands K-major, DA and
    DB stepped 32 bytes along a swizzled row, then `jumps` to the next 64 of D."""
    step = K_STEP * 2 // DESC_UNIT
    body = [f"{_wgmma(n)} {acc}_ACC_N{n}, DA, DB, 0, 1, 1, 0, 0;"]
    for t in range(1, d // K_STEP):
        j = jumps if t % 4 == 0 else (step, step)
        body += [f"add.s64 DA, DA, {j[0]};", f"add.s64 DB, DB, {j[1]};",
                 f"{_wgmma(n)} {acc}_ACC_N{n}, DA, DB, 1, 1, 1, 0, 0;"]
    return body


def _kv_gemm(cols: int, acc: str, frag: str | None, steps: int) -> list[str]:
    """dV or dK (acc DV / DK) over `steps` k-steps of 16 queries, B read MN-major (DB steps 16
    rows); A from the bf16 pairs %frag (RS) or, frag None, from the shared tile DA (SS,
    K-major, 32 bytes a step)."""
    body = []
    for t in range(steps):
        if t:
            body += ([] if frag else [f"add.s64 DA, DA, {K_STEP * 2 // DESC_UNIT};"]) + \
                [f"add.s64 DB, DB, {K_STEP * ROW_BYTES // DESC_UNIT};"]
        if frag:
            a = ", ".join(f"%{frag}{4 * t + j}" for j in range(4))
            body.append(f"{_wgmma(cols)} {acc}_ACC_N{cols}, {{{a}}}, DB, 1, 1, 1, 1;")
        else:
            body.append(f"{_wgmma(cols)} {acc}_ACC_N{cols}, DA, DB, 1, 1, 1, 0, 1;")
    return body


def _jumps(b: bwd_builds.Build) -> tuple[int, int]:
    """Descriptor steps from a row's last k-step to the next 64 of D: K/V tile, Q/dO tile."""
    step = K_STEP * 2 // DESC_UNIT
    return (b.block_n * ROW_BYTES // DESC_UNIT - 3 * step,
            b.block_m * ROW_BYTES // DESC_UNIT - 3 * step)


def gemm_suffix(b: bwd_builds.Build) -> str:
    """The name of a build's GEMM macros and header: D<dim>, D<dim>T for a dq_t build."""
    return f"D{b.head_dim}" + ("T" if b.dq_t else "")


def _dqt_gemm(b: bwd_builds.Build) -> list[str]:
    """dQ^T = K^T dS^T for one consumer's 64 columns of D x BLOCK_M queries: 16 keys a k-step;
    A = K read MN-major (D contiguous: 16 key rows a step), B = the dS tile K-major (32 bytes
    a step along a swizzled row, then the next 64 keys' block)."""
    step = K_STEP * 2 // DESC_UNIT
    jump = b.block_m * ROW_BYTES // DESC_UNIT - 3 * step
    return _key_steps(b.ds_keys // K_STEP, lambda t: jump if t % 4 == 0 else step,
                      f"{_wgmma(b.block_m)} DQ_ACC_N{b.block_m}, DA, DB, {{}}, 1, 1, 1, 0;")


def _key_steps(steps: int, b_step, wgmma: str) -> list[str]:
    """A dQ GEMM's chain of k-steps of 16 keys: DA advances 16 key rows a step, DB by
    b_step(t) descriptor units; wgmma's {} is the scale-d operand (0 on the first step)."""
    body = []
    for t in range(steps):
        if t:
            body += [f"add.s64 DA, DA, {K_STEP * ROW_BYTES // DESC_UNIT};",
                     f"add.s64 DB, DB, {b_step(t)};"]
        body.append(wgmma.format(int(t > 0)))
    return body


def gemm_header(b: bwd_builds.Build) -> str:
    d, bm, bn = b.head_dim, b.block_m, b.block_n
    g = gemm_suffix(b)
    step = K_STEP * 2 // DESC_UNIT                     # 32 bytes along a swizzled row
    a_jump, b_jump = _jumps(b)                         # next 64 of D in the K/V, Q/dO tiles
    out: list[str] = []
    for name, acc, what in (("ST", "ST", "S^T = K Q^T"), ("DPT", "DPT", "dP^T = V dO^T")):
        out += _macro(f"{name}_GEMM_{g}", "DA, DB", _score_gemm(bm, d, acc, (a_jump, b_jump)),
                      f"{what}: {d // K_STEP} k-steps over D; DA (K or V rows of this consumer, "
                      f"a {bn}-row tile) and DB\n(Q or dO, {bm} rows), both K-major, step {step} "
                      f"along a swizzled row, then {a_jump} / {b_jump} to the next 64 of D\n"
                      "(advanced in place: pass copies). The first step overwrites")
    cols = b.dkv_cols
    for name, acc, frag, what in (("DV", "DV", "pt", "dV += P^T dO"),
                                  ("DK", "DK", "dst", "dK += dS^T Q")):
        out += _macro(f"{name}_GEMM_{g}", "DB", _kv_gemm(cols, acc, frag, bm // K_STEP),
                      f"{what}: {bm // K_STEP} k-steps of 16 queries (RS: A from %{frag}); DB "
                      f"(dO or Q read MN-major, {cols}\ncolumns) steps 16 rows; advanced in place")
    if b.dq_t:
        out += _macro(f"DQ_GEMM_{g}", "DA, DB", _dqt_gemm(b),
                      f"dQ^T = K^T dS^T for one consumer's slice (its 64 columns of D x {bm} "
                      f"queries): {b.ds_keys // K_STEP} k-steps\nof 16 keys; DA (K, read "
                      "MN-major: D contiguous) steps 16 key rows, DB (the dS tile, query rows,\n"
                      "K-major) 32 bytes along a swizzled row, then to the next 64 keys. The "
                      "first step overwrites;\nadvanced in place")
        return _guarded(f"gen_bwd_{g.lower()}.ptxh",
                        f"The backward's GEMMs at head dim {d}, {bm}-row query blocks, dQ "
                        "transposed.", out)
    body = _key_steps(b.ds_keys // K_STEP, lambda t: K_STEP * ROW_BYTES // DESC_UNIT,
                      f"{_wgmma(b.dq_cols)} DQ_ACC_N{b.dq_cols}, DA, DB, {{}}, 1, 1, 1, 1;")
    out += _macro(f"DQ_GEMM_D{d}", "DA, DB", body,
                  f"dQ = dS K for one consumer's slice (64 rows x {b.dq_cols} columns): "
                  f"{b.ds_keys // K_STEP} k-steps of 16 keys;\nDA (dS^T tile, read MN-major: "
                  "queries contiguous), DB (K, read MN-major) both step 16 key rows.\n"
                  "The first step overwrites; advanced in place")
    return _guarded(f"gen_bwd_d{d}.ptxh", f"The backward's GEMMs at head dim {d}.", out)


def query_split_gemm_header(b: bwd_builds.Build) -> str:
    """The GEMMs of a query-split build that differ from its head dim's D-split ones: S^T and
    dP^T over half the queries (m64n32), and dV, dK in two halves of k-steps (the consumer's
    own queries RS from %pt / %dst, the other consumer's SS from its P^T / dS^T tile). dQ is
    the D-split build's (gen_bwd_d<D>.ptxh)."""
    d, bm, bn = b.head_dim, b.block_m, b.block_n
    n = b.score_cols
    step = K_STEP * 2 // DESC_UNIT
    a_jump, b_jump = _jumps(b)
    out: list[str] = []
    for name, acc, what in (("ST", "ST", "S^T = K Q^T"), ("DPT", "DPT", "dP^T = V dO^T")):
        out += _macro(f"{name}_GEMM_D{d}Q", "DA, DB", _score_gemm(n, d, acc, (a_jump, b_jump)),
                      f"{what} of this consumer's {n} queries: {d // K_STEP} k-steps over D; DA "
                      f"(the {bn} keys' K or V rows) and DB\n(rows {n}c.. of the {bm}-row Q or "
                      f"dO tile), both K-major, step {step} along a swizzled row, then {a_jump} / "
                      f"{b_jump}\nto the next 64 of D (advanced in place: pass copies). The first "
                      "step overwrites")
    cols = b.dkv_cols
    own = n // K_STEP                                   # k-steps of this consumer's queries
    for name, acc, frag, what in (("DV", "DV", "pt", "dV += P^T dO"),
                                  ("DK", "DK", "dst", "dK += dS^T Q")):
        out += _macro(f"{name}_OWN_GEMM_D{d}Q", "DB", _kv_gemm(cols, acc, frag, own),
                      f"{what} over this consumer's own {n} queries: {own} k-steps (RS: A from "
                      f"%{frag}); DB (dO or Q read\nMN-major, {cols} columns, from its first own "
                      "query row) steps 16 rows; advanced in place")
        out += _macro(f"{name}_OTHER_GEMM_D{d}Q", "DA, DB", _kv_gemm(cols, acc, None, own),
                      f"{what} over the other consumer's {n} queries: {own} k-steps (SS: DA its "
                      "half of the P^T or dS^T\ntile, K-major, 32 bytes a step; DB as for the own "
                      "half, from the other's first query row);\nadvanced in place")
    return _guarded(f"gen_bwd_d{d}q.ptxh",
                    f"The backward's query-split GEMMs at head dim {d}.", out)


# ---- the build table -----------------------------------------------------------------------

def _log2(x: int) -> int:
    assert x & (x - 1) == 0, x
    return x.bit_length() - 1


LAYOUT_SWITCHES = ("PTXATTN_BWD_QSPLIT", "PTXATTN_BWD_DQRED",     # Build.layout_defines' names
                   "PTXATTN_BWD_DQT", "PTXATTN_BWD_DSPT")


def layout_rows() -> list[bwd_builds.Build]:
    """One build per block of gen_bwd_layout.ptxh: per head dim, each distinct layout of a
    variant (its layout_defines), then today's."""
    out = []
    for d in bwd_builds.HEAD_DIMS:
        seen = set()
        for b in bwd_builds.all_builds():
            key = tuple(sorted(b.layout_defines))
            if b.head_dim == d and key and key not in seen:
                seen.add(key)
                out.append(b)
        out.append(bwd_builds.BUILDS[d])
    return out


def block_condition(b: bwd_builds.Build) -> str:
    """The #if of a build's block: its head dim, and for a variant's layout every layout
    switch defined or not (so that no other build lands in it)."""
    if not b.layout_defines:
        return f"HEAD_DIM == {b.head_dim}"
    return " && ".join([f"HEAD_DIM == {b.head_dim}"] + [
        f"{'' if name in b.layout_defines else '!'}defined({name})" for name in LAYOUT_SWITCHES])


def layout_header() -> str:
    out = ["// Which macros and offsets a head dim's build uses, and its shared memory in bytes",
           "// from the 1024-aligned base. HEAD_DIM selects the block; a variant of the build",
           "// table whose tiles or offsets differ (bwd_builds.Build.layout_defines) has a block",
           "// of its own, selected by its switches as well.", ""]
    first = True
    for b in layout_rows():
        d = b.head_dim
        lay = b.layout()
        t = b.tile_bytes
        out.append(f"#{'if' if first else 'elif'} {block_condition(b)}")
        first = False
        out.append(f"// {b.why}")
        pow2 = b.block_m & (b.block_m - 1) == 0        # else mul / div by BLOCK_M (bwd.ptx)
        defs = [("BLOCK_M", b.block_m), *([("BLOCK_M_SHIFT", _log2(b.block_m))] if pow2 else []),
                ("BLOCK_M_POW2", int(pow2)),
                ("BLOCK_N", b.block_n), ("BLOCK_N_SHIFT", _log2(b.block_n)),
                ("KEY_SPLIT", int(b.key_split)), ("QUERY_SPLIT", int(b.query_split)),
                ("SCORE_COLS", b.score_cols), ("DKV_COLS", b.dkv_cols),
                ("DQ_COLS", b.dq_cols), ("DQ_SPLIT_ROWS", int(b.dq_split_rows)),
                ("DQ_RED", int(b.dq_red)), ("DQ_T", int(b.dq_t)),
                ("EARLY_DV", int(b.early_dv)),
                ("Q_STAGES", b.q_stages), ("Q_STAGE_SHIFT", _log2(b.q_stages)),
                ("KV_TILE_BYTES", t["K"]), ("Q_TILE_BYTES", t["Q"]),
                ("DS_TILE_BYTES", t["dS"]), ("DQ_TILE_BYTES", t["dQ"]),
                ("STAT_BYTES", t["LSE"]), ("Q_STAGE_TX", b.q_stage_tx)]
        defs += [(f"SMEM_{k.upper()}", v) for k, v in lay.items()
                 if k not in ("end", "smem_bytes")]
        defs += [("SMEM_END", lay["end"]), ("SMEM_BYTES", lay["smem_bytes"])]
        width = max(len(k) for k, _ in defs)
        out += [f"#define {k:<{width}} {v}" for k, v in defs]
        rows = {64: "64ROWS", 80: "80ROWS", 128: "128ROWS"}
        s, c, q = b.score_cols, b.dkv_cols, b.dq_cols
        g = f"D{d}Q" if b.query_split else gemm_suffix(b)   # the score GEMMs' macros
        gk = gemm_suffix(b)                                # dV's, dK's and dQ's
        out += [f"#define DESC_QDO_T_BITS DESC_MNMAJOR_SW128_{rows[b.block_m]}   "
                "// Q, dO read MN-major: LBO = BLOCK_M rows * 128 B",
                f"#define DESC_K_T_BITS DESC_MNMAJOR_SW128_{rows[b.block_n]}     "
                "// K read MN-major: LBO = BLOCK_N rows * 128 B",
                "#define DESC_DS_BITS DESC_MNMAJOR_SW128_128ROWS   // dS^T: one 64-query block"
                " in M, so LBO is unused",
                f"#define ST_ACC ST_ACC_N{s}", f"#define DPT_ACC DPT_ACC_N{s}",
                f"#define ST_REGS {s // 2}", f"#define PT_REGS {s // 4}",
                f"#define DKV_REGS {c // 2}", f"#define DQ_REGS {b.registers['dQ']}",
                f"#define ST_GEMM(DA, DB) ST_GEMM_{g}(DA, DB)",
                f"#define DPT_GEMM(DA, DB) DPT_GEMM_{g}(DA, DB)"]
        if b.query_split:
            out += [f"#define DV_OWN_GEMM(DB) DV_OWN_GEMM_{g}(DB)",
                    f"#define DK_OWN_GEMM(DB) DK_OWN_GEMM_{g}(DB)",
                    f"#define DV_OTHER_GEMM(DA, DB) DV_OTHER_GEMM_{g}(DA, DB)",
                    f"#define DK_OTHER_GEMM(DA, DB) DK_OTHER_GEMM_{g}(DA, DB)"]
        else:
            out += [f"#define DV_GEMM(DB) DV_GEMM_{gk}(DB)",
                    f"#define DK_GEMM(DB) DK_GEMM_{gk}(DB)"]
        out += [f"#define DQ_GEMM(DA, DB) DQ_GEMM_{gk}(DA, DB)",
                f"#define SOFTMAX_PT(A, S, T0, T1) SOFTMAX_PT_N{s}(A, S, T0, T1)",
                f"#define DS_TILE(A, T0, T1) DS_{'PT_' if b.ds_from_pt else ''}N{s}(A, T0, T1)",
                f"#define PACK_PT PACK_PT_N{s}", f"#define PACK_DST PACK_DST_N{s}",
                f"#define MASK_ST(A, B, C, D) MASK_ST_N{s}(A, B, C, D)",
                f"#define STMATRIX_DST STMATRIX_DST{'_T' if b.dq_t else ''}_N{s}"]
        if b.query_split:
            out.append(f"#define STMATRIX_PT STMATRIX_PT_N{s}")
        out += [f"#define ZERO_DKV ZERO_DKV_N{c}", f"#define SCALE_DK(F) SCALE_DK_N{c}(F)",
                f"#define STMATRIX_DK STMATRIX_DK_N{c}", f"#define STMATRIX_DV STMATRIX_DV_N{c}",
                f"#define DQ_RED_GLOBAL DQ_RED_GLOBAL_N{q}" if b.dq_red else
                f"#define DQ_TO_SHARED DQT_TO_SHARED_N{s}" if b.dq_t else
                f"#define DQ_TO_SHARED DQ_TO_SHARED_N{q}"]
        if b.dq_t:
            out += ["#define DESC_KT_BITS DESC_MNMAJOR_SW128_128ROWS   // dQ^T's A: K read "
                    "MN-major, 64 of D in M, so LBO is unused"]
        out.append("")
        if b.query_split or b.dq_t:
            out.append(f'#include "gen_bwd_n{s}.ptxh"')
        out.append(f'#include "gen_bwd_{gk.lower()}.ptxh"')
        if b.query_split:
            out.append(f'#include "gen_bwd_d{d}q.ptxh"')
        out.append("")
    out += ["#else", '#error "backward: HEAD_DIM must be 64, 128 or 256"', "#endif", ""]
    body = [f'#include "gen_bwd_n{n}.ptxh"' for n in ACC_WIDTHS] + [""] + out
    return _guarded("gen_bwd_layout.ptxh",
                    "The backward build table (ptxattn/bwd_builds.py) for the production "
                    "kernel.", body)


def headers() -> dict[str, str]:
    out = {f"gen_bwd_n{n}.ptxh": fragment_header(n) for n in ACC_WIDTHS}
    out.update({f"gen_bwd_d{d}.ptxh": gemm_header(b) for d, b in bwd_builds.BUILDS.items()})
    if any(b.query_split for b in bwd_builds.all_builds()):
        out[f"gen_bwd_n{HALF}.ptxh"] = half_fragment_header()
    for b in bwd_builds.all_builds():
        if b.dq_t:
            out[f"gen_bwd_n{b.block_m}.ptxh"] = transposed_fragment_header(b.block_m)
            out[f"gen_bwd_{gemm_suffix(b).lower()}.ptxh"] = gemm_header(b)
    out.update({f"gen_bwd_d{b.head_dim}q.ptxh": query_split_gemm_header(b)
                for b in bwd_builds.all_builds() if b.query_split})
    out["gen_bwd_layout.ptxh"] = layout_header()
    return out


def stale(directory=INCLUDE) -> list[str]:
    from .ptxgen import stale_headers
    return stale_headers(headers(), directory)


def main(argv=None) -> int:
    return run_generator("python -m ptxattn.tools.ptxgen_bwd", __doc__.split("\n")[0], headers,
                         INCLUDE, argv)


if __name__ == "__main__":
    sys.exit(main())

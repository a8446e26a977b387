"""Write the per-register PTX macros of the FP8 forward that the preprocessor cannot compute.

The FP8 builds of the production kernel (ptx/sm90/production/forward.ptx with -D PTXATTN_FP8,
one per row of builds.FP8_BUILDS) keep the bf16 builds' S accumulator and score macros
(gen_n*.ptxh: row max, exponentials, masks); what changes is written here into
ptx/sm90/include/gen_fp8.ptxh, for the shapes the FP8 rows name (a new row: its macros): the e4m3 wgmma k-steps (k32) of
S = Q K^T and O += P V, P packed four e4m3 to a register in the order the FP8 PV's A fragment
wants (fp8_reference.p_source_register: no shuffles, since V^T's keys are permuted to match),
and the epilogue's per-channel V descale. tests/test_fp8_builds.py checks that the committed
header equals this output.

    python -m ptxattn.tools.ptxgen_fp8            # rewrite the header
    python -m ptxattn.tools.ptxgen_fp8 --check    # exit 1 if the committed header differs

Register names the macros use (the kernel declares them): %s<N/2> scores, %o<D/2> output
accumulators, %p<N/8> P as e4m3 quadruples, %ph_lo/%ph_hi (b16) packing scratch, %p_acc and
%zero for the first QK^T step; SCALE_V: %vs_addr, %vs_next (b64), %vs_col, %vs_chunk (b64:
one and eight channels' strides, bytes), %vs_lo, %vs_hi (f32).
"""

from __future__ import annotations

import sys
from pathlib import Path

from .. import builds, fp8_reference
from . import ptxgen

ROWS = builds.Q_BOX_ROWS      # query rows per consumer warpgroup
K_STEP = builds.FP8_K_STEP    # e4m3 wgmma K: 32 one-byte elements, 32 bytes along a row
DESC_UNIT = builds.DESC_UNIT
HEADER = "gen_fp8.ptxh"


def shapes() -> list[tuple[int, int]]:
    """(BLOCK_N, D) of every FP8 row: the k-steps' shapes."""
    return sorted({(b.block_n, b.head_dim) for b in _rows()})


def _rows() -> tuple[builds.Build, ...]:
    """The FP8 rows and the measurement variants (builds.FP8_VARIANTS)."""
    return builds.FP8_BUILDS + tuple(builds.FP8_VARIANTS.values())


def block_ns() -> list[int]:
    return sorted({n for n, _ in shapes()})


def head_dims() -> list[int]:
    return sorted({d for _, d in shapes()})


def _row(n: int, d: int) -> builds.Build:
    return next(b for b in _rows() if (b.block_n, b.head_dim) == (n, d))


def _wgmma(n: int) -> str:
    return f"wgmma.mma_async.sync.aligned.m64n{n}k{K_STEP}.f32.e4m3.e4m3"


def qk_macro(n: int, d: int) -> list[str]:
    """S = Q K^T over D bytes of e4m3: D / 32 k-steps; rows are split into swizzled blocks of
    the row's qk_row_bytes, the next block rows * block bytes further (Q 64, K n rows)."""
    block = _row(n, d).qk_row_bytes
    blocks, per_block = d // block, block // K_STEP
    step = K_STEP // DESC_UNIT
    q_jump = ROWS * block // DESC_UNIT - (per_block - 1) * step
    k_jump = n * block // DESC_UNIT - (per_block - 1) * step
    body = ["setp.ne.u32 %p_acc, %zero, 0;",
            f"{_wgmma(n)} S_ACC_N{n}, DQ, DK, %p_acc, 1, 1;",
            "setp.eq.u32 %p_acc, %zero, 0;"]
    for t in range(1, blocks * per_block):
        qs, ks = (q_jump, k_jump) if t % per_block == 0 else (step, step)
        body += [f"add.s64 DQ, DQ, {qs};", f"add.s64 DK, DK, {ks};",
                 f"{_wgmma(n)} S_ACC_N{n}, DQ, DK, %p_acc, 1, 1;"]
    return ptxgen._macro(
        f"QK_FP8_N{n}_D{d}", "DQ, DK", body,
        f"S = Q K^T over D = {d} e4m3: {blocks * per_block} k-steps of 32; DQ, DK (b64) step "
        f"{step} along a {block}-byte swizzled row" + (f",\nthen {q_jump} / {k_jump} to the "
        f"next {block} bytes of D ({ROWS} / {n} rows on)" if blocks > 1 else "")
        + ". The first step overwrites S (%p_acc false)")


def pv_macro(n: int, d: int) -> list[str]:
    """O += P V: n / 32 k-steps of 32 keys; B is V^T, K-major: D rows of n key bytes (permuted
    within groups of 32), one swizzled block, a step 32 bytes along it; where n is not a
    swizzle width (the variants), [n / row][D][row] blocks: past a block's row, the next block
    D rows * row bytes on."""
    row = _row(n, d).vt_row_bytes
    steps, per_block = n // K_STEP, row // K_STEP
    step = K_STEP // DESC_UNIT
    jump = d * row // DESC_UNIT - (per_block - 1) * step
    body = []
    for t in range(steps):
        if t:
            body.append(f"add.s64 DV, DV, {jump if t % per_block == 0 else step};")
        p = ", ".join(f"%p{4 * t + j}" for j in range(4))
        body.append(f"{_wgmma(d)} O_ACC_D{d}, {{{p}}}, DV, 1, 1, 1;")
    return ptxgen._macro(
        f"PV_FP8_N{n}_D{d}", "DV", body,
        (f"O += P V: {steps} k-steps of 32 keys; DV (b64): V^T (D rows of {n} bytes, "
         f"{row}B-swizzled, K-major) steps {step}") if row == n else
        (f"O += P V: {steps} k-steps of 32 keys; DV (b64): V^T in {n // row} blocks of D rows "
         f"of {row} bytes ({row}B-swizzled, K-major),\nsteps {step} within a block, {jump} to "
         "the next"))


def pack_macro(n: int) -> list[str]:
    """P (e4m3) <- S: register %p(4t + r) = bytes %s[p_source_register(t, 4r..4r+3)]."""
    body = []
    for t in range(n // K_STEP):
        for r in range(4):
            i0, i1, i2, i3 = (int(x) for x in fp8_reference.p_source_register(
                t, range(4 * r, 4 * r + 4)))
            body += [f"cvt.rn.satfinite.e4m3x2.f32 %ph_lo, %s{i1}, %s{i0};",
                     f"cvt.rn.satfinite.e4m3x2.f32 %ph_hi, %s{i3}, %s{i2};",
                     f"mov.b32 %p{4 * t + r}, {{%ph_lo, %ph_hi}};"]
    return ptxgen._macro(
        f"PACK_P_FP8_N{n}", None, body,
        f"P (e4m3, saturating) <- S: {n // 8} registers of 4, the A fragments of PV k-step t in "
        "%p4t..%p4t+3;\nregister 4t + r takes %s[16t + 8(r >> 1) + 2(r & 1) + {0, 1, 4, 5}] "
        "(low byte first): its own row's scores\nat the keys V^T holds at the A fragment's "
        "columns (fp8_reference.PV_KEY_ORDER)")


def scale_v_macro(d: int) -> list[str]:
    """O's columns times their V descale: for each 8-column chunk j the thread's two columns
    8j + 2 (l % 4) + {0, 1} (accumulators 4j, 4j + 2 and 4j + 1, 4j + 3)."""
    body = []
    for j in range(d // 8):
        if j:
            body.append("add.s64 %vs_addr, %vs_addr, %vs_chunk;")
        body += ["ld.global.nc.f32 %vs_lo, [%vs_addr];",
                 "add.s64 %vs_next, %vs_addr, %vs_col;",
                 "ld.global.nc.f32 %vs_hi, [%vs_next];",
                 f"mul.f32 %o{4 * j}, %o{4 * j}, %vs_lo;",
                 f"mul.f32 %o{4 * j + 2}, %o{4 * j + 2}, %vs_lo;",
                 f"mul.f32 %o{4 * j + 1}, %o{4 * j + 1}, %vs_hi;",
                 f"mul.f32 %o{4 * j + 3}, %o{4 * j + 3}, %vs_hi;"]
    return ptxgen._macro(
        f"SCALE_V_D{d}", None, body,
        f"O *= V's descale per column ({d // 8} chunks of 8): %vs_addr (b64) at this thread's "
        "first column's descale,\n%vs_col one column's stride in bytes, %vs_chunk eight "
        "columns' (0 and 0: one descale a head)")


def header() -> str:
    out: list[str] = []
    for n in block_ns():
        out += pack_macro(n)
    for n, d in shapes():
        out += qk_macro(n, d) + pv_macro(n, d)
    for d in head_dims():
        out += scale_v_macro(d)
    text = ptxgen._guarded(HEADER, "The FP8 (e4m3) forward's k-steps, P packing and V descale.",
                           out)
    # the guard's first line names ptxgen.py: this header has its own generator
    return text.replace("`python -m ptxattn.tools.ptxgen` (ptxattn/tools/ptxgen.py)",
                        "`python -m ptxattn.tools.ptxgen_fp8` (ptxattn/tools/ptxgen_fp8.py)", 1)


def headers() -> dict[str, str]:
    return {HEADER: header()}


def stale(directory: Path = ptxgen.INCLUDE) -> list[str]:
    return ptxgen.stale_headers(headers(), directory)


def main(argv=None) -> int:
    return ptxgen.run_generator("python -m ptxattn.tools.ptxgen_fp8", __doc__.split("\n")[0], headers,
                                ptxgen.INCLUDE, argv)


if __name__ == "__main__":
    sys.exit(main())

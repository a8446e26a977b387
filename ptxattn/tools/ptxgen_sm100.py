"""Write the per-register PTX macros of the Blackwell lineage that the preprocessor cannot compute.

pcpp does no arithmetic, so a macro cannot say "for each of the 128 score registers". This
generator writes those lists into ptx/sm100/include/gen_sm100.ptxh; the kernels in ptx/sm100/
include it and keep their structure (roles, barriers, schedule, the softmax's decisions) inline.
tests/test_sm100_ptx.py checks that the committed header equals this output.

    python -m ptxattn.tools.ptxgen_sm100            # rewrite the header
    python -m ptxattn.tools.ptxgen_sm100 --check    # exit 1 if the committed header differs

Layout (tcgen05, M = 128, cta_group::1): row r of an accumulator in tensor memory is TMEM lane r,
column c of f32 data is TMEM column c. A `tcgen05.ld/st .32x32b.xN` gives thread t of warp w
(w % 4 = q) lane 32 q + t and N consecutive columns: one thread holds one row. So the softmax
needs no shuffles, and every macro below walks one thread's own row.

Register names the macros use (each kernel declares them): %s<128> one row of S (f32),
%pk<64> P as bf16 pairs, %oc<32> a 32-column chunk of O (f32), %ob<16> that chunk as bf16 pairs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..stages import ptx_root
from . import ptxgen

BLOCK_N = 128          # key/value rows per tile: the N of S = Q K^T, one thread's 128 scores
HEAD_DIM = 128         # D: the K of Q K^T and the N of O = P V
ROWS = 128             # the MMA's M: query rows per Q tile (TMEM lanes)
K_STEP = 16            # bf16 tcgen05.mma K
O_CHUNK = 32           # O columns moved per tcgen05.ld/st in the rescale and the epilogue
DESC_UNIT = 16         # descriptor addresses count 16-byte units
CORE_BYTES = 16        # one core-matrix row: 8 bf16
SWIZZLE_BYTES = 128    # one 128-byte swizzled row: 64 bf16

INCLUDE = ptx_root() / "sm100" / "include"
HEADER = "gen_sm100.ptxh"


def _macro(name: str, params: str | None, body: list[str], comment: str) -> list[str]:
    head = f"#define {name}" + (f"({params})" if params is not None else "")
    out = [f"// {c}" for c in comment.split("\n")] + [head + " \\"]
    out += [f"    {line} \\" for line in body[:-1]] + [f"    {body[-1]}", ""]
    return out


def _reg_list(prefix: str, first: int, count: int) -> str:
    return "{" + ", ".join(f"%{prefix}{i}" for i in range(first, first + count)) + "}"


def _chains(op: str, dst: str, temps: list[str], regs: list[int]) -> list[str]:
    """DST <- op over %s{regs}, as len(temps)+1 independent chains joined at the end (ILP)."""
    accs = [dst] + temps
    lanes = [regs[i::len(accs)] for i in range(len(accs))]
    body = []
    for acc, lane in zip(accs, lanes):
        body.append(f"{op}.f32 {acc}, %s{lane[0]}, %s{lane[1]};")
    for k in range(2, max(len(lane) for lane in lanes)):
        for acc, lane in zip(accs, lanes):
            if k < len(lane):
                body.append(f"{op}.f32 {acc}, {acc}, %s{lane[k]};")
    for acc in temps:
        body.append(f"{op}.f32 {dst}, {dst}, {acc};")
    return body


def score_macros() -> list[str]:
    n = BLOCK_N
    half = n // 2
    out = _macro("S_LIST_LO", None, [_reg_list("s", 0, half)],
                 f"S columns 0..{half - 1} of this thread's row: one tcgen05.ld .32x32b.x{half}")
    out += _macro("S_LIST_HI", None, [_reg_list("s", half, half)],
                  f"S columns {half}..{n - 1}: the second tcgen05.ld .32x32b.x{half}")
    out += _macro("P_LIST", None, [_reg_list("pk", 0, n // 2)],
                  f"P of this thread's row as {n // 2} bf16 pairs: one tcgen05.st .32x32b.x{n // 2}")
    regs = list(range(n))
    out += _macro("ROW_MAX_S", "MAX, T1, T2, T3", _chains("max", "MAX", ["T1", "T2", "T3"], regs),
                  f"MAX <- max of the {n} scores of this thread's row (4 chains; T1-T3 scratch f32)")
    out += _macro("ROW_SUM_S", "SUM, T1, T2, T3", _chains("add", "SUM", ["T1", "T2", "T3"], regs),
                  f"SUM <- sum of the {n} probabilities of this thread's row (4 chains)")
    out += _macro("SCALE_S", "F", [f"mul.f32 %s{i}, %s{i}, F;" for i in regs],
                  "s <- s * F for every score")
    body = []
    for i in regs:
        body += [f"sub.f32 %s{i}, %s{i}, MAX;", f"mul.f32 %s{i}, %s{i}, LOG2E;",
                 f"ex2.approx.f32 %s{i}, %s{i};"]
    out += _macro("EXP_S", "MAX, LOG2E", body,
                  "s <- e^(s - MAX) as 2^((s - MAX) * log2 e), three instructions a score (stages 1-7)")
    body = []
    for i in regs:
        body += [f"fma.rn.f32 %s{i}, %s{i}, SCALE_LOG2, NEG_MAX;", f"ex2.approx.ftz.f32 %s{i}, %s{i};"]
    out += _macro("FFMA_EX2_S", "SCALE_LOG2, NEG_MAX", body,
                  "s <- 2^(s * SCALE_LOG2 + NEG_MAX): the scale and log2 e folded into one FFMA\n"
                  "(stage 8 on; NEG_MAX = -row_max * SCALE_LOG2, row_max of the raw scores)")
    body = []
    for i in regs:
        body += [f"fma.rn.f32 %s{i}, %s{i}, SCALE_LOG2, NEG_MAX;", f"EXP2_AT_{i % 8}(%s{i}, T_F32, T_INT, T_BITS)"]
    out += _macro("FFMA_EXP2_MIXED_S", "SCALE_LOG2, NEG_MAX, T_F32, T_INT, T_BITS", body,
                  "as FFMA_EX2_S, but slot j = i % 8 of every 8 scores takes EXP2_AT_j (exp2.ptxh):\n"
                  "MUFU.EX2, or the polynomial on the FMA pipe for the last SW_EXP2_PER_8 slots (stage 9 on)")
    accs = ["S0", "S1", "S2", "S3"]
    for h in range(2):
        body = []
        for j in range(h * n // 4, (h + 1) * n // 4):
            lo, hi, acc = 2 * j, 2 * j + 1, accs[j % 4]
            for i in (lo, hi):
                body += [f"fma.rn.f32 %s{i}, %s{i}, SCALE_LOG2, NEG_MAX;",
                         f"EXP2_AT_{i % 8}(%s{i}, T_F32, T_INT, T_BITS)"]
            first = h == 0 and j < 4
            body += [f"mov.f32 {acc}, %s{lo};" if first else f"add.f32 {acc}, {acc}, %s{lo};",
                     f"add.f32 {acc}, {acc}, %s{hi};",
                     f"cvt.rn.bf16x2.f32 %pk{j}, %s{hi}, %s{lo};"]
        cols = f"{h * n // 2}..{(h + 1) * n // 2 - 1}"
        out += _macro(f"EXP2_SUM_PACK_S_HALF{h}", "SCALE_LOG2, NEG_MAX, S0, S1, S2, S3, T_F32, T_INT, T_BITS",
                      body,
                      f"scores {cols} in one pass, a pair at a time: 2^(s * SCALE_LOG2 + NEG_MAX) (EXP2_AT_j),\n"
                      f"added to the four partial sums S0-S3 ({'started' if h == 0 else 'continued'} here) "
                      f"and packed to %pk{h * n // 4}..%pk{(h + 1) * n // 4 - 1}:\n"
                      "each score register is dead once summed and packed")
    for h in range(2):
        out += _macro(f"P_LIST_{'LO' if h == 0 else 'HI'}", None, [_reg_list("pk", h * n // 4, n // 4)],
                      f"P columns {h * n // 2}..{(h + 1) * n // 2 - 1} (bf16 pairs): one tcgen05.st .32x32b.x{n // 4}")
    out += _macro("PACK_P", None,
                  [f"cvt.rn.bf16x2.f32 %pk{j}, %s{2 * j + 1}, %s{2 * j};" for j in range(n // 2)],
                  "P (bf16 pairs, lower column in the low half) <- S")
    k_chunks = n * 2 // CORE_BYTES
    out += _macro("STS_P_NOSWZ", "ADDR",
                  [f"st.shared.v4.b32 [ADDR+{k * ROWS * CORE_BYTES}], "
                   f"{{%pk{4 * k}, %pk{4 * k + 1}, %pk{4 * k + 2}, %pk{4 * k + 3}}};"
                   for k in range(k_chunks)],
                  f"P row to shared memory in the K-major layout without swizzle, [k/8][row][8]:\n"
                  f"ADDR = P base + row * {CORE_BYTES}; column block k of 8 sits {ROWS * CORE_BYTES} bytes on")
    return out


def output_macros() -> list[str]:
    c = O_CHUNK
    out = _macro("OC_LIST", None, [_reg_list("oc", 0, c)],
                 f"{c} O columns of this thread's row: one tcgen05.ld/st .32x32b.x{c}")
    out += _macro("SCALE_OC", "F", [f"mul.f32 %oc{i}, %oc{i}, F;" for i in range(c)],
                  f"o <- o * F for the {c} columns of the chunk")
    out += _macro("PACK_OC", None,
                  [f"cvt.rn.bf16x2.f32 %ob{j}, %oc{2 * j + 1}, %oc{2 * j};" for j in range(c // 2)],
                  "the chunk as bf16 pairs")
    out += _macro("STG_OB", "ADDR",
                  [f"st.global.v4.b32 [ADDR+{16 * j}], {{%ob{4 * j}, %ob{4 * j + 1}, %ob{4 * j + 2}, "
                   f"%ob{4 * j + 3}}};" for j in range(c // 8)],
                  f"the chunk's {c * 2} bytes to global memory at ADDR (16-byte aligned)")
    # The TMA-store epilogue (stage 16): the chunk into a 128-byte swizzled staging tile,
    # [D/64][row][64], where 16-byte unit u of a row sits at unit u ^ (row % 8). The row's
    # XOR is a run-time value, so each unit's offset is computed: (C + 16 j) ^ X16.
    units = c * 2 // CORE_BYTES
    body = []
    for j in range(units):
        body += [f"xor.b32 T, X16, C + {CORE_BYTES * j};" if j else "xor.b32 T, X16, C;",
                 "add.u32 T, T, ROW;",
                 f"st.shared.v4.b32 [T+HALF], {{%ob{4 * j}, %ob{4 * j + 1}, %ob{4 * j + 2}, "
                 f"%ob{4 * j + 3}}};"]
    out += _macro("STS_OB_SW128", "ROW, X16, T, C, HALF", body,
                  f"the chunk's {units} 16-byte units to a 128-byte swizzled row of shared memory:\n"
                  f"ROW = the tile's base + row * {SWIZZLE_BYTES}, X16 = (row % 8) * 16, C = the byte "
                  f"offset of the chunk\nin its {SWIZZLE_BYTES}-byte row (0 or {c * 2}), HALF = the "
                  f"64-column half's offset (immediate); T scratch b32")
    return out


def mma_macros() -> list[str]:
    """The k-steps of S = Q K^T (over D) and O += P V (over N), with their descriptor steps."""
    out: list[str] = []
    steps_d = HEAD_DIM // K_STEP
    steps_n = BLOCK_N // K_STEP

    def ss(name, steps, da_step, db_step, doc):
        body = [f"tcgen05.mma.cta_group::1.kind::f16 [TM], DA, DB, IDESC, P_FIRST;"]
        for t in range(1, steps):
            body += [f"add.s64 DA, DA, {da_step(t)};", f"add.s64 DB, DB, {db_step(t)};",
                     f"tcgen05.mma.cta_group::1.kind::f16 [TM], DA, DB, IDESC, P_ON;"]
        back_a = sum(da_step(t) for t in range(1, steps))
        back_b = sum(db_step(t) for t in range(1, steps))
        body += [f"sub.s64 DA, DA, {back_a};", f"sub.s64 DB, DB, {back_b};"]
        return _macro(name, "TM, DA, DB, IDESC, P_FIRST, P_ON", body, doc)

    def ts(name, steps, db_step, doc):
        body = [f"tcgen05.mma.cta_group::1.kind::f16 [TM], [TA], DB, IDESC, P_FIRST;"]
        for t in range(1, steps):
            body += [f"add.s64 DB, DB, {db_step(t)};",
                     f"tcgen05.mma.cta_group::1.kind::f16 [TM], [TA+{t * K_STEP // 2}], DB, IDESC, P_ON;"]
        body += [f"sub.s64 DB, DB, {sum(db_step(t) for t in range(1, steps))};"]
        return _macro(name, "TM, TA, DB, IDESC, P_FIRST, P_ON", body, doc)

    # Without swizzle, tiles are [k/8][row][8]: a k-step of 16 is two 8-column blocks of
    # rows * 16 bytes (K-major), or two 8-row groups of 128 bytes (V, MN-major).
    kmajor_step = 2 * ROWS * CORE_BYTES // DESC_UNIT
    kmajor_step_kv = 2 * BLOCK_N * CORE_BYTES // DESC_UNIT
    vmajor_step = 2 * 8 * CORE_BYTES // DESC_UNIT
    out += ss("QK_SS_NOSWZ", steps_d, lambda t: kmajor_step, lambda t: kmajor_step_kv,
              f"S = Q K^T: {steps_d} k-steps of {K_STEP} over D, tiles without swizzle. P_FIRST false:\n"
              "the first step overwrites S. Issued by one thread; DA, DB come back to step 0")
    out += ss("PV_SS_NOSWZ", steps_n, lambda t: kmajor_step, lambda t: vmajor_step,
              f"O += P V from shared memory: {steps_n} k-steps over the key rows, P K-major and V\n"
              "MN-major (read transposed), without swizzle. P_FIRST false: O = P V")
    out += ts("PV_TS_NOSWZ", steps_n, lambda t: vmajor_step,
              f"O += P V with P in tensor memory at TA (bf16 pairs: a k-step is {K_STEP // 2} columns),\n"
              "V MN-major without swizzle")
    # 128-byte swizzle: tiles are [D/64][row][64]; a k-step moves 32 bytes along a swizzled row
    # and the fifth step jumps to the other 64-column half of D (rows * 128 bytes on).
    per_half = SWIZZLE_BYTES // (2 * K_STEP)
    row_step = 2 * K_STEP // DESC_UNIT

    def sw_step(rows):
        jump = rows * SWIZZLE_BYTES // DESC_UNIT - (per_half - 1) * row_step
        return lambda t: jump if t % per_half == 0 else row_step

    out += ss("QK_SS_SW128", steps_d, sw_step(ROWS), sw_step(BLOCK_N),
              f"S = Q K^T over 128-byte swizzled tiles: {row_step * DESC_UNIT} bytes a k-step, "
              f"a jump to the second\nhalf of D after {per_half} steps")
    v_step = K_STEP * SWIZZLE_BYTES // DESC_UNIT       # 16 key rows of 128 bytes
    out += ts("PV_TS_SW128", steps_n, lambda t: v_step,
              f"O += P V, P in tensor memory, V MN-major 128-byte swizzled: a k-step is {K_STEP} rows\n"
              f"of 128 bytes (two 1024-byte atoms)")
    # Early PV (stage 13): the same k-steps in two halves over the key rows, so that the
    # first half can run as soon as the first 32 columns of P (keys 0-63) are in TMEM.
    half = steps_n // 2
    body = ["tcgen05.mma.cta_group::1.kind::f16 [TM], [TA], DB, IDESC, P_FIRST;"]
    for t in range(1, half):
        body += [f"add.s64 DB, DB, {v_step};",
                 f"tcgen05.mma.cta_group::1.kind::f16 [TM], [TA+{t * K_STEP // 2}], DB, IDESC, P_ON;"]
    body += [f"add.s64 DB, DB, {v_step};"]
    out += _macro("PV_TS_SW128_LO", "TM, TA, DB, IDESC, P_FIRST, P_ON", body,
                  f"PV_TS_SW128's first {half} k-steps (keys 0..{half * K_STEP - 1}, P columns "
                  f"0..{half * K_STEP // 2 - 1}); DB is left at k-step {half}")
    body = []
    for t in range(half, steps_n):
        if t > half:
            body += [f"add.s64 DB, DB, {v_step};"]
        body += [f"tcgen05.mma.cta_group::1.kind::f16 [TM], [TA+{t * K_STEP // 2}], DB, IDESC, P_ON;"]
    body += [f"sub.s64 DB, DB, {(steps_n - 1) * v_step};"]
    out += _macro("PV_TS_SW128_HI", "TM, TA, DB, IDESC, P_ON", body,
                  f"the last {steps_n - half} k-steps, after PV_TS_SW128_LO; DB comes back to k-step 0")
    return out


def header() -> str:
    name = HEADER
    guard = f"PTXATTN_{name.upper().replace('.', '_')}"
    head = [f"// {name}: generated by `python -m ptxattn.tools.ptxgen_sm100` "
            "(ptxattn/tools/ptxgen_sm100.py); do not edit.",
            f"// One thread's row of a {ROWS} x {BLOCK_N} S tile and of O (D = {HEAD_DIM}); "
            "the tcgen05.mma k-steps.", f"#ifndef {guard}", f"#define {guard}", ""]
    body = score_macros() + output_macros() + mma_macros()
    return "\n".join(head + body + ["#endif", ""])


def headers() -> dict[str, str]:
    return {HEADER: header()}


def stale(directory: Path = INCLUDE) -> list[str]:
    """Names of generated headers that are missing or differ from the generator's output."""
    return ptxgen.stale_headers(headers(), directory)


def main(argv=None) -> int:
    return ptxgen.run_generator("python -m ptxattn.tools.ptxgen_sm100", __doc__.split("\n")[0],
                                headers, INCLUDE, argv)

if __name__ == "__main__":
    sys.exit(main())

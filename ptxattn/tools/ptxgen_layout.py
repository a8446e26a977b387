"""Write ptx/sm90/production/layout.ptxh, the production kernel's build table, from ptxattn/builds.py.

One `#if HEAD_DIM == d` block per row of builds.BUILDS (and, under `#ifdef PTXATTN_FP8`, one per
row of builds.FP8_BUILDS), every figure a literal number: pcpp does no arithmetic outside #if, and the golden fingerprints compare the operands' text, so an
operand must expand to the number (or the product) it has always been. Beside the figures, each
block includes the row's generated fragment headers (ptxgen.py), names its per-score macros
and writes the statement lists that depend on the row (the ring's mbarrier inits, O's
64-column block rows). tests/test_builds.py checks that the committed header equals this output.

    python -m ptxattn.tools.ptxgen_layout            # rewrite the header
    python -m ptxattn.tools.ptxgen_layout --check    # exit 1 if the committed header differs
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from .. import builds
from ..decode_builds import MIN_PAGE_SIZE
from .ptxgen import run_generator

PRODUCTION = Path(__file__).resolve().parents[2] / "ptx" / "sm90" / "production"
NAME = "layout.ptxh"


def _define(name: str, value, comment: str = "") -> str:
    line = f"#define {name} {value}"
    return f"{line:<48} // {comment}" if comment else line


def _macro(name: str, body: list[str]) -> list[str]:
    if not body:
        return [f"#define {name}"]
    return [f"#define {name} \\"] + [f"    {s} \\" for s in body[:-1]] + [f"    {body[-1]}"]


def _aliases(b: builds.Build) -> list[str]:
    """The per-score and per-head-dim macros of the row (gen_nN / gen_dD, and the FP8 rows'
    k-steps, P packing and V descale: gen_fp8.ptxh) under the names the kernel uses."""
    n, d = f"N{b.block_n}", f"D{b.head_dim}"
    if b.fp8:
        gemms = [f"#define QK_TILE(DQ, DK) QK_FP8_{n}_{d}(DQ, DK)",
                 f"#define PV_TILE(DV) PV_FP8_{n}_{d}(DV)",
                 f"#define PACK_P PACK_P_FP8_{n}",
                 "#define PACK_P_REGS .reg .b16 %ph_lo, %ph_hi;   // two e4m3 each",
                 f"#define SCALE_V SCALE_V_{d}"]
    else:
        gemms = [f"#define QK_TILE(DQ, DK) QK_{n}_{d}(DQ, DK)",
                 f"#define PV_TILE(DV) PV_{n}_{d}(DV)",
                 f"#define PACK_P PACK_P_{n}",
                 "#define PACK_P_REGS"]
    return gemms + [
        f"#define ZERO_O ZERO_O_{d}",
        f"#define SCALE_O(LO, HI) SCALE_O_{d}(LO, HI)",
        f"#define STMATRIX_O STMATRIX_O_{d}",
        f"#define STORE_O_BF16(LO, HI, OK_LO, OK_HI) STORE_O_BF16_{d}(LO, HI, OK_LO, OK_HI)",
        f"#define ROW_MAX_LO(M) ROW_MAX_LO_{n}(M)",
        f"#define ROW_MAX_HI(M) ROW_MAX_HI_{n}(M)",
        f"#define ROW_SUM_ADD_LO(S) ROW_SUM_ADD_LO_{n}(S)",
        f"#define ROW_SUM_ADD_HI(S) ROW_SUM_ADD_HI_{n}(S)",
        f"#define SCALE_EXP2(A, B, C, D, E, F) SCALE_EXP2_{n}(A, B, C, D, E, F)",
        f"#define MASK_COLS(LIMIT) MASK_COLS_{n}(LIMIT)",
        f"#define MASK_RANGE(LO_LO, HI_LO, LO_HI, HI_HI) MASK_RANGE_{n}(LO_LO, HI_LO, LO_HI, HI_HI)",
    ]


def ring_magic(d: int) -> tuple[int, int]:
    """(M, s) with floor(g / d) == (g * M >> 32) >> s for every g < 2^31 (a ring depth that is
    not a power of two divides so in the hot loop, not by div.u32's general sequence)."""
    for s in range((d - 1).bit_length(), -1, -1):
        m = (1 << (32 + s)) // d + 1
        # exact for g < 2^31 when M's excess over 2^(32+s)/d, times 2^31, stays below
        # 2^(32+s)/d's distance to the next multiple (Granlund-Montgomery): checked exactly
        if m < 1 << 32 and (m * d - (1 << (32 + s))) * (1 << 31) < (1 << (32 + s)):
            return m, s
    raise ValueError(f"ring depth {d}: no 32-bit magic divisor")


def figures(b: builds.Build) -> list[tuple[str, object, str]]:
    """(name, value, comment) of every figure of the row, in the header's order: a value is an
    int, or the text an operand must expand to (a product, a descriptor's name)."""
    sm = b.smem
    out: list[tuple[str, object, str]] = [
        ("CONSUMERS", b.consumers, f"consumer warpgroups, {builds.Q_BOX_ROWS} query rows each"),
        ("BLOCK_M", b.block_m, "query rows a tile"),
    ]
    if b.block_m_shift is not None:
        out.append(("BLOCK_M_SHIFT", b.block_m_shift, "log2(BLOCK_M)"))
    out.append(("BLOCK_N", b.block_n, "key/value rows a K/V tile"))
    if b.block_n_shift is not None:      # else the tile arithmetic multiplies and divides
        out.append(("BLOCK_N_SHIFT", b.block_n_shift, "log2(BLOCK_N)"))
    out += [
        ("CTA_THREADS", b.threads, "a producer warpgroup and the consumers"),
        ("CONSUMER_THREADS", b.consumers * builds.WARPGROUP,
         "the arrivals that release a K/V slot or Q"),
        ("CLUSTER_KV_EMPTY_ARRIVALS", b.cluster_kv_empty_arrivals,
         f"K/V multicast: a consumer warp of each of the {builds.KV_MULTICAST_CTAS} CTAs"),
        ("CONSUMER_REGS", b.consumer_regs,
         f"setmaxnreg: ({builds.REGISTERS_PER_SM} - {builds.PRODUCER_REGS} * "
         f"{builds.WARPGROUP}) / {b.consumers * builds.WARPGROUP}, to 8"),
        ("S_REGS", b.s_regs, "BLOCK_N / 2 scores a thread"),
        ("P_REGS", b.p_regs, "BLOCK_N / 8 e4m3 quadruples" if b.fp8 else "BLOCK_N / 4 bf16 pairs"),
        ("O_REGS", b.o_regs, "D / 2 accumulators a thread"),
        ("Q_TILE_BYTES", b.q_box_bytes, "one consumer's 64 rows of Q"),
        ("O_TILE_BYTES", b.o_box_bytes, "one consumer's 64 rows of O (bf16)"),
        ("Q_BUFFERS", b.q_buffers, ""),
        # products, not their values: the operand text the kernel has always had
        ("Q_BUFFER_BYTES", f"({b.consumers} * {b.q_box_bytes})", "every consumer's rows"),
        ("Q_TX_BYTES", f"{b.consumers} * {b.q_box_bytes}", "Q FULL's expect_tx: a box a consumer"),
        ("KV_TILE_BYTES", b.kv_tile_bytes, "V^T's too (D rows of BLOCK_N keys)" if b.fp8 else ""),
        ("KV_TX_BYTES", b.kv_tx_bytes, "a K or V FULL's expect_tx"),
        ("KV_SLOT_DESC", b.kv_slot_desc, "KV_TILE_BYTES >> 4: a slot's descriptor step"),
        ("KV_STAGES", b.kv_stages, "ring depth"),
    ]
    if b.kv_stage_shift is not None:
        out.append(("KV_STAGE_SHIFT", b.kv_stage_shift, "log2(KV_STAGES)"))
    else:
        magic, shift = ring_magic(b.kv_stages)
        out += [("RING_MAGIC", hex(magic), "g / KV_STAGES = mul.hi(g, RING_MAGIC) >> RING_MAGIC_SHIFT"),
                ("RING_MAGIC_SHIFT", shift, "")]
    out += [
        ("O_STAGED_IN_Q", int(b.o_staged_in_q), ""),
    ]
    notes = {"SMEM_Q": "buffer b, consumer c at SMEM_Q + (CONSUMERS*b + c)*Q_TILE_BYTES",
             "SMEM_K": "slot s at SMEM_K + s*KV_TILE_BYTES",
             "SMEM_V": "slot s at SMEM_V + s*KV_TILE_BYTES",
             "SMEM_O": ("O staged in the consumer's own Q rows" if b.o_staged_in_q
                        else "consumer c's O staging at SMEM_O + c*Q_TILE_BYTES"),
             "SMEM_BAR_FULL_K": f"[KV_STAGES] each, {builds.MBAR_BYTES} bytes apart",
             "SMEM_BAR_Q_1": "Q FULL and Q EMPTY of buffer 1"}
    out += [(name, offset, notes.get(name, "")) for name, offset in sm.items()]
    out.append(("Q_ROW_OF_BOX_1", builds.Q_BOX_ROWS, "consumer 1's first row in the tile"))
    if b.consumers >= 3:
        out.append(("Q_ROW_OF_BOX_2", 2 * builds.Q_BOX_ROWS, "consumer 2's"))
    out += [(f"BAR_TURN_{c}", b.bar_turn(c), f"consumer {c}'s GEMM turn")
            for c in range(b.consumers)]
    out += [(f"BAR_O_{c}", b.bar_o(c), f"consumer {c}'s O staging") for c in range(b.consumers)]
    out.append(("DESC_QK_BITS", b.desc_qk_bits,
                f"Q and K K-major, {b.qk_row_bytes}-byte swizzled rows"))
    if b.fp8 and b.vt_chunks > 1:
        out += [("VT_CHUNKS", b.vt_chunks, f"V^T's {b.vt_row_bytes}-byte row blocks a tile, "
                 "a TMA box each"),
                ("VT_CHUNK_KEYS", b.vt_row_bytes, "keys of one row block (its TMA box)"),
                ("VT_CHUNK_BYTES", b.head_dim * b.vt_row_bytes, "one row block: D rows")]
    if not b.fp8:
        # the paged varlen build's K/V boxes (kv_paged.ptxh, decode_kv_paged.ptxh): a page of
        # fewer keys than a tile lands in each of the tile's 64-column blocks of D
        out += [("D_BLOCK_BYTES", b.block_n * 128, "a K/V tile's next 64 columns of D"),
                ("MAX_PAGES_PER_TILE", b.block_n // MIN_PAGE_SIZE,
                 f"paged: a tile's pages at page size {MIN_PAGE_SIZE}")]
    out.append(("DESC_V_BITS", b.desc_v_bits,
                f"V^T K-major: D rows of {b.vt_row_bytes} key bytes" if b.fp8 else
                "V MN-major: LBO BLOCK_N rows * 128 B to the next 64 of D"))
    return out


def numbers(b: builds.Build) -> dict[str, int]:
    """The row's figures that are plain numbers, as the header defines them (what a replay of
    the PTX needs: offsets, sizes, counts)."""
    return {name: value for name, value, _ in figures(b) if isinstance(value, int)}


def _row(b: builds.Build) -> list[str]:
    lead = f"// {'FP8 ' if b.fp8 else ''}D = {b.head_dim}: "
    out = textwrap.wrap(b.why, 96, initial_indent=lead, subsequent_indent="// ",
                        break_on_hyphens=False)
    out += [f'#include "{name}"' for name in b.headers]
    out += [_define(name, value, comment) for name, value, comment in figures(b)]
    if b.sw_exp2_per_8:              # softmax.ptxh's default is 0; a -D knob still overrides
        out += ["#ifndef SW_EXP2_PER_8",
                _define("SW_EXP2_PER_8", b.sw_exp2_per_8, "of every 8 exponentials on the FMA pipe"),
                "#endif"]
    # the K/V ring's FULL or EMPTY barriers, one a slot (the includer's %p_leader inits them)
    out.append("// the mbarriers of a ring (FULL or EMPTY, K or V), one a slot")
    out += _macro("MBAR_INIT_RING(BAR, COUNT)", [
        f"@%p_leader mbarrier.init.shared::cta.b64 [BAR{f'+{s * builds.MBAR_BYTES}' if s else ''}], COUNT;"
        for s in range(b.kv_stages)])
    # O's 64-column blocks: the stmatrix rows of blocks 1.. (block 0's is %st_row_0)
    extra = [f"%st_row_{k}" for k in range(2, b.o_blocks)]
    out.append("// O's 64-column blocks past the first two: their stmatrix row registers")
    out += _macro("O_BLOCK_ROW_REGS", [f".reg .b32 {', '.join(extra)};"] if extra else [])
    out.append("// this lane's row in each 64-column block of O past the first (64 rows * 128 B on)")
    out += _macro("O_BLOCK_ROWS", [f"add.u32 %st_row_{k}, %st_row_0, {b.o_block_offset(k)};"
                                   for k in range(1, b.o_blocks)])
    out += _aliases(b)
    return out


def _rows(rows: tuple[builds.Build, ...], what: str,
          variants: tuple[builds.Build, ...] = ()) -> list[str]:
    """`#if HEAD_DIM == d` ... `#endif` over the rows of one precision (its measurement
    variants first, each selected by its defines; defines no variant has are an error)."""
    dims = sorted(b.head_dim for b in rows)
    named = ", ".join(map(str, dims[:-1])) + f" or {dims[-1]}"
    out = []
    for i, b in enumerate(variants):
        test = " && ".join(f"{k} == {v}" for k, v in b.defines.items())
        if b.fp8:
            for knob in ("FP8_KV_STAGES", "FP8_CONSUMERS"):
                if knob not in b.defines:
                    test += f" && !defined({knob})"
        key = "FP8_BLOCK_N" if b.fp8 else "BF16_BLOCK_N"
        out.append(f"#{'if' if i == 0 else 'elif'} HEAD_DIM == {b.head_dim} && "
                   f"defined({key}) && {test}")
        out.append(f"// ---- measurement variant {b.variant} "
                   f"(builds.{'FP8' if b.fp8 else 'BF16'}_VARIANTS)")
        out += _row(b)
    if variants and variants[0].fp8:
        out += ["#elif defined(FP8_BLOCK_N) || defined(FP8_KV_STAGES) || defined(FP8_CONSUMERS)",
                '#error "production: FP8_BLOCK_N (FP8_KV_STAGES, FP8_CONSUMERS) names no variant '
                'of this head dim (builds.FP8_VARIANTS)"']
    elif variants:
        out += ["#elif defined(BF16_BLOCK_N)",
                '#error "production: BF16_BLOCK_N names no variant of this head dim '
                '(builds.BF16_VARIANTS)"']
    for i, b in enumerate(rows):
        out.append(f"#{'if' if i == 0 and not variants else 'elif'} HEAD_DIM == {b.head_dim}")
        out += _row(b)
    return out + ["#else", f'#error "production: {what}HEAD_DIM must be {named} (a row of '
                  'ptxattn/builds.py)"', "#endif"]


def header() -> str:
    table = ["//   precision D    consumers BLOCK_M BLOCK_N ring  Q buffers  O staged  smem      "
             "registers/thread (S, P, O of the consumer budget)"]
    for b in (builds.BUILDS + tuple(builds.BF16_VARIANTS.values()) + builds.FP8_BUILDS
              + tuple(builds.FP8_VARIANTS.values())):
        table.append(f"//   {b.precision + ('/' + b.variant if b.variant else ''):<9} {b.head_dim:<4} {b.consumers:<9} {b.block_m:<7} "
                     f"{b.block_n:<7} {b.kv_stages:<5} {b.q_buffers:<10} "
                     f"{'in Q' if b.o_staged_in_q else 'own':<9} "
                     f"{b.smem_bytes:<9} S {b.s_regs}, P {b.p_regs}, O {b.o_regs} "
                     f"(of {b.consumer_regs})")
    out = [
        f"// {NAME}: generated by `python -m ptxattn.tools.ptxgen_layout` (ptxattn/tools/ptxgen_layout.py)",
        "// from the build table in ptxattn/builds.py; do not edit.",
        "// The production kernel's figures per head dim: tiles, consumers, shared-memory offsets,",
        "// transaction bytes, descriptor steps, shifts, named barrier IDs, register budgets.",
        "// Every bf16 tile is 128-byte swizzled, stored [D / 64][rows][64 elements]; the FP8",
        "// builds' (-D PTXATTN_FP8) Q and K tiles [D / 128][rows][128 bytes] (D = 64: [rows][64",
        "// bytes], 64-byte swizzle), V^T tiles [D][BLOCK_N bytes], O staging as bf16's.",
        "//",
        *table,
        "#ifndef PTXATTN_PRODUCTION_LAYOUT_PTXH",
        "#define PTXATTN_PRODUCTION_LAYOUT_PTXH",
        "",
        "#ifndef HEAD_DIM",
        _define("HEAD_DIM", builds.DEFAULT_HEAD_DIM, "the default build"),
        "#endif",
        "",
        "// ---- every build",
        _define("Q_BOX_ROWS", builds.Q_BOX_ROWS, "a consumer's query rows: one Q (or O) TMA box"),
        _define("SWIZZLE_ROW_BYTES", builds.SWIZZLE_ROW_BYTES, "a 128-byte swizzled row"),
        _define("MBAR_BYTES", builds.MBAR_BYTES, "one mbarrier"),
        _define("SMEM_ALIGN_UP", builds.SMEM_ALIGN - 1, "the dynamic base rounded up to"),
        _define("SMEM_ALIGN_MASK", -builds.SMEM_ALIGN, "a 1024-byte swizzle atom"),
        _define("PRODUCER_REGS", builds.PRODUCER_REGS, "setmaxnreg of the producer warpgroup"),
        _define("BAR_CTA", builds.Build.bar_cta, "named barrier: the whole CTA"),
        _define("BAR_TURN_THREADS", 2 * builds.WARPGROUP, "a turn: the waiter and the hand-over"),
        _define("BAR_O_THREADS", builds.WARPGROUP, "an O staging barrier: one consumer"),
        _define("DESCALE_BLOCK_SHIFT", builds.FP8_SCALE_BLOCK.bit_length() - 1,
                "FP8: log2 of the rows (keys) a Q (K) descale covers"),
        _define("DESCALE_BYTES", builds.F32_BYTES, "FP8: a float32 descale"),
        _define("DESCALE_BYTES_SHIFT", builds.F32_BYTES.bit_length() - 1, "log2(DESCALE_BYTES)"),
        "",
        "#ifndef PTXATTN_FP8",
        "// ==== the bf16 builds (stages.PRODUCTION)",
        *_rows(builds.BUILDS, "", tuple(builds.BF16_VARIANTS.values())),
        "#else",
        "// ==== the FP8 builds (-D PTXATTN_FP8: attention(precision=\"fp8\"))",
        *_rows(builds.FP8_BUILDS, "FP8: ", tuple(builds.FP8_VARIANTS.values())),
        "#endif", "",
        "// ---- K/V tile arithmetic: shifts where BLOCK_N is a power of two; the variants' 80",
        "// (bf16), 192 and 224 (FP8) multiply and divide (dense builds only: the masked walk shifts)",
        "#ifdef BLOCK_N_SHIFT",
        "#define KV_TILES_OF_KEYS(DST, KEYS) shr.u32 DST, KEYS, BLOCK_N_SHIFT;",
        "#define KEYS_OF_KV_TILES(DST, TILES) shl.b32 DST, TILES, BLOCK_N_SHIFT;",
        "#define KEY_TAIL(DST, KEYS) and.b32 DST, KEYS, BLOCK_N - 1;",
        "#else",
        "#if defined(PTXATTN_MASKED) || defined(PTXATTN_VARLEN) || defined(PTXATTN_KV_MULTICAST)",
        '#error "production: a BLOCK_N that is not a power of two builds only the dense kernel"',
        "#endif",
        "#define KV_TILES_OF_KEYS(DST, KEYS) div.u32 DST, KEYS, BLOCK_N;",
        "#define KEYS_OF_KV_TILES(DST, TILES) mul.lo.u32 DST, TILES, BLOCK_N;",
        "#define KEY_TAIL(DST, KEYS) rem.u32 DST, KEYS, BLOCK_N;",
        "#endif",
        "// ---- the K/V ring: fill g of the walk uses slot g % KV_STAGES, its barriers' phase",
        "// (g / KV_STAGES) & 1 (shifts at a power-of-two depth; the n192s3 variant divides)",
        "#ifdef KV_STAGE_SHIFT",
        "#define RING_SLOT(DST, G) and.b32 DST, G, KV_STAGES - 1;",
        "#define RING_FILL(DST, G) shr.u32 DST, G, KV_STAGE_SHIFT;",
        "#else",
        "// g / KV_STAGES as mul.hi and a shift by RING_MAGIC, RING_MAGIC_SHIFT (the row's; exact",
        "// for every g below 2^31), g % KV_STAGES from it (DST other than G)",
        "#define RING_FILL(DST, G) mul.hi.u32 DST, G, RING_MAGIC; shr.u32 DST, DST, RING_MAGIC_SHIFT;",
        "#define RING_SLOT(DST, G) RING_FILL(DST, G) mul.lo.u32 DST, DST, KV_STAGES; sub.u32 DST, G, DST;",
        "#endif", "",
        "#endif // PTXATTN_PRODUCTION_LAYOUT_PTXH", ""]
    return "\n".join(out)


def headers() -> dict[str, str]:
    return {NAME: header()}


def stale(directory: Path = PRODUCTION) -> list[str]:
    """[NAME] when the committed header is missing or differs from the generator's output."""
    from .ptxgen import stale_headers
    return stale_headers(headers(), directory)


def main(argv=None) -> int:
    return run_generator("python -m ptxattn.tools.ptxgen_layout", __doc__.split("\n")[0], headers,
                         PRODUCTION, argv)


if __name__ == "__main__":
    sys.exit(main())

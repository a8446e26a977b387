"""Write ptx/sm90/include/gen_decode.ptxh: the decode kernels' build table and the lists the
preprocessor cannot compute, from ptxattn/decode_builds.py (the only source of the tiles).

    python -m ptxattn.tools.decode_gen            # rewrite the header
    python -m ptxattn.tools.decode_gen --check    # exit 1 if the committed header differs

What it holds, per head dim (`#if HEAD_DIM == d`):
- the build row: BLOCK_N, KV_STAGES, CTAS_PER_SM, the shared-memory carve-up, the V descriptor
  bits, register counts, and which of ptxgen's per-score macros (gen_n*.ptxh, gen_d*.ptxh) the
  kernel's S/P/O code uses;
- STORE_O_BF16 / STORE_O_F32: aliases of gen_d*.ptxh's O stores (ptxattn/tools/ptxgen.py);
- Q_LOAD: the consumer threads' ld.global of Q chunks, then their swizzled st.shared
  (decode_q.ptxh has the per-chunk macros);
- COMBINE_BATCH: the combine kernel's loads and FMAs of combine_batch splits' partial O;
- the paged row-group layout (PTXATTN_PAGED_ROW_GROUP): its descriptor bits and the QK/PV
  k-steps over it (QK_RG_N*_D*, PV_RG_N*_D*: ptxgen's k-steps with that layout's strides).
tests/test_decode_cpu.py checks the committed header equals this output.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..decode_builds import DECODE_BUILDS, ROWS, DecodeBuild
from .ptxgen import INCLUDE, _guarded, _macro, gemm_macros, run_generator

HEADER = "gen_decode.ptxh"
KMAJOR_SW128 = "DESC_KMAJOR_SW128"


def _v_desc_bits(build: DecodeBuild) -> str:
    """V is read transposed (MN-major): SBO 1024 (8 key rows), LBO block_n * 128 bytes (the
    next 64 columns of D), 128-byte swizzle."""
    lbo = build.block_n * 128
    value = (1 << 62) | ((1024 >> 4) << 32) | (((lbo >> 4) & 0x3FFF) << 16)
    return f"0x{value:016X}"


def _row_group_bytes(b: DecodeBuild) -> int:
    """The paged row-group layout's 8 key rows over all of D ([BLOCK_N / 8][D / 64][8][64])."""
    return (b.head_dim // 64) * 1024


def _row_group_desc_bits(b: DecodeBuild) -> tuple[str, str]:
    """(K, V) descriptor bits of the row-group layout: K K-major with SBO = a row group (the
    next 8 keys); V MN-major with SBO = a row group (8 key rows) and LBO 1024 (the next 64
    columns of D, the next atom of the group)."""
    sbo = _row_group_bytes(b) >> 4
    k = (1 << 62) | (sbo << 32) | (1 << 16)
    v = (1 << 62) | (sbo << 32) | ((1024 >> 4) << 16)
    return f"0x{k:016X}", f"0x{v:016X}"


def _row_group_defines(b: DecodeBuild) -> list[str]:
    """The paged build's row-group layout (PTXATTN_PAGED_ROW_GROUP, decode_kv_address.ptxh):
    its descriptor bits, its group size, and the k-steps that walk it."""
    n, d = b.block_n, b.head_dim
    k_bits, v_bits = _row_group_desc_bits(b)
    group = _row_group_bytes(b)
    defs = [
        ("KV_ROW_GROUP_BYTES", group, "paged row groups: 8 key rows x D"),
        ("DESC_K_ROW_GROUP", k_bits, f"K-major, SBO {group}, 128B swizzle"),
        ("DESC_V_ROW_GROUP", v_bits, f"MN-major, LBO 1024, SBO {group}, 128B swizzle"),
    ]
    out = []
    for name, value, note in defs:
        line = f"#define {name} {value}"
        out.append(f"{line:<48}// {note}")
    out += [f"#define QK_ROW_GROUP_TILE(DQ, DK) QK_RG_N{n}_D{d}(DQ, DK)",
            f"#define PV_ROW_GROUP_TILE(DV) PV_RG_N{n}_D{d}(DV)"]
    return out


def _row_group_macros(b: DecodeBuild) -> list[str]:
    """QK_RG_N*_D* / PV_RG_N*_D* (and their rewinds): production's k-steps over the row-group
    layout (K's next 64 columns of D 1024 bytes on, V's next 16 keys two row groups on)."""
    return gemm_macros(b.block_n, b.head_dim, k_block_bytes=1024,
                       pv_step_bytes=2 * _row_group_bytes(b), tag="_RG")


def _row_defines(b: DecodeBuild) -> list[str]:
    n, d = b.block_n, b.head_dim
    q_chunks = d // 8                        # 16-byte chunks of a Q row
    defs = [
        ("BLOCK_N", n, "keys per K/V tile"),
        ("BLOCK_N_SHIFT", n.bit_length() - 1, "log2(BLOCK_N)"),
        ("KV_STAGES", b.kv_stages, "ring depth: K/V tile pairs in shared memory"),
        ("CTAS_PER_SM", b.ctas_per_sm, ".minnctapersm"),
        ("Q_BYTES", b.q_bytes, f"{ROWS} rows x D x 2 bytes"),
        ("KV_TILE_BYTES", b.kv_tile_bytes, "one K or V tile"),
        ("KV_SLOT_DESC", b.kv_tile_bytes >> 4, "a slot's descriptor offset"),
        ("D_BLOCK_BYTES", n * 128, "a K/V tile's next 64 columns of D"),
        ("MAX_PAGES_PER_TILE", b.max_pages_per_tile, "paged: a tile's pages at page size 16"),
        ("SMEM_Q", b.smem_q, ""),
        ("SMEM_K", b.smem_k, "slot s at SMEM_K + s * KV_TILE_BYTES"),
        ("SMEM_V", b.smem_v, "slot s at SMEM_V + s * KV_TILE_BYTES"),
        ("SMEM_BAR_FULL_K", b.barrier("FULL_K"), "[KV_STAGES] each, 8 bytes apart"),
        ("SMEM_BAR_FULL_V", b.barrier("FULL_V"), ""),
        ("SMEM_BAR_EMPTY_K", b.barrier("EMPTY_K"), ""),
        ("SMEM_BAR_EMPTY_V", b.barrier("EMPTY_V"), ""),
        ("SMEM_SEQ_LEN", b.smem_seq_len, "the sequence's raw length, read once a CTA"),
        ("SMEM_BYTES", b.smem_bytes, "dynamic shared memory, alignment slack included"),
        ("DESC_V_BITS", _v_desc_bits(b), f"MN-major, LBO {n * 128}, SBO 1024, 128B swizzle"),
        ("S_REGS", b.s_regs, "BLOCK_N / 2 scores a thread"),
        ("P_REGS", n // 4, "BLOCK_N / 4 bf16 pairs"),
        ("O_REGS", b.o_regs, "D / 2 accumulators a thread"),
        ("Q_CHUNKS", q_chunks, "16-byte chunks of a Q row"),
        ("Q_CHUNKS_SHIFT", q_chunks.bit_length() - 1, ""),
        ("Q_ROW_STEP", 128 // q_chunks, "rows between a thread's Q chunks"),
        ("Q_REGS", 4 * (ROWS * q_chunks // 128), "b32 registers of a thread's Q chunks"),
        ("COMBINE_COLS", b.combine_cols, "fp32 columns of a row per combine lane"),
        ("COMBINE_BATCH", b.combine_batch, "splits the combine loads at once"),
        ("COMBINE_REGS", b.combine_cols * b.combine_batch, ""),
    ]
    out = []
    for name, value, note in defs:
        line = f"#define {name} {value}"
        out.append(f"{line:<48}// {note}" if note else line)
    out += [
        f'#include "gen_n{n}.ptxh"',
        f'#include "gen_d{d}.ptxh"',
        f"#define QK_TILE(DQ, DK) QK_N{n}_D{d}(DQ, DK)",
        f"#define PV_TILE(DV) PV_N{n}_D{d}(DV)",
        f"#define ZERO_O ZERO_O_D{d}",
        f"#define SCALE_O(LO, HI) SCALE_O_D{d}(LO, HI)",
        f"#define ROW_MAX_LO(M) ROW_MAX_LO_N{n}(M)",
        f"#define ROW_MAX_HI(M) ROW_MAX_HI_N{n}(M)",
        f"#define ROW_SUM_ADD_LO(S) ROW_SUM_ADD_LO_N{n}(S)",
        f"#define ROW_SUM_ADD_HI(S) ROW_SUM_ADD_HI_N{n}(S)",
        f"#define SCALE_EXP2(A, B, C, D, E, F) SCALE_EXP2_N{n}(A, B, C, D, E, F)",
        f"#define PACK_P PACK_P_N{n}",
        f"#define MASK_RANGE(LO_LO, HI_LO, LO_HI, HI_HI) MASK_RANGE_N{n}(LO_LO, HI_LO, LO_HI, HI_HI)",
        f"#define STORE_O_BF16(LO, HI, OK_LO, OK_HI) STORE_O_BF16_D{d}(LO, HI, OK_LO, OK_HI)",
        f"#define STORE_O_F32(LO, HI, OK_LO, OK_HI) STORE_O_F32_D{d}(LO, HI, OK_LO, OK_HI)",
        f"#define Q_LOAD Q_LOAD_D{d}",
        f"#define COMBINE_LOADS COMBINE_LOADS_D{d}",
        f"#define COMBINE_FMAS COMBINE_FMAS_D{d}",
        f"#define COMBINE_STORE(ADDR) COMBINE_STORE_D{d}(ADDR)",
    ]
    return out


def _q_load_macro(b: DecodeBuild) -> list[str]:
    passes = ROWS * (b.head_dim // 8) // 128
    regs = [[f"%qv{4 * k + j}" for j in range(4)] for k in range(passes)]
    body = [f"Q_CHUNK_LOAD({k}, {', '.join(r)})" for k, r in enumerate(regs)]
    body += [f"Q_CHUNK_STORE({k}, {', '.join(r)})" for k, r in enumerate(regs)]
    return _macro(f"Q_LOAD_D{b.head_dim}", None, body,
                  f"this thread's {passes} Q chunks: every load first, then the stores "
                  "(decode_q.ptxh)")


def _combine_macros(b: DecodeBuild) -> list[str]:
    cols, batch, d = b.combine_cols, b.combine_batch, b.head_dim
    loads, fmas = [], []
    for j in range(batch):
        regs = [f"%cv{cols * j + c}" for c in range(cols)]
        loads += [f"add.u32 %tmp, %batch_lane, {j};",
                  f"shfl.sync.idx.b32 %cw{j}, %w_sel, %tmp, 31, -1;"]
        # a split of weight 0 is not read: past the call's splits it lies past the workspace
        loads.append(f"setp.ne.f32 %p_w, %cw{j}, 0f00000000;")
        for half in range(0, cols, 4):
            group = regs[half:half + 4]
            width = "v2" if len(group) == 2 else "v4"
            loads.append(f"@%p_w ld.global.{width}.f32 {{{', '.join(group)}}}, "
                         f"[%ws_addr+{half * 4}];")
        loads.append("add.u64 %ws_addr, %ws_addr, %split_bytes;")
        fmas.append(f"setp.ne.f32 %p_w, %cw{j}, 0f00000000;")
        fmas += [f"selp.f32 {r}, {r}, 0f00000000, %p_w;" for r in regs]
        fmas += [f"fma.rn.f32 %acc{c}, %cw{j}, {r}, %acc{c};" for c, r in enumerate(regs)]
    out = _macro(f"COMBINE_LOADS_D{d}", None, loads,
                 f"{batch} splits' weights (shuffled from the lanes holding them) and partial O "
                 f"({cols} floats a lane),\nevery load before any use, none of weight 0; "
                 "%ws_addr steps one split on each")
    out += _macro(f"COMBINE_FMAS_D{d}", None, fmas,
                  "acc += weight * partial O, split by split; a split of weight 0 (LSE -inf: "
                  "it saw no key)\ncontributes 0 whatever its O holds")
    packs = [f"cvt.rn.bf16x2.f32 %ck{c // 2}, %acc{c + 1}, %acc{c};" for c in range(0, cols, 2)]
    words = [f"%ck{c}" for c in range(cols // 2)]
    store = ("st.global.b32 [ADDR], %ck0;" if len(words) == 1 else
             f"st.global.v{len(words)}.b32 [ADDR], {{{', '.join(words)}}};")
    out += _macro(f"COMBINE_STORE_D{d}", "ADDR", packs + [store],
                  f"the lane's {cols} output columns (acc, already divided) as bf16 at ADDR")
    return out


def header() -> str:
    out = ["// The build table of ptxattn/decode_builds.py, one row per head dim (the only source",
           "// of the decode kernels' tiles; the launcher reads the same rows).",
           "#ifndef HEAD_DIM", "#define HEAD_DIM 128", "#endif"]
    for i, (d, b) in enumerate(sorted(DECODE_BUILDS.items())):
        out.append(f"{'#if' if i == 0 else '#elif'} HEAD_DIM == {d}")
        out.append(f"// {b.why}")
        out += _row_defines(b)
        out += _row_group_defines(b)
    out += ["#else", '#error "gen_decode.ptxh: HEAD_DIM must be '
            + ", ".join(map(str, sorted(DECODE_BUILDS))) + '"', "#endif", ""]
    for d, b in sorted(DECODE_BUILDS.items()):
        out += _q_load_macro(b)
        out += _combine_macros(b)
        out += _row_group_macros(b)
    return _guarded(HEADER, "Decode kernels (ptx/sm90/production/decode.ptx, combine.ptx): build "
                    "rows, Q loads, combine batches.", out).replace(
        "`python -m ptxattn.tools.ptxgen` (ptxattn/tools/ptxgen.py)",
        "`python -m ptxattn.tools.decode_gen` (ptxattn/tools/decode_gen.py)", 1)


def headers() -> dict[str, str]:
    return {HEADER: header()}


def stale(directory: Path = INCLUDE) -> list[str]:
    """Names of generated headers that are missing from `directory` or differ from the output."""
    return [name for name, text in headers().items()
            if not (directory / name).is_file() or (directory / name).read_text() != text]


def main(argv=None) -> int:
    return run_generator("python -m ptxattn.tools.decode_gen", __doc__.split("\n")[0], headers,
                         INCLUDE, argv)


if __name__ == "__main__":
    sys.exit(main())

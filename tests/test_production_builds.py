"""The production kernel's builds per head dim (CPU only): the build table as the PTX reads it
(ptx/sm90/production/layout.ptxh, generated from ptxattn/builds.py) agrees with
stages.PRODUCTION_VARIANTS and with itself (shared-memory carve-up, transaction bytes,
descriptor steps, register lists), the launcher's TMA boxes move exactly the bytes the PTX
expects, and each build assembles without spills with the HGMMA, STSM and MUFU counts its tile
shape implies.

The GPU side (every build against the reference) is tests/test_gpu_production.py.
"""

from __future__ import annotations

import re

import pytest

from ptxattn import api as attn
from ptxattn import choice, ptx, stages, tma
from ptxattn.tools import sass

LAYOUT = (stages.ptx_root() / "sm90" / "production" / "layout.ptxh").read_text()
SOURCE = ptx.source_text(stages.PRODUCTION)     # the kernel's file and every include
DESC_HEADER = (stages.ptx_root() / "sm90" / "include" / "wgmma_desc.ptxh").read_text()
MAX_DYNAMIC_SMEM = 227 * 1024          # per CTA on sm_90
BARRIER_BYTES = 128                    # the 10 or 12 mbarriers' room at the end of the carve-up
ALIGN_SLACK = 1024                     # the kernel rounds the dynamic base up to 1024
HEAD_DIMS = sorted({d for d, _ in stages.PRODUCTION_VARIANTS})
UNMASKED = [d for d in HEAD_DIMS if (d, False) in stages.PRODUCTION_VARIANTS]


def row_defines(body: str) -> dict[str, str]:
    """{name: value text} of the #defines in one row of the generated build table, any
    trailing comment removed (a function-like macro under its bare name)."""
    out = {}
    for line in body.splitlines():
        d = re.match(r"#define (\w+(?:\([^)]*\))?)\s+(.*?)\s*(?://.*)?$", line)
        if d:
            out[d.group(1).split("(")[0]] = d.group(2)
    return out


def build_defines(head_dim: int) -> dict[str, str]:
    """The #defines of one row of the generated build table (`#if HEAD_DIM == d` up to the
    next #elif/#else), value text with any trailing comment removed."""
    m = re.search(rf"^#(?:el)?if HEAD_DIM == {head_dim}\n(.*?)^#(?:elif|else)\b", LAYOUT, re.M | re.S)
    assert m, f"layout.ptxh has no build table row for HEAD_DIM {head_dim}"
    return row_defines(m.group(1))


def num(defs: dict, name: str) -> int:
    return int(defs[name], 0)


def desc_fields(bits_name: str) -> dict[str, int]:
    m = re.search(rf"#define {bits_name}\s+(0x[0-9a-fA-F]+)", DESC_HEADER)
    assert m, bits_name
    value = int(m.group(1), 16)
    return {"lbo": ((value >> 16) & 0x3FFF) << 4, "sbo": ((value >> 32) & 0x3FFF) << 4,
            "swizzle": value >> 62}


def test_the_registry_and_the_ptx_cover_the_same_head_dims():
    in_ptx = sorted({int(d) for d in re.findall(r"^#(?:el)?if HEAD_DIM == (\d+)$", LAYOUT, re.M)})
    assert in_ptx == HEAD_DIMS == [64, 128, 256]
    assert stages.PRODUCTION.head_dims == (64, 128, 256)
    assert set(UNMASKED) == {64, 128, 256}


@pytest.mark.parametrize("d", UNMASKED)
def test_build_table_row_is_consistent(d):
    v = stages.PRODUCTION_VARIANTS[(d, False)]
    f = build_defines(d)
    n, ring = num(f, "BLOCK_N"), num(f, "KV_STAGES")
    assert (n, ring) == (v.block_n, v.kv_stages)
    assert 1 << num(f, "BLOCK_N_SHIFT") == n and 1 << num(f, "KV_STAGE_SHIFT") == ring
    # tiles: [D / 64][rows][64 bf16], one consumer's Q (and O) box is 64 rows
    q_box, kv_tile = num(f, "Q_TILE_BYTES"), num(f, "KV_TILE_BYTES")
    assert q_box == 64 * d * 2 and kv_tile == n * d * 2
    assert num(f, "KV_SLOT_DESC") == kv_tile >> 4
    # the carve-up: Q (buffers x 2 boxes) | K ring | V ring | O staging (or O in Q's place)
    # | barriers; a second Q buffer (tiles back to back) only where O has its own staging
    sq, sk, sv, so = (num(f, k) for k in ("SMEM_Q", "SMEM_K", "SMEM_V", "SMEM_O"))
    q_buffers, consumers = num(f, "Q_BUFFERS"), num(f, "CONSUMERS")
    assert q_buffers == (1 if num(f, "O_STAGED_IN_Q") else 2)
    # a consumer warpgroup is 64 query rows; the launcher's block_m and threads agree
    assert num(f, "BLOCK_M") == 64 * consumers == v.block_m
    assert v.threads == 128 * (consumers + 1)
    assert sq == 0 and sk == sq + q_buffers * consumers * q_box and sv == sk + ring * kv_tile
    end = sv + ring * kv_tile
    if num(f, "O_STAGED_IN_Q"):
        assert so == sq
    else:
        assert so == end
        end += consumers * q_box
    for base in (sq, sk, sv, so, kv_tile, q_box):
        assert base % 1024 == 0, "a 128B-swizzle atom (8 rows x 128 B) needs 1024-byte alignment"
    bars = [num(f, k) for k in ("SMEM_BAR_Q", "SMEM_BAR_FULL_K", "SMEM_BAR_FULL_V",
                                "SMEM_BAR_EMPTY_K", "SMEM_BAR_EMPTY_V", "SMEM_BAR_Q_EMPTY")]
    assert bars[0] == end
    assert bars == [end, end + 8, end + 8 + 8 * ring, end + 8 + 16 * ring, end + 8 + 24 * ring,
                    end + 8 + 32 * ring]
    if q_buffers == 2:                     # buffer 1's Q FULL and Q EMPTY follow
        bars += [num(f, "SMEM_BAR_Q_1"), num(f, "SMEM_BAR_Q_EMPTY_1")]
        assert bars[-2:] == [bars[-3] + 8, bars[-3] + 16]
    assert bars[-1] + 8 <= end + BARRIER_BYTES
    assert v.smem_bytes == end + BARRIER_BYTES + ALIGN_SLACK <= MAX_DYNAMIC_SMEM
    # register lists and the generated macros of this (N, D)
    assert (num(f, "S_REGS"), num(f, "P_REGS"), num(f, "O_REGS")) == (n // 2, n // 4, d // 2)
    assert f["QK_TILE"] == f"QK_N{n}_D{d}(DQ, DK)" and f["PV_TILE"] == f"PV_N{n}_D{d}(DV)"
    for name in ("ZERO_O", "STMATRIX_O"):
        assert f[name] == f"{name}_D{d}"
    assert f["SCALE_O"] == f"SCALE_O_D{d}(LO, HI)"
    for name in ("ROW_MAX_LO", "ROW_MAX_HI", "ROW_SUM_ADD_LO", "ROW_SUM_ADD_HI", "MASK_COLS",
                 "PACK_P", "SCALE_EXP2"):
        assert f[name].startswith(f"{name}_N{n}"), (name, f[name])
    assert f'#include "gen_n{n}.ptxh"' in LAYOUT and f'#include "gen_d{d}.ptxh"' in LAYOUT


@pytest.mark.parametrize("d", UNMASKED)
def test_v_descriptor_strides_match_the_tile(d):
    """V is read transposed (MN-major, 128B swizzle): SBO = 1024 (the next 8 key rows), LBO =
    the next 64 columns of D, i.e. BLOCK_N rows * 128 B further (unused when D = 64)."""
    f = build_defines(d)
    fields = desc_fields(f["DESC_V_BITS"])
    assert fields["swizzle"] == 1 and fields["sbo"] == 1024
    if d > 64:
        assert fields["lbo"] == num(f, "BLOCK_N") * 128


@pytest.mark.parametrize("d", UNMASKED)
def test_tma_boxes_move_the_bytes_the_barriers_expect(d):
    """The launcher's boxes (tma.map_geometry with the build's rows) against the PTX's
    expect_tx counts: a Q box is Q_TILE_BYTES (one a consumer), a K or V box KV_TILE_BYTES."""
    build = stages.PRODUCTION.specialize(d)
    f = build_defines(d)
    chunk = build.tma_chunk
    assert chunk == 64                                     # 128 bytes: one swizzle row
    for rows, expected in ((build.q_box_rows, num(f, "Q_TILE_BYTES")),
                           (build.block_n, num(f, "KV_TILE_BYTES"))):
        for layout in ("bhld", "bshd"):
            g = tma.map_geometry(layout, 2, 3, 1000, d, rows, chunk)
            box = g["box"]
            assert max(box) <= 256 and box[0] * 2 == 128
            assert box[0] * box[1] * box[2] * 2 == expected, (layout, box)
    # the expect_tx the producer announces: a box a consumer for Q, one tile for K and for V
    assert eval(f["Q_TX_BYTES"]) == num(f, "CONSUMERS") * num(f, "Q_TILE_BYTES")
    assert num(f, "KV_TX_BYTES") == num(f, "KV_TILE_BYTES")
    assert SOURCE.count("], Q_TX_BYTES;") == 2 and SOURCE.count("], KV_TX_BYTES;") == 2


@pytest.mark.parametrize("d", UNMASKED)
def test_specialize_picks_the_row(d):
    build = stages.PRODUCTION.specialize(d)
    v = stages.PRODUCTION_VARIANTS[(d, False)]
    assert build.head_dims == (d,) and build.block_n == v.block_n
    assert build.smem_bytes == v.smem_bytes and dict(build.defines) == {"HEAD_DIM": str(d)}


def test_a_head_dim_without_a_build_is_refused():
    with pytest.raises(ValueError, match="no build for head dim 96"):
        stages.PRODUCTION.specialize(96)


@pytest.mark.parametrize("d", [64, 256])
def test_the_default_kernel_takes_head_dims_64_and_256(d):
    for lq, lk in ((1, 1), (1000, 63), (129, 8191)):
        assert choice.pick_stage(None, d, lq, lk, gqa=True, lse=True) is stages.PRODUCTION
    with pytest.raises(ValueError, match=f"head dim {d} \\(takes 128\\)"):
        choice.pick_stage(14, d, 128, 128)


requires_ptxas = pytest.mark.skipif(sass.locate("ptxas") is None,
                                    reason="no ptxas anywhere (pip install 'ptxattn[tools]')")


@requires_ptxas
@pytest.mark.parametrize("d", UNMASKED)
def test_build_assembles_without_spills_and_with_its_instruction_counts(d):
    """ptxas on the HEAD_DIM build: no spills or local memory (O is 128 registers per thread at
    D = 256), setmaxnreg kept, wgmma not serialized, and the counts the tile shape implies:
    QK^T is D/16 k-steps and PV BLOCK_N/16, each issued three times (QK^T: the prologue and the
    loop's plain and masked steps; PV: the two steps and the last tile); exponentials BLOCK_N/2
    per thread and 2 corrections, once per S; one stmatrix per 8 of O's D/2 registers."""
    n = stages.PRODUCTION.specialize(d).block_n
    copies = 3
    result = sass.inspect_stage(stages.PRODUCTION, defines={"HEAD_DIM": str(d)})
    s = result.summary
    assert s.spill_bytes == 0 and s.stack_frame == 0, (s.spill_bytes, s.stack_frame)
    assert not sass.grep(result.sass, "LDL") and not sass.grep(result.sass, "STL")
    assert not [w for w in s.warnings if "setmaxnreg" in w or "wgmma" in w], s.warnings
    assert s.classes["USETMAXREG"] == 2
    assert s.classes["HGMMA"] == copies * (d // 16 + n // 16)
    assert s.classes["STSM"] == d // 16
    # every build's exponentials are all MUFU (SW_EXP2_PER_8 0: no FMA polynomials)
    sw = 0
    assert s.classes["MUFU.EX2"] == copies * (n // 2 * (8 - sw) // 8 + 2)   # + 2 corrections
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in result.sass     # S waited with PV in flight
    assert s.dynamic_smem == stages.PRODUCTION_VARIANTS[(d, False)].smem_bytes


@pytest.mark.parametrize("d,masked", sorted(stages.PRODUCTION_VARIANTS))
def test_the_launch_grid_never_exceeds_the_kernels_tile_count(d, masked):
    """The kernel starts every CTA on tile %ctaid.x without checking it against its tile count
    (production/forward.ptx, the consumer and producer tile loops): a CTA past the last tile would load,
    compute and store a (batch, head) that does not exist (its lse rows are checked against
    seq_q only). So the launcher's grid must stay within the PTX's own count,
    ceil(seq_q / BLOCK_M) * heads * batch, BLOCK_M from this build's row (192 at D = 64), for
    any SM count and any PTXATTN_PERSISTENT_CTAS cap."""
    block_m = num(build_defines(d), "BLOCK_M")
    build = stages.PRODUCTION.specialize(d, masked)
    assert build.persistent and build.block_m == block_m
    for seq_q in (1, 63, 64, 127, 128, 129, 191, 192, 193, 255, 256, 383, 384, 385, 1000, 8191):
        for batch, heads in ((1, 1), (1, 2), (2, 3), (4, 32)):
            tiles = -(-seq_q // block_m) * heads * batch
            for sms in (1, 2, 7, 132, 10**6):
                grid = build.grid(batch, heads, seq_q, sms)
                assert grid[1:] == (1, 1) and 1 <= grid[0] <= min(sms, tiles), (
                    d, masked, seq_q, batch, heads, sms, grid, tiles)
                assert grid[0] == min(sms, tiles)


# ---- the bf16 measurement variants (builds.BF16_VARIANTS: d256n80, -D BF16_BLOCK_N=80)

from ptxattn import builds  # noqa: E402

BF16_VARIANTS = sorted(builds.BF16_VARIANTS)


def variant_defines(name: str) -> dict[str, str]:
    """The #defines of a variant's row (`#if HEAD_DIM == d && defined(BF16_BLOCK_N) ...`)."""
    b = builds.BF16_VARIANTS[name]
    m = re.search(rf"^#(?:el)?if HEAD_DIM == {b.head_dim} && defined\(BF16_BLOCK_N\) && "
                  rf"BF16_BLOCK_N == {b.block_n}\n(.*?)^#(?:elif|else)\b", LAYOUT, re.M | re.S)
    assert m, f"layout.ptxh has no row for the bf16 variant {name}"
    return row_defines(m.group(1))


@pytest.mark.parametrize("name", BF16_VARIANTS)
def test_bf16_variant_row_and_v_descriptor(name):
    """The variant's row: its tile, the macros of its (N, D), and V's MN-major descriptor with
    LBO = BLOCK_N rows * 128 B to the next 64 columns of D (80 rows: 10240, a multiple of the
    1024-byte swizzle atom, SBO 1024 for the next 8 key rows); K's k-steps jump the same
    BLOCK_N rows * 128 B (in 16-byte units, less the 3 steps of 32 bytes taken)."""
    b = builds.BF16_VARIANTS[name]
    f = variant_defines(name)
    n, d = b.block_n, b.head_dim
    assert num(f, "BLOCK_N") == n and "BLOCK_N_SHIFT" not in f and num(f, "KV_STAGES") == 2
    assert (num(f, "S_REGS"), num(f, "P_REGS"), num(f, "O_REGS")) == (n // 2, n // 4, d // 2)
    assert f["QK_TILE"] == f"QK_N{n}_D{d}(DQ, DK)" and f["PV_TILE"] == f"PV_N{n}_D{d}(DV)"
    fields = desc_fields(f["DESC_V_BITS"])
    assert fields == {"lbo": n * 128, "sbo": 1024, "swizzle": 1}
    assert num(f, "KV_TILE_BYTES") == n * d * 2 and num(f, "SMEM_V") % 1024 == 0
    assert b.smem_bytes == 230528 <= MAX_DYNAMIC_SMEM and num(f, "O_STAGED_IN_Q") == 1
    gen = (stages.ptx_root() / "sm90" / "include" / f"gen_n{n}.ptxh").read_text()
    assert f"add.s64 DK, DK, {n * 128 // 16 - 3 * 2};" in gen.split(f"QK_N{n}_D{d}(")[1]
    assert f"S_ACC_N{n} \\" in gen                       # (fragments.ptxh names 64 and 128 only)


@pytest.mark.parametrize("name", BF16_VARIANTS)
def test_bf16_variant_stage_takes_its_tile(name):
    """api.prepare's defines select the variant's tile for the launcher (grid, boxes, walk);
    a masked build is refused (the masked walk shifts), other stages and defines are kept."""
    b = builds.BF16_VARIANTS[name]
    st = stages.PRODUCTION.specialize(b.head_dim).with_defines(builds.bf16_variant_defines(name))
    assert (st.block_m, st.block_n, st.threads, st.smem_bytes) == (
        b.block_m, b.block_n, b.threads, b.smem_bytes)
    assert dict(st.defines) == {"HEAD_DIM": str(b.head_dim)}       # the variant's go with the call
    plain = stages.PRODUCTION.specialize(b.head_dim)
    assert plain.with_defines({"SW_EXP2_PER_8": "1"}) is plain and plain.with_defines(None) is plain
    with pytest.raises(ValueError, match="dense only"):
        stages.PRODUCTION.specialize(b.head_dim, True).with_defines(b.defines)
    with pytest.raises(ValueError, match="no bf16 variant"):
        stages.PRODUCTION.specialize(128).with_defines(b.defines)


def test_bf16_variant_masked_or_unknown_builds_do_not_assemble():
    """The PTX refuses what the host refuses: a masked build of a non-power-of-two BLOCK_N, and
    a BF16_BLOCK_N no variant has."""
    st = stages.PRODUCTION.specialize(256)
    for defines, why in (({"BF16_BLOCK_N": "80", "PTXATTN_MASKED": "1"}, "dense kernel"),
                         ({"BF16_BLOCK_N": "96"}, "names no variant")):
        with pytest.raises(Exception, match=why):
            ptx.source(st, {**dict(st.defines), **defines})


@requires_ptxas
@pytest.mark.parametrize("name", BF16_VARIANTS)
def test_bf16_variant_assembles_without_spills(name):
    """As test_build_assembles_without_spills_and_with_its_instruction_counts for the variant's
    tile: no spills, HGMMA 3 x (D/16 + BLOCK_N/16), MUFU.EX2 3 x (BLOCK_N/2 + 2), its smem."""
    b = builds.BF16_VARIANTS[name]
    defines = {"HEAD_DIM": str(b.head_dim), **b.defines}
    result = sass.inspect_stage(stages.PRODUCTION, defines=defines)
    s = result.summary
    assert s.spill_bytes == 0 and s.stack_frame == 0, (s.spill_bytes, s.stack_frame)
    assert not sass.grep(result.sass, "LDL") and not sass.grep(result.sass, "STL")
    assert not [w for w in s.warnings if "setmaxnreg" in w or "wgmma" in w], s.warnings
    assert s.classes["HGMMA"] == 3 * (b.head_dim // 16 + b.block_n // 16)
    assert s.classes["MUFU.EX2"] == 3 * (b.block_n // 2 + 2)
    assert s.dynamic_smem == b.smem_bytes

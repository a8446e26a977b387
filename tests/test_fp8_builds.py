"""The FP8 forward's builds (CPU only): the build table in forward_fp8.ptx agrees with
fp8_forward.BUILDS and with itself (shared-memory carve-up, tile bytes, descriptors), the
generated header is the generator's output and packs P as the fragment model says, the maps
move the bytes the barriers expect, and every build assembles without spills with QGMMA (and
no HGMMA) in the counts its tiles imply.
"""

from __future__ import annotations

import re

import pytest

from ptxattn import fp8_forward
from ptxattn.tools import ptxgen_fp8, sass
from ptxattn import fp8_reference as model
from ptxattn.stages import ptx_root

SOURCE = (ptx_root() / fp8_forward.FORWARD_FILE).read_text()
MAX_DYNAMIC_SMEM = 227 * 1024


def build_defines(head_dim: int) -> dict[str, str]:
    m = re.search(rf"^#(?:el)?if HEAD_DIM == {head_dim}\n(.*?)^#(?:elif|else)\b", SOURCE,
                  re.M | re.S)
    assert m, f"forward_fp8.ptx has no build table row for HEAD_DIM {head_dim}"
    out = {}
    for line in m.group(1).splitlines():
        d = re.match(r"#define (\w+(?:\([^)]*\))?)\s+(.*?)\s*(?://.*)?$", line)
        if d:
            out[d.group(1).split("(")[0]] = d.group(2)
    return out


def num(defs, name):
    return int(defs[name], 0)


def test_committed_header_equals_the_generator_output():
    assert ptxgen_fp8.stale() == [], "run `python -m ptxattn.tools.ptxgen_fp8` and commit the header"


@pytest.mark.parametrize("d", sorted(fp8_forward.BUILDS))
def test_build_table_row_is_consistent(d):
    defs, build = build_defines(d), fp8_forward.BUILDS[d]
    consumers, n = num(defs, "CONSUMERS"), num(defs, "BLOCK_N")
    assert (num(defs, "BLOCK_M"), n) == (build.block_m, build.block_n) == (64 * consumers, n)
    assert build.threads == 128 * (consumers + 1)
    assert 1 << num(defs, "BLOCK_N_SHIFT") == n
    assert num(defs, "Q_TILE_BYTES") == 64 * d                   # e4m3: a byte an element
    assert num(defs, "O_TILE_BYTES") == 64 * d * 2               # bf16 O staging
    assert num(defs, "KV_TILE_BYTES") == n * d                   # K and V^T alike
    assert num(defs, "KV_SLOT_DESC") == num(defs, "KV_TILE_BYTES") >> 4
    stages_ = num(defs, "KV_STAGES")
    assert 1 << num(defs, "KV_STAGE_SHIFT") == stages_
    # the carve-up: Q's two buffers, K ring, V ring, O staging, barriers, no overlap
    q_end = 2 * consumers * num(defs, "Q_TILE_BYTES")
    assert num(defs, "SMEM_Q") == 0 and num(defs, "SMEM_K") >= q_end
    assert num(defs, "SMEM_V") >= num(defs, "SMEM_K") + stages_ * num(defs, "KV_TILE_BYTES")
    assert num(defs, "SMEM_O") >= num(defs, "SMEM_V") + stages_ * num(defs, "KV_TILE_BYTES")
    assert num(defs, "SMEM_BAR_Q") >= num(defs, "SMEM_O") + consumers * num(defs, "O_TILE_BYTES")
    assert num(defs, "SMEM_BAR_Q") == build.barriers_at
    # swizzle atoms: 1024-byte alignment for 128B tiles, 512 for 64B
    for name in ("SMEM_K", "SMEM_V", "SMEM_O"):
        assert num(defs, name) % 1024 == 0, name
    assert build.smem_bytes <= MAX_DYNAMIC_SMEM
    # registers: S n / 2, P n / 8 quadruples, O d / 2
    assert (num(defs, "S_REGS"), num(defs, "P_REGS"), num(defs, "O_REGS")) == (n // 2, n // 8, d // 2)
    # descriptors: Q/K by their row bytes, V^T by its keys' bytes
    qk = "DESC_KMAJOR_SW64" if d == 64 else "DESC_KMAJOR_SW128"
    v = "DESC_KMAJOR_SW64" if n == 64 else "DESC_KMAJOR_SW128"
    assert (defs["DESC_QK_BITS"], defs["DESC_V_BITS"]) == (qk, v)
    assert fp8_forward.qk_swizzle(d)[1] == ptxgen_fp8.swizzle_row_bytes(d)


def test_the_sw64_descriptor_is_what_it_says():
    m = re.search(r"#define DESC_KMAJOR_SW64 (0x[0-9a-fA-F]+)", SOURCE)
    value = int(m.group(1), 16)
    assert value >> 62 == 2                                # 64-byte swizzle
    assert ((value >> 32) & 0x3FFF) << 4 == 512            # SBO: 8 rows of 64 bytes
    assert ((value >> 16) & 0x3FFF) << 4 == 16             # LBO (unused, K-major swizzled)


@pytest.mark.parametrize("n", ptxgen_fp8.BLOCK_NS)
def test_pack_p_puts_each_score_where_the_fragment_model_says(n):
    text = ptxgen_fp8.header()
    body = re.search(rf"#define PACK_P_FP8_N{n} \\\n((?:.*\\\n)*.*\n)", text).group(1)
    cvts = re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32 %ph_(lo|hi), %s(\d+), %s(\d+);", body)
    movs = re.findall(r"mov\.b32 %p(\d+), \{%ph_lo, %ph_hi\};", body)
    assert len(movs) == n // 8 and len(cvts) == n // 4
    for j, reg in enumerate(movs):
        (_, hi1, lo1), (_, hi2, lo2) = cvts[2 * j], cvts[2 * j + 1]
        got = [int(lo1), int(hi1), int(lo2), int(hi2)]          # bytes 0..3, low first
        t, r = divmod(int(reg), 4)
        assert got == [int(x) for x in model.p_source_register(t, range(4 * r, 4 * r + 4))]


def test_the_maps_move_the_bytes_the_barriers_expect():
    for d, build in fp8_forward.BUILDS.items():
        defs = build_defines(d)
        _, chunk = fp8_forward.qk_swizzle(d)
        assert chunk * 64 * (d // chunk) == num(defs, "Q_TILE_BYTES")
        assert chunk * build.block_n * (d // chunk) == num(defs, "KV_TILE_BYTES")
        assert build.block_n * d == num(defs, "KV_TILE_BYTES")        # the V^T box
        assert model.V_BLOCK % build.block_n == 0                      # whole boxes of V^T


requires_ptxas = pytest.mark.skipif(sass.locate("ptxas") is None,
                                    reason="no ptxas anywhere (pip install 'ptxattn[tools]')")


@requires_ptxas
@pytest.mark.parametrize("d", sorted(fp8_forward.BUILDS))
@pytest.mark.parametrize("masked", [False, True])
def test_build_assembles_without_spills_with_qgmma_only(d, masked):
    """0 spills, setmaxnreg kept, QGMMA (e4m3) in the counts the tiles imply and no HGMMA:
    QK^T D / 32 k-steps and PV BLOCK_N / 32, each three times (prologue, the plain and masked
    steps; PV: two steps and the last tile); e4m3 packs BLOCK_N / 4 per PACK_P, three copies."""
    build = fp8_forward.BUILDS[d]
    built = sass.assemble_ptx(fp8_forward.forward_source(d, masked), "sm_90a",
                              name=f"forward_fp8_d{d}{'_masked' if masked else ''}")
    text = sass.disassemble(built.cubin)
    s = sass.summarize(text, built.log, function=fp8_forward.ENTRY)
    assert s.spill_bytes == 0 and s.stack_frame == 0, (s.spill_bytes, s.stack_frame)
    assert not [w for w in s.warnings if "setmaxnreg" in w or "wgmma" in w], s.warnings
    qgmma = sum(c for op, c in s.opcodes.items() if op.startswith("QGMMA"))
    assert qgmma == 3 * (d // 32 + build.block_n // 32), s.opcodes
    assert not any(op.startswith("HGMMA") for op in s.opcodes)
    e4m3 = sum(c for op, c in s.opcodes.items() if op.startswith("F2FP.SATFINITE.E4M3"))
    assert e4m3 == 3 * build.block_n // 4
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in text            # S waited with PV in flight

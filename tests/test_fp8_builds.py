"""The FP8 builds of the production kernel (CPU only): forward.ptx with -D PTXATTN_FP8 and the
FP8 rows of the build table (ptxattn/builds.py, FP8_BUILDS). The rows' figures as the
preprocessor reads them from the generated layout header, their carve-up, tile bytes and
descriptors; no copy of the bf16 kernel (the FP8 build is the same composing file and parts,
with the descales as their one FP8-only include); the generated k-steps and P packing against
the fragment model; the FP8 parameter list against the launcher's table; the maps against the
barriers' bytes; and every build assembling without spills with QGMMA (and no HGMMA) in the
counts its tiles imply.
"""

from __future__ import annotations

import re

import pytest

from ptxattn import builds, fp8_forward, ptx, stages
from ptxattn import fp8_reference as model
from ptxattn.tools import ptxgen_fp8, ptxgen_layout, sass
from test_production_builds import row_defines

PRODUCTION_DIR = stages.ptx_root() / "sm90" / "production"
SHARED_INCLUDE = stages.ptx_root() / "sm90" / "include"
LAYOUT = (PRODUCTION_DIR / "layout.ptxh").read_text()
DESC_HEADER = (SHARED_INCLUDE / "wgmma_desc.ptxh").read_text()
FP8_SECTION = LAYOUT.split("// ==== the FP8 builds", 1)[1]
MAX_DYNAMIC_SMEM = 227 * 1024
HEAD_DIMS = builds.FP8_HEAD_DIMS


def build_defines(head_dim: int) -> dict[str, str]:
    """The #defines of one FP8 row of the generated header (its `#if HEAD_DIM == d` block in
    the PTXATTN_FP8 section), value text with any trailing comment removed."""
    m = re.search(rf"^#(?:el)?if HEAD_DIM == {head_dim}\n(.*?)^#(?:elif|else)\b", FP8_SECTION,
                  re.M | re.S)
    assert m, f"layout.ptxh has no FP8 row for HEAD_DIM {head_dim}"
    return row_defines(m.group(1))


def num(defs, name):
    return int(defs[name], 0)


def test_committed_headers_equal_the_generators_output():
    assert ptxgen_fp8.stale() == [], "run `python -m ptxattn.tools.ptxgen_fp8` and commit the header"
    assert ptxgen_layout.stale() == [], "run `python -m ptxattn.tools.ptxgen_layout`"


def test_the_fp8_rows_are_the_launchers_and_the_generators():
    assert HEAD_DIMS == fp8_forward.HEAD_DIMS == (64, 128, 256)
    assert all(b.fp8 and b.precision == "fp8" for b in builds.FP8_BUILDS)
    assert ptxgen_fp8.shapes() == sorted({(b.block_n, b.head_dim) for b in builds.FP8_BUILDS
                                          + tuple(builds.FP8_VARIANTS.values())})
    in_header = sorted(int(d) for d in re.findall(r"^#(?:el)?if HEAD_DIM == (\d+)$",
                                                  FP8_SECTION, re.M))
    assert in_header == list(HEAD_DIMS)
    with pytest.raises(ValueError, match="FP8 build is built for 64, 128, 256"):
        fp8_forward.build_of(96)


def _probe(tmp_path, names, defines):
    probe = tmp_path / "probe.ptx"
    probe.write_text('#include "layout.ptxh"\n' + "".join(f"@key_{n}= {n} ;\n" for n in names))
    text = ptx.expand_file(probe, [PRODUCTION_DIR, SHARED_INCLUDE], defines).text
    return dict(re.findall(r"^@key_(\w+)= (.*?) ;$", text, re.M))


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_the_preprocessor_reads_each_fp8_rows_figures(tmp_path, d):
    b = builds.get(d, "fp8")
    want = ptxgen_layout.numbers(b)
    got = _probe(tmp_path, sorted(want), {"HEAD_DIM": str(d), "PTXATTN_FP8": "1"})
    assert {k: int(v) for k, v in got.items()} == want
    # and the bf16 row of the same head dim without the switch (they differ: e4m3 tiles)
    bf16 = _probe(tmp_path, ["Q_TILE_BYTES"], {"HEAD_DIM": str(d)})
    assert int(bf16["Q_TILE_BYTES"]) == 2 * want["Q_TILE_BYTES"]
    with pytest.raises(Exception, match="FP8: HEAD_DIM must be 64, 128 or 256"):
        _probe(tmp_path, ["CONSUMERS"], {"HEAD_DIM": "96", "PTXATTN_FP8": "1"})


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_fp8_row_is_consistent(d):
    defs, build = build_defines(d), builds.get(d, "fp8")
    consumers, n = num(defs, "CONSUMERS"), num(defs, "BLOCK_N")
    assert (num(defs, "BLOCK_M"), n) == (build.block_m, build.block_n) == (64 * consumers, n)
    assert build.threads == 128 * (consumers + 1)
    assert 1 << num(defs, "BLOCK_N_SHIFT") == n
    assert num(defs, "Q_TILE_BYTES") == 64 * d                   # e4m3: a byte an element
    assert num(defs, "O_TILE_BYTES") == 64 * d * 2               # bf16 O staging
    assert num(defs, "KV_TILE_BYTES") == n * d == num(defs, "KV_TX_BYTES")   # K and V^T alike
    assert num(defs, "KV_SLOT_DESC") == num(defs, "KV_TILE_BYTES") >> 4
    stages_ = num(defs, "KV_STAGES")
    assert 1 << num(defs, "KV_STAGE_SHIFT") == stages_
    # the carve-up: Q's buffers (two; one at D = 256, whose 128-key ring takes the room), K
    # ring, V^T ring, O staging, barriers, no overlap
    q_buffers = num(defs, "Q_BUFFERS")
    assert q_buffers == (1 if d == 256 else 2) == build.q_buffers
    assert num(defs, "O_STAGED_IN_Q") == 0
    q_end = q_buffers * consumers * num(defs, "Q_TILE_BYTES")
    assert num(defs, "SMEM_Q") == 0 and num(defs, "SMEM_K") == q_end
    assert num(defs, "SMEM_V") == num(defs, "SMEM_K") + stages_ * num(defs, "KV_TILE_BYTES")
    assert num(defs, "SMEM_O") == num(defs, "SMEM_V") + stages_ * num(defs, "KV_TILE_BYTES")
    assert num(defs, "SMEM_BAR_Q") == num(defs, "SMEM_O") + consumers * num(defs, "O_TILE_BYTES")
    for name in ("SMEM_K", "SMEM_V", "SMEM_O"):
        assert num(defs, name) % 1024 == 0, name
    assert build.smem_bytes == num(defs, "SMEM_BAR_Q") + 128 + 1024 <= MAX_DYNAMIC_SMEM
    # registers: S n / 2, P n / 8 quadruples, O d / 2
    assert (num(defs, "S_REGS"), num(defs, "P_REGS"), num(defs, "O_REGS")) == (n // 2, n // 8, d // 2)
    # descriptors: Q/K by their row bytes, V^T by its keys' bytes; the FP8 macros of (n, d)
    qk = "DESC_KMAJOR_SW64" if d == 64 else "DESC_KMAJOR_SW128"
    v = "DESC_KMAJOR_SW64" if n == 64 else "DESC_KMAJOR_SW128"
    assert (defs["DESC_QK_BITS"], defs["DESC_V_BITS"]) == (qk, v)
    assert defs["QK_TILE"] == f"QK_FP8_N{n}_D{d}(DQ, DK)" and defs["PV_TILE"] == f"PV_FP8_N{n}_D{d}(DV)"
    assert defs["PACK_P"] == f"PACK_P_FP8_N{n}" and defs["SCALE_V"] == f"SCALE_V_D{d}"
    assert fp8_forward.qk_swizzle(d)[1] == build.qk_row_bytes


def test_the_descriptors_are_what_they_say():
    def fields(name):
        value = int(re.search(rf"#define {name}\s+(0x[0-9a-fA-F]+)", DESC_HEADER).group(1), 16)
        return value >> 62, ((value >> 32) & 0x3FFF) << 4, ((value >> 16) & 0x3FFF) << 4
    assert fields("DESC_KMAJOR_SW64") == (2, 512, 16)      # 64B swizzle, SBO 8 rows of 64 B
    assert fields("DESC_KMAJOR_SW128") == (1, 1024, 16)    # 128B swizzle, SBO 8 rows of 128 B


# ---- no copy of the bf16 kernel ---------------------------------------------------------------

def test_the_fp8_build_is_the_production_kernel_composed_with_a_switch():
    """One composing file for both precisions; the only FP8 source of its own in the
    production folder is descales.ptxh (and the quantizer, another kernel); the bf16 and FP8
    expansions share the scheduler, masks, producer and barriers statement for statement
    (everything that is not an operand's size, a GEMM, the softmax or the descales)."""
    files = {p.name for p in ptx.source_files(stages.PRODUCTION) if p.parent == PRODUCTION_DIR}
    assert "descales.ptxh" in files
    own = sorted(p.name for p in PRODUCTION_DIR.iterdir() if "fp8" in p.name)
    assert own == ["quantize_fp8.ptx"], own
    text = {p.name: p.read_text() for p in PRODUCTION_DIR.iterdir() if p.suffix == ".ptx"}
    assert [n for n, t in text.items() if ".entry FORWARD_ENTRY" in t or "ptxattn_fwd_fp8" in t] \
        == ["forward.ptx"]
    fp8 = fp8_forward.forward_source(128, True)
    bf16 = ptx.source(stages.PRODUCTION.specialize(128, masked=True))
    for label in ("produce_loop", "kv_masked_run", "kv_back_run", "wait_q_empty", "tile_end"):
        assert f"{label}:" in fp8 and f"{label}:" in bf16, label
    assert ".entry ptxattn_fwd_fp8(" in fp8 and ".entry ptxattn_fwd(" in bf16


_ENTRY = re.compile(r"\.entry\s+ptxattn_fwd_fp8\s*\((.*?)\)", re.S)


@pytest.mark.parametrize("masked", [False, True])
def test_the_fp8_parameter_list_is_the_launchers_table(masked):
    body = _ENTRY.search(fp8_forward.forward_source(128, masked)).group(1)
    declared = []
    for piece in body.split(","):
        m = re.match(r"^\.param\s+(.+?)\s+(\w+)\s*(\[\d+\])?$", " ".join(piece.split()))
        assert m, piece
        declared.append((m.group(2), " ".join(m.group(1).split()) + (m.group(3) or "")))
    assert declared == [(p.name, p.ptx) for p in fp8_forward.PARAMS]


# ---- the generated k-steps and P ---------------------------------------------------------------

@pytest.mark.parametrize("n", ptxgen_fp8.block_ns())
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


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_the_qk_steps_walk_the_swizzled_rows(d):
    """QK_FP8: D / 32 k-steps, 2 descriptor units (32 bytes) apart within a swizzled row, and a
    jump to the next 128-byte block of D (rows * 128 bytes on) where a row has two."""
    b = builds.get(d, "fp8")
    body = re.search(rf"#define QK_FP8_N{b.block_n}_D{d}\(DQ, DK\) \\\n((?:.*\\\n)*.*\n)",
                     ptxgen_fp8.header()).group(1)
    assert body.count("wgmma.mma_async.sync.aligned") == d // 32
    steps = [int(x) for x in re.findall(r"add\.s64 DQ, DQ, (\d+);", body)]
    k_steps = [int(x) for x in re.findall(r"add\.s64 DK, DK, (\d+);", body)]
    per_row = b.qk_row_bytes // 32
    for i, (sq, sk) in enumerate(zip(steps, k_steps), start=1):
        if i % per_row:
            assert sq == sk == 2
        else:   # the next block: back over the row's steps, then rows * row bytes on
            assert sq == 64 * b.qk_row_bytes // 16 - 2 * (per_row - 1)
            assert sk == b.block_n * b.qk_row_bytes // 16 - 2 * (per_row - 1)


def test_the_maps_move_the_bytes_the_barriers_expect():
    for d in HEAD_DIMS:
        defs, build = build_defines(d), builds.get(d, "fp8")
        _, chunk = fp8_forward.qk_swizzle(d)
        assert chunk * 64 * (d // chunk) == num(defs, "Q_TILE_BYTES")
        assert chunk * build.block_n * (d // chunk) == num(defs, "KV_TILE_BYTES")
        assert build.block_n * d == num(defs, "KV_TILE_BYTES")        # the V^T box
        assert model.V_BLOCK % build.block_n == 0                      # whole boxes of V^T
        assert eval(defs["Q_TX_BYTES"]) == build.consumers * num(defs, "Q_TILE_BYTES")


requires_ptxas = pytest.mark.skipif(sass.locate("ptxas") is None,
                                    reason="no ptxas anywhere (pip install 'ptxattn[tools]')")


@requires_ptxas
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("masked", [False, True])
def test_build_assembles_without_spills_with_qgmma_only(d, masked):
    """0 spills, setmaxnreg kept, QGMMA (e4m3) in the counts the tiles imply and no HGMMA:
    QK^T D / 32 k-steps and PV BLOCK_N / 32, each three times (prologue, the plain and masked
    steps; PV: two steps and the last tile); e4m3 packs BLOCK_N / 4 per PACK_P, three copies."""
    build = builds.get(d, "fp8")
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


def test_fp8_and_varlen_are_not_one_build():
    """Both builds come from forward.ptx; asking for both at once is a preprocessing error that
    names them, not a kernel with one's parameters and the other's addressing."""
    from ptxattn.errors import PtxattnError
    with pytest.raises(PtxattnError, match="PTXATTN_VARLEN and PTXATTN_FP8"):
        ptx.source(stages.PRODUCTION, {"PTXATTN_FP8": "1", "PTXATTN_VARLEN": "1"})
    for one in ({"PTXATTN_FP8": "1"}, {"PTXATTN_VARLEN": "1"}):
        assert ".entry" in ptx.source(stages.PRODUCTION, one)


def test_the_fp8_variants():
    """The measurement variants (builds.FP8_VARIANTS): wider key tiles at D = 128, V^T in
    row blocks of a swizzle width, selected only by their defines; the table's rows keep their
    V^T layout (one block)."""
    n192, n224 = builds.FP8_VARIANTS["n192"], builds.FP8_VARIANTS["n224"]
    assert (n192.block_n, n192.vt_row_bytes, n192.vt_chunks, n192.desc_v_bits) == \
        (192, 64, 3, "DESC_KMAJOR_SW64")
    assert (n224.block_n, n224.vt_row_bytes, n224.vt_chunks, n224.desc_v_bits) == \
        (224, 32, 7, "DESC_KMAJOR_SW32")
    assert all(b.vt_chunks == 1 and not b.variant for b in builds.FP8_BUILDS)
    assert [b.vt_row_bytes for b in builds.FP8_BUILDS] == [128, 128, 128]
    for b in (n192, n224):
        assert b.block_n_shift is None and b.smem_bytes <= builds.MAX_DYNAMIC_SMEM
        assert b.kv_tile_bytes == b.vt_chunks * b.vt_row_bytes * b.head_dim
        assert fp8_forward.build_of(128, b.defines) is b
        assert fp8_forward.variant_defines(b.variant) == {"FP8_BLOCK_N": str(b.block_n)}
    assert fp8_forward.build_of(128) is builds.FP8_BY_HEAD_DIM[128]
    assert fp8_forward.variant_defines("default") == {}
    # S + P + O: 184 of 240 at 192 (fits the table's estimate), 204 at 224 (ptxas decides)
    assert n192.s_regs + n192.p_regs + n192.o_regs == 184
    assert n224.s_regs + n224.p_regs + n224.o_regs == 204 and n224.registers_by_ptxas
    s3, d256 = builds.FP8_VARIANTS["n192s3"], builds.FP8_VARIANTS["d256n64"]
    assert s3.kv_stage_shift is None and s3.defines == {"FP8_BLOCK_N": "192",
                                                        "FP8_KV_STAGES": "3"}
    assert s3.smem_bytes <= builds.MAX_DYNAMIC_SMEM < 3 * 2 * n224.kv_tile_bytes + 65536
    assert d256.block_n_shift == 6 and d256.q_buffers == 2 and d256.defines == {
        "FP8_BLOCK_N": "64"}
    # the D = 256 row (session 12: FlashAttention-3's 128 x 128 tile) fits with one Q buffer
    row = builds.FP8_BY_HEAD_DIM[256]
    assert row.block_n == 128 and row.q_buffers == 1 and not row.o_staged_in_q
    assert row.registers_by_ptxas and row.smem_bytes <= builds.MAX_DYNAMIC_SMEM
    assert row.smem_bytes + row.q_buffer_bytes > builds.MAX_DYNAMIC_SMEM
    for b in (s3, d256):
        assert fp8_forward.build_of(b.head_dim, b.defines) is b
    with pytest.raises(ValueError, match="no FP8 variant"):
        fp8_forward.build_of(128, {"FP8_BLOCK_N": "224", "FP8_KV_STAGES": "3"})


def test_the_fp8_variants_select_their_layout_and_refuse_the_rest():
    from ptxattn.tools import ptxgen_layout
    text = fp8_forward.forward_source(128, False, {"FP8_BLOCK_N": "224"})
    assert "m64n224k32" in text and "div.u32 %kv_tiles, %kv_tiles, 224;" in text
    default = fp8_forward.forward_source(128, False)
    assert "m64n128k32" in default and "m64n224k32" not in default
    assert "shr.u32 %kv_tiles, %kv_tiles, 7;" in default
    for bad in ({"FP8_BLOCK_N": "160"}, {"FP8_BLOCK_N": "192", "PTXATTN_MASKED": "1"}):
        with pytest.raises(Exception, match="FP8_BLOCK_N|dense"):
            fp8_forward.forward_source(128, "PTXATTN_MASKED" in bad, bad)
    assert "VT_CHUNKS 7" in ptxgen_layout.header()


def test_the_three_consumer_fp8_variant():
    """m3n96: three consumers (192-row tiles) at D = 128, selected by FP8_CONSUMERS=3 beside
    its FP8_BLOCK_N; 96-key tiles (a consumer's 160 registers: 128 keys spilled), V^T in three
    32-byte row blocks; the expanded PTX has the third consumer's Q box and a 512-thread CTA,
    and FP8_CONSUMERS with a block width no variant has is refused."""
    m3 = builds.FP8_VARIANTS["m3n96"]
    assert (m3.consumers, m3.block_m, m3.block_n, m3.threads, m3.consumer_regs) == \
        (3, 192, 96, 512, 160)
    assert (m3.vt_row_bytes, m3.vt_chunks, m3.desc_v_bits) == (32, 3, "DESC_KMAJOR_SW32")
    assert m3.defines == {"FP8_BLOCK_N": "96", "FP8_CONSUMERS": "3"}
    assert fp8_forward.variant_defines("m3n96") == m3.defines
    assert fp8_forward.build_of(128, m3.defines) is m3
    # Q 2 x 24 KiB, ring 2 x (12 + 12) KiB, O 3 x 16 KiB
    assert m3.smem["SMEM_K"] == 2 * 3 * 8192 and m3.smem_bytes <= builds.MAX_DYNAMIC_SMEM
    assert m3.s_regs + m3.p_regs + m3.o_regs == 124 and m3.registers_by_ptxas
    # the other variants keep their defines (no FP8_CONSUMERS: their consumers are the row's)
    assert all("FP8_CONSUMERS" not in b.defines for k, b in builds.FP8_VARIANTS.items()
               if k != "m3n96")
    text = fp8_forward.forward_source(128, False, m3.defines)
    assert ".maxntid 512, 1, 1" in text and "add.u32 %q_row2, %q_row, 128;" in text
    assert "setmaxnreg.inc.sync.aligned.u32 160;" in text and "m64n96k32" in text
    for bad in ({"FP8_BLOCK_N": "128", "FP8_CONSUMERS": "3"}, {"FP8_CONSUMERS": "3"}):
        with pytest.raises(ValueError, match="no FP8 variant"):
            fp8_forward.build_of(128, bad)
        with pytest.raises(Exception, match="names no variant"):
            fp8_forward.forward_source(128, False, bad)
    with pytest.raises(Exception, match="dense"):
        fp8_forward.forward_source(128, True, m3.defines)

"""The generated fragment headers (ptxattn/tools/ptxgen.py): committed = generated, and what they
generate is the fragment layout of fragments.ptxh (CPU only)."""

import os
import re
import shutil
import subprocess
import textwrap

import pytest

from ptxattn import ptx
from ptxattn.tools import ptxgen


def test_committed_headers_equal_the_generator_output():
    assert ptxgen.stale() == [], "run `python -m ptxattn.tools.ptxgen` and commit the headers"


def test_a_hand_edit_of_a_header_is_caught(tmp_path):
    for name, text in ptxgen.headers().items():
        (tmp_path / name).write_text(text)
    assert ptxgen.stale(tmp_path) == []
    name = "gen_n128.ptxh"
    (tmp_path / name).write_text((tmp_path / name).read_text().replace("%s63", "%s62", 1))
    assert ptxgen.stale(tmp_path) == [name]


def test_every_shape_has_its_headers_and_macros():
    h = ptxgen.headers()
    for n in ptxgen.BLOCK_NS:
        for macro in ("ROW_MAX_LO", "ROW_MAX_HI", "ROW_SUM_ADD_LO", "ROW_SUM_ADD_HI", "SCALE_EXP2",
                      "PACK_P", "MASK_COLS"):
            assert f"#define {macro}_N{n}" in h[f"gen_n{n}.ptxh"]
        for d in ptxgen.HEAD_DIMS:
            for macro in ("QK", "PV", "PV_REWIND"):
                assert f"#define {macro}_N{n}_D{d}(" in h[f"gen_n{n}.ptxh"]
    for d in ptxgen.HEAD_DIMS:
        for macro in ("O_ACC", "ZERO_O", "SCALE_O", "STMATRIX_O"):
            assert f"#define {macro}_D{d}" in h[f"gen_d{d}.ptxh"]


def _body(text, name):
    """The statements of one #define, continuation lines joined."""
    m = re.search(rf"#define {name}\b[^\n]*\\\n((?:[^\n]*\\\n)*[^\n]*)", text)
    return [s.strip() for s in m.group(1).replace("\\\n", " ").split(";") if s.strip()]


@pytest.mark.parametrize("n", ptxgen.BLOCK_NS)
def test_rows_and_columns_follow_the_accumulator_layout(n):
    text = ptxgen.headers()[f"gen_n{n}.ptxh"]
    lo = {int(r) for r in re.findall(r"%s(\d+)", " ".join(_body(text, f"ROW_MAX_LO_N{n}")))}
    hi = {int(r) for r in re.findall(r"%s(\d+)", " ".join(_body(text, f"ROW_MAX_HI_N{n}")))}
    assert lo | hi == set(range(n // 2)) and not lo & hi
    assert all(i % 4 in (0, 1) for i in lo)             # values 0,1 of each group of 4: first row
    mask = _body(text, f"MASK_COLS_N{n}")
    assert len(mask) == n                                # setp + selp per score
    cols = [int(re.match(r"setp\.ge\.s32 %p_mask, (\d+), LIMIT", s).group(1)) for s in mask[::2]]
    # each column appears twice (lo and hi row) and they cover 8 chunks x {0, 1}
    assert sorted(cols) == sorted(2 * [8 * c + j for c in range(n // 8) for j in (0, 1)])
    assert mask[1] == "selp.f32 %s0, 0fFF800000, %s0, %p_mask"


def test_descriptor_steps_match_the_tile_geometry():
    text = ptxgen.headers()["gen_n128.ptxh"]
    qk = _body(text, "QK_N128_D128")
    assert sum("wgmma" in s for s in qk) == 8
    assert "add.s64 DQ, DQ, 506" in qk and "add.s64 DK, DK, 1018" in qk   # 8 / 16 KiB on, >> 4
    assert _body(text, "QK_REWIND_N128_D128") == ["sub.s64 DQ, DQ, 518", "sub.s64 DK, DK, 1030"]
    assert sum("wgmma" in s for s in _body(text, "QK_N128_D256")) == 16
    assert sum("wgmma" in s for s in _body(ptxgen.headers()["gen_n64.ptxh"], "QK_N64_D64")) == 4
    assert _body(text, "PV_REWIND_N128_D128") == ["sub.s64 DV, DV, 896"]


KERNEL = textwrap.dedent("""\
    .version 8.4
    .target sm_90a
    .address_size 64
    #define SW_EXP2_PER_8 3
    #include "exp2_poly.ptxh"
    #include "fragments.ptxh"
    #include "gen_exp2.ptxh"
    #include "gen_n{n}.ptxh"
    #include "gen_d{d}.ptxh"
    .visible .entry ptxattn_fwd(.param .u64 out, .param .u32 lim)
    {{
        .reg .pred %p_mask, %p_acc;
        .reg .f32 %s<{s}>, %o<{o}>, %lo, %hi, %f;
        .reg .b32 %p<{p}>, %pk<4>, %zero, %limit, %n, %bits, %st_swz, %st_addr, %tmp, %st_row_<4>;
        .reg .b64 %ptr, %dq, %dk, %dv;
        ld.param.u32 %limit, [lim];
        ld.param.u64 %ptr, [out];
        mov.u32 %zero, 0;
        mov.u32 %st_swz, 0;
        mov.u32 %st_row_0, 0; mov.u32 %st_row_1, 0; mov.u32 %st_row_2, 0; mov.u32 %st_row_3, 0;
        mov.b64 %dq, 0; mov.b64 %dk, 0; mov.b64 %dv, 0;
        mov.f32 %lo, 0f3F800000; mov.f32 %hi, 0f3F800000;
        ZERO_O_D{d}
        wgmma.fence.sync.aligned;
        QK_N{n}_D{d}(%dq, %dk)
        wgmma.commit_group.sync.aligned;
        wgmma.wait_group.sync.aligned 0;
        MASK_COLS_N{n}(%limit)
        ROW_MAX_LO_N{n}(%lo)
        ROW_MAX_HI_N{n}(%hi)
        SCALE_EXP2_N{n}(%lo, %lo, %hi, %f, %n, %bits)
        ROW_SUM_ADD_LO_N{n}(%lo)
        ROW_SUM_ADD_HI_N{n}(%hi)
        PACK_P_N{n}
        wgmma.fence.sync.aligned;
        PV_N{n}_D{d}(%dv)
        wgmma.commit_group.sync.aligned;
        wgmma.wait_group.sync.aligned 0;
        SCALE_O_D{d}(%lo, %hi)
        STMATRIX_O_D{d}
        st.global.f32 [%ptr], %o0;
        ret;
    }}
    """)


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="no ptxas on PATH")
@pytest.mark.parametrize("n", ptxgen.BLOCK_NS)
@pytest.mark.parametrize("d", ptxgen.HEAD_DIMS)
def test_every_generated_macro_assembles(tmp_path, n, d):
    """Each shape's macros, used once, are valid PTX for sm_90a (ptxas, no GPU)."""
    src = tmp_path / "k.ptx"
    src.write_text(KERNEL.format(n=n, d=d, s=n // 2, o=d // 2, p=n // 4))
    out = tmp_path / "k.expanded.ptx"
    out.write_text(ptx.expand_file(src, [ptxgen.INCLUDE]).text)
    run = subprocess.run(["ptxas", "-arch=sm_90a", str(out), "-o", os.devnull],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr

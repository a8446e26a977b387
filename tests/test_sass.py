"""ptxattn.tools.sass: the parsers on committed ptxas/nvdisasm/cuobjdump output, tool discovery, and
every registered stage through the real ptxas (CPU only: no GPU needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ptxattn import stages
from ptxattn.tools import sass

FIXTURES = Path(__file__).parent / "fixtures"


def read(name: str) -> str:
    return (FIXTURES / name).read_text()


# --------------------------------------------------------------------------- ptxas -v report

def test_ptxas_log_of_the_tiny_kernel():
    report = sass.parse_ptxas_log(read("tiny_sm90a.log"))
    assert report["warnings"] == []
    f = report["functions"]["tiny_sm90a"]
    # .maxntid lets ptxas honour setmaxnreg: it reports the raised count
    assert f == {"arch": "sm_90a", "registers": 240, "barriers": 1, "stack_frame": 0,
                 "spill_stores": 0, "spill_loads": 0, "static_smem": 1024}


def test_ptxas_log_with_setmaxnreg_ignored_warning():
    report = sass.parse_ptxas_log(read("tiny_sm90a_no_maxntid.log"))
    assert report["functions"]["tiny_sm90a"]["registers"] == 58
    assert len(report["warnings"]) == 1
    assert report["warnings"][0].startswith("(C7508)")
    assert "setmaxnreg" in report["warnings"][0]


def test_ptxas_log_with_spills():
    f = sass.parse_ptxas_log(read("spill_sm90a.log"))["functions"]["spill"]
    assert (f["registers"], f["stack_frame"]) == (32, 392)
    assert (f["spill_stores"], f["spill_loads"]) == (388, 520)
    assert f["static_smem"] == 0


# --------------------------------------------------------------------------- instruction mix

@pytest.mark.parametrize("sass_file", ["tiny_sm90a.nvdisasm.sass", "tiny_sm90a.cuobjdump.sass"])
def test_instruction_classes_of_the_tiny_kernel(sass_file):
    s = sass.summarize(read(sass_file), read("tiny_sm90a.log"))
    c = s.classes
    assert c["HGMMA"] == 1                      # one wgmma.mma_async m64n64k16
    assert c["WARPGROUP"] == 2                  # wgmma.fence + wgmma.wait_group
    assert c["TMA"] == 4                        # UTMALDG, UTMASTG, UBLKCP, UTMACMDFLUSH
    assert c["MUFU.EX2"] == 2 and c["MUFU other"] == 0
    assert c["SHFL"] == 2
    assert c["LDS"] == 1 and c["STS"] == 1 and c["LDSM"] == 1 and c["STSM"] == 1
    assert c["USETMAXREG"] == 2                 # inc at entry, dec before the store
    assert c["SYNCS"] == 4                      # mbarrier init, arrive.expect_tx, 2 try_wait
    assert c["BAR"] == 3
    assert c["F2FP"] == 1 and c["FFMA"] == 1 and c["FMUL"] == 1
    assert c["LDL"] == c["STL"] == 0
    assert s.instructions == 100 == sum(c.values())
    assert s.opcodes["HGMMA.64x64x16.F32.BF16"] == 1
    assert "NOP" not in s.classes and s.opcodes.get("NOP", 0) == 0  # padding is not counted
    assert (s.function, s.arch, s.registers, s.spill_bytes, s.static_smem) == (
        "tiny_sm90a", "sm_90a", 240, 0, 1024)


def test_nvdisasm_and_cuobjdump_agree():
    a = sass.summarize(read("tiny_sm90a.nvdisasm.sass"))
    b = sass.summarize(read("tiny_sm90a.cuobjdump.sass"))
    assert a.opcodes == b.opcodes


def test_spills_show_as_local_memory():
    s = sass.summarize(read("spill_sm90a.nvdisasm.sass"), read("spill_sm90a.log"))
    assert s.spill_bytes == 388 + 520
    assert s.classes["LDL"] > 0 and s.classes["STL"] > 0
    assert s.classes["HGMMA"] == 0


def test_classify_matches_whole_dot_separated_prefixes():
    assert sass.classify("BAR.SYNC.DEFER_BLOCKING") == "BAR"
    assert sass.classify("BRA") == "branch"              # not BAR
    assert sass.classify("LDS.128") == "LDS"
    assert sass.classify("LDSM.16.M88.4") == "LDSM"      # not LDS
    assert sass.classify("MUFU.EX2") == "MUFU.EX2"
    assert sass.classify("MUFU.RCP") == "MUFU other"
    assert sass.classify("SYNCS.PHASECHK.TRANS64.TRYWAIT") == "SYNCS"
    assert sass.classify("WARPGROUP.DEPBAR.LE") == "WARPGROUP"
    assert sass.classify("IMAD.MOV.U32") == "other"


def test_grep():
    text = read("tiny_sm90a.cuobjdump.sass")
    assert len(sass.grep(text, "MUFU.EX2")) == 2
    assert len(sass.grep(text, "mufu")) == 2
    assert len(sass.grep(text, "MUFU.EX")) == 0          # whole components only
    lines = sass.grep(text, "HGMMA")
    assert len(lines) == 1 and "HGMMA.64x64x16.F32.BF16" in lines[0]
    assert "0x" not in lines[0].split("*/", 1)[1].split(",")[0]  # cuobjdump encodings dropped
    assert sass.grep(text, "SYNCS")[0].startswith("/*")


def test_predicated_instructions_are_parsed():
    line = "        /*0040*/              @!P0 BRA `(.L_x_0) ;"
    [(op, text)] = sass.instructions(line)
    assert op == "BRA" and "@!P0" in text


def test_to_json_round_trips():
    s = sass.summarize(read("tiny_sm90a.nvdisasm.sass"), read("tiny_sm90a_no_maxntid.log"),
                       dynamic_smem=58432)
    data = json.loads(sass.to_json(s))
    assert data["registers"] == 58 and data["dynamic_smem"] == 58432
    assert data["spill_bytes"] == 0
    assert data["classes"]["HGMMA"] == 1
    assert data["warnings"] and "C7508" in data["warnings"][0]


def test_format_summary_mentions_the_essentials():
    s = sass.summarize(read("tiny_sm90a.nvdisasm.sass"), read("tiny_sm90a_no_maxntid.log"))
    text = sass.format_summary(s, "tiny")
    assert "registers     58" in text and "C7508" in text and "HGMMA" in text


def test_diff_summaries_rows_and_deltas():
    a = sass.summarize(read("tiny_sm90a.nvdisasm.sass"), read("tiny_sm90a.log"))
    b = sass.summarize(read("spill_sm90a.nvdisasm.sass"), read("spill_sm90a.log"))
    rows = {r.what: r for r in sass.diff_summaries(a, b)}
    assert (rows["registers"].a, rows["registers"].b, rows["registers"].delta) == (240, 32, "-87%")
    assert rows["spill bytes"].delta == "new"
    assert rows["HGMMA"].delta == "-100%"
    assert "SHFL" in rows and "MUFU other" not in rows   # classes absent from both are left out
    text = sass.format_diff(list(rows.values()), "tiny", "spill")
    assert text.splitlines()[0].split() == ["tiny", "spill", "delta"]
    assert sass.DiffRow("MUFU.EX2", 128, 96).delta == "-25%"
    assert sass.DiffRow("x", 5, 5).delta == ""


# --------------------------------------------------------------------------- tool discovery

def test_no_tools_anywhere_names_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))          # an empty folder
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(sass, "_wheel_bin_dirs", lambda: [])
    monkeypatch.setattr(sass, "DEFAULT_CUDA_HOMES", ())
    for name in sass.TOOLS:
        assert sass.locate(name) is None
        with pytest.raises(sass.ToolNotFoundError) as err:
            sass.find_tool(name)
        assert "pip install 'ptxattn[tools]'" in str(err.value)
        assert "CUDA toolkit" in str(err.value)
        assert sass.TOOL_WHEELS[name] in str(err.value)
    with pytest.raises(sass.ToolNotFoundError, match="nvdisasm nor cuobjdump"):
        sass.disassemble(b"")
    assert all(v["path"] is None for v in sass.tool_report().values())


def test_tools_found_under_cuda_home(monkeypatch, tmp_path):
    bin_dir = tmp_path / "cuda" / "bin"
    bin_dir.mkdir(parents=True)
    fake = bin_dir / "nvdisasm"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    tool = sass.locate("nvdisasm")
    assert tool is not None and tool.path == fake and tool.source == "CUDA_HOME"


def test_unknown_tool_name():
    with pytest.raises(ValueError, match="tool"):
        sass.locate("nvcc")


# --------------------------------------------------------------------------- the real thing

requires_ptxas = pytest.mark.skipif(sass.locate("ptxas") is None,
                                    reason="no ptxas anywhere (pip install 'ptxattn[tools]')")


@requires_ptxas
def test_tiny_fixture_assembles_like_the_committed_log():
    asm = sass.assemble_ptx(read("tiny_sm90a.ptx"), "sm_90a", name="tiny_sm90a")
    assert asm.cubin[:4] == b"\x7fELF"
    live = sass.parse_ptxas_log(asm.log)["functions"]["tiny_sm90a"]
    assert live == sass.parse_ptxas_log(read("tiny_sm90a.log"))["functions"]["tiny_sm90a"]


@requires_ptxas
def test_assembly_error_is_clear():
    bad = read("tiny_sm90a.ptx").replace("ex2.approx.ftz.f32 %f4, %f3;", "ex2.bogus.f32 %f4, %f3;")
    with pytest.raises(sass.AssemblyError) as err:
        sass.assemble_ptx(bad, "sm_90a", name="bad")
    assert "ptxas failed on bad (sm_90a)" in str(err.value)
    assert "bad.ptx, line" in err.value.log                    # not the temporary path


@requires_ptxas
@pytest.mark.parametrize("stage", stages.all_stages(), ids=lambda s: s.label)
def test_every_stage_assembles_without_spills_and_uses_hgmma(stage):
    result = sass.inspect_stage(stage)
    s = result.summary
    assert s.arch == stage.arch and s.function == stages.ENTRY
    assert s.spill_bytes == 0, f"{stage.label} spills {s.spill_bytes} bytes"
    assert s.stack_frame == 0
    assert s.classes["HGMMA"] > 0, f"{stage.label}: no HGMMA in its SASS"
    assert s.registers is not None and s.registers <= 255
    assert s.dynamic_smem == stage.smem_bytes
    # ptxas performance notes that silently change what a stage measures: setmaxnreg ignored
    # (C7508: the register split is gone) or wgmma serialized (the async MMA waits on itself)
    assert not [w for w in s.warnings if "setmaxnreg" in w or "wgmma" in w], s.warnings
    # What each step's idea needs in the machine code. Warp specialization (stage 4 on: more
    # than one warpgroup) moves registers with setmaxnreg: one dealloc (producer) and one
    # alloc (consumers). The compute pipeline (stage 7 on) waits for S with PV still in
    # flight: a wgmma wait that leaves one group pending.
    specialized = stage.threads > 128
    assert (s.classes["USETMAXREG"] == 2) == specialized, (stage.label, s.classes["USETMAXREG"])
    overlapped = "WARPGROUP.DEPBAR.LE gsb0, 0x1" in result.sass
    assert overlapped == (stage.number >= 7), (stage.label, "wgmma groups kept in flight")

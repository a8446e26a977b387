"""Preprocessing of stage sources, line mapping, and JIT log annotation (CPU only)."""

import dataclasses
import os
import shutil
import subprocess
import re
import textwrap

import pytest

from ptxattn import ptx, stages
from ptxattn.errors import PtxattnError

DIRECTIVE = re.compile(r"^\s*#", re.M)


@pytest.mark.parametrize("stage", stages.all_stages(), ids=lambda s: s.label)
def test_every_stage_expands_to_plain_ptx(stage):
    if not (stages.ptx_root() / stage.file).is_file():
        pytest.skip(f"{stage.file} is not written yet")
    text = ptx.source(stage)
    assert not DIRECTIVE.search(text), "a preprocessor directive survived expansion"
    assert re.search(r"\.entry\s+ptxattn_fwd\b", text)
    assert ".target sm_90a" in text or stage.arch != "sm_90a"
    # every expanded line maps back to a real line of a real file
    exp = ptx.expand(stage)
    assert len(exp.line_map) == len(text.splitlines())
    for file, line in exp.line_map:
        assert file.startswith("ptx/") and line >= 1
    assert ptx.source(stage) is text        # cached per (stage, defines)


HEADER = textwrap.dedent("""\
    // helpers shared by stages
    #pragma once
    #define WAIT(bar, phase) \\
        mbarrier.try_wait.parity.shared::cta.b64 %p_done, [bar], phase;

    .func helper_func()
    {
        ret;
    }
    """)

KERNEL = textwrap.dedent("""\
    // a tiny stage: the one change is nothing at all
    .version 8.0
    .target sm_90a
    .address_size 64

    #include "helpers.ptxh"
    #include "helpers.ptxh"
    #define BLOCK_M 64

    .visible .entry ptxattn_fwd(
        .param .u64 o_ptr
    )
    {
        .reg .pred %p_done;
        .reg .b32 %r<2>;
        mov.u32 %r1, BLOCK_M;
    #ifdef TRACE
        mov.u32 %r1, TRACE;
    #endif
    $L_wait:
        WAIT(%r1, 0)
        @!%p_done bra $L_wait;
        ret;
    }
    """)


@pytest.fixture
def tiny_stage(tmp_path):
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "helpers.ptxh").write_text(HEADER)
    (tmp_path / "99_tiny.ptx").write_text(KERNEL)
    base = stages.get_stage(1)
    # stage.file is joined to ptx/; an absolute path stays absolute
    return dataclasses.replace(base, number=99, name="tiny", file=str(tmp_path / "99_tiny.ptx"))


def line_of(text, needle):
    return next(i for i, l in enumerate(text.splitlines(), 1) if needle in l)


def test_includes_macros_and_conditionals_expand(tiny_stage):
    text = ptx.source(tiny_stage)
    assert not DIRECTIVE.search(text)
    assert text.count(".func helper_func()") == 1          # pragma once honoured
    assert "mov.u32 %r1, 64;" in text
    assert "mbarrier.try_wait.parity.shared::cta.b64 %p_done, [%r1], 0;" in text
    assert "TRACE" not in text
    traced = ptx.source(tiny_stage, defines={"TRACE": 7})
    assert "mov.u32 %r1, 7;" in traced and "mov.u32 %r1, 7;" not in text
    assert ptx.source(tiny_stage, defines={"TRACE": True}).count("mov.u32 %r1, 1;") == 1


def test_line_map_points_into_the_include(tiny_stage, tmp_path):
    text = ptx.source(tiny_stage)
    n = line_of(text, ".func helper_func()")
    file, line = ptx.map_line(tiny_stage, n)
    assert file == str(tmp_path / "include" / "helpers.ptxh") and line == 6
    file, line = ptx.map_line(tiny_stage, line_of(text, "bra $L_wait"))
    assert file.endswith("99_tiny.ptx") and line == 22
    file, line = ptx.map_line(tiny_stage, line_of(text, "mov.u32 %r1, 64"))
    assert line == 16
    traced = ptx.source(tiny_stage, defines={"TRACE": 3})
    assert ptx.map_line(tiny_stage, line_of(traced, "mov.u32 %r1, 3"), defines={"TRACE": 3})[1] == 18
    assert ptx.map_line(tiny_stage, 10_000) is None


def test_annotate_log_appends_file_line_and_source(tiny_stage, tmp_path):
    text = ptx.source(tiny_stage)
    n = line_of(text, "mbarrier.try_wait")
    log = (f"ptxas application ptx input, line {n}; error   : Arguments mismatch for instruction "
           f"'mbarrier'\nptxas fatal   : Ptx assembly aborted due to errors")
    out = ptx.annotate_log(tiny_stage, log)
    assert f"line {n}; error" in out
    assert f"-> {tmp_path / '99_tiny.ptx'}:21: WAIT(%r1, 0)" in out
    assert out.splitlines()[-1] == "ptxas fatal   : Ptx assembly aborted due to errors"


def test_repository_paths_are_shown_relative(monkeypatch, tmp_path):
    root = tmp_path / "repo" / "ptx"
    (root / "sm90" / "include").mkdir(parents=True)
    (root / "sm90" / "include" / "helpers.ptxh").write_text(HEADER)
    (root / "sm90" / "99_tiny.ptx").write_text(KERNEL)
    monkeypatch.setattr(ptx, "ptx_root", lambda: root)
    stage = dataclasses.replace(stages.get_stage(1), number=99, name="tiny", file="sm90/99_tiny.ptx")
    text = ptx.expand_file(root / stage.file, [root / "sm90" / "include"]).text
    exp = ptx.expand_file(root / stage.file, [root / "sm90" / "include"])
    assert exp.map_line(line_of(text, ".func helper_func()")) == ("ptx/sm90/include/helpers.ptxh", 6)
    log = f"ptxas application ptx input, line {line_of(text, '.func helper_func()')}; error : x"
    annotated, where = ptx.annotate(exp, log)
    assert "-> ptx/sm90/include/helpers.ptxh:6: .func helper_func()" in annotated
    assert where == [("ptx/sm90/include/helpers.ptxh", 6, ".func helper_func()")]


def test_preprocessor_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.ptx"
    bad.write_text('.version 8.0\n#include "missing.ptxh"\n')
    with pytest.raises(PtxattnError, match=r"bad\.ptx:2.*missing\.ptxh"):
        ptx.expand_file(bad)
    err = tmp_path / "err.ptx"
    err.write_text(".version 8.0\n#error stage needs TRACE\n")
    with pytest.raises(PtxattnError, match="stage needs TRACE"):
        ptx.expand_file(err)
    unknown = tmp_path / "unknown.ptx"
    unknown.write_text(".version 8.0\n#pragma unroll\n")
    with pytest.raises(PtxattnError, match="unsupported directive #pragma"):
        ptx.expand_file(unknown)


def test_missing_stage_file_is_a_clear_error(tmp_path):
    stage = dataclasses.replace(stages.get_stage(1), file=str(tmp_path / "nope.ptx"))
    with pytest.raises(FileNotFoundError, match="nope.ptx"):
        ptx.source(stage)


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="no ptxas on PATH")
def test_a_real_ptxas_error_maps_back_to_the_include(tmp_path):
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "h.ptxh").write_text("// helper\n.func broken()\n{\n    bogus.op;\n"
                                                 "    ret;\n}\n")
    (tmp_path / "k.ptx").write_text('.version 8.4\n.target sm_90a\n.address_size 64\n'
                                    '#include "h.ptxh"\n.visible .entry ptxattn_fwd()\n{\n'
                                    '    ret;\n}\n')
    stage = dataclasses.replace(stages.get_stage(1), file=str(tmp_path / "k.ptx"))
    expanded = tmp_path / "expanded.ptx"
    expanded.write_text(ptx.source(stage))
    run = subprocess.run(["ptxas", "-arch=sm_90a", str(expanded), "-o", os.devnull],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "line" in run.stderr
    out = ptx.annotate_log(stage, run.stderr)
    assert f"-> {tmp_path / 'include' / 'h.ptxh'}:4: bogus.op;" in out


MULTI = textwrap.dedent("""\
    .version 8.0
    .target sm_90a
    .address_size 64
    #define SPIN(LABEL, BAR) \\
    LABEL: \\
        mbarrier.try_wait.parity.shared::cta.b64 %p_done, [BAR], 0; \\
        @!%p_done bra.uni LABEL;
    .visible .entry ptxattn_fwd()
    {
        .reg .pred %p_done;
        .reg .b32 %r<3>;
        mov.u32 %r1, 1;  mov.u32 %r2, 2;
        SPIN(spin_here, %r1)
        ret;
    }
    """)


def test_multi_statement_lines_become_one_statement_per_line(tmp_path):
    """A macro of several statements expands onto one line; the listing shows one statement a
    line, the label on a line of its own, and every piece maps to the macro's invocation."""
    (tmp_path / "m.ptx").write_text(MULTI)
    exp = ptx.expand_file(tmp_path / "m.ptx")
    lines = exp.text.splitlines()
    assert all(l.count(";") <= 1 for l in lines)
    i = lines.index("spin_here:")
    assert lines[i + 1] == "    mbarrier.try_wait.parity.shared::cta.b64 %p_done, [%r1], 0;"
    assert lines[i + 2] == "    @!%p_done bra.uni spin_here;"
    assert [exp.map_line(n)[1] for n in (i + 1, i + 2, i + 3)] == [13, 13, 13]
    j = lines.index("    mov.u32 %r1, 1;")
    assert lines[j + 1] == "    mov.u32 %r2, 2;"
    assert exp.map_line(j + 1)[1] == exp.map_line(j + 2)[1] == 12
    assert len(exp.line_map) == len(lines)


def test_every_stage_lists_one_statement_per_line():
    for stage in stages.all_stages():
        if (stages.ptx_root() / stage.file).is_file():
            lines = ptx.source(stage).splitlines()
            assert not [l for l in lines if l.count(";") > 1], stage.label


@pytest.mark.parametrize("head_dim,masked", [(64, False), (256, True)])
def test_a_production_build_expands_as_itself(head_dim, masked):
    """A specialized Stage (the build a call runs: D = 64 is three consumers, 512 threads)
    expands with its own defines: ptx.source(build) was the default D = 128 build's text while
    build.threads and build.smem_bytes described the other one."""
    build = stages.PRODUCTION.specialize(head_dim, masked)
    text = ptx.source(build)
    assert text == ptx.source(stages.PRODUCTION, dict(build.defines))
    assert text != ptx.source(stages.PRODUCTION)
    assert f".maxntid {build.threads}, 1, 1" in text
    # tool defines add to the build's (what launch.kernel() hands the JIT)
    traced = ptx.source(build, {"PTXATTN_TRACE": "1"})
    assert traced == ptx.source(stages.PRODUCTION, {**dict(build.defines), "PTXATTN_TRACE": "1"})


def test_a_kernel_in_its_own_folder_finds_its_includes_and_the_lineages(monkeypatch, tmp_path):
    """ptx/<arch>/<kernel>/main.ptx: `#include "x"` is searched beside the including file first
    (nested includes too), then in ptx/<arch>/include; source_files lists what is reached."""
    root = tmp_path.resolve() / "ptx"
    (root / "sm90" / "include").mkdir(parents=True)
    (root / "sm90" / "kern").mkdir()
    (root / "sm90" / "include" / "shared.ptxh").write_text("#define SHARED_VALUE 7\n")
    (root / "sm90" / "include" / "part.ptxh").write_text("#define PART_VALUE 1\n")   # shadowed
    (root / "sm90" / "kern" / "part.ptxh").write_text('#include "nested.ptxh"\n#define PART_VALUE 2\n')
    (root / "sm90" / "kern" / "nested.ptxh").write_text("#define NESTED_VALUE 3\n")
    (root / "sm90" / "kern" / "main.ptx").write_text(
        '#include "shared.ptxh"\n#include "part.ptxh"\n'
        ".visible .entry ptxattn_fwd()\n{\n    mov.u32 %r, SHARED_VALUE;\n"
        "    mov.u32 %r, PART_VALUE;\n    mov.u32 %r, NESTED_VALUE;\n}\n")
    monkeypatch.setattr(ptx, "ptx_root", lambda: root)
    ptx._CACHE.clear()
    stage = dataclasses.replace(stages.get_stage(14), file="sm90/kern/main.ptx")
    text = ptx.source(stage)
    assert "mov.u32 %r, 7;" in text and "mov.u32 %r, 2;" in text and "mov.u32 %r, 3;" in text
    assert ptx.include_dirs(root / "sm90" / "kern" / "main.ptx") == [root / "sm90" / "include"]
    files = [p.relative_to(root).as_posix() for p in ptx.source_files(stage)]
    assert files == ["sm90/kern/main.ptx", "sm90/include/shared.ptxh", "sm90/kern/part.ptxh",
                     "sm90/kern/nested.ptxh"]
    ptx._CACHE.clear()


def test_the_production_kernels_sources_are_its_folder_and_the_shared_includes():
    files = ptx.source_files(stages.PRODUCTION)
    assert files[0] == stages.ptx_root() / stages.PRODUCTION.file
    production = stages.ptx_root() / "sm90" / "production"
    assert {p.parent for p in files} == {production, stages.ptx_root() / "sm90" / "include"}
    # the folder holds the production kernels (forward, decode, backward, ...): every include
    # in it is read by one of its .ptx files, so none is left behind by a refactor
    used = set()
    for entry in sorted(production.glob("*.ptx")):
        rel = entry.relative_to(stages.ptx_root()).as_posix()
        used |= {p.name for p in ptx.source_files(dataclasses.replace(stages.PRODUCTION, file=rel))
                 if p.parent == production}
    assert {p.name for p in production.glob("*.ptxh")} <= used
    # the lineage's sources are its file and the shared includes, as before
    assert [p.parent for p in ptx.source_files(14)][1:] == [
        stages.ptx_root() / "sm90" / "include"] * (len(ptx.source_files(14)) - 1)

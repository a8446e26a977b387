"""The CLI through click's CliRunner, on a machine without a GPU (ptxas from the tools extra)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli_helpers import cli, needs_sass, no_gpu, one_clean_error  # noqa: F401 (a fixture)
from ptxattn import driver, stages
from ptxattn.tools import sass
from ptxattn.tools.cli import main

SYNTHETIC = Path(__file__).parent / "fixtures" / "bench_synthetic.json"
FIRST = stages.all_stages()[0]
LAST = stages.all_stages()[-1]



def test_list_shows_every_stage():
    result = cli("list")
    assert result.exit_code == 0, result.output
    for s in stages.all_stages():
        assert any(line.split()[:3] == [str(s.number), s.name, s.arch]
                   for line in result.output.splitlines())
    assert f"Lq%{FIRST.block_m}" in result.output


def test_list_shows_each_production_build_geometry():
    """The production row's threads and tile are per build (PRODUCTION_VARIANTS): D = 64 runs
    three consumers (512 threads, 192-row tiles), D = 256 64-row K/V tiles. The row showed the
    unspecialized Stage's 384 threads and 128x128 only."""
    result = cli("list", "--arch", "sm_90a")
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines()
               if line.split()[:2] == ["-", "production"])
    builds = [stages.PRODUCTION.specialize(d) for d in stages.PRODUCTION.head_dims]
    assert row.split()[3] == "/".join(str(b.threads) for b in builds)
    assert row.split()[4] == "/".join(f"{b.block_m}x{b.block_n}" for b in builds)
    assert "512" in row.split()[3] and "192x128" in row.split()[4]
    assert f"D={'/'.join(map(str, stages.PRODUCTION.head_dims))}" in row


def test_info_without_gpu_says_so(no_gpu):
    result = cli("info")
    assert result.exit_code == 0, result.output
    assert "no GPU" in result.output
    for tool in ("ptxas", "nvdisasm", "cuobjdump"):
        assert tool in result.output


@pytest.mark.skipif(driver.gpu_available(), reason="this machine has a GPU")
def test_info_on_this_machine_without_gpu():
    result = cli("info")
    assert result.exit_code == 0 and "no GPU" in result.output


def test_ptx_is_expanded():
    result = cli("ptx", FIRST.label)
    assert result.exit_code == 0, result.output
    assert f".entry {stages.ENTRY}(" in result.output
    assert "#include" not in result.output and "#define" not in result.output


@pytest.mark.parametrize("alias", ["stage1", "stage01", "1", "baseline"])
def test_stage_aliases_select_stage_1(alias):
    assert cli("ptx", alias).output == cli("ptx", "1").output


@pytest.mark.parametrize("command", ["run", "ptx", "sass"])
def test_bad_stage_name(command):
    one_clean_error(cli(command, "nope"), "unknown stage 'nope'", "stage01")


def test_run_without_gpu_is_one_clean_error(no_gpu):
    one_clean_error(cli("run", "stage1", "--shape", "4k"), "no CUDA GPU")


@pytest.mark.skipif(driver.gpu_available(), reason="this machine has a GPU")
def test_run_on_this_machine_without_gpu():
    one_clean_error(cli("run", "1", "--shape", "512"), "no CUDA GPU")


def test_run_rejects_a_shape_the_stage_cannot_take(no_gpu):
    one_clean_error(cli("run", "1", "-L", "100"), "cannot run", "query length 100")


def test_run_rejects_an_unknown_shape():
    one_clean_error(cli("run", "1", "--shape", "huge"), "shape")


@needs_sass
def test_sass_summary():
    result = cli("sass", FIRST.label, "--summary")
    assert result.exit_code == 0, result.output
    assert "registers" in result.output and "HGMMA" in result.output
    assert f"{FIRST.smem_bytes} B dynamic" in result.output


@needs_sass
def test_sass_summary_of_the_production_kernel_names_its_build():
    """The production kernel's summary says which build the defines chose (head dim, masked),
    and its figures are that build's (D = 64: three consumers, 128 registers at 512 threads)."""
    result = cli("sass", "production", "-d", "HEAD_DIM=64", "-d", "PTXATTN_MASKED", "--summary")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == "production (HEAD_DIM=64, masked)"
    assert "registers     128" in result.output
    plain = cli("sass", "production", "--summary")
    assert plain.output.splitlines()[0] == "production (HEAD_DIM=128)"


@needs_sass
def test_sass_of_the_backward_builds_and_variants():
    """STAGE bwd is the production backward: its build from -d and --variant (the figures are
    that build's: the query split's 230,936 bytes and its m64n32 S^T), b1..b3 its lineage."""
    result = cli("sass", "bwd", "-d", "HEAD_DIM=256", "--variant", "qsplit", "--summary")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == "bwd_production (HEAD_DIM=256), variant qsplit"
    assert "230936 B dynamic" in result.output and "spills        0 B stored" in result.output
    grep = cli("sass", "bwd", "-d", "HEAD_DIM=256", "--variant", "qsplit", "--grep", "HGMMA")
    assert "HGMMA.64x32x16" in grep.output, grep.output[-500:]
    plain = cli("sass", "bwd", "--summary")
    assert plain.output.splitlines()[0] == "bwd_production (HEAD_DIM=128)"
    assert cli("sass", "b2", "--summary").output.splitlines()[0] == "b2 warp_specialized"
    one_clean_error(cli("sass", "bwd", "--variant", "qsplit"), "variant", "head dim 128")
    one_clean_error(cli("sass", "stage14", "--variant", "qsplit"), "--variant", "bwd")


@needs_sass
def test_sass_json():
    result = cli("sass", "1", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["stage"] == "stage01" and data["spill_bytes"] == 0
    assert data["classes"]["HGMMA"] > 0


def test_sass_grep_and_json_are_refused_together():
    result = cli("sass", "1", "--json", "--grep", "HGMMA")
    assert result.exit_code != 0 and "--grep and --json" in result.output


@needs_sass
def test_sass_grep_and_full_listing():
    result = cli("sass", "1", "--grep", "mufu.ex2")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[-1].endswith("x MUFU.EX2") and len(lines) == int(lines[-1].split()[0]) + 1
    assert all("MUFU.EX2" in line for line in lines[:-1])
    full = cli("sass", "1")
    assert full.exit_code == 0 and "HGMMA" in full.output and "EXIT" in full.output


def test_diff_ptx_of_a_stage_with_itself():
    result = cli("diff", "1", "stage01", "--ptx")
    assert result.exit_code == 0, result.output
    assert "no difference" in result.output


@pytest.mark.skipif(len(stages.all_stages()) < 2, reason="one stage registered")
def test_diff_ptx_of_two_stages():
    result = cli("diff", FIRST.label, LAST.label)
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"--- {FIRST.label} ")
    assert f"+++ {LAST.label} " in result.output and "\n@@ " in result.output


@needs_sass
def test_diff_sass():
    result = cli("diff", FIRST.label, LAST.label, "--sass")
    assert result.exit_code == 0, result.output
    header, *rows = result.output.splitlines()
    assert header.split() == [FIRST.label, LAST.label, "delta"]
    assert any(r.startswith("registers") for r in rows) and any(r.startswith("HGMMA") for r in rows)


def test_bench_without_gpu_is_one_clean_error(no_gpu):
    one_clean_error(cli("bench", "--shapes", "4k"), "no CUDA GPU")


def test_bench_from_json_prints_the_table():
    result = cli("bench", "--from-json", SYNTHETIC)
    assert result.exit_code == 0, result.output
    assert "stage01 baseline" in result.output and "% cuDNN" in result.output


def test_bench_plot_from_json(tmp_path):
    out = tmp_path / "progression.png"
    result = cli("bench", "--from-json", SYNTHETIC, "--plot", out)
    if importlib.util.find_spec("matplotlib") is None:
        one_clean_error(result, "pip install -e '.[plot]'")      # this is a checkout
    else:
        assert result.exit_code == 0, result.output
        assert out.read_bytes()[:4] == b"\x89PNG"


def test_python_dash_m_ptxattn():
    proc = subprocess.run([sys.executable, "-m", "ptxattn", "list"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert FIRST.name in proc.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [FIRST.label, LAST.label])
def test_run_on_the_gpu(stage):
    result = cli("run", stage, "--shape", "2x2x512x128", "--reps", "3", "--layout", "bshd")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == "PASS"
    assert "TFLOP/s" in result.output and "NaN 0" in result.output


def test_run_with_a_fake_gpu_prints_figures_and_passes(monkeypatch):
    import fake_gpu
    launches = fake_gpu.install(monkeypatch, {1: 0.5})
    result = cli("run", "stage1", "--shape", "1x2x128x128", "--layout", "bshd", "--reps", "4")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "stage01 baseline on Fake GPU: 1x2x128x128 (B=1 H=2 L=128 D=128, bshd)"
    assert lines[1].split()[:3] == ["time", "0.500", "ms"]
    assert f"{bench_tflops(1, 2, 128, 128, 128, 0.5):.1f} TFLOP/s" in lines[1]
    assert lines[2].startswith("check   rel_l2 ") and "NaN 0" in lines[2]
    assert lines[-1] == "PASS"
    assert launches == {1: 2}                  # the checked launch + one in the fake timing


def test_run_with_a_fake_gpu_fails_on_a_wrong_result(monkeypatch):
    import fake_gpu
    fake_gpu.install(monkeypatch, {1: 0.5}, wrong={1})
    result = cli("run", "1", "-b", "1", "-H", "1", "-L", "128")
    assert result.exit_code == 1
    assert result.output.splitlines()[-1] == "FAIL"
    no_check = cli("run", "1", "-b", "1", "-H", "1", "-L", "128", "--no-check")
    assert no_check.exit_code == 0 and "skipped (--no-check)" in no_check.output


def test_bench_with_a_fake_gpu_writes_results(monkeypatch, tmp_path):
    import fake_gpu
    fake_gpu.install(monkeypatch, {s.number: 1.0 + s.number for s in stages.all_stages()})
    result = cli("bench", "--shapes", "1x1x128x128", "--stages", "1", "--reps", "2",
                 "--rounds", "2", "--out", tmp_path)
    assert result.exit_code == 0, result.output
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and "bench.txt" in files
    [json_file] = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
    assert json_file.name.endswith("-fake-gpu.json")
    data = json.loads(json_file.read_text())
    assert data["results"][0]["ms"] == 2.0 and data["results"][0]["pass"]
    assert (tmp_path / "bench.txt").read_text().strip() in result.output


def bench_tflops(*args):
    from ptxattn.tools import bench
    return bench.tflops(*args)


@needs_sass
def test_assembly_error_is_one_line_and_verbose_shows_the_mapped_log():
    # sm_90a-only wgmma cannot be assembled for sm_120a: ptxas fails on a known line
    # (not sm_100a: it names the Blackwell lineage now, whose own stage 1 assembles there)
    one_clean_error(cli("sass", "1", "--arch", "sm_120a"), "ptxas failed on stage01 (sm_120a)",
                    "ptx/sm90/01_baseline.ptx:", "ptxattn -v")
    verbose = CliRunner().invoke(main, ["-v", "sass", "1", "--arch", "sm_120a"])
    assert verbose.exit_code == 1 and "Traceback" not in verbose.output
    assert "    -> ptx/sm90/" in verbose.output       # every log line mapped to its source


# --------------------------------------------------------------------------- first contact (issue 14)

def _ptxattn(*args):
    return [sys.executable, "-m", "ptxattn", *map(str, args)]


def _subprocess_env():
    import os
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


@pytest.mark.parametrize("args", [("list",), ("ptx", LAST.label)])
def test_a_closed_stdout_ends_the_command_quietly(args):
    # The reader is gone before the command writes a byte: every write meets EPIPE.
    proc = subprocess.Popen(_ptxattn(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=_subprocess_env())
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and err == b"", err.decode()


def test_piping_into_head_is_quiet_every_time():
    # The case: `... | head -1` failed 3 times in 5. The expanded PTX of the last stage
    # is more than a pipe buffer, so the command is still writing when head exits.
    cmd = " ".join(_ptxattn("ptx", LAST.label)) + ' | head -1; echo "rc=${PIPESTATUS[0]}" >&2'
    first_line = cli("ptx", LAST.label).output.splitlines(keepends=True)[0]
    for _ in range(5):
        proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120,
                              env=_subprocess_env())
        assert proc.stdout == first_line
        assert proc.stderr.strip() == "rc=0", proc.stderr


def test_a_broken_pipe_elsewhere_is_still_an_error(monkeypatch):
    # Only a closed stdout is quiet; a BrokenPipeError from anything else is reported.
    def broken():
        raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(stages, "all_kernels", broken)
    one_clean_error(cli("list"), "Broken pipe")


def test_version():
    import ptxattn
    result = cli("--version")
    assert result.exit_code == 0 and result.output == f"ptxattn {ptxattn.__version__}\n"


def test_verbose_is_accepted_before_and_after_the_command(monkeypatch):
    def two_lines(key):
        raise ValueError("stage: first line\nsecond line")
    monkeypatch.setattr(stages, "get_stage", two_lines)
    short = one_clean_error(cli("ptx", "1"), "first line", "ptxattn -v")
    assert "second line" not in short
    for args in (("-v", "ptx", "1"), ("ptx", "1", "-v"), ("ptx", "--verbose", "1")):
        result = cli(*args)
        assert result.exit_code == 1 and "second line" in result.output, (args, result.output)


@pytest.mark.parametrize("args, needle", [
    (("sass", "1", "--summary", "--json"), "--summary and --json"),
    (("diff", "1", "2", "--ptx", "--sass"), "--ptx and --sass"),
    (("diff", "1", "2", "--arch", "sm_120a"), "--arch applies to --sass only"),
])
def test_conflicting_flags_are_refused(args, needle):
    result = cli(*args)
    assert result.exit_code == 2, result.output
    assert needle in result.output and "Traceback" not in result.output


@pytest.fixture
def gpu_untouched(monkeypatch):
    """Fail loudly if a command asks for the GPU: its arguments should have been refused."""
    def touched():
        raise AssertionError("the GPU was asked for")
    monkeypatch.setattr(driver, "device_info", touched)


@pytest.mark.parametrize("command", ["run", "trace"])
@pytest.mark.parametrize("flag", ["-b", "-H", "-L", "-D"])
def test_zero_dimensions_are_refused_before_the_gpu(gpu_untouched, tmp_path, command, flag):
    extra = ("--out", tmp_path / "t.svg") if command == "trace" else ()
    result = cli(command, "1", flag, "0", *extra)
    assert result.exit_code == 2, result.output
    assert "0 is not in the range x>=1" in result.output and "GPU" not in result.output


def test_layout_is_case_insensitive(monkeypatch):
    import fake_gpu
    fake_gpu.install(monkeypatch, {1: 0.5})
    result = cli("run", "1", "--shape", "1x2x128x128", "--layout", "BSHD", "--reps", "2")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0].endswith("(B=1 H=2 L=128 D=128, bshd)")


def test_trace_out_must_name_an_svg(gpu_untouched, tmp_path):
    result = cli("trace", "1", "--out", tmp_path / "t.png")
    assert result.exit_code == 2 and "*.svg" in result.output, result.output
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["chart", "chart.pdf"])
def test_bench_plot_must_name_png_or_svg(tmp_path, name):
    result = cli("bench", "--from-json", SYNTHETIC, "--plot", tmp_path / name)
    assert result.exit_code == 2 and "*.png or *.svg" in result.output, result.output
    assert not list(tmp_path.iterdir())


def test_no_gpu_error_names_what_works_without_one(no_gpu):
    line = one_clean_error(cli("run", "1", "-L", "128"), "no CUDA GPU")
    for offline in ("list", "ptx", "sass", "diff", "bench --from-json", "trace --from-json"):
        assert offline in line.split("no CUDA GPU", 1)[1], line


def test_info_shows_tool_versions_and_warns_on_a_mismatch(no_gpu, monkeypatch):
    def report(ptxas_version, nvdisasm_version):
        return {"ptxas": {"path": "/t/ptxas", "source": "PATH", "version": ptxas_version},
                "nvdisasm": {"path": "/w/nvdisasm", "source": "wheel nvidia-cuda-nvdisasm",
                             "version": nvdisasm_version},
                "cuobjdump": {"path": None, "source": None, "version": None}}
    monkeypatch.setattr(sass, "tool_report", lambda: report("13.0.88", "13.5.37"))
    result = cli("info")
    assert result.exit_code == 0, result.output
    assert "13.0.88" in result.output and "13.5.37" in result.output
    [warning] = [l for l in result.output.splitlines() if l.startswith("warning")]
    assert "ptxas 13.0.88 (PATH)" in warning and "nvdisasm 13.5.37" in warning
    monkeypatch.setattr(sass, "tool_report", lambda: report("13.5.12", "13.5.37"))
    assert "warning" not in cli("info").output      # same release, other patch level: fine


@needs_sass
def test_info_shows_the_version_of_every_tool_found(no_gpu):
    import re
    result = cli("info")
    for name in ("ptxas", "nvdisasm", "cuobjdump"):
        if sass.locate(name):
            [line] = [l for l in result.output.splitlines() if l.split()[:1] == [name]]
            assert re.match(rf"\s+{name}\s+\d+\.\d+\.\d+\s+/", line), line


@pytest.mark.parametrize("command", ["ptx", "sass"])
def test_a_define_the_kernel_refuses_shows_its_error_text(command):
    """`-d HEAD_DIM=96` stops at the kernel's #error: its text is in the one error line
    without -v (it read "preprocessing failed:" and nothing else), and -v shows every line."""
    line = one_clean_error(cli(command, "production", "-d", "HEAD_DIM=96"),
                           "preprocessing failed:", "#error", "HEAD_DIM", "-v")
    assert line.count("#error") == 1, line
    full = cli("-v", command, "production", "-d", "HEAD_DIM=96")
    assert full.exit_code == 1 and full.output.count("#error") >= 2, full.output

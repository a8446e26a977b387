"""The README's framework examples and the sanitizer script, checked without a GPU.

The GPU side (tests/test_gpu_api.py) runs the README blocks; here they must at least exist,
compile, and import only what the test knows how to skip.
"""

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from readme_blocks import imported_packages, python_blocks

from ptxattn import stages

ROOT = Path(__file__).resolve().parent.parent
SANITIZE = ROOT / "bench" / "sanitize.sh"
CASE = ROOT / "bench" / "sanitize_case.py"
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")


def test_readme_has_one_compiling_example_per_framework():
    blocks = python_blocks()
    assert len(blocks) == 3
    frameworks = [next(p for p in imported_packages(b) if p in ("torch", "jax", "cupy"))
                  for b in blocks]
    assert frameworks == ["torch", "jax", "cupy"]
    for block in blocks:
        compile(block, "README.md", "exec")
        assert "ptxattn" in imported_packages(block)
        known = {"torch", "jax", "cupy", "ptxattn", "numpy", "ml_dtypes", "os"}
        assert set(imported_packages(block)) <= known, imported_packages(block)


def test_readme_documents_threading_and_the_grid_knob():
    text = (ROOT / "README.md").read_text()
    assert "\n## Threading\n" in text and "PTXATTN_PERSISTENT_CTAS" in text


def test_sanitize_script_is_executable_and_parses():
    assert SANITIZE.stat().st_mode & stat.S_IXUSR, "bench/sanitize.sh is not executable"
    subprocess.run(["bash", "-n", str(SANITIZE)], check=True)
    text = SANITIZE.read_text()
    for tool in TOOLS:
        assert f"{tool}" in text
    assert "--racecheck-report analysis" in text and "ERROR SUMMARY" in text
    compile(CASE.read_text(), str(CASE), "exec")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _sanitize_case_module():
    """bench/sanitize_case.py as a fresh module (registered: its dataclass needs that)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("sanitize_case", CASE)
    case = importlib.util.module_from_spec(spec)
    sys.modules["sanitize_case"] = case
    spec.loader.exec_module(case)
    return case


def _listed(*extra):
    """bench/sanitize_case.py --list (or --controls): (name, ctas, the arguments) per line."""
    out = subprocess.run([sys.executable, str(CASE), *(extra or ("--list",))],
                         capture_output=True, text=True, check=True, env=_env(), cwd=ROOT).stdout
    return [tuple(line.split("\t")) for line in out.splitlines() if line.strip()]


def _parsed_cases(*extra):
    """(Case, CTAS) for each listed line: the Case its arguments run, through the script's own
    parser (its run() replaced by a recorder)."""
    case = _sanitize_case_module()
    seen = []
    case.run = lambda c, seed, defines: seen.append(c) or True
    out = []
    for _, ctas, args in _listed(*extra):
        assert case.main(args.split()) == 0
        out.append((seen[-1], int(ctas)))
    del sys.modules["sanitize_case"]
    return out


def test_sanitizer_cases_cover_every_stage():
    cases = _parsed_cases()
    by_stage, layouts = {}, {}
    for c, ctas in cases:
        # the production kernel's and decode's cases: production:D, decode:D
        key = c.kernel if ":" in c.kernel else int(c.kernel)
        assert c.ctas == 0 and ctas in (0, 2)                # the cap comes from the script
        by_stage.setdefault(key, []).append((c.batch, c.heads, c.seq_q, ctas))
        layouts.setdefault(key, set()).add(c.layout)
    for stage in stages.all_stages():
        shapes = by_stage[stage.number]
        assert (1, 2, 256, 0) in shapes, stage.label
        assert layouts[stage.number] == {"bhld", "bshd"}, stage.label
        if stage.block_m == 128:
            assert (1, 2, 512, 0) in shapes, stage.label     # several K/V tiles, the ring wraps
        if stage.persistent:
            b, h, l, ctas = next(s for s in shapes if s[3])
            tiles = (l // stage.block_m) * h * b
            assert ctas == 2 and tiles >= 4 * ctas, (stage.label, tiles)   # tiles per CTA > 1
    # the kernel attention() runs: every head dim's build (D = 64: 512 threads, 192-row
    # tiles), both layouts, and a persistent walk of several tiles a CTA
    for d in stages.PRODUCTION.head_dims:
        build = stages.PRODUCTION.specialize(d)
        shapes = by_stage[f"production:{d}"]
        assert (1, 2, 256, 0) in shapes and layouts[f"production:{d}"] == {"bhld", "bshd"}, d
        b, h, l, ctas = next(s for s in shapes if s[3])
        tiles = -(-l // build.block_m) * h * b
        assert ctas == 2 and tiles >= 3 * ctas, (d, tiles)
    # every newer kernel, at every head dim: decode, paged decode, varlen prefill (packed and
    # paged keys), FP8
    assert set(by_stage) == {s.number for s in stages.all_stages()} | {
        f"production:{d}" for d in stages.PRODUCTION.head_dims} | {
        f"{kind}:{d}" for kind in ("decode", "paged", "varlen", "paged_varlen", "fp8")
        for d in (64, 128, 256)}
    # paged: a page below a K/V tile (a box per page) and one above it, in both kernels
    for kind in ("paged:", "paged_varlen:"):
        pages = {c.page for c, _ in cases if c.kernel.startswith(kind)}
        assert 16 in pages and max(pages) >= 128, (kind, pages)


def test_sanitizer_cases_cover_the_production_features():
    """Issue 28, defect 10: the masked builds (causal for each head dim, windows), GQA and MQA,
    ragged tails (Lq and Lk not tile multiples, Lq != Lk both ways), the top-left diagonal and
    the LSE, in the persistent walk too; every case small enough for racecheck."""
    cases = [(c, ctas) for c, ctas in _parsed_cases() if c.kernel.startswith("production:")]
    prod = [c for c, _ in cases]
    dims = lambda c: int(c.kernel.split(":")[1])
    tiles = {d: stages.PRODUCTION.specialize(d, masked=True).block_m
             for d in stages.PRODUCTION.head_dims}
    assert {dims(c) for c in prod if c.causal} == set(stages.PRODUCTION.head_dims)
    assert any(c.window and c.window[1] == 0 and not c.causal for c in prod)   # sliding
    assert any(c.window and c.window[0] > 0 and c.window[1] > 0 for c in prod)  # two-sided
    assert any(c.causal for c, ctas in cases if ctas)                  # masked, several tiles
    assert any(1 < c.hkv < c.heads for c in prod) and any(c.hkv == 1 < c.heads for c in prod)
    ragged = [c for c in prod if c.seq_q % tiles[dims(c)] and c.lk % 128]
    assert any(c.seq_q < c.lk for c in ragged) and any(c.seq_q > c.lk for c in ragged)
    assert any(c.diagonal == "top_left" for c in prod)
    lse = [c for c in prod if c.lse]
    assert any(not (c.causal or c.window or c.hkv != c.heads) for c in lse)     # alone
    assert any(c.causal or c.window for c in lse) and any(c.hkv != c.heads for c in lse)
    for c in prod:
        assert c.batch * c.heads * c.seq_q * c.lk <= 2 * 2 * 512 * 512, c    # small: racecheck
    controls = [name for name, _, _ in _listed("--controls")]
    assert [n.split()[-1] for n in controls] == ["PTXATTN_PLANT_HAZARD=1",
                                                 "PTXATTN_PLANT_HAZARD=2"]


def test_sanitize_case_runs_the_production_build_of_its_head_dim(monkeypatch):
    """--stage production:64 prepares the production kernel on D = 64 inputs (its three-consumer
    build), a lineage stage on D = 128, with the case's features passed to prepare() and its
    k/v heads; --stages takes "production" (or 0) for its cases."""
    case = _sanitize_case_module()
    assert case.stage_and_head_dim("production:64") == ("production", 64)
    assert case.stage_and_head_dim("14") == ("14", 128)
    with pytest.raises(Exception, match="production:D"):
        case.stage_and_head_dim("production:x")
    assert case.parse_stages("1, production") == {1, 0} and case.parse_stages("") is None
    assert {c.kernel for c in case.cases({0})} == {f"production:{d}" for d in (64, 128, 256)}

    from ptxattn import api
    seen = {}

    def prepare(q, k, v, *, stage, **kw):
        seen.update(stage=stage, d=q.shape[-1], k=k.shape, kw=kw)
        raise RuntimeError("stop here")          # the launch needs a GPU

    monkeypatch.setattr(api, "prepare", prepare)
    from ptxattn import tensors
    monkeypatch.setattr(tensors, "from_numpy", lambda x, **kw: x)
    monkeypatch.setattr(tensors, "empty", lambda shape, **kw: type(
        "Out", (), {"fill_u16": lambda self, v: None})())
    with pytest.raises(RuntimeError, match="stop here"):
        case.main("--stage production:64 -b 1 -H 4 --heads-kv 2 -L 333 --seq-k 200 "
                  "--layout bshd --window 40,8 --diagonal top_left --lse".split())
    assert seen["stage"].production and seen["d"] == 64
    assert stages.get_stage(seen["stage"]).specialize(seen["d"]).threads == 512
    assert seen["k"] == (1, 200, 2, 64)                                  # BSHD, 2 k/v heads
    assert seen["kw"] == dict(layout="bshd", out=seen["kw"]["out"], defines=None,
                              return_lse=True, causal=False, window=(40, 8),
                              diagonal="top_left")
    # decode's rows (and bench/decode_device.sh's command) go to its own runner
    monkeypatch.setattr(case, "run_decode", lambda *a: seen.update(decode=a) or True)
    assert case.main("--stage decode:128 -b 3 -H 8 -L 600".split()) == 0
    assert seen["decode"] == (128, 3, 8, 600, 0)


def test_sanitize_dry_run_names_every_command(tmp_path):
    env = _env() | {"DRY_RUN": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(SANITIZE)], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [l for l in result.stdout.splitlines()
             if "sanitize_case.py" in l and "PLANT_HAZARD" not in l]   # controls: test_bench
    n_cases = len(_listed())
    assert re.search(r"estimate: \d+ sanitizer invocations \+ \d+ plain runs, \d+ at a time: "
                     r"about \d+s", result.stderr), result.stderr
    for tool in TOOLS:
        mine = [l for l in lines if f"--tool {tool}" in l]
        assert len(mine) == n_cases, (tool, len(mine), n_cases)
    assert any("PTXATTN_PERSISTENT_CTAS=2" in l for l in lines)
    kinds = "production|decode|paged|varlen|paged_varlen|fp8"
    assert all(re.search(rf"--stage (\d+|({kinds}):\d+) ", l) for l in lines)
    assert any("--stage production:64 " in l for l in lines)
    assert not list(tmp_path.iterdir())            # a dry run writes no report


# --------------------------------------------------------------------------- set-up and "No GPU?"

def _section(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(heading + "\n")
    level = heading.split(" ", 1)[0]
    rest = text[start + len(heading) + 1:]
    end = re.search(rf"^#{{1,{len(level)}}} ", rest, flags=re.M)
    return rest[:end.start()] if end else rest


def test_setup_names_the_python_it_needs_and_a_virtual_environment():
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    setup = _section("## Set up")
    minimum = project["requires-python"].removeprefix(">=")
    assert f"Python {minimum} or newer" in setup
    assert "python3 -m venv .venv && . .venv/bin/activate" in setup
    # the two commands the README promises: install + run, install + tests
    assert "pip install -e '.[tools]' && ptxattn run production --shape 4k" in setup
    assert "pip install -e '.[test,tools]' && python -m pytest -q" in setup
    for extra in ("tools", "test"):
        assert extra in project["optional-dependencies"]


def test_the_version_has_one_source():
    import tomllib

    import ptxattn
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "ptxattn.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", ptxattn.__version__)


def _no_gpu_commands() -> list[list[str]]:
    [block] = re.findall(r"^```bash\n(.*?)^```$", _section("### No GPU?"), flags=re.M | re.S)
    commands = []
    for line in block.splitlines():
        line = line.split("#", 1)[0].split("|", 1)[0].strip()
        if line.startswith("ptxattn "):
            commands.append(line.split()[1:])
    return commands


def test_no_gpu_quick_start_runs_offline(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from ptxattn import driver
    from ptxattn.tools import cli

    def no_gpu():
        raise AssertionError("a 'No GPU?' command asked for the GPU")
    monkeypatch.setattr(driver, "device_info", no_gpu)
    monkeypatch.chdir(ROOT)
    commands = _no_gpu_commands()
    assert {c[0] for c in commands} == {"list", "ptx", "sass", "diff", "bench", "trace", "guide"}
    for args in commands:
        if args[0] in ("sass", "diff"):          # ptxas runs: covered by test_cli.py; here the
            for stage in args[1:3]:              # stages they name must exist
                if stage.isdigit():
                    stages.get_stage(stage)
            continue
        args = [str(tmp_path / a) if a.endswith(".svg") else a for a in args]
        result = CliRunner().invoke(cli.main, args)
        assert result.exit_code == 0, (args, result.output)
        assert "--from-json" not in args or "GPU" not in result.output


def test_the_no_gpu_error_names_the_quick_start_commands():
    from ptxattn.tools import cli
    for command in {c[0] for c in _no_gpu_commands()}:
        assert command in cli.NO_GPU_COMMANDS, command

"""A wheel built from the repository carries every kernel and works from any directory (CPU).

ptx/ stays at the repository's root and is package data (pyproject.toml: ptxattn._ptx); here
the wheel is built offline from a clean copy of the sources (`pip wheel --no-build-isolation
--no-index`: setuptools and wheel come with the test extra), installed with `pip install
--target`, and its commands run from a directory outside the checkout, with the checkout and
any editable install of it out of reach, so that every file they read is the wheel's.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ptxattn.tools import sass

ROOT = Path(__file__).resolve().parent.parent
KERNEL_SUFFIXES = (".ptx", ".ptxh")

# Runs a script or `-c` code with nothing of the checkout importable: the editable install's
# finder (a meta path hook that would serve any module the wheel lacks from the checkout) and
# any sys.path entry inside the checkout are removed first; at exit it names every module that
# was loaded from the checkout after all (there must be none).
# The interpreter's own site-packages stay: CI's venv lives inside the checkout (.ci/run makes
# .venv there), and the wheel's dependencies (click, numpy, ...) are installed in it.
GUARD = """
import atexit, runpy, site, sys
from pathlib import Path
root = Path(sys.argv[1]).resolve()
sites = [Path(p).resolve() for p in site.getsitepackages() + [site.getusersitepackages()]]


def in_checkout(path):
    path = Path(path or ".").resolve()
    return path.is_relative_to(root) and not any(path.is_relative_to(s) for s in sites)


sys.meta_path[:] = [f for f in sys.meta_path
                    if not (getattr(f, "__module__", None) or "").startswith("__editable__")]
sys.path[:] = [p for p in sys.path if not in_checkout(p)]


def leaked():
    bad = sorted(name for name, m in list(sys.modules.items())
                 if getattr(m, "__file__", None) and in_checkout(m.__file__))
    if bad:
        sys.stderr.write(f"LEAKED FROM THE CHECKOUT: {bad}\\n")


atexit.register(leaked)
if sys.argv[2] == "-c":
    code = sys.argv[3]
    sys.argv = ["-c"]
    exec(compile(code, "<-c>", "exec"), {"__name__": "__main__"})
else:
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _build_tools_missing() -> str | None:
    try:
        version = importlib.metadata.version("setuptools")
        importlib.metadata.version("wheel")
    except importlib.metadata.PackageNotFoundError as exc:
        return f"{exc.name} is not installed (pip install -e '.[test]')"
    if int(version.split(".")[0]) < 68:
        return f"setuptools {version} < 68 (pip install -e '.[test]')"
    return None


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(_build_tools_missing() is not None,
                                 reason=str(_build_tools_missing()))]


def kernel_files() -> list[str]:
    """The checkout's kernel files and their READMEs, relative to ptx/."""
    return sorted(str(p.relative_to(ROOT / "ptx")) for p in (ROOT / "ptx").rglob("*")
                  if p.is_file() and (p.suffix in KERNEL_SUFFIXES or p.name == "README.md"))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(target folder of `pip install --target`, the wheel's file names)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, src / name)
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for folder in ("ptxattn", "ptx"):
        shutil.copytree(ROOT / folder, src / folder, ignore=junk)
    dist = tmp / "dist"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                          "-w", str(dist), str(src)], check=True, cwd=tmp, timeout=300,
                   capture_output=True, text=True)
    (wheel,) = dist.glob("ptxattn-*.whl")
    target = tmp / "site"
    subprocess.run(pip + ["install", "--no-deps", "--no-index", "-q", "--target", str(target),
                          str(wheel)], check=True, cwd=tmp, timeout=300,
                   capture_output=True, text=True)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    return target, names, elsewhere


def run(installed, *argv, code: str | None = None) -> str:
    """A command of the installed wheel, from outside the checkout; its stdout."""
    target, _, elsewhere = installed
    guard = elsewhere / "guard.py"
    guard.write_text(GUARD)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = str(target)
    command = [sys.executable, str(guard), str(ROOT)] + (["-c", code] if code else list(argv))
    proc = subprocess.run(command, capture_output=True, text=True, cwd=elsewhere, env=env,
                          timeout=300)
    assert proc.returncode == 0, (argv, proc.stdout[-2000:], proc.stderr[-4000:])
    assert "LEAKED FROM THE CHECKOUT" not in proc.stderr, proc.stderr
    return proc.stdout


def test_the_wheel_holds_every_kernel(installed):
    _, names, _ = installed
    packaged = sorted(n.removeprefix("ptxattn/_ptx/") for n in names
                      if n.startswith("ptxattn/_ptx/"))
    assert packaged == kernel_files()
    assert sum(n.endswith(".ptx") for n in names) >= 35 and "ptxattn/tools/cli.py" in names
    assert "ptxattn/tools/emulator/machine.py" in names and "ptxattn/tools/emulate.py" in names
    assert not [n for n in names if n.startswith(("tests/", "bench/", "ptx/"))]


def test_import_from_elsewhere_finds_the_installed_package_and_kernels(installed):
    target, _, elsewhere = installed
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = str(target)
    # the plain command, as a user types it
    proc = subprocess.run([sys.executable, "-c", "import ptxattn; print(ptxattn.__file__)"],
                          capture_output=True, text=True, cwd=elsewhere, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).is_relative_to(target)
    out = run(installed, code="import ptxattn, ptxattn.stages as s\n"
                              "print(ptxattn.__file__)\nprint(s.ptx_root())\n"
                              "print(ptxattn.attention.__module__)\n")
    where, root, module = out.split()
    assert Path(where).is_relative_to(target) and module == "ptxattn.api"
    assert Path(root) == target / "ptxattn" / "_ptx"


def test_ptxattn_list_from_the_console_script(installed):
    target, _, _ = installed
    out = run(installed, str(target / "bin" / "ptxattn"), "list")
    rows = {line.split()[1] for line in out.splitlines()[1:] if len(line.split()) > 1}
    assert {"production", "baseline", "persistent", "q_tile_ahead"} <= rows, out[:2000]
    assert "no PTX file yet" not in out           # cli: a registered stage whose file is absent
    assert str(target / "ptxattn" / "_ptx") in run(installed, str(target / "bin" / "ptxattn"),
                                                   "info")


def test_ptxattn_ptx_14_prints_the_kernel(installed):
    target, _, _ = installed
    out = run(installed, str(target / "bin" / "ptxattn"), "ptx", "14")
    assert ".visible .entry ptxattn_fwd(" in out and "wgmma.mma_async" in out
    assert ".param .align 64 .b8 tmap_q[128]" in out and out.count("\n") > 300


@pytest.mark.skipif(sass.locate("ptxas") is None, reason="no ptxas (pip install -e '.[tools]')")
def test_ptxattn_sass_production_summary(installed):
    target, _, _ = installed
    out = run(installed, str(target / "bin" / "ptxattn"), "sass", "production", "--summary")
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "ptxattn_fwd (sm_90a)" in lines["function"]
    registers = int(lines["registers"].split()[1])
    assert 64 <= registers <= 255, lines["registers"]
    assert "HGMMA" in lines and int(lines["instructions"].split()[1]) > 1000

"""A hard dependency that is missing fails the suite; it never turns tests into skips.

`pytest.importorskip("cuda.bindings.driver")` in test_prepare.py and test_driver.py made ~280
tests (with test_steady.py, which imports test_prepare) vanish green on a machine without
cuda-python. Skips are for what is optional (torch, diffusers, matplotlib, a GPU).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
# distribution name -> the module it is imported as
IMPORT_NAMES = {"cuda-python": "cuda", "ml_dtypes": "ml_dtypes", "numpy": "numpy",
                "click": "click", "pcpp": "pcpp"}


def hard_dependencies() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0] for d in project["dependencies"]]
    unknown = [n for n in names if n not in IMPORT_NAMES]
    assert not unknown, f"add the import names of {unknown} to IMPORT_NAMES"
    return [IMPORT_NAMES[n] for n in names]


def test_no_test_skips_for_want_of_a_hard_dependency():
    modules = hard_dependencies()
    skip = re.compile(r"""(?:importorskip|import_or_skip)\(\s*["']([\w.]+)["']""")
    found = [f"{path.name}: {m.group(0)}" for path in sorted(TESTS.glob("*.py"))
             if path.name != Path(__file__).name for m in skip.finditer(path.read_text())
             if m.group(1).split(".")[0] in modules]
    assert not found, f"hard dependencies must be imported, not skipped: {found}"


def test_without_cuda_python_the_driver_tests_fail_to_collect():
    """cuda.bindings made unimportable: collecting the tests that use it is an error (exit
    status 2, ModuleNotFoundError named), not a green run of skips."""
    code = ("import sys; sys.modules['cuda.bindings'] = None; "
            "sys.modules['cuda.bindings.driver'] = None; import pytest; "
            "sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', "
            "'tests/test_prepare.py', 'tests/test_driver.py', 'tests/test_steady.py']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, (proc.returncode, out[-3000:])
    assert "ModuleNotFoundError" in out and "cuda.bindings" in out, out[-3000:]
    assert out.count("ERROR collecting") == 3, out[-3000:]

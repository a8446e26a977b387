"""CI (.ci/run) runs the README's test command after installing PyTorch's CPU build and the
model libraries, so that the torch integration and the gloo ring run in every CI run; and when
it installed them, their absence fails the run instead of turning ~160 tests into skips."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CI = ROOT / ".ci" / "run"
README_TEST_COMMAND = "pip install -e '.[test,tools]' && python -m pytest -q"


def test_the_modules_ci_installed_are_importable():
    """.ci/run exports PTXATTN_CI_EXPECT_IMPORTS after installing them (unset elsewhere)."""
    for name in os.environ.get("PTXATTN_CI_EXPECT_IMPORTS", "").split():
        importlib.import_module(name)


def test_ci_runs_the_readme_command_after_installing_cpu_torch():
    text = CI.read_text()
    subprocess.run(["bash", "-n", str(CI)], check=True)
    assert README_TEST_COMMAND in (ROOT / "README.md").read_text()
    install, pytest_line = (f"python -m {part.strip()}" if not part.strip().startswith("python")
                            else part.strip() for part in README_TEST_COMMAND.split("&&"))
    code = [line.strip() for line in text.splitlines() if not line.strip().startswith("#")]
    pos = {what: next(i for i, line in enumerate(code) if line.startswith(what))
           for what in ("case \"$TORCH_MODE\"", "python -m pip install -q -e '.[test,tools]'",
                        "python -m pytest -q")}
    assert pos["case \"$TORCH_MODE\""] < pos["python -m pip install -q -e '.[test,tools]'"] \
        < pos["python -m pytest -q"]
    assert install.replace("pip install", "pip install -q") in code
    assert pytest_line in code
    # the default takes the CPU build: PyTorch's CPU index, else a local wheel, never PyPI's
    assert "CPU_INDEX=https://download.pytorch.org/whl/cpu" in text
    assert re.search(r"TORCH_MODE=\$\{PTXATTN_CI_TORCH:-cpu\}", text)
    cpu_branch = text[text.index("install_cpu_torch() {"):text.index('case "$TORCH_MODE" in')]
    assert "--index-url \"$CPU_INDEX\"" in cpu_branch and "--no-index --no-deps torch" in cpu_branch
    assert not re.search(r"pip install -q torch\s*$", cpu_branch, flags=re.M)

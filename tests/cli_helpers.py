"""Helpers shared by the CLI tests: run the click app in-process, read its one error line."""

import pytest
from click.testing import CliRunner

from ptxattn import driver
from ptxattn.errors import NoGpuError
from ptxattn.tools import sass
from ptxattn.tools.cli import main

needs_sass = pytest.mark.skipif(
    sass.locate("ptxas") is None or not (sass.locate("nvdisasm") or sass.locate("cuobjdump")),
    reason="no ptxas/nvdisasm (pip install 'ptxattn[tools]')")


@pytest.fixture
def no_gpu(monkeypatch):
    """Make the driver say 'no GPU' whatever machine this is."""
    def fail():
        raise NoGpuError("ptxattn: no CUDA GPU available (test)")
    monkeypatch.setattr(driver, "device_info", fail)


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_clean_error(result, *needles):
    """Exit code != 0, one `Error: ...` line, no traceback; returns that line."""
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    for needle in needles:
        assert needle in errors[0], result.output
    return errors[0]

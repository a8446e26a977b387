"""Helpers shared by the CLI tests: run the click app in-process, read its one error line."""

from click.testing import CliRunner

from ptxattn.tools.cli import main


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

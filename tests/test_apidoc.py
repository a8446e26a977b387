"""docs/api.md is what `python -m ptxattn.tools.apidoc` writes from the docstrings, covers every
public name, argument and exception, and every environment variable the code reads, with the
default the code applies."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import ptxattn
from ptxattn.tools import apidoc

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "api.md"


def test_the_committed_reference_is_current():
    assert DOC.read_text(encoding="utf-8") == apidoc.build(), \
        "docs/api.md is stale: run python -m ptxattn.tools.apidoc"


def test_every_exported_name_has_an_entry_with_every_argument():
    text = DOC.read_text(encoding="utf-8")
    for name in sorted(n for n in ptxattn.__all__ if n not in ptxattn._SUBMODULES):
        heading = re.search(rf"^### (class )?`ptxattn\.{name}`", text, flags=re.M)
        assert heading, f"ptxattn.{name} has no entry in docs/api.md"
        obj = getattr(ptxattn, name)
        if inspect.isfunction(obj):
            entry = text[heading.end():].split("\n### ", 1)[0]
            for param in inspect.signature(obj).parameters:
                assert re.search(rf"\b{param}\b", entry), (name, param)


def test_torch_and_distributed_names_have_entries():
    text = DOC.read_text(encoding="utf-8")
    tree = ast.parse((ROOT / "ptxattn" / "torch" / "__init__.py").read_text())
    names = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                 and getattr(n.targets[0], "id", "") == "__all__")
    for name in names:
        assert f"`ptxattn.torch.{name}`" in text, name
    for name in ("ring_attention", "ShardPlan", "shard", "gather"):
        assert f"`ptxattn.distributed.{name}`" in text, name


def test_every_exception_class_is_listed():
    text = DOC.read_text(encoding="utf-8")
    for path in (ROOT / "ptxattn").rglob("*.py"):
        if "emulator" in str(path):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Error") \
                    and not node.name.startswith("_") and path.name not in ("trace.py",):
                assert f"{node.name}`" in text, f"{node.name} ({path}) is not in docs/api.md"


def test_environment_table_matches_what_the_code_reads():
    missing, stale = apidoc.undocumented_environment()
    assert not missing, f"read in the code, not described in apidoc.ENVIRONMENT: {missing}"
    assert not stale, f"described in apidoc.ENVIRONMENT, read nowhere: {stale}"
    for name in ("PTXATTN_DEVICE", "PTXATTN_REQUIRE_GPU", "PTXATTN_PERSISTENT_CTAS"):
        assert f"| `{name}` |" in DOC.read_text()


@pytest.mark.parametrize("name", sorted(apidoc.environment_defaults()))
def test_each_documented_default_is_the_codes(name):
    documented = apidoc.ENVIRONMENT[name][0]
    for default in apidoc.environment_defaults()[name]:
        if default == "":
            assert documented.startswith("unset"), (name, documented)
        else:
            assert documented.split()[0] == default, (name, documented, default)


def test_the_scanner_finds_a_new_read(tmp_path, monkeypatch):
    """A variable read through a module constant, as the code does, is found (so the currency
    check above can fail)."""
    pkg = tmp_path / "ptxattn"
    pkg.mkdir()
    (pkg / "m.py").write_text('import os\nKNOB_ENV = "PTXATTN_NEW_KNOB"\n'
                              'def f():\n    return os.environ.get(KNOB_ENV, "7")\n')
    monkeypatch.setattr(apidoc, "PACKAGE", pkg)
    monkeypatch.setattr(apidoc, "ROOT", tmp_path)
    monkeypatch.setattr(apidoc, "EXTRA_SOURCES", ())
    assert apidoc.environment_reads() == {"PTXATTN_NEW_KNOB": {"ptxattn/m.py"}}
    assert apidoc.environment_defaults() == {"PTXATTN_NEW_KNOB": {"7"}}

"""Load a module of bench/ or bench/models (scripts, not a package) by its file, for the tests."""

import importlib.util
from pathlib import Path

MODELS = Path(__file__).resolve().parents[1] / "bench" / "models"


def load(name: str):
    """bench/models/<name>.py as a module named capstone_<name>."""
    spec = importlib.util.spec_from_file_location(f"capstone_{name}", MODELS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_script(name: str):
    """bench/<name>.py as a module named bench_<name> (registered: dataclasses need that)."""
    import sys
    spec = importlib.util.spec_from_file_location(f"bench_{name}", MODELS.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module

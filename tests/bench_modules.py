"""Load a module of bench/models (scripts, not a package) by its file, for the tests."""

import importlib.util
from pathlib import Path

MODELS = Path(__file__).resolve().parents[1] / "bench" / "models"


def load(name: str):
    """bench/models/<name>.py as a module named capstone_<name>."""
    spec = importlib.util.spec_from_file_location(f"capstone_{name}", MODELS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

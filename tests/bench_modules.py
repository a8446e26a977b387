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


def run_with_stub_python(script, tmp_path, **env):
    """bash `script` (a device script of bench/) with stand-in python3 and nvidia-smi on PATH,
    python3 logging its arguments: (the process, python3's calls but pip's), OUT=tmp_path/o."""
    import subprocess
    root = MODELS.parents[1]
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    log = tmp_path / "calls.txt"
    (stub / "python3").write_text(f'#!/bin/bash\necho "$*" >> {log}\n')
    (stub / "nvidia-smi").write_text("#!/bin/bash\nexit 0\n")
    for f in stub.iterdir():
        f.chmod(0o755)
    log.write_text("")
    proc = subprocess.run(["bash", str(root / script)], cwd=root, capture_output=True,
                          text=True, timeout=60,
                          env={"PATH": f"{stub}:/usr/bin:/bin", "OUT": str(tmp_path / "o"),
                               **env})
    return proc, [x for x in log.read_text().splitlines() if not x.startswith("-m pip")]

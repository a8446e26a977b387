"""Shared test setup: GPU tests (marked `gpu`) are skipped unless a GPU is usable.

"Usable" means cuInit(0) succeeds and the driver reports at least one device.
The probe talks to cuda.bindings directly (not through ptxattn), so a bug in
ptxattn.driver cannot hide GPU tests, and it runs only when gpu tests are
collected.

PTXATTN_REQUIRE_GPU=1 (bench/device_run.sh sets it) turns that skip into a failure, and
with tests/gpu_checks.py also the skips of GPU tests whose framework (torch, CuPy, JAX)
cannot be imported or used: a device run cannot come back green without having run.
"""

from __future__ import annotations

import functools
import os

import pytest
from gpu_checks import REQUIRE_GPU_ENV, gpu_required   # tests/ is on sys.path (rootdir conftest)

# JAX (imported by some GPU tests) takes 75% of GPU memory at its first use unless told not to;
# this must be set before jax is imported anywhere in the session.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


@functools.lru_cache(maxsize=1)
def gpu_status() -> tuple[bool, str]:
    try:
        from cuda.bindings import driver as cu
    except ImportError as e:
        return False, f"cuda-python is not importable ({e})"
    try:
        (err,) = cu.cuInit(0)
    except Exception as e:           # libcuda.so cannot be loaded
        return False, f"no CUDA driver library ({type(e).__name__})"
    if int(err) != 0:
        return False, f"cuInit returned {cu.CUresult(int(err)).name}"
    err, count = cu.cuDeviceGetCount()
    if int(err) != 0 or count == 0:
        return False, "the driver reports no CUDA device"
    return True, ""


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items or gpu_required():      # required: pytest_runtest_setup fails them instead
        return
    usable, why = gpu_status()
    if usable:
        return
    skip = pytest.mark.skip(reason=f"no usable GPU: {why}")
    for item in gpu_items:
        item.add_marker(skip)


def pytest_runtest_setup(item):
    if "gpu" in item.keywords and gpu_required():
        usable, why = gpu_status()
        if not usable:
            pytest.fail(f"{REQUIRE_GPU_ENV}=1 but no usable GPU: {why}", pytrace=False)


@pytest.fixture
def no_driver(monkeypatch):
    """Fail loudly if a test reaches the CUDA driver (validation must not)."""
    from ptxattn import driver

    def refuse(*args, **kwargs):
        raise AssertionError("the CUDA driver was touched")

    monkeypatch.setattr(driver, "context", refuse)
    monkeypatch.setattr(driver, "cu", refuse)


@pytest.fixture
def emulated_gpu(monkeypatch):
    """An H200 emulated on the CPU (ptxattn/tools/emulator): ptxattn.driver.cu() returns the
    emulator's fake of cuda.bindings.driver, so attention() and every other public entry point
    run end to end (validation, plan, maps, parameters, launch, output). The runtime's caches of
    contexts, modules and maps are cleared before and after. Yields the FakeDriver (its
    .launches hold each launch's report)."""
    from ptxattn.tools.emulator import fake_driver
    fake = fake_driver.install(monkeypatch)
    yield fake
    fake_driver.clear_runtime_caches()

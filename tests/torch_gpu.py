"""The fixtures of the GPU tests that run through PyTorch: `torch` (the module, with CUDA, or
a skip that PTXATTN_REQUIRE_GPU=1 turns into a failure) and `pt` (ptxattn.torch with its
fallback counters reset before and after). Import both into a test module."""

from __future__ import annotations

import pytest
from gpu_checks import import_or_skip, skip_or_fail


@pytest.fixture(scope="module")
def torch():
    t = import_or_skip("torch")
    if not t.cuda.is_available():
        skip_or_fail("torch has no CUDA here (a CPU build, or no device)")
    return t


@pytest.fixture
def pt(torch):
    import ptxattn.torch as pt
    pt.reset_fallback_counts()
    yield pt
    pt.reset_fallback_counts()

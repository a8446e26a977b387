"""attention(..., return_lse=True, lse_out=): the caller's LSE buffer (CPU only).

Validation refuses every bad buffer before any driver call, naming lse_out; a good one is
what the plan launches with (so a caller that gives out= and lse_out= allocates nothing
through the library: what CUDA-graph capture of ptxattn.torch's op with its LSE needs). The
steady path keys the buffer like out=. Device arrays are fakes (tests/fakes.py) never read,
or the pretend driver of bench/callpath.py where launches are recorded.
"""

from __future__ import annotations

import numpy as np
import pytest
from fakes import FAKE_BASE, FakeDLPack

from ptxattn import api as attn
from ptxattn.plan import validate

B, H, L, D = 2, 3, 100, 128
MiB = 1 << 20


def dev(shape, slot, **kw):
    return FakeDLPack(shape, ptr=FAKE_BASE + slot * 64 * MiB, **kw)


def qkv():
    return dev((B, H, L, D), 0), dev((B, H, L, D), 1), dev((B, H, L, D), 2)


def plan_with(lse_out, **kw):
    q, k, v = qkv()
    return validate(q, k, v, stage=None, scale=None, layout="bhld", out=None, stream=None,
                    return_lse=True, lse_out=lse_out, **kw)


@pytest.mark.usefixtures("no_driver")
def test_a_good_device_buffer_is_the_plans():
    lse = dev((B, H, L), 3, dtype="float32")
    plan = plan_with(lse)
    assert plan.lse_out.ptr == lse.ptr and plan.lse_out.dtype == np.float32
    assert plan.lse_out.shape == (B, H, L)


@pytest.mark.usefixtures("no_driver")
@pytest.mark.parametrize("make, exc, words", [
    (lambda: dev((B, H, L + 1), 3, dtype="float32"), ValueError, ["lse_out", "shape", str((B, H, L))]),
    (lambda: dev((B, H, L), 3, dtype="bfloat16"), TypeError, ["lse_out", "float32"]),
    (lambda: dev((B, H, L), 3, dtype="float32", strides=(H * L * 2, L * 2, 2)), ValueError,
     ["lse_out", "contiguous"]),
    (lambda: FakeDLPack((B, H, L), ptr=FAKE_BASE + 3 * 64 * MiB + 2, dtype="float32"),
     ValueError, ["lse_out", "aligned"]),
    (lambda: dev((B, H, L), 3, dtype="float32", readonly=True), ValueError,
     ["lse_out", "read-only"]),
    (lambda: dev((B, H, L), 0, dtype="float32"), ValueError, ["lse_out", "overlaps q"]),
    (lambda: dev((B, H, L), 3, dtype="float32", device=1), ValueError, ["lse_out", "device"]),
    (lambda: np.zeros((B, H, L), np.float32), ValueError, ["lse_out", "NumPy"]),
    (lambda: [1.0], TypeError, ["lse_out", "list"]),
])
def test_bad_device_buffers_are_refused_by_name(make, exc, words):
    with pytest.raises(exc) as info:
        plan_with(make())
    for w in words:
        assert w in str(info.value), (w, str(info.value))


@pytest.mark.usefixtures("no_driver")
def test_lse_out_needs_return_lse():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="lse_out: given with return_lse=False"):
        attn.attention(q, k, v, lse_out=dev((B, H, L), 3, dtype="float32"))


def test_host_buffers():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 8, 64)).astype(np.float32) for _ in range(3))
    with pytest.raises(TypeError, match="lse_out: expected dtype float32"):
        validate(q, k, v, stage=None, scale=None, layout="bhld", out=None, stream=None,
                 return_lse=True, lse_out=np.zeros((1, 2, 8), np.float64))
    with pytest.raises(ValueError, match="lse_out: expected shape"):
        validate(q, k, v, stage=None, scale=None, layout="bhld", out=None, stream=None,
                 return_lse=True, lse_out=np.zeros((1, 2, 9), np.float32))
    frozen = np.zeros((1, 2, 8), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="lse_out: the NumPy array is read-only"):
        validate(q, k, v, stage=None, scale=None, layout="bhld", out=None, stream=None,
                 return_lse=True, lse_out=frozen)
    with pytest.raises(ValueError, match="lse_out: q, k, v are NumPy"):
        validate(q, k, v, stage=None, scale=None, layout="bhld", out=None, stream=None,
                 return_lse=True, lse_out=dev((1, 2, 8), 3, dtype="float32"))
    good = np.zeros((1, 2, 8), np.float32)
    plan = validate(q, k, v, stage=None, scale=None, layout="bhld", out=None, stream=None,
                    return_lse=True, lse_out=good)
    assert plan.lse_out is good and plan.host


@pytest.fixture
def pretend(monkeypatch):
    """bench/callpath.py's pretend driver: the library's real code, launches recorded."""
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import callpath

    from ptxattn import driver
    launches = []
    with callpath.fake_driver():
        cu = driver.cu()
        real, alloc = cu.cuLaunchKernelEx, cu.cuMemAllocAsync
        allocs = []
        cu.cuLaunchKernelEx = lambda *a: (launches.append(a), real(*a))[1]
        cu.cuMemAllocAsync = lambda *a: (allocs.append(a), alloc(*a))[1]
        try:
            yield launches, allocs
        finally:
            cu.cuLaunchKernelEx, cu.cuMemAllocAsync = real, alloc
    import sys
    sys.modules.pop("callpath", None)


def test_with_out_and_lse_out_the_library_allocates_nothing_and_the_steady_path_keys_it(pretend):
    """Given out= and lse_out=, neither the full path nor the steady one allocates (what a
    CUDA-graph capture needs), the caller's buffers come back, and a new LSE buffer at another
    address is another key (a full-path call), the same one a steady hit."""
    from ptxattn import fastpath, tensors
    launches, allocs = pretend
    fastpath.clear_steady_cache()
    q, k, v = (tensors.empty((1, 2, 64, 128)) for _ in range(3))
    out = tensors.empty((1, 2, 64, 128))
    lse = tensors.empty((1, 2, 64), dtype=np.float32)
    other = tensors.empty((1, 2, 64), dtype=np.float32)
    before = len(allocs)
    for buf in (lse, lse, other, lse):
        got_out, got_lse = attn.attention(q, k, v, out=out, return_lse=True, lse_out=buf)
        assert got_out is out and got_lse is buf
    assert len(allocs) == before, "the library allocated with out= and lse_out= given"
    assert len(launches) == 4
    keys = [key for key in fastpath._STEADY if key[9] is not None]
    assert {key[9][0] for key in keys} == {lse.ptr, other.ptr}
    # without lse_out the LSE is the library's own (stream-ordered) allocation
    _, mine = attn.attention(q, k, v, out=out, return_lse=True)
    assert len(allocs) == before + 1 and mine.ptr not in (lse.ptr, other.ptr)
    fastpath.clear_steady_cache()

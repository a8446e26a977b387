"""How the GPU tests check: the pass bar on sampled rows, and skips that PTXATTN_REQUIRE_GPU=1
turns into failures.

Rows are compared at seeded random positions (reference.sample_rows: every row position of
a 128-row and of a 192-row tile at least once, never a fixed stride), and the non-finite scan (NaN and Inf)
covers the whole output, which the tests poison with NaN before the launch.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from ptxattn.reference import attention_reference, error_metrics, passes, sample_rows

REQUIRE_GPU_ENV = "PTXATTN_REQUIRE_GPU"
CHECKED_ROWS = 256


def gpu_required() -> bool:
    return os.environ.get(REQUIRE_GPU_ENV, "").strip() not in ("", "0")


def skip_or_fail(reason: str):
    """pytest.skip(reason), or pytest.fail under PTXATTN_REQUIRE_GPU=1: for a test that could
    not run for want of its GPU framework (not for a shape a stage does not take)."""
    if gpu_required():
        pytest.fail(f"{REQUIRE_GPU_ENV}=1 and this test cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def import_or_skip(name: str):
    """The module (the named one: "ptxattn.torch" gives ptxattn.torch, not ptxattn), or
    skip_or_fail naming why it cannot be imported."""
    import importlib
    try:
        return importlib.import_module(name)
    except Exception as e:              # ImportError, or a broken CUDA setup under it
        skip_or_fail(f"{name} is not importable here: {type(e).__name__}: {e}")


def launch_once(p, out, inputs, lse: bool):
    """(out, lse or None) on the host after one launch of prepared call `p` into `out` (already
    NaN-poisoned), its LSE poisoned first when asked; p closed and `out` and `inputs` freed."""
    from ptxattn import driver
    if lse:
        driver.memset_u16(p.lse.ptr, 0xFFFF, 2 * p.lse.size)   # f32 NaN
    p.launch()
    o = out.to_numpy()
    l = p.lse.to_numpy() if lse else None
    p.close()
    for x in (*inputs, out):
        x.free()
    return o, l


def seq_axis(layout: str) -> int:
    return 2 if layout == "bhld" else 1


def rows_for(seq_q: int, seed: int = 0) -> np.ndarray:
    return sample_rows(seq_q, CHECKED_ROWS, seed=seed)


def check_rows(q, k, v, out, layout="bhld", scale=None, ref=None, seed=0, **mask) -> dict:
    """Metrics of out against the float64 reference on sampled query rows (rows_for), plus
    nan_total: NaN and Inf over all of out. `ref` is the reference on those rows, if made."""
    Lq = q.shape[seq_axis(layout)]
    rows = rows_for(Lq, seed)
    if ref is None:
        ref = attention_reference(q, k, v, scale=scale, layout=layout, rows=rows, **mask)
    got = np.take(out, rows, axis=seq_axis(layout))
    m = error_metrics(got, ref)
    m["nan_total"] = int(np.count_nonzero(~np.isfinite(np.asarray(out).astype(np.float32))))
    return m


def assert_passes(m: dict, what: str = "") -> None:
    """Fails with the figures: NaN/Inf anywhere first (unwritten tiles), then the bar."""
    assert m.get("nan_total", 0) == 0, f"{what} {m['nan_total']} NaN/Inf: tiles not written?"
    assert passes(m), f"{what} {m}"

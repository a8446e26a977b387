"""The K/V multicast build (-D PTXATTN_KV_MULTICAST=1: clusters of two CTAs on one head, each
K/V tile multicast to both) on the GPU against the float64 reference (skipped without a GPU;
PTXATTN_REQUIRE_GPU=1 makes a skip a failure).

Fresh standard-normal inputs per test, the output and the log-sum-exp poisoned with NaN
before the launch, sampled rows (reference.sample_rows) against the float64 reference with
DESIGN.md's bar, NaN/Inf over the whole output. The launch is checked to be the cluster one:
cluster (2, 1, 1), an even grid of at most the clusters that fit at once.
"""

from __future__ import annotations

import numpy as np
import pytest

from ptxattn import driver, kv_multicast, tensors
from ptxattn.api import prepare
from ptxattn.reference import BF16, attention_reference, error_metrics, sample_rows

from gpu_checks import assert_passes, launch_once

pytestmark = pytest.mark.gpu

MCAST = {kv_multicast.DEFINE: "1"}
LSE_TOL = 2e-3
ROWS = 256


def qkv(B, H, Hkv, Lq, Lk, layout, seed):
    rng = np.random.default_rng(seed)

    def one(h, L):
        shape = (B, h, L, 128) if layout == "bhld" else (B, L, h, 128)
        return rng.standard_normal(shape, dtype=np.float32).astype(BF16)
    return one(H, Lq), one(Hkv, Lk), one(Hkv, Lk)


def run(q, k, v, layout, lse=True):
    """Device copies in, NaN-poisoned out (and lse), one multicast launch, back on the host."""
    qd, kd, vd = (tensors.from_numpy(x) for x in (q, k, v))
    out = tensors.empty(q.shape)
    out.fill_u16(0xFFFF)                                      # bf16 NaN
    p = prepare(qd, kd, vd, layout=layout, out=out, return_lse=lse, defines=MCAST)
    assert p.cluster == kv_multicast.CLUSTER
    assert p.grid[0] % 2 == 0 and p.grid[1:] == (1, 1)
    most = driver.max_active_clusters(p.function, p.block, p.smem_bytes, p.cluster)
    assert 1 <= p.grid[0] // 2 <= most
    return launch_once(p, out, (qd, kd, vd), lse)


def check(B, H, Hkv, Lq, Lk, layout, seed, lse=True):
    q, k, v = qkv(B, H, Hkv, Lq, Lk, layout, seed)
    o, l = run(q, k, v, layout, lse)
    axis = 2 if layout == "bhld" else 1
    rows = sample_rows(Lq, ROWS, seed=seed + 7919)
    ref, ref_lse = attention_reference(q, k, v, layout=layout, rows=rows, return_lse=True)
    m = error_metrics(np.take(o, rows, axis=axis), ref)
    m["nan_total"] = int(np.count_nonzero(~np.isfinite(o.astype(np.float32))))
    assert_passes(m, f"multicast B={B} H={H} Hkv={Hkv} Lq={Lq} Lk={Lk} {layout}")
    if lse:
        assert not np.isnan(l).any(), f"{int(np.isnan(l).sum())} lse values left unwritten"
        err = np.abs(l[:, :, rows].astype(np.float64) - ref_lse).max()
        assert err <= LSE_TOL, f"lse max abs error {err:.2e}"
    return m


@pytest.mark.parametrize("B, H, L", [(1, 2, 256), (2, 3, 1024), (4, 16, 8192)])
@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_shapes(B, H, L, layout):
    check(B, H, H, L, L, layout, seed=B * 1000 + H * 10 + L % 997)


@pytest.mark.parametrize("H, Hkv", [(8, 2), (16, 1), (12, 4)])
@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_gqa(H, Hkv, layout):
    check(2, H, Hkv, 1024, 1024, layout, seed=H * 10 + Hkv)


@pytest.mark.parametrize("Lq, Lk", [(200, 300), (256, 1), (1000, 4095), (4096, 129)])
def test_lengths(Lq, Lk):
    """A ragged last Q tile (even blocks), a key tail, Lq != Lk both ways."""
    check(2, 3, 3, Lq, Lk, "bhld", seed=Lq + Lk)


def test_clusters_walk_several_pairs(monkeypatch):
    """A capped grid (PTXATTN_PERSISTENT_CTAS=4: two clusters), so each cluster walks many
    pairs and its ring wraps across tiles of several heads."""
    monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", "4")
    check(2, 5, 5, 1024, 1024, "bshd", seed=5)


def test_same_as_unicast():
    """The multicast build and the default build compute the same tiles in the same order of
    keys: their outputs are the same bits."""
    q, k, v = qkv(2, 4, 4, 2048, 2048, "bhld", seed=11)
    o_mc, _ = run(q, k, v, "bhld", lse=False)
    qd, kd, vd = (tensors.from_numpy(x) for x in (q, k, v))
    p = prepare(qd, kd, vd, layout="bhld")
    p.launch()
    o = p.out.to_numpy()
    p.close()
    for x in (qd, kd, vd):
        x.free()
    assert np.array_equal(o.view(np.uint16), o_mc.view(np.uint16))


def test_refused_on_gpu():
    q, k, v = qkv(1, 2, 2, 256, 256, "bhld", seed=1)
    with pytest.raises(ValueError, match="dense attention only"):
        prepare(q, k, v, causal=True, defines=MCAST)

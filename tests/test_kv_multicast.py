"""The K/V multicast build (-D PTXATTN_KV_MULTICAST=1) on the CPU: what the host refuses, the
cluster walk's model, and the kernel itself on the emulator (clusters of two, TMA multicast,
remote mbarrier arrives, barrier.cluster: ptxattn/tools/emulator/cluster.py) against the
float64 reference, with planted bugs the emulator must catch."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ptxattn import kv_multicast, reference, stages, tile_walk
from ptxattn.api import prepare

from emulator_checks import plant, qkv

MCAST = {kv_multicast.DEFINE: "1"}


def _plan(**kw):
    base = dict(masked=False, window=(-1, -1), head_dim=128, seq_q=256)
    base.update(kw)
    return SimpleNamespace(**base)


def _prod(head_dim=128, masked=False, varlen=False):
    return stages.PRODUCTION.specialize(head_dim, masked, varlen)


# ---- refusals ----------------------------------------------------------------------------

@pytest.mark.parametrize("plan, stage, defines, words", [
    (_plan(masked=True, window=(-1, 0)), _prod(masked=True), MCAST, "dense attention only"),
    (_plan(masked=True, window=(64, 64)), _prod(masked=True), MCAST, "sliding window"),
    (_plan(head_dim=64), _prod(64), MCAST, "head dim 128 only"),
    (_plan(head_dim=256), _prod(256), MCAST, "head dim 128 only"),
    (_plan(seq_q=128), _prod(), MCAST, "even number"),
    (_plan(seq_q=300), _prod(), MCAST, "got 3"),
    (_plan(), _prod(varlen=True), MCAST, "varlen"),
    (_plan(), _prod(), {**MCAST, "PTXATTN_FP8": "1"}, "FP8"),
    (_plan(), stages.get_stage(15), MCAST, "dynamic tile scheduler"),
    (_plan(), stages.get_stage(14), MCAST, "production kernel only"),
])
def test_refused(plan, stage, defines, words):
    with pytest.raises(ValueError, match=kv_multicast.DEFINE) as e:
        kv_multicast.check(plan, stage, defines)
    assert words in str(e.value)


def test_taken():
    for lq in (256, 200, 512, 8192, 16384):
        kv_multicast.check(_plan(seq_q=lq), _prod(), MCAST)      # no error


@pytest.mark.parametrize("value, asked", [("1", True), (1, True), ("0", False), (None, False)])
def test_requested(value, asked):
    defines = {} if value is None else {kv_multicast.DEFINE: value}
    assert kv_multicast.requested(defines) is asked


def test_refusal_before_anything_is_built(emulated_gpu):
    """A refused call compiles nothing, launches nothing, leaves no device memory behind."""
    q, k, v = qkv(1, 2, 256, 256, 128)
    live = emulated_gpu.gmem.bytes_live
    with pytest.raises(ValueError, match="dense attention only"):
        prepare(q, k, v, causal=True, defines=MCAST)
    with pytest.raises(ValueError, match="even number"):
        prepare(q[:, :, :100], k, v, defines=MCAST)
    assert emulated_gpu.launches == [] and emulated_gpu.gmem.bytes_live == live


# ---- the cluster walk ---------------------------------------------------------------------

@pytest.mark.parametrize("B, H, Lq, clusters, section", [
    (1, 2, 256, 2, 1), (2, 3, 1024, 5, 2), (4, 16, 8192, 66, 8), (1, 16, 16384, 66, 16),
    (2, 3, 1000, 7, 6), (1, 1, 512, 1, 1)])
def test_cluster_walk(B, H, Lq, clusters, section):
    """Every tile once; a cluster's two CTAs take query blocks 2m and 2m+1 of the same
    (batch, head) at each step, and the same number of steps (the same K/V tiles in the same
    ring positions)."""
    p = tile_walk.Problem(B, H, Lq, Lq, 128, H, None, 128, 128)
    assert p.m_blocks % 2 == 0
    walk = kv_multicast.walk(p, section, clusters)
    seen = []
    for ranks in walk:
        r0, r1 = ranks
        assert len(r0) == len(r1) >= 1
        for (m0, bh0), (m1, bh1) in zip(r0, r1):
            assert bh0 == bh1 and m0 % 2 == 0 and m1 == m0 + 1
        seen += r0 + r1
    assert sorted(seen) == sorted((m, bh) for m in range(p.m_blocks) for bh in range(B * H))


def test_cluster_count():
    assert kv_multicast.clusters(pairs=1000, max_active=66) == 66
    assert kv_multicast.clusters(pairs=3, max_active=66) == 3
    assert kv_multicast.clusters(pairs=1000, max_active=66, cap_ctas=4) == 2
    assert kv_multicast.clusters(pairs=1000, max_active=66, cap_ctas=1) == 1


def test_walk_section_in_pairs():
    """The pair walk's section is the sectioned walk's on M/2 blocks of twice the rows."""
    p = tile_walk.Problem(4, 16, 8192, 8192, 128, 16, None, 128, 128)
    pp = kv_multicast.pair_problem(p)
    assert pp.m_blocks == p.m_blocks // 2 and pp.bh == p.bh and pp.tiles == p.tiles // 2


# ---- the kernel on the emulator -------------------------------------------------------------

def _run(monkeypatch, B, H, Lq, Lk, *, hkv=None, layout="bhld", seed=None, ctas=None,
         lse=False, edits=()):
    from ptxattn.tools.emulator import fake_driver
    fake = fake_driver.install(monkeypatch, seed=seed, raise_hazards=False)
    if edits:
        plant(fake, *edits)
    if ctas is not None:
        monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", str(ctas))
    try:
        q, k, v = qkv(B, H, Lq, Lk, 128, heads_kv=hkv, layout=layout, seed=Lq + H)
        p = prepare(q, k, v, layout=layout, return_lse=lse, defines=MCAST)
        assert p.cluster == (2, 1, 1) and p.grid[0] % 2 == 0
        p.launch()
        out = p.out.to_numpy()
        got_lse = p.lse.to_numpy() if lse else None
        p.close()
    finally:
        fake_driver.clear_runtime_caches()
    (name, grid, block, smem, report), = fake.launches
    ref = reference.attention_reference(q, k, v, layout=layout, return_lse=lse)
    ref, ref_lse = ref if lse else (ref, None)
    return report, reference.error_metrics(out, ref), got_lse, ref_lse


@pytest.mark.parametrize("B, H, Lq, Lk, kw", [
    (1, 2, 256, 256, dict(seed=1)),                              # two clusters, one pair each
    (1, 2, 512, 512, dict(seed=2, ctas=2)),                      # one cluster walks 4 pairs
    (1, 4, 256, 300, dict(hkv=2, layout="bshd", seed=3, lse=True)),   # GQA, key tail, LSE
    (1, 2, 200, 160, dict(seed=4, ctas=2)),                      # ragged last Q tile
])
def test_emulated(monkeypatch, B, H, Lq, Lk, kw):
    report, m, lse, ref_lse = _run(monkeypatch, B, H, Lq, Lk, **kw)
    assert report.hazards == []
    assert reference.passes(m), m
    assert report.cluster == (2, 1, 1)
    kv_tiles = -(-Lk // 128)
    pairs = B * H * (-(-Lq // 128) // 2)
    assert report.multicast == 2 * kv_tiles * pairs          # each K and V tile once a pair
    if lse is not None:
        assert np.abs(lse - ref_lse).max() <= 2e-3


RELEASE_BOTH = ("@%p_lane0 mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%peer_bar];",
                "")


def test_emulator_catches_a_missing_peer_release(monkeypatch):
    """Consumers that release only their own CTA's slot (and counts to match): the peer's
    producer refills a slot this CTA still reads."""
    report, m, _, _ = _run(monkeypatch, 1, 2, 512, 512, seed=1, ctas=2, edits=(
        RELEASE_BOTH, ("mbarrier.init.shared::cta.b64 [%bar_empty_k], 16;",
                       "mbarrier.init.shared::cta.b64 [%bar_empty_k], 8;"),
        ("mbarrier.init.shared::cta.b64 [%bar_empty_k+8], 16;",
         "mbarrier.init.shared::cta.b64 [%bar_empty_k+8], 8;"),
        ("mbarrier.init.shared::cta.b64 [%bar_empty_v], 16;",
         "mbarrier.init.shared::cta.b64 [%bar_empty_v], 8;"),
        ("mbarrier.init.shared::cta.b64 [%bar_empty_v+8], 16;",
         "mbarrier.init.shared::cta.b64 [%bar_empty_v+8], 8;")))
    assert {h.kind for h in report.hazards} & {"tma-overwrite-in-flight-read",
                                               "read-before-tma-landed"}, report.hazards


def test_emulator_catches_an_early_exit(monkeypatch):
    """No cluster barrier before exit: a CTA leaves while its peer still arrives on its
    barriers."""
    report, _, _, _ = _run(monkeypatch, 1, 2, 512, 512, seed=1, ctas=2, edits=(
        ("barrier.cluster.arrive.release;", ""), ("barrier.cluster.wait.acquire;", "")))
    assert "cluster-peer-exited" in {h.kind for h in report.hazards}, report.hazards

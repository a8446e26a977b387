"""The K/V multicast build (-D PTXATTN_KV_MULTICAST=1) on the CPU: what the host refuses, the
cluster walk's model, and the kernel itself on the emulator (clusters of two, TMA multicast,
remote mbarrier arrives, barrier.cluster: ptxattn/tools/emulator/cluster.py) against the
float64 reference, with planted bugs the emulator must catch."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ptxattn import kv_multicast, ptx, reference, stages, tile_walk
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
         lse=False, edits=(), defines=MCAST, raw=False):
    from ptxattn.tools.emulator import fake_driver
    fake = fake_driver.install(monkeypatch, seed=seed, raise_hazards=False)
    if edits:
        plant(fake, *edits)
    if ctas is not None:
        monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", str(ctas))
    try:
        q, k, v = qkv(B, H, Lq, Lk, 128, heads_kv=hkv, layout=layout, seed=Lq + H)
        p = prepare(q, k, v, layout=layout, return_lse=lse, defines=defines)
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
    if raw:                                              # the output itself, not its metrics
        return report, out, ref
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


# ---- what the emulator does not model: a shared::cta address's cluster rank ----------------

def _desc_starts(text: str) -> list[list[str]]:
    """Per wgmma descriptor built from an address (include/wgmma_desc.ptxh MAKE_DESC: shr 4,
    cvt.u64, or), the statements between the shift and the cvt."""
    lines = [s.strip() for s in text.splitlines()]
    out = []
    for i, s in enumerate(lines):
        if s.startswith("cvt.u64.u32 %desc_"):
            tmp = s.split(",")[1].strip().rstrip(";")
            j = max(n for n in range(i) if lines[n].startswith(f"shr.u32 {tmp}, "))
            out.append(lines[j + 1:i])
    return out


def test_descriptors_drop_the_cluster_rank():
    """In a cluster launch a shared::cta address is %cluster_ctarank << 24 | offset on sm_90
    (ptxas builds a .shared symbol's address from SR_CgaCtaId << 24); shifted right by 4,
    rank 1's bit lands in bit 20 of a wgmma descriptor, the LBO field, and its MN-major V
    descriptor reads the other half of D 256 bytes too far (the first GPU run: rank 1's
    columns 64..127 wrong at every shape). The emulator's shared addresses carry no rank, so
    the check is on the text: every descriptor of the multicast build keeps the offset's
    bits 4-17 only; the unicast build's descriptors are as before (no mask)."""
    mc = _desc_starts(ptx.source(_prod(), MCAST))
    assert len(mc) >= 3                                   # K, V, and Q's per tile
    assert all(between == ["and.b32 %tmp, %tmp, 0x3FFF;"] for between in mc), mc
    assert all(between == [] for between in _desc_starts(ptx.source(_prod())))
    old = _desc_starts(ptx.source(_prod(), {**MCAST, "PTXATTN_MCAST_DEBUG_NO_DESC_MASK": "1"}))
    assert all(between == [] for between in old)          # the probe's failing build


def _gpu_address(reg: str) -> tuple[str, str]:
    """A planted edit: the descriptor of the tile at REG built from the address the GPU has
    there (%cluster_ctarank << 24 | offset), the rest of the kernel left on the emulator's."""
    return (f"shr.u32 %tmp, {reg}, 4;",
            "{ .reg .b32 %hw; shl.b32 %hw, %cta_rank, 24; or.b32 %hw, %hw, " + reg
            + "; shr.u32 %tmp, %hw, 4; }")


@pytest.mark.parametrize("masked", [True, False])
def test_descriptors_on_the_gpus_addresses(monkeypatch, masked):
    """K's and V's descriptors built from the GPU's addresses: the multicast build (masked)
    computes every block right; the first build (PTXATTN_MCAST_DEBUG_NO_DESC_MASK) shows the
    first GPU run's signature: rank 0's blocks and every block's columns 0..63 right, rank
    1's (odd blocks') columns 64..127 wrong (NaN here: the read past the slot meets the
    emulator's poisoned shared memory)."""
    defines = MCAST if masked else {**MCAST, "PTXATTN_MCAST_DEBUG_NO_DESC_MASK": "1"}
    _, out, ref = _run(monkeypatch, 1, 2, 256, 256, seed=1, defines=defines, raw=True,
                       edits=(_gpu_address("%sK"), _gpu_address("%sV")))
    ok = [reference.passes(reference.error_metrics(out[:, :, rows, cols], ref[:, :, rows, cols]))
          for rows in (slice(0, 128), slice(128, 256)) for cols in (slice(0, 64), slice(64, 128))]
    assert ok == ([True] * 4 if masked else [True, True, True, False]), ok

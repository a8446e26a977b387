"""The emulator's thread-block clusters (ptxattn/tools/emulator/cluster.py) on hand-written
kernels: the cluster registers, mapa and a remote mbarrier arrive, barrier.cluster, and the
errors (a CTA that leaves without its cluster arrive deadlocks its peer; a cluster that does not
divide the grid is refused). The K/V multicast kernel's own runs: tests/test_kv_multicast.py."""

from __future__ import annotations

import numpy as np
import pytest

from ptxattn.tools.emulator import Deadlock, EmulatorError, GlobalMemory, run_kernel

HEAD = ".version 8.4\n.target sm_90a\n.address_size 64\n"
REGS = """
    .reg .pred %p0, %p_ready;
    .reg .b32 %t, %rank, %peer, %bar, %rbar, %cid, %ncid, %v;
    .reg .b64 %out, %off, %st;
    .shared .align 8 .b64 mbar;
"""

# Each CTA inits a barrier that its PEER's 64 threads complete (mapa + remote arrive), waits on
# it, then writes rank | cluster id << 8 | clusters << 16 | cluster size << 24.
PEER_ARRIVE = HEAD + """
.visible .entry k(.param .u64 out)
.maxntid 64, 1, 1
{""" + REGS + """
    mov.u32 %t, %tid.x;
    mov.u32 %rank, %cluster_ctarank;
    xor.b32 %peer, %rank, 1;
    mov.u32 %bar, mbar;
    setp.eq.u32 %p0, %t, 0;
    @%p0 mbarrier.init.shared::cta.b64 [%bar], 64;
    @%p0 fence.mbarrier_init.release.cluster;
    barrier.cluster.arrive.release.aligned;
    barrier.cluster.wait.acquire.aligned;
    mapa.shared::cluster.u32 %rbar, %bar, %peer;
    mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%rbar];
wait:
    mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 %p_ready, [%bar], 0;
    @!%p_ready bra.uni wait;
    mov.u32 %cid, %clusterid.x;
    mov.u32 %ncid, %nclusterid.x;
    shl.b32 %v, %cid, 8;
    or.b32 %v, %v, %rank;
    shl.b32 %ncid, %ncid, 16;
    or.b32 %v, %v, %ncid;
    mov.u32 %cid, %cluster_nctarank;
    shl.b32 %cid, %cid, 24;
    or.b32 %v, %v, %cid;
    ld.param.u64 %out, [out];
    mov.u32 %cid, %ctaid.x;
    mul.wide.u32 %off, %cid, 4;
    add.s64 %out, %out, %off;
    @%p0 st.global.u32 [%out], %v;
    barrier.cluster.arrive.release;
    barrier.cluster.wait.acquire;
    ret;
}
"""

# Rank 1 leaves at once; rank 0 waits for it at the cluster barrier: a deadlock.
EARLY_EXIT = HEAD + """
.visible .entry k()
.maxntid 32, 1, 1
{
    .reg .pred %p1;
    .reg .b32 %rank;
    mov.u32 %rank, %cluster_ctarank;
    setp.ne.u32 %p1, %rank, 0;
    @%p1 ret;
    barrier.cluster.arrive;
    barrier.cluster.wait;
    ret;
}
"""


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_registers_mapa_and_remote_arrive(seed):
    gmem = GlobalMemory()
    out = gmem.alloc(4 * 6)
    report = run_kernel(PEER_ARRIVE, 6, 64, [out], gmem=gmem, seed=seed, cluster=(2, 1, 1))
    got = gmem.read_bytes(out, 24).view(np.uint32)
    want = [(c % 2) | (c // 2) << 8 | 3 << 16 | 2 << 24 for c in range(6)]
    assert got.tolist() == want and report.hazards == []
    assert report.cluster == (2, 1, 1)


def test_a_cta_that_leaves_without_its_cluster_arrive_deadlocks_its_peer():
    with pytest.raises(Deadlock, match="cluster barrier"):
        run_kernel(EARLY_EXIT, 2, 32, [], cluster=(2, 1, 1))


def test_a_cluster_must_divide_the_grid():
    with pytest.raises(EmulatorError, match="does not divide"):
        run_kernel(EARLY_EXIT, 3, 32, [], cluster=(2, 1, 1))


def test_without_clusters_mapa_names_the_cta_itself():
    """A launch without cluster dims: clusters of one (mapa to rank 0 is the address)."""
    gmem = GlobalMemory()
    out = gmem.alloc(4)
    text = PEER_ARRIVE.replace("xor.b32 %peer, %rank, 1;", "mov.u32 %peer, 0;")
    run_kernel(text, 1, 64, [out], gmem=gmem)
    assert int(gmem.read_bytes(out, 4).view(np.uint32)[0]) == (1 << 16 | 1 << 24)

"""Thread-block clusters: CTAs that see each other's shared memory (sm_90).

What a launch with cluster dims (cx, cy, cz) gets here:
  - the cluster special registers (%clusterid, %nclusterid, %cluster_ctaid, %cluster_nctaid,
    %cluster_ctarank, %cluster_nctarank, %is_explicit_cluster), rank = x + y*cx + z*cx*cy
    within the cluster, as on the GPU;
  - shared::cluster addresses: mapa maps a CTA-relative shared address to rank r's copy as
    (r + 1) << 24 | address (the emulator's encoding of the distributed shared window; a
    plain shared::cta address still names the CTA's own memory), getctarank reads it back;
    mbarrier operations take such addresses (resolve());
  - TMA .multicast::cluster loads (asyncops): one load per rank of ctaMask into that CTA's
    shared memory at the same offset, completing on the mbarrier at the same offset there;
  - barrier.cluster.arrive / wait: every thread of every CTA of the cluster arrives once a
    phase (an exited thread never does: a CTA that leaves without its arrive deadlocks its
    peers, stricter than any hardware ordering needs); wait blocks a thread until the phase it
    arrived in is complete. A wait without an arrive, or two arrives in one phase, is an error.
Checked: an access of a peer's shared memory or barriers after the peer's last warp exited is
a hazard (cluster-peer-exited): on the GPU its shared memory may already belong to another CTA.
Not modelled: the memory ordering of .release/.acquire (memory is sequentially consistent),
clusters whose CTAs are not all resident (every CTA of the grid is), and the rank bits of a
shared::cta address: on sm_90 a CTA's own shared addresses are %cluster_ctarank << 24 | offset
(a .shared symbol's address included), here plain offsets. Code that does arithmetic on
them (a wgmma descriptor's 14-bit start field) is right here and wrong on rank 1 of the GPU
unless it masks (tests/test_kv_multicast.py checks the multicast build's descriptors on text).
"""

from __future__ import annotations

import numpy as np

from .errors import EmulatorError, MemoryFault, SyncError, Unsupported
from .isa import WAIT, Wait

RANK_SHIFT = 24                     # shared::cluster address = (rank + 1) << 24 | offset
OFFSET_MASK = (1 << RANK_SHIFT) - 1


class ClusterBarrier:
    """barrier.cluster: arrivals by threads, a phase count, the groups waiting."""

    def __init__(self, cluster: "Cluster"):
        self.cluster = cluster
        self.phase = 0
        self.arrived = 0
        self.waiters: set = set()

    def describe(self) -> str:
        c = self.cluster
        return (f"cluster barrier of cluster {c.ident} (phase {self.phase}: {self.arrived} of "
                f"{c.threads} threads arrived)")


class Cluster:
    def __init__(self, ident, ctas):
        self.ident = ident
        self.ctas = ctas                      # by rank
        self.threads = sum(c.threads for c in ctas)
        self.barrier = ClusterBarrier(self)
        for rank, cta in enumerate(ctas):
            cta.cluster, cta.rank = self, rank
            cta.cluster_arrived = np.full(cta.threads, -1, np.int64)


def check_dims(grid, cluster) -> None:
    if any(c < 1 for c in cluster) or any(g % c for g, c in zip(grid, cluster)):
        raise EmulatorError(f"cluster {tuple(cluster)} does not divide grid {tuple(grid)}")
    if cluster[0] * cluster[1] * cluster[2] > 16:
        raise EmulatorError(f"cluster {tuple(cluster)}: more than 16 CTAs")


def rank_of(ctaid, cluster) -> int:
    (x, y, z), (cx, cy, cz) = ctaid, cluster
    return x % cx + (y % cy) * cx + (z % cz) * cx * cy


def special_registers(launch, ctaid) -> dict:
    """The cluster registers' values of a CTA (plain ints)."""
    cx, cy, cz = launch.cluster
    gx, gy, gz = launch.grid
    x, y, z = ctaid
    return {"%clusterid.x": x // cx, "%clusterid.y": y // cy, "%clusterid.z": z // cz,
            "%nclusterid.x": gx // cx, "%nclusterid.y": gy // cy, "%nclusterid.z": gz // cz,
            "%cluster_ctaid.x": x % cx, "%cluster_ctaid.y": y % cy, "%cluster_ctaid.z": z % cz,
            "%cluster_nctaid.x": cx, "%cluster_nctaid.y": cy, "%cluster_nctaid.z": cz,
            "%cluster_ctarank": rank_of(ctaid, launch.cluster),
            "%cluster_nctarank": cx * cy * cz,
            "%is_explicit_cluster": int(launch.cluster != (1, 1, 1))}


def link(launch) -> None:
    """After the CTAs exist: each one's cluster (its peers by rank) and cluster barrier."""
    groups: dict = {}
    for cta in launch.ctas:
        key = tuple(i // c for i, c in zip(cta.ctaid, launch.cluster))
        groups.setdefault(key, []).append(cta)
    for key, ctas in groups.items():
        ctas.sort(key=lambda c: rank_of(c.ctaid, launch.cluster))
        Cluster(key, ctas)


def resolve(g, addr: int, what: str):
    """(CTA, CTA-relative address) of a shared::cluster address used by group g."""
    rank = (addr >> RANK_SHIFT) - 1
    if rank < 0:
        return g.cta, addr
    cluster = getattr(g.cta, "cluster", None)
    size = len(cluster.ctas) if cluster is not None else 1
    if rank >= size or addr >> 32:
        raise MemoryFault(f"{what}: shared::cluster address 0x{addr:x} names CTA rank {rank} "
                          f"of a cluster of {size}", None, addr)
    cta = cluster.ctas[rank] if cluster is not None else g.cta
    if cta is not g.cta and cta.live_warps == 0:
        g.launch.hazard("cluster-peer-exited",
                        f"{what} on CTA rank {rank}'s shared memory (0x{addr:x}) after that CTA "
                        f"exited: its shared memory may belong to another CTA by now", g)
    return cta, addr & OFFSET_MASK


def peers(g, mask: int, what: str) -> list:
    """The CTAs of g's cluster that a ctaMask names, by rank."""
    cluster = getattr(g.cta, "cluster", None)
    ctas = cluster.ctas if cluster is not None else [g.cta]
    if mask == 0 or mask >> len(ctas):
        raise SyncError(f"{what}: ctaMask 0x{mask:x} for a cluster of {len(ctas)} CTA(s)")
    out = [c for r, c in enumerate(ctas) if mask >> r & 1]
    for c in out:
        if c is not g.cta and c.live_warps == 0:
            g.launch.hazard("cluster-peer-exited",
                            f"{what} into CTA {c.ctaid} after it exited", g)
    return out


# ----------------------------------------------------------------------------- instructions

def compile_mapa(prog, ins):
    """mapa(.shared::cluster).u32/u64 d, a, rank: a's copy in CTA `rank` of the cluster;
    getctarank d, a: the rank whose shared memory a names."""
    if ins.op == "mapa":
        if "shared::cluster" not in ins.parts:
            raise Unsupported(f"{ins.opcode}: generic addresses (only .shared::cluster)")
        t = ins.parts[-1]
        d, a, r = ins.operands
        ra, rr = prog.reader(a, t), prog.reader(r, "u32")
        write = prog.writer(d, t)

        def mapa(g, idx):
            addrs = ra(g, idx).astype(np.uint64)
            ranks = rr(g, idx).astype(np.uint64)
            size = len(g.cta.cluster.ctas) if getattr(g.cta, "cluster", None) else 1
            if (ranks >= size).any():
                raise SyncError(f"mapa to CTA rank {int(ranks.max())} of a cluster of {size}")
            local = addrs & np.uint64(OFFSET_MASK)
            if size == 1:
                out = local                        # a cluster of one: the address itself
            else:
                out = local | ((ranks + np.uint64(1)) << np.uint64(RANK_SHIFT))
            write(g, idx, out.astype(np.uint32 if t == "u32" else np.uint64))
        return prog.wrap(ins, mapa, prog.regs_of(*ins.operands))
    d, a = ins.operands
    ra = prog.reader(a, ins.parts[-1] if ins.parts[-1] in ("u32", "u64") else "u32")
    write = prog.writer(d, "u32")

    def getctarank(g, idx):
        addrs = ra(g, idx).astype(np.int64)
        rank = (addrs >> RANK_SHIFT) - 1
        own = getattr(g.cta, "rank", 0)
        write(g, idx, np.where(rank < 0, own, rank).astype(np.uint32))
    return prog.wrap(ins, getctarank, prog.regs_of(*ins.operands))


def compile_barrier_cluster(prog, ins):
    """barrier.cluster.arrive{.release|.relaxed}{.aligned} / barrier.cluster.wait{.acquire}."""
    kind = ins.parts[2] if len(ins.parts) > 2 else ""
    if kind not in ("arrive", "wait"):
        raise Unsupported(f"{ins.opcode}")

    def _state(g):
        cluster = getattr(g.cta, "cluster", None)
        if cluster is None:
            raise Unsupported(f"{ins.opcode} outside a cluster launch")
        return cluster.barrier, g.cta.cluster_arrived

    def arrive(g, idx):
        b, arrived = _state(g)
        if (arrived[idx] == b.phase).any():
            raise SyncError(f"{ins.opcode}: a thread arrived twice in phase {b.phase} of the "
                            f"cluster barrier (no wait between)")
        arrived[idx] = b.phase
        b.arrived += len(idx)
        if b.arrived == b.cluster.threads:
            b.phase += 1
            b.arrived = 0
            waiters, b.waiters = b.waiters, set()
            for w in waiters:
                if w.wait is not None:
                    g.launch.wake(w)
        return None

    def wait(g, idx):
        b, arrived = _state(g)
        mine = arrived[idx]
        if (mine < 0).any():
            raise SyncError(f"{ins.opcode} by a thread that never arrived on the cluster barrier")
        ok = mine < b.phase
        if ok.all():
            return None
        w = Wait(b.describe, (b,), register=b.waiters.add)
        if not ok.any():
            b.waiters.add(g)
            return w
        return (w, idx[~ok])
    return prog.wrap(ins, arrive if kind == "arrive" else wait, (), kind=WAIT)

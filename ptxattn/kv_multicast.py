"""The K/V multicast build of the production forward (-D PTXATTN_KV_MULTICAST=1): the host's side.

A measurement build (bench/experiments/variants.py names it as production:PTXATTN_KV_MULTICAST=1),
off by default. The kernel (ptx/sm90/production/kv_multicast.ptxh) runs clusters of two CTAs
that take two Q tiles of the same (batch, head) at once, consecutive query blocks 2m and 2m+1,
and load each K/V tile from L2 once for both (TMA .multicast::cluster). This module holds what
the launcher needs for it, in one place:

  - requested(defines): whether a call asks for the build;
  - check(plan, stage, defines): ValueError for what the build does not take (it is written
    for the dense D = 128 bf16 static walk only), before anything is compiled or allocated;
  - clusters(...): the persistent grid in clusters, at most the clusters that fit the GPU at
    once (cuOccupancyMaxActiveClusters) and at most the tile pairs;
  - walk(...): the model of the kernel's cluster walk (tests check the PTX's against it).
"""

from __future__ import annotations

from . import tile_walk

DEFINE = "PTXATTN_KV_MULTICAST"
CLUSTER = (2, 1, 1)            # two CTAs a cluster: the pair of Q tiles of one head
HEAD_DIM = 128                 # the one build it is written for (two consumers, 128-row tiles)


def requested(defines) -> bool:
    """Whether a call's build defines ask for the multicast build (any value but 0)."""
    value = (defines or {}).get(DEFINE)
    return value is not None and str(value) not in ("", "0")


def check(plan, stage, defines=None) -> None:
    """ValueError naming why the multicast build cannot run this call (None: it can)."""
    def refuse(why: str):
        raise ValueError(f"{DEFINE}=1 (K/V multicast across a cluster of two CTAs): {why}")
    every = {**dict(stage.defines), **dict(defines or {})}
    if stage.dynamic_tiles:
        refuse("the static persistent walk only, not the dynamic tile scheduler")
    if not stage.production:
        refuse(f"a build of the production kernel only, not {stage.title}")
    if stage.varlen:
        refuse("no varlen build (packed sequences); dense (B, H, L, D) inputs only")
    if "PTXATTN_FP8" in every:
        refuse("no FP8 build; bf16 only")
    if plan.masked:
        refuse("dense attention only: no causal mask and no sliding window "
               f"(got window {plan.window})")
    if plan.head_dim != HEAD_DIM:
        refuse(f"head dim {HEAD_DIM} only, got {plan.head_dim}")
    m_blocks = -(-plan.seq_q // stage.block_m)
    if m_blocks % 2:
        refuse(f"an even number of {stage.block_m}-row query blocks a head (the cluster's two "
               f"CTAs take blocks 2m and 2m+1), got {m_blocks} for seq_q {plan.seq_q}")


def pair_problem(p: tile_walk.Problem) -> tile_walk.Problem:
    """The walk's problem in tile pairs: a pair is two query blocks, so the walk's section
    arithmetic runs on M/2 blocks of twice the rows (what the kernel's TILE_WALK sees)."""
    return tile_walk.Problem(p.batch, p.heads, p.seq_q, p.seq_k, p.head_dim, p.heads_kv,
                             p.window, 2 * p.block_m, p.block_n)


def clusters(pairs: int, max_active: int, cap_ctas: int | None = None) -> int:
    """Clusters of the persistent grid: every cluster has a pair to take, no more clusters than
    fit at once, and the PTXATTN_PERSISTENT_CTAS cap (in CTAs) halved."""
    n = min(pairs, max(1, max_active))
    if cap_ctas is not None:
        n = min(n, max(1, cap_ctas // 2))
    return max(1, n)


def walk(p: tile_walk.Problem, section: int, n_clusters: int):
    """Per cluster, per rank, the (m_block, bh) tiles in order: the kernel's walk. Cluster c
    takes pairs c, c + n, ... of the sectioned walk over pair blocks; rank r block 2m + r."""
    pp = pair_problem(p)
    out = []
    for c in range(n_clusters):
        pairs = [tile_walk.tile_of(t, pp, section)
                 for t in tile_walk.cta_tiles(c, n_clusters, pp.tiles, snake=False)]
        out.append([[(2 * m + r, bh) for m, bh in pairs] for r in range(CLUSTER[0])])
    return out

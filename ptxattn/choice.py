"""Kernel choice: which registered kernel runs a call, and which build of it.

pick_stage answers from what the call needs (head dim, lengths, GQA, LSE, masks) and, once
the device is known, its compute capability: the requested stage, checked, or the production
kernel when it takes the call, else the fastest lineage stage that does. specialized is the
production kernel's build for a head dim and mask (Stage.specialize over
stages.PRODUCTION_VARIANTS). Both answers are remembered: a model asks the same question on
every call. registry() is every object an answer depends on; a remembered answer (here, or a
steady call in fastpath.py) is stale when any of them is not the same object (tests swap them).
"""

from __future__ import annotations

import functools

from . import stages, stages_sm100
from .stages import Stage, by_speed, get_stage


# What a GPU ptxattn has no kernel for should use instead (named in the error).
OTHER_GPUS = ("ptxattn's kernels run on Hopper (an H100/H200, compute capability 9.0); on this "
              "GPU use torch.nn.functional.scaled_dot_product_attention or flash-attn "
              "(ptxattn.torch.scaled_dot_product_attention falls back to torch's by itself)")


def arch_ok(arch: str, cc: tuple[int, int]) -> bool:
    """sm_90a runs only on compute capability 9.0; plain sm_XY on XY and newer."""
    digits = arch.removeprefix("sm_").rstrip("af")
    want = (int(digits[:-1]), int(digits[-1]))
    return cc == want if arch[-1] in "af" else cc >= want


def pick_stage(stage, head_dim: int, seq_q: int, seq_k: int, cc=None, *, gqa: bool = False,
                lse: bool = False, masked: bool = False) -> Stage:
    """_pick_uncached, remembered per arguments: the answer depends on them and on the
    registry alone, and a model asks the same question every call. The memory is dropped
    whenever the registry objects change (tests swap them); errors are never remembered."""
    now = registry()
    if any(a is not b for a, b in zip(now, _PICKS_REGISTRY)):
        _PICKS.clear()
        _PICKS_REGISTRY[:] = now
    key = (stage, head_dim, seq_q, seq_k, cc, gqa, lse, masked)
    try:
        hit = _PICKS.get(key)
    except TypeError:                   # an unhashable `stage` argument: answer it uncached
        return _pick_uncached(stage, head_dim, seq_q, seq_k, cc, gqa=gqa, lse=lse, masked=masked)
    if hit is None:
        hit = _pick_uncached(stage, head_dim, seq_q, seq_k, cc, gqa=gqa, lse=lse, masked=masked)
        if len(_PICKS) >= 512:
            _PICKS.clear()
        _PICKS[key] = hit
    return hit


_PICKS: dict[tuple, Stage] = {}
_PICKS_REGISTRY: list = [None, None, None, None, None]
_SM100_NAMES = vars(stages_sm100)   # its FASTEST_FIRST is optional: a dict lookup, no raise


def registry() -> tuple:
    """Every registry object _pick_uncached reads, Blackwell's included (stages.by_speed reads
    stages_sm100.FASTEST_FIRST when it is defined). A remembered pick or steady call is stale
    when any of them is not the same object (tests swap them)."""
    return (stages.PRODUCTION, stages.STAGES, stages.FASTEST_FIRST, stages.SM100_STAGES,
            _SM100_NAMES.get("FASTEST_FIRST"))


@functools.lru_cache(maxsize=256)
def specialized(stage: Stage, head_dim: int, masked: bool, varlen: bool = False,
                paged: bool = False) -> Stage:
    """stage.specialize(head_dim, masked, varlen, paged), built once per arguments (a
    dataclasses.replace per call is a measurable part of a small call's host time)."""
    return stage.specialize(head_dim, masked, varlen, paged)


def _pick_uncached(stage, head_dim: int, seq_q: int, seq_k: int, cc=None, *, gqa: bool = False,
                   lse: bool = False, masked: bool = False) -> Stage:
    """The requested kernel, checked; or the production kernel when it takes the call, else
    the fastest lineage stage (stages.by_speed) that does (and, once the device is known,
    runs on its compute capability). gqa: k/v have fewer heads than q; lse: return_lse.
    On a compute capability 10.0 device the choice is among the Blackwell lineage's stages
    (stages_sm100), fastest first by stages.by_speed: it has no production kernel."""
    q_len = seq_q or None  # an empty query never launches: only head dim and keys matter
    blackwell = cc is not None and stages.lineage_for(cc) == stages.BLACKWELL
    pool = by_speed(stages.BLACKWELL) if blackwell else (stages.PRODUCTION,) + by_speed()
    # What a shape that only the production kernel takes is told on a B200.
    no_production = ("; there is no production kernel for sm_100a: its lineage takes head dim "
                     "128, no GQA/MQA, LSE or masks, and lengths that are multiples of its "
                     "tiles" if blackwell else "")

    def why_not(s: Stage):
        if gqa and not s.gqa:
            return "k/v with fewer heads than q (GQA/MQA)"
        if lse and not s.lse:
            return "return_lse=True"
        if masked and not s.masks:
            return "causal or window masks"
        return s.unsupported(head_dim, q_len or s.block_m, seq_k)

    def argument(why: str) -> str:
        return {"k": "k", "r": "return_lse", "c": "causal"}.get(why[0], "q")

    def takers(exclude):
        # A few names, fastest first; past four, the fastest and a count (errors stay short).
        ok = [s for s in pool if s is not exclude and why_not(s) is None
              and (cc is None or arch_ok(s.arch, cc))]
        if not ok:
            return "no registered stage takes this shape" + no_production
        if len(ok) > 4:
            return (f"{ok[0].title} and {len(ok) - 1} other stages would take it "
                    f"(see `ptxattn list`)")
        return ", ".join(s.title for s in ok) + " would take it"

    if stage is not None:
        chosen = get_stage(stage)
        why = why_not(chosen)
        if why:
            raise ValueError(f"{argument(why)}: {chosen.title} does not take "
                             f"{why}; {takers(chosen)}")
        if cc is not None and not arch_ok(chosen.arch, cc):
            # The lineages' numbers collide: say how to name the one this GPU runs.
            hint = ""
            if blackwell and chosen.production:
                hint = "; there is no production kernel for sm_100a"
            elif blackwell and any(s.number == chosen.number for s in pool):
                hint = (f"; a plain number names a Hopper stage: name a Blackwell one as "
                        f"'sm100_stage{chosen.number:02d}' or "
                        f"stages.get_stage({chosen.number}, arch='sm_100a')")
            elif not blackwell and chosen.arch == stages.BLACKWELL:
                hint = ("; the sm_100a lineage runs on compute capability 10.0 (a B200) only, "
                        "and has never been run by this project")
            raise ValueError(f"stage: {chosen.title} is built for {chosen.arch}, "
                             f"which this GPU (compute capability {cc[0]}.{cc[1]}) cannot run; "
                             f"{takers(chosen)}{hint}")
        return chosen
    candidates = [s for s in pool if cc is None or arch_ok(s.arch, cc)]
    for s in candidates:
        if why_not(s) is None:
            return s
    if not candidates:
        raise ValueError(f"stage: no registered stage runs on compute capability {cc[0]}.{cc[1]}"
                         f"{' (no sm_100a stage is registered)' if blackwell else ''}; "
                         f"{OTHER_GPUS}")
    grouped: dict[str, list[str]] = {}
    for s in candidates:
        grouped.setdefault(why_not(s), []).append(s.label)
    # Counts, not 15 names: "head dim 64 (takes 128) for every stage; see `ptxattn list`".
    reasons = "; ".join(
        f"{why} for {'every stage' if len(labels) == len(candidates) else len(labels)}"
        f"{'' if len(labels) in (1, len(candidates)) else ' stages'}"
        f"{' (' + labels[0] + ')' if len(labels) == 1 < len(candidates) else ''}"
        for why, labels in grouped.items())
    raise ValueError(f"{argument(why_not(candidates[0]))}: no registered stage takes this shape: "
                     f"{reasons}{no_production}; see `ptxattn list`")

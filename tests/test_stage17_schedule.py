"""Stage 17's synchronisation, executed from its own PTX and replayed against real barrier rules
(CPU only).

Stage 17 (ptx/sm90/17_tiles_back_to_back.ptx) runs a persistent CTA's K/V steps on across its
tiles and double-buffers Q, so its parities are counted across tiles: Q buffer local_tile % 2
and its FULL/EMPTY parities, K/V ring positions g counted over the CTA's whole walk, and the
pingpong turns with one boundary step a tile. The GPU tests pass for the shapes they run; this
checks many CTAs, grids and tile counts (seq_k = 128: one K/V tile a Q tile, where the boundary
step follows the prologue directly).

The replay (tests/sync_replay.py, shared with test_production_sync.py) runs the PTX's integer
and predicate code for the producer and both consumers in test_production_schedule's
interpreter, records every synchronising statement's operands, and replays the three sequences
together under the mbarrier and named-barrier rules in several interleavings; see its docstring
for what it asserts. Here: stage 17's build, its own #defines, and its reference schedule
(round-robin, head-major; seq_q and seq_k multiples of the tile sizes).
"""

from __future__ import annotations

import re
from functools import lru_cache

import pytest

from ptxattn import ptx
import sync_replay
from sync_replay import round_robin

STAGE_FILE = "17_tiles_back_to_back.ptx"


def stage17():
    return sync_replay.lineage_stage(STAGE_FILE)


@lru_cache(maxsize=None)
def stage_defines() -> dict:
    return sync_replay.lineage_defines(stage17())


class Model(sync_replay.Model):
    """Stage 17's text (optionally mutated), instrumented and sliced once."""

    def __init__(self, text: str):
        super().__init__(text, stage_defines())


@lru_cache(maxsize=None)
def model() -> Model:
    st = stage17()
    return Model(ptx.source(st, dict(st.defines)))


def reference(prm, ctaid, grid):
    d = stage_defines()
    return round_robin(prm, ctaid, grid, d["BLOCK_M"], d["BLOCK_N"])


def play_all(m, prm, grid, seeds=3):
    sync_replay.play_all(m, prm, grid, reference, seeds)


def prm(seq_q, seq_k, heads=1, batch=1):
    return dict(seq_q=seq_q, seq_k=seq_k, heads=heads, batch=batch)


# ---- the tests -------------------------------------------------------------------------

def test_the_replay_sees_every_synchronising_statement():
    m = model()
    kinds = sorted({k for k, _, _ in m.ops.values()})
    assert kinds == ["bar.arrive", "bar.sync", "mbarrier.arrive", "mbarrier.arrive.expect_tx",
                     "mbarrier.init", "mbarrier.try_wait.parity"]
    body = m.text[m.text.index(".entry"):]
    # every statement naming an mbarrier or a named barrier is instrumented (none slipped by)
    lines = [ln for ln in body.splitlines()
             if re.match(r"\s*(@!?%\w+\s+)?(mbarrier\.|bar\.)", ln)]
    assert len(lines) == len(m.ops)


@pytest.mark.parametrize("seq_k", [128, 256, 384, 640])
def test_parities_and_buffers_across_tiles(seq_k):
    """Many tiles a CTA (grid 1-5 over 6-8 tiles), several K/V tiles a Q tile, seq_k = 128
    included (one K/V tile a Q tile: the boundary step right after the prologue)."""
    m = model()
    for p in (prm(128, seq_k), prm(384, seq_k, heads=2), prm(256, seq_k, heads=2, batch=2)):
        tiles = p["seq_q"] // 128 * p["heads"] * p["batch"]
        for grid in sorted({1, 2, 3, 5, tiles - 1, tiles} - {0}):
            if grid <= tiles:
                play_all(m, p, grid)


def test_long_walks():
    """A CTA with 9-17 tiles (Q buffers reused many times; ring positions past 2^3)."""
    m = model()
    for seq_k in (128, 384):
        p = prm(1024, seq_k, heads=2, batch=1)              # 16 tiles
        for grid in (1, 2, 7):
            play_all(m, p, grid, seeds=2)


def mutant(old: str, new: str, count: int = 1) -> Model:
    text = model().text
    assert text.count(old) == count, (old, text.count(old))
    return Model(text.replace(old, new))


@pytest.mark.parametrize("old, new, count", [
    # the consumer's Q parity without the buffer's use count: wrong from the 3rd tile
    ("shr.u32 %q_phase, %local_tile, 1;\n    and.b32 %q_phase, %q_phase, 1;",
     "and.b32 %q_phase, %local_tile, 1;", 2),
    # the producer's Q EMPTY parity one completion late: it waits for ever (or early)
    ("add.u32 %q_phase, %q_phase, 1;", "", 1),
    # the producer skips the Q EMPTY wait: Q overwritten while in use
    ("setp.lt.u32 %p_first, %local_tile, 2;", "setp.lt.u32 %p_first, %local_tile, 99;", 1),
    # the consumers never release Q (the tile-end arrive dropped)
    ("mbarrier.arrive.shared::cta.b64 %state, [%q_buf_empty];", "", 1),
    # the boundary step forgets to switch Q buffers
    ("add.u32 %local_tile, %local_tile, 1;\n    and.b32 %q_buf", "and.b32 %q_buf", 1),
])
def test_the_replay_catches_a_broken_protocol(old, new, count):
    m = mutant(old, new, count)
    with pytest.raises(AssertionError):
        for p in (prm(128, 128, heads=5), prm(128, 384, heads=5)):
            play_all(m, p, 1, seeds=1)
            play_all(m, p, 2, seeds=1)


def test_the_replay_catches_a_skipped_last_handover_on_the_wrong_consumer():
    """Consumer 0 skipping its last hand-over (not consumer 1) leaves consumer 1 waiting."""
    text = model().text
    old = "and.pred %p_tiles, %p_second, %p_last_tile;"
    assert text.count(old) == 1
    m = Model(text.replace(old, "not.pred %p_tiles, %p_second;\n    and.pred %p_tiles, "
                                "%p_tiles, %p_last_tile;"))
    with pytest.raises(AssertionError, match="deadlock|half arrived"):
        play_all(m, prm(256, 256), 1, seeds=1)


def test_the_traced_build_synchronises_as_the_plain_one():
    """PTXATTN_TRACE=1 (`ptxattn trace`) adds trace points around the waits: the same
    statements, the same replay."""
    st = stage17()
    traced = Model(ptx.source(st, {**dict(st.defines), "PTXATTN_TRACE": 1}))
    assert sorted(k for k, _, _ in traced.ops.values()) == \
        sorted(k for k, _, _ in model().ops.values())
    for p, grid in ((prm(384, 128, heads=2), 4), (prm(256, 384, heads=2), 3)):
        play_all(traced, p, grid, seeds=1)

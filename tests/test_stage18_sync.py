"""Stage 18's synchronisation, replayed from its own PTX (CPU only; tests/sync_replay.py).

Stage 18 (ptx/sm90/18_q_tile_ahead.ptx) is stage 14 with Q double-buffered: the producer fills
Q buffer local_tile % 2 once the tile two before released it, so Q's FULL and EMPTY parities are
counted per buffer across the CTA's walk, while the consumers' steps are stage 14's (a tile at a
time: one turn per K/V tile plus the last PV's). The replay checks parities, buffers, ring slots,
turns and the last-tile flag under several interleavings, and catches planted breakages.
"""

from __future__ import annotations

import re
from functools import lru_cache

import pytest

from ptxattn import ptx
import sync_replay
from sync_replay import round_robin

STAGE_FILE = "18_q_tile_ahead.ptx"


def stage18():
    return sync_replay.lineage_stage(STAGE_FILE)


@lru_cache(maxsize=None)
def stage_defines() -> dict:
    return sync_replay.lineage_defines(stage18())


@lru_cache(maxsize=None)
def source(**knobs) -> str:
    st = stage18()
    return ptx.source(st, {**dict(st.defines), **knobs})


def model(text: str | None = None) -> sync_replay.Model:
    return sync_replay.Model(text if text is not None else source(), stage_defines(),
                             tile_end="last_pv")   # stage 14's name for a tile's end


@lru_cache(maxsize=None)
def plain_model() -> sync_replay.Model:
    return model()


def reference(prm, ctaid, grid):
    d = stage_defines()
    return round_robin(prm, ctaid, grid, d["BLOCK_M"], d["BLOCK_N"])


def prm(seq_q, seq_k, heads=1, batch=1):
    return dict(seq_q=seq_q, seq_k=seq_k, heads=heads, batch=batch)


def test_two_q_buffers_and_every_synchronising_statement_seen():
    m = plain_model()
    assert m.q_buffers == 2
    body = m.text[m.text.index(".entry"):]
    lines = [ln for ln in body.splitlines() if re.match(r"\s*(@!?%\w+\s+)?(mbarrier\.|bar\.)", ln)]
    assert len(lines) == len(m.ops)


@pytest.mark.parametrize("seq_k", [128, 384])
def test_parities_and_buffers_across_tiles(seq_k):
    """Grids 1 to one CTA a tile over 6-16 tiles: each Q buffer reused many times."""
    m = plain_model()
    for p in (prm(384, seq_k, heads=2), prm(256, seq_k, heads=2, batch=2),
              prm(1024, seq_k, heads=2)):
        tiles = p["seq_q"] // 128 * p["heads"] * p["batch"]
        for grid in sorted({1, 2, 3, 7, tiles} & set(range(1, tiles + 1))):
            sync_replay.play_all(m, p, grid, reference, seeds=2)


def test_a_tile_at_a_time_turn_count():
    """Every tile starts from its own prologue and ends with its own last PV: a consumer takes
    one turn per K/V tile plus one per tile."""
    m = plain_model()
    p = prm(512, 384, heads=2)                       # 8 tiles of 3 K/V tiles
    for grid in (1, 3):
        for c in range(grid):
            r = sync_replay.Replay(m, p, c, grid, reference)
            tiles, _, kv = reference(p, c, grid)
            want = sum(map(len, kv)) + len(tiles)
            for order in sync_replay.orders(1):
                assert r.play(order) == [want, want]


@pytest.mark.parametrize("old, new", [
    # the consumer's Q parity without the buffer's use count: wrong from the 3rd tile
    ("shr.u32 %q_phase, %local_tile, 1;\n    and.b32 %q_phase, %q_phase, 1;",
     "and.b32 %q_phase, %local_tile, 1;"),
    # the producer's Q EMPTY parity one completion late
    ("add.u32 %q_phase, %q_phase, 1;", ""),
    # the producer skips the Q EMPTY wait: a buffer overwritten in use
    ("setp.lt.u32 %p_first, %local_tile, 2;", "setp.lt.u32 %p_first, %local_tile, 99;"),
    # the consumers never release Q
    ("mbarrier.arrive.shared::cta.b64 %state, [%q_buf_empty];", ""),
    # the producer always fills buffer 0 (but signals buffer local_tile % 2)
    ("mad.lo.u32 %tmp, %q_buf, 32768, %sQ;", "mov.u32 %tmp, %sQ;"),
])
def test_the_replay_catches_a_broken_protocol(old, new):
    text = source()
    assert text.count(old) == 1, (old, text.count(old))
    m = model(text.replace(old, new))
    with pytest.raises(AssertionError):
        for p in (prm(128, 128, heads=5), prm(128, 384, heads=5)):
            sync_replay.play_all(m, p, 1, reference, seeds=1)
            sync_replay.play_all(m, p, 2, reference, seeds=1)


def test_the_traced_build_synchronises_as_the_plain_one():
    traced = model(source(PTXATTN_TRACE=1))
    assert sorted(k for k, _, _ in traced.ops.values()) == \
        sorted(k for k, _, _ in plain_model().ops.values())
    sync_replay.play_all(traced, prm(384, 256, heads=2), 4, reference, seeds=1)

"""The production kernel's synchronisation, replayed from its own PTX (CPU only), for every build
of the build table with its consumer warpgroups (CONSUMERS: three at D = 64, 192-row tiles; two
at D = 128 and 256).

At D = 64 and 128 (two Q buffers in the build table) the kernel (ptx/sm90/production/)
double-buffers Q and loads it a tile ahead, so the Q parities, the K/V ring positions and the
pingpong turns are counted across a persistent CTA's whole walk; at D = 256 (O staged in Q) one
Q buffer is released after the O store. test_production_schedule checks the walk, the K/V runs
and the masks; this replays the barrier protocol (tests/sync_replay.py: mbarrier parities, Q
buffers, ring slots, turns, last-tile flag) under several interleavings, for the unmasked and
masked builds, ragged lengths, GQA, causal and windowed masks, grids from 1 CTA to one a tile,
and mutants of the protocol that it must catch (three-consumer ones at D = 64: the turn ring,
the last hand-over, EMPTY counts, the third Q box). Also: the traced build (PTXATTN_TRACE=1);
each tile takes one turn a K/V tile plus its own last PV's.

The references (BLOCK_M from the build's row: m_blocks = ceil(seq_q / BLOCK_M); Q one 64-row
box a consumer): the tiles round-robin (t = ctaid + k * grid) unmasked, the snake (round k:
k*G + c, or k*G + G-1-c on odd rounds) masked; tile t the sectioned walk's (m_block, (batch,
head)) for the parameter walk_section clamped to [1, B*H] (ptxattn/tile_walk.tile_of, longest
rows first when masked); every K/V tile of K/V head head // heads_per_kv unmasked, masked the
K/V tiles some row of the Q tile sees (test_production_schedule.truth; a Q tile whose rows see
no key keeps one fully masked tile).
A fill's content is read from its TMA loads' coordinates: the K/V loads' head is the K/V head
the kernel actually loads (%head_kv), checked against the reference's head // heads_per_kv.
"""

from __future__ import annotations

import re
from functools import lru_cache

import pytest

from ptxattn import builds, ptx, stages, tile_walk
from ptxattn.launch import UNBOUNDED
import sync_replay
from sync_replay import q_content, round_robin
from test_production_schedule import build_constant, params, truth, walk_of

HEAD_DIMS = builds.HEAD_DIMS                                           # every build
TWO_Q_BUFFERS = tuple(d for d in HEAD_DIMS if builds.get(d).q_buffers == 2)   # D = 64, 128


def defines(head_dim: int) -> dict:
    """The replay's #defines from the build table's row of this head dim."""
    names = sync_replay.BARRIERS + sync_replay.SIZES     # (CONSUMERS and BLOCK_M among them)
    if builds.get(head_dim).q_buffers == 2:
        names += ("SMEM_BAR_Q_1", "SMEM_BAR_Q_EMPTY_1")
    return {n: build_constant(head_dim, n) for n in names}


def source(head_dim: int, masked: bool, **knobs) -> str:
    st = stages.PRODUCTION.specialize(head_dim, masked=masked)
    return ptx.source(st, {**dict(st.defines), **{k: "1" for k, on in knobs.items() if on}})


class Build:
    """One production build, its replay model and its reference schedule."""

    def __init__(self, head_dim: int, masked: bool, text: str | None = None, **knobs):
        self.head_dim, self.masked = head_dim, masked
        self.block_m = build_constant(head_dim, "BLOCK_M")
        self.block_n = build_constant(head_dim, "BLOCK_N")
        self.consumers = build_constant(head_dim, "CONSUMERS")
        self.model = sync_replay.Model(text if text is not None
                                       else source(head_dim, masked, **knobs),
                                       defines(head_dim))

    def reference(self, prm, ctaid, grid):
        return sectioned_walk(prm, ctaid, grid, self.head_dim, self.masked)

    def play(self, prm, grid, seeds=2, ctas=None):
        """Every CTA of the launch (or those in ctas) under every interleaving."""
        for c in range(grid) if ctas is None else ctas:
            r = sync_replay.Replay(self.model, prm, c, grid, self.reference)
            for order in sync_replay.orders(seeds, self.consumers):
                r.play(order)


@lru_cache(maxsize=None)
def build(head_dim: int, masked: bool, **knobs) -> Build:
    return Build(head_dim, masked, **knobs)


def sectioned_walk(prm, ctaid, grid, head_dim: int, masked: bool):
    """The production build's reference: its CTA's tiles (the snake when masked), each tile's
    (m_block, batch, head) in the sectioned walk (tile_walk.tile_of with the clamped
    walk_section: the rules check_q_tile checks the walk against) and the K/V tiles some of
    its rows see (every K/V tile unmasked)."""
    block_m = build_constant(head_dim, "BLOCK_M")
    block_n = build_constant(head_dim, "BLOCK_N")
    p, section = walk_of(prm, head_dim, masked, block_m, block_n)
    tiles = tile_walk.cta_tiles(ctaid, grid, p.tiles, snake=masked)
    q, kv = [], []
    for t in tiles:
        m_block, bh = tile_walk.tile_of(t, p, section)
        head, batch = bh % p.heads, bh // p.heads
        q_row = m_block * block_m
        q.append(q_content(q_row, block_m, head, batch))
        if masked:
            seen, _ = truth(p.seq_q, p.seq_k, q_row, block_m, block_n, prm["diag_offset"],
                            prm["window_left"], prm["window_right"])
            if not seen:
                # no row sees a key: one fully masked tile, the one of the first row's first
                # key clamped to [0, seq_k)
                key = min(max(q_row + prm["diag_offset"] - prm["window_left"], 0), p.seq_k - 1)
                seen = [key // block_n]
        else:
            seen = range(p.kv_tiles)
        kv.append([(i * block_n, head // prm["heads_per_kv"], batch) for i in seen])
    return tiles, q, kv


def causal(seq_q, seq_k, **kw):
    """The bottom-right causal mask (diag = seq_k - seq_q, no left edge, right edge 0)."""
    return params(seq_q, seq_k, diag=seq_k - seq_q, left=UNBOUNDED, right=0, **kw)


def tile_count(b: Build, prm) -> int:
    return -(-prm["seq_q"] // b.block_m) * prm["heads"] * prm["batch"]


def grids(tiles: int, few: int = 4):
    """1 to `few` CTAs (each with many tiles: the Q buffers and their parities wrap), then a
    few up to one CTA a tile (the launcher's min(SMs, tiles))."""
    return sorted({*range(1, min(tiles, few) + 1), tiles // 2 + 1, max(tiles - 1, 1), tiles})


# ragged lengths (seq_q 129, 300, 513; seq_k 1, 127, 128, 129, 385), several heads and batches,
# GQA (heads_per_kv 2) and MQA (every head reads K/V head 0)
UNMASKED_CASES = [
    params(513, 385),                                    # 5 tiles of 4 K/V tiles, one CTA-row
    params(300, 127, heads=2, batch=2, heads_per_kv=2),  # 12 tiles, one ragged K/V tile each
    params(129, 128, heads=3, heads_per_kv=3),           # MQA; one K/V tile: boundary at once
    params(300, 129, batch=3),
]
MASKED_CASES = [
    causal(300, 385, heads=2, heads_per_kv=2),           # GQA, causal, ragged both
    causal(513, 129),                  # rows 0-383 see no key: one fully masked K/V tile each
    causal(129, 1, heads=2, batch=2),
    params(513, 385, heads=2, diag=0, left=130, right=5),   # a window (front and back runs)
    params(300, 127, heads=3, heads_per_kv=3, diag=-40, left=60, right=UNBOUNDED),
]


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_the_replay_sees_every_synchronising_statement(head_dim):
    row = builds.get(head_dim)
    for masked in (False, True):
        m = build(head_dim, masked).model
        kinds = sorted({k for k, _, _ in m.ops.values()})
        assert kinds == ["bar.arrive", "bar.sync", "mbarrier.arrive",
                         "mbarrier.arrive.expect_tx", "mbarrier.init",
                         "mbarrier.try_wait.parity"]
        body = m.text[m.text.index(".entry"):]
        lines = [ln for ln in body.splitlines()
                 if re.match(r"\s*(@!?%\w+\s+)?(mbarrier\.|bar\.)", ln)]
        assert len(lines) == len(m.ops)
        assert m.q_buffers == row.q_buffers == {64: 2, 128: 2, 256: 1}[head_dim]
        assert m.consumers == row.consumers == {64: 3, 128: 2, 256: 2}[head_dim]
        assert m.tids == tuple(128 * w for w in range(m.consumers + 1))
        # the producer's TMA loads: Q (a 64-row box a consumer), K, V; what they read
        loads = [(args[1], args[-3]) for _, _, args in m.loads.values()]
        assert loads == [("%tmap_q", "%head")] * m.consumers + [
            ("%tmap_k", "%head_kv"), ("%tmap_v", "%head_kv")], loads


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_builds_across_tiles(head_dim, masked):
    b = build(head_dim, masked)
    for prm in MASKED_CASES if masked else UNMASKED_CASES:
        for grid in grids(tile_count(b, prm)):
            b.play(prm, grid)


def test_long_walks_wrap_the_q_buffers():
    """CTAs with 8-40 tiles: each Q buffer and its FULL/EMPTY parities go round many times,
    ring positions run far past 2^3; the masked build's walk over 33 (batch, head) pairs in
    sections of 5 (the last one of 3; two m_blocks: BLOCK_M + 1 query rows). Grids stay within
    the tile count, as the launcher's min(SMs, tiles) does (a CTA without a tile still runs
    one)."""
    for head_dim in HEAD_DIMS:
        plain = build(head_dim, False)
        masked = build(head_dim, True)
        prm = params(513, 1, heads=4, batch=2, heads_per_kv=2)   # 40 tiles (24 at D = 64)
        for grid in (1, 3):
            plain.play(prm, grid, seeds=1)
        prm = causal(masked.block_m + 1, 300, heads=33, heads_per_kv=33, section=5)
        assert tile_count(masked, prm) == 66
        masked.play(prm, 3, seeds=1)
        masked.play(prm, 40, seeds=1, ctas=(0, 39))


def expected_turns(b: Build, prm, ctaid, grid) -> int:
    """A consumer's turns: one a K/V tile (its S, beside the previous K/V tile's PV), plus each
    tile's last PV on its own."""
    tiles, _, kv = b.reference(prm, ctaid, grid)
    return sum(map(len, kv)) + len(tiles)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_each_tile_runs_from_its_own_prologue_to_its_own_last_pv(head_dim):
    """Turn counts: two Q buffers (D = 64, 128) load a tile's Q a tile ahead, one (D = 256:
    O staged in Q, Q EMPTY after the O store) after the tile before's store; either way each tile
    takes a turn a K/V tile and one for its last PV."""
    for masked, prm in ((False, UNMASKED_CASES[1]), (True, MASKED_CASES[0])):
        b = build(head_dim, masked)
        assert b.model.q_buffers == builds.get(head_dim).q_buffers
        for grid in (1, 3):
            for c in range(grid):
                r = sync_replay.Replay(b.model, prm, c, grid, b.reference)
                for order in sync_replay.orders(1, b.consumers):
                    want = expected_turns(b, prm, c, grid)
                    assert r.play(order) == [want] * b.consumers


def test_the_traced_build_synchronises_as_the_plain_one():
    """PTXATTN_TRACE=1 (`ptxattn trace`) adds trace points around the waits: the same
    statements, the same replay."""
    for head_dim, masked in ((64, True), (128, False), (256, True)):
        traced = build(head_dim, masked, PTXATTN_TRACE=True)
        plain = build(head_dim, masked)
        assert sorted(k for k, _, _ in traced.model.ops.values()) == \
            sorted(k for k, _, _ in plain.model.ops.values())
        prm = MASKED_CASES[3] if masked else UNMASKED_CASES[1]
        for grid in (1, 3, tile_count(traced, prm)):
            traced.play(prm, grid, seeds=1)


# ---- mutants: the replay must catch a broken protocol ----------------------------------

def mutate(text: str, old: str, new: str, count: int = 1, after: str | None = None) -> str:
    """text with old replaced by new: every one of `count` occurrences, or with `after` the
    first occurrence past that anchor only."""
    if after is not None:
        at = text.index(after)
        i = text.index(old, at)
        return text[:i] + new + text[i + len(old):]
    assert text.count(old) == count, (old, text.count(old))
    return text.replace(old, new)


MUTANTS = {        # name: (old, new, count, anchor, what the replay must say)
    # the consumer's Q parity without the buffer's use count: wrong from the 2nd tile (parity
    # 1 on a fresh barrier passes at once) or the 3rd
    "q parity without use count": (
        "shr.u32 %q_phase, %local_tile, 1;\n    and.b32 %q_phase, %q_phase, 1;",
        "and.b32 %q_phase, %local_tile, 1;", 1, None, "passed on fill|deadlock"),
    # the producer's Q EMPTY parity off by one: it waits early (or for ever)
    "q empty parity off by one": ("add.u32 %q_phase, %q_phase, 1;", "", 1, None,
                                  "passed after 0 releases|deadlock"),
    # the producer skips the Q EMPTY wait: a Q buffer overwritten while in use (with one K/V
    # tile a Q tile; with more, the K/V ring alone holds the producer back far enough)
    "q empty wait skipped": ("setp.lt.u32 %p_first, %local_tile, 2;",
                             "setp.lt.u32 %p_first, %local_tile, 99;", 1, None,
                             "overwritten in use"),
    # the consumers never release Q (the tile-end arrive dropped): the producer waits for ever
    "q empty arrive dropped": ("mbarrier.arrive.shared::cta.b64 %state, [%q_buf_empty];", "",
                               1, None, "deadlock"),
    # the consumer's Q buffer one tile behind (local_tile - 1): it waits on the other
    # buffer's barrier, or reads a buffer it did not wait for (from its second tile)
    "consumer q buffer one tile behind": (
        "and.b32 %q_buf, %local_tile, 1;",
        "setp.ne.u32 %p_buf1, %local_tile, 0;\n    selp.b32 %q_buf, 1, 0, %p_buf1;\n"
        "    sub.u32 %q_buf, %local_tile, %q_buf;\n    and.b32 %q_buf, %q_buf, 1;",
        None, "consumer_tile_loop:", "passed on fill|deadlock|reads buffer"),
    # the first PV's hand-over dropped (the prologue's): the other consumer never gets its turn
    "prologue hand-over dropped": ("bar.arrive %other_turn, 256;", "", None,
                                   "wait_full_k0:", "deadlock"),
    # K and V loaded from the query head, not its K/V head (GQA/MQA)
    "k/v loads read the query head": ("%zero, %head_kv, %batch}", "%zero, %head, %batch}", 2,
                                      None, "producer's K loads"),
    # the producer loads Q into buffer 0 every time, though it signals buffer local_tile % 2
    "q loaded into the wrong buffer": (
        "mad.lo.u32 %tmp, %q_buf, (2 * 16384), %sQ;", "mov.u32 %tmp, %sQ;", 1, None,
        r"loads \[\('%tmap_q', 0\), \('%tmap_q', 16384\)\] for barrier"),
}


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_the_replay_catches_a_broken_protocol(name, masked):
    """Each mutant of the D = 128 build fails the replay, for its own reason (MQA: 5 query heads
    read K/V head 0)."""
    old, new, count, after, reason = MUTANTS[name]
    b = Build(128, masked, mutate(source(128, masked), old, new, count, after))
    make = causal if masked else params
    with pytest.raises(AssertionError, match=reason):
        for seq_k in (128, 385):                 # one K/V tile a Q tile, then four
            for grid in (1, 2):                  # 5 tiles: 3 a CTA at most
                b.play(make(129, seq_k, heads=5, heads_per_kv=5), grid, seeds=1)


def test_the_replay_catches_q_released_before_the_tiles_last_s():
    """The Q EMPTY arrive moved from tile_end to right after a tile's first S: harmless with one
    K/V tile a Q tile (its first S is its last), caught with more (a later S reads a released
    Q, which the producer may overwrite)."""
    arrive = "mbarrier.arrive.shared::cta.b64 %state, [%q_buf_empty];"
    text = mutate(source(128, False), arrive, "")
    # where the K/V runs start, after the prologue
    runs = "\n    add.u32 %kv_end, %kv_base"
    text = mutate(text, runs, f"\n    {arrive}{runs}")
    b = Build(128, False, text)
    b.play(params(129, 128, heads=5), 2, seeds=1)
    with pytest.raises(AssertionError, match="whose fill it has released|overwritten in use"):
        b.play(params(129, 385, heads=5), 2, seeds=1)


# ---- three consumers (D = 64): the turn ring, named barriers, the third Q box --------------

def test_named_barriers_of_every_consumer():
    """Named barrier 0 is the CTA's (every warpgroup, .maxntid threads); turn barrier c + 1 is
    consumer c's (its bar.sync) and the previous consumer's hand-over (the last consumer's to
    consumer 0); then one O staging barrier of 128 threads a consumer, c + CONSUMERS + 1
    (4, 5, 6 at D = 64; 3, 4 at D = 128), within the 16 of the hardware."""
    for head_dim in HEAD_DIMS:
        row = builds.get(head_dim)
        b = build(head_dim, True)
        n = b.consumers
        r = sync_replay.Replay(b.model, MASKED_CASES[0], 0, 2, b.reference)
        r.play(sync_replay.orders(0, n)[0])
        want = {row.bar_cta: {t: 128 * (n + 1) for t in range(n + 1)}}
        for c in range(n):
            want[row.bar_turn(c)] = {c + 1: 256, (c - 1) % n + 1: 256}
            want[row.bar_o(c)] = {c + 1: 128}
        assert sorted(want) == list(range(1 + 2 * n)) and row.named_barriers == 1 + 2 * n
        assert r.named_uses == want, (head_dim, r.named_uses)
        assert max(want) < 16


def test_the_references_take_the_rows_block_m():
    """192-row tiles at D = 64: m_blocks = ceil(seq_q / 192), a Q content of three 64-row
    boxes; 128 rows (two boxes) at D = 128."""
    prm = causal(385, 385, heads=2)
    for head_dim, rows in ((64, (0, 64, 128)), (128, (0, 64))):
        b = build(head_dim, True)
        m_blocks = -(-385 // (64 * len(rows)))
        assert b.block_m == 64 * len(rows) and tile_count(b, prm) == 2 * m_blocks
        for walk in (b.reference, lambda *a: round_robin(*a, b.block_m, b.block_n)):
            tiles, q, _ = walk(prm, 0, 1)
            assert len(tiles) == len(q) == 2 * m_blocks
            assert sorted(q)[0] == ("Q", *rows, 0, 0), q
    tiles, q, _ = round_robin(params(385, 128), 0, 1, 192, 128)
    assert tiles == [0, 1, 2] and q[2] == ("Q", 384, 448, 512, 0, 0)


def test_the_interleavings_cover_every_consumer():
    """The fixed priorities put each thread first at least once, the last consumer ahead of
    the others and, with three consumers, the middle one first."""
    for n in (2, 3):
        live = list(range(n + 1))
        firsts = [order(live) for order in sync_replay.orders(0, n)]
        assert all(sorted(f) == live for f in firsts)
        assert {f[0] for f in firsts} == set(live), firsts
        assert [n, *range(n - 1, 0, -1), 0] in firsts
    live = [0, 1, 2, 3]
    assert [2, 0, 1, 3] in [order(live) for order in sync_replay.orders(0, 3)]
    shuffled = sync_replay.orders(2, 3)[-2:]
    assert all(sorted(order(live)) == live for order in shuffled)


def test_the_model_checks_its_consumers():
    """CONSUMERS must match BLOCK_M (64 rows a consumer) and .maxntid (a warpgroup each)."""
    text = source(64, False)
    d = defines(64)
    with pytest.raises(ValueError, match="BLOCK_M 192 is not 64 rows for each of CONSUMERS 2"):
        sync_replay.Model(text, {**d, "CONSUMERS": 2})
    with pytest.raises(ValueError, match=r"\.maxntid 384, not a producer and CONSUMERS 3"):
        sync_replay.Model(text.replace(".maxntid 512,", ".maxntid 384,"), d)
    with pytest.raises(ValueError, match="missing CONSUMERS"):
        sync_replay.Model(text, {k: v for k, v in d.items() if k != "CONSUMERS"})


THREE_CONSUMER_MUTANTS = {        # name: (old, new, what the replay must say)
    # the last consumer hands over to consumer 1, not back to consumer 0
    "last consumer hands over to consumer 1": (
        "selp.u32 %other_turn, 1, %other_turn, %p_last_consumer;",
        "selp.u32 %other_turn, 2, %other_turn, %p_last_consumer;",
        "consumer 2: hands over to consumer 1's turn"),
    # consumer 1 skips its very last hand-over instead of consumer 2 (the last): consumer 2
    # waits for ever, and consumer 2's last hand-over has no taker
    "consumer 1 skips the last hand-over": (
        "and.pred %p_tiles, %p_last_consumer, %p_last_tile;",
        "setp.eq.u32 %p_tiles, %consumer, 1;\n    and.pred %p_tiles, %p_tiles, %p_last_tile;",
        "deadlock|half arrived"),
    # consumer 1, not the last, hands consumer 0 its first turn
    "consumer 1 starts the ring": (
        "@%p_last_consumer bar.arrive 1, 256;",
        "setp.eq.u32 %p_tiles, %consumer, 1;\n    @%p_tiles bar.arrive 1, 256;",
        "consumer 1: hands over to consumer 0's turn"),
    # a K slot's EMPTY barrier counts two consumers' threads: the producer refills it before
    # the third consumer released it, or (the third's arrivals counted into the next phase)
    # the parities drift apart and everyone waits
    "k empty counts two consumers": ("[%bar_empty_k], 384;", "[%bar_empty_k], 256;",
                                     r"consumers \[\d\] not all of theirs|deadlock"),
    "q empty counts two consumers": ("[%bar_q_empty], 384;", "[%bar_q_empty], 256;",
                                     r"consumers \[\d\] not all of theirs"),
    # the third Q box loads the second one's rows
    "third q box reads the second's rows": ("add.u32 %q_row2, %q_row, 128;",
                                            "add.u32 %q_row2, %q_row, 64;", "multiplied by Q"),
    # Q's expect_tx announces two boxes, three arrive
    "q expect_tx of two boxes": ("[%q_buf_bar], 3 * 8192;", "[%q_buf_bar], 2 * 8192;",
                                 "expect_tx of 16384 bytes, 3 loads"),
    # O staging from barrier 3 (two consumers' BAR_O_FIRST): consumer 0's O barrier is
    # consumer 2's turn
    "o staging on a turn barrier": ("add.u32 %o_bar, %consumer, 4;",
                                    "add.u32 %o_bar, %consumer, 3;",
                                    "named barrier 3 with count (128|256), elsewhere"),
}


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", sorted(THREE_CONSUMER_MUTANTS))
def test_the_replay_catches_a_broken_three_consumer_protocol(name, masked):
    """Each mutant of the D = 64 build's three-consumer protocol fails the replay, for its own
    reason (5 tiles of 192 rows; one K/V tile a Q tile, then three)."""
    old, new, reason = THREE_CONSUMER_MUTANTS[name]
    text = source(64, masked)
    b = Build(64, masked, mutate(text, old, new, text.count(old) or 1))
    assert b.consumers == 3
    make = causal if masked else params
    with pytest.raises(AssertionError, match=reason):
        for seq_k in (128, 385):
            for grid in (1, 2):
                b.play(make(129, seq_k, heads=5, heads_per_kv=5), grid, seeds=1)


# ---- one Q buffer, O staged in it (D = 256) ---------------------------------------------------

ONE_BUFFER_MUTANTS = {        # name: (old, new, what the replay must say)
    # the consumers never release Q after the O store: the producer waits for ever
    "q empty after the store dropped": ("mbarrier.arrive.shared::cta.b64 %state, [%bar_q_empty];",
                                        "", "deadlock"),
    # the producer's Q EMPTY parity one fill late: it waits for a release that is not due
    "q empty parity off by one": ("add.u32 %q_phase, %local_tile, 1;",
                                  "mov.u32 %q_phase, %local_tile;",
                                  "passed after|deadlock"),
    # the producer never waits for Q EMPTY: the next tile's Q lands on a consumer's O (and Q)
    "q empty wait skipped": ("setp.eq.u32 %p_first, %local_tile, 0;",
                             "setp.ge.u32 %p_first, %local_tile, 0;", "overwritten in use"),
}


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", sorted(ONE_BUFFER_MUTANTS))
def test_the_replay_catches_a_broken_one_buffer_protocol(name, masked):
    """Each mutant of the D = 256 build's single Q buffer (released after the O store) fails the
    replay, for its own reason."""
    old, new, reason = ONE_BUFFER_MUTANTS[name]
    b = Build(256, masked, mutate(source(256, masked), old, new))
    assert b.model.q_buffers == 1
    make = causal if masked else params
    with pytest.raises(AssertionError, match=reason):
        for seq_k in (64, 385):                  # one K/V tile a Q tile (BLOCK_N 64), then seven
            for grid in (1, 2):
                b.play(make(129, seq_k, heads=5, heads_per_kv=5), grid, seeds=1)

"""The L2-local tile walk (ptxattn/tile_walk.py, ptx/sm90/include/tile_walk.ptxh), CPU only
except the GPU tests at the end.

- The model's walks: every tile once, for any section size; section 1 is head-major and
  section BH m_block-major (one section: the alternation changes nothing, so the kernel given
  today_section's BH walks the old m_block-major walk exactly).
- The production builds' PTX (the sectioned walk is every non-varlen build's) takes, CTA by
  CTA, exactly the tiles of the model's sectioned walk, in the same order, in every build (D
  64/128/256, masked or not), with the parameter clamped (0 or more than BH pairs); its
  producer walks them too; the last tile flag is set on each CTA's last tile only.
- The host: the launcher passes tile_walk.host_section's value as walk_section (and a
  measurement's rule, api.prepare(walk_rule=)), per prepared call.
- The simulation: against a direct event-by-event reference on small problems, its limits
  (an L2 that holds everything: only first reads miss), and the predictions the walk was
  chosen by (causal (2, 16, 16384): a busiest CTA within 0.5% of the mean and far more K/V
  reuse than today's m_block-major walk).
- The host's section: whole GQA groups, inside the L2 share, the best balance.
"""

from __future__ import annotations

import heapq
import itertools
import re
from collections import OrderedDict
from functools import lru_cache

import numpy as np
import pytest

from ptxattn import ptx, stages, tile_walk
from ptxattn.launch import UNBOUNDED
from ptxattn.tile_walk import Problem
from sync_replay import q_content
from test_prepare import gpu  # noqa: F401  (a fixture: the pretend driver)
from test_steady import tagged  # noqa: F401  (a fixture)
from test_production_schedule import (CONSUMER_WATCH, PRODUCER_WATCH, Program, build_constant,
                                      consumer_tiles, params, program, run_cta)


def small(batch, heads, seq_q, seq_k, head_dim, heads_kv=0, masked=False):
    """A Problem with the build's tiles; masked: causal."""
    return Problem.of(batch, heads, seq_q, seq_k, head_dim, heads_kv, causal=masked)


# ---- the model's walks --------------------------------------------------------------------

@pytest.mark.parametrize("masked", [False, True])
def test_every_walk_covers_every_tile_once(masked):
    for batch, heads, seq in itertools.product((1, 2, 3), (1, 2, 5), (128, 300, 1000)):
        p = small(batch, heads, seq, seq, 128, masked=masked)
        for section in sorted({1, 2, 3, p.bh, p.bh + 4}):
            for grid in sorted({1, 2, 7, 13, p.tiles}):
                if grid > p.tiles:
                    continue
                done = [t for cta in tile_walk.walk(p, min(section, p.bh), grid) for t in cta]
                want = [(m, bh) for bh in range(p.bh) for m in range(p.m_blocks)]
                assert sorted(done) == sorted(want), (batch, heads, seq, section, grid)


def test_sections_one_and_all_are_head_major_and_m_block_major():
    p = small(2, 3, 600, 600, 128, masked=True)           # 5 query blocks, 6 pairs
    m = p.m_blocks
    head_major = [tile_walk.tile_of(t, p, 1, alternate=False) for t in range(p.tiles)]
    assert head_major == [(m - 1 - t % m, t // m) for t in range(p.tiles)]
    mblock_major = [tile_walk.tile_of(t, p, p.bh) for t in range(p.tiles)]
    assert mblock_major == [(m - 1 - t // p.bh, t % p.bh) for t in range(p.tiles)]


def test_sections_alternate_and_the_last_goes_longest_first():
    """Three sections of 2 pairs (the last walks longest first, the one before shortest
    first, the first longest first again); a narrower last section of one pair."""
    p = small(1, 6, 384, 384, 128, masked=True)           # 3 query blocks
    order = [tile_walk.tile_of(t, p, 2) for t in range(p.tiles)]
    assert order[:6] == [(2, 0), (2, 1), (1, 0), (1, 1), (0, 0), (0, 1)]
    assert order[6:12] == [(0, 2), (0, 3), (1, 2), (1, 3), (2, 2), (2, 3)]
    assert order[12:] == [(2, 4), (2, 5), (1, 4), (1, 5), (0, 4), (0, 5)]
    p = small(1, 5, 384, 384, 128, masked=True)
    assert [tile_walk.tile_of(t, p, 2) for t in range(12, 15)] == [(2, 4), (1, 4), (0, 4)]


# ---- the kernel's walks, from its PTX -----------------------------------------------------

WATCHED = {r for w in (CONSUMER_WATCH, PRODUCER_WATCH) for regs in w.values() for r in regs}


def walk_program(head_dim: int, masked: bool) -> Program:
    """The production build (shared with test_production_schedule's tests)."""
    return program(head_dim, masked)


def kernel_walk(head_dim, masked, prm, grid, prog):
    """Per CTA: its tiles as (m_block, bh) the way consumer 0 and the producer take them,
    and consumer 0's last-tile flags."""
    out, flags = [], []
    for c in range(grid):
        producer, consumer = run_cta(head_dim, masked, prm, c, grid, prog=prog, tids=(0, 128))
        tiles = consumer_tiles(consumer)
        got = [(t["%m_block"], t["%batch"] * prm["heads"] + t["%head"]) for t in tiles]
        made = [(v["%batch"] * prm["heads"] + v["%head"]) for name, v in producer
                if name == "produce_q"]
        assert made == [bh for _, bh in got], f"CTA {c}: producer {made}, consumer {got}"
        q_rows = [v["%q_row"] for name, v in producer if name == "produce_q"]
        block_m = build_constant(head_dim, "BLOCK_M")
        assert q_rows == [m * block_m for m, _ in got], f"CTA {c}: Q rows {q_rows}"
        out.append(got)
        flags.append([t["last"]["%p_last_tile"] for t in tiles])
        if masked:                          # the model's K/V range of each Q tile is the PTX's
            p = Problem.of(prm["batch"], prm["heads"], prm["seq_q"], prm["seq_k"], head_dim,
                           causal=True)
            ranges = [(t["%kv_first"], t["%kv_count"]) for t in tiles]
            assert ranges == [p.kv_range(m) for m, _ in got], (c, ranges)
    return out, flags


def masked_params(seq_q, seq_k, heads, batch, group, masked):
    return params(seq_q, seq_k, heads=heads, batch=batch, heads_per_kv=group,
                  diag=seq_k - seq_q if masked else 0, left=UNBOUNDED,
                  right=0 if masked else UNBOUNDED)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("masked", [True, False])
def test_the_ptx_walk_is_the_models(head_dim, masked):
    """CTA by CTA, the production build's tiles are tile_walk.walk()'s, over shapes, section
    sizes (0 and past BH: clamped to 1 and BH) and grids."""
    prog = walk_program(head_dim, masked)
    n = build_constant(head_dim, "BLOCK_N")
    block_m = build_constant(head_dim, "BLOCK_M")
    checked = 0
    for batch, heads, group, seq_q in [(1, 5, 1, 3 * block_m), (2, 3, 3, 2 * block_m + 7),
                                       (3, 4, 2, block_m), (1, 1, 1, 4 * block_m - 1),
                                       (2, 6, 2, 2 * block_m)]:
        p = Problem.of(batch, heads, seq_q, n - 3, head_dim, heads // group, causal=masked)
        for section in sorted({0, 1, 2, p.bh - 1, p.bh, p.bh + 5}):
            prm = dict(masked_params(seq_q, n - 3, heads, batch, group, masked),
                       walk_section=section)
            clamped = min(max(section, 1), p.bh)
            for grid in sorted({1, 4, p.tiles}):
                got, flags = kernel_walk(head_dim, masked, prm, grid, prog)
                want = tile_walk.walk(p, clamped, grid)
                assert got == want, (f"B={batch} H={heads} Lq={seq_q} S={section} G={grid}: "
                                     f"PTX {got} model {want}")
                for f in flags:
                    assert f == [False] * (len(f) - 1) + [True], flags
                checked += 1
    assert checked > 50


def test_one_section_is_the_old_m_block_major_walk():
    """today_section's B*H (masked, B*H <= 32): one section, so the alternation changes
    nothing and the kernel given it walks the m_block-major walk of the builds before, tile
    for tile; given 1 it walks head-major, every other head's query blocks the other way."""
    for masked, (batch, heads, seq) in itertools.product((True, False),
                                                         [(1, 3, 640), (3, 11, 300)]):
        prog = walk_program(128, masked)
        p = Problem.of(batch, heads, seq, 125, 128, causal=masked)
        for section in (p.bh, 1):
            prm = dict(masked_params(seq, 125, heads, batch, 1, masked), walk_section=section)
            for grid in (1, 5):
                got, _ = kernel_walk(128, masked, prm, grid, prog)
                assert got == tile_walk.walk(p, section, grid), (masked, batch, heads, grid)
                if section == p.bh:
                    assert got == tile_walk.walk(p, section, grid, alternate=False)
    p = Problem.of(1, 3, 640, 125, 128, causal=True)
    assert tile_walk.today_section(p) == p.bh


def test_the_ptx_check_can_fail():
    """A walk without the alternation is caught (the sections' directions matter)."""
    st = stages.PRODUCTION.specialize(128, masked=True)
    text = ptx.source(st, dict(st.defines))
    old = "@%p_walk_back sub.u32 %m_block, %m_blocks, %m_block;"
    assert text.count(old) == 2
    prog = Program(text.replace(old, "").replace("@%p_walk_back add.u32 %m_block, %m_block, -1;",
                                                 ""), WATCHED)
    p = Problem.of(1, 4, 384, 100, 128, causal=True)
    prm = dict(masked_params(384, 100, 4, 1, 1, True), walk_section=2)
    got, _ = kernel_walk(128, True, prm, 3, prog)
    assert got != tile_walk.walk(p, 2, 3)
    assert kernel_walk(128, True, prm, 3, walk_program(128, True))[0] == tile_walk.walk(p, 2, 3)


def test_every_non_varlen_build_takes_the_walk_parameter():
    """walk_section right after window_right in every production build but the varlen one
    (its tile table is its walk: tiles_ptr there), and no build knob left for the walk."""
    for head_dim, masked in itertools.product((64, 128, 256), (False, True)):
        st = stages.PRODUCTION.specialize(head_dim, masked=masked)
        text = ptx.source(st, dict(st.defines))
        entry = text[text.index(".entry"):text.index(")", text.index(".entry"))]
        names = re.findall(r"\.param\s+(?:\.align\s+\d+\s+)?\.\w+\s+(\w+)", entry)
        assert names[-2:] == ["window_right", "walk_section"], names
        assert "p_mblock_major" not in text and "MBLOCK_MAJOR" not in text
    st = stages.PRODUCTION.specialize(128, varlen=True)
    assert "walk_section" not in ptx.source(st, dict(st.defines))
    raw = ptx.source_text(stages.PRODUCTION)
    for knob in ("PTXATTN_L2_WALK", "PTXATTN_HEAD_MAJOR", "MBLOCK_MAJOR_MAX_BH"):
        assert knob not in raw, knob


def walk_reference(head_dim: int, masked: bool):
    """sync_replay's reference schedule of the production build (test_production_sync's:
    the rounds, tile_walk's tiles for the clamped section, the K/V tiles rows see)."""
    from test_production_sync import sectioned_walk
    return lambda prm, ctaid, grid: sectioned_walk(prm, ctaid, grid, head_dim, masked)


@pytest.mark.parametrize("head_dim, masked", [(128, True), (128, False), (64, True)])
def test_walk_build_synchronisation_replays(head_dim, masked):
    """The production build's barrier protocol (tests/sync_replay.py: parities, Q buffers, ring
    slots, turns, TMA contents against the walk's reference) under several interleavings, at
    several sections; its K/V runs and Q loads follow the walk's tiles."""
    import sync_replay
    from test_production_sync import defines
    model = sync_replay.Model(walk_program_text(head_dim, masked), defines(head_dim))
    reference = walk_reference(head_dim, masked)
    n = build_constant(head_dim, "BLOCK_N")
    for batch, heads, group, seq_q, seq_k, section, grid in [
            (2, 3, 1, 300, 2 * n + 5, 2, 4), (1, 4, 2, 500, n - 3, 4, 3),
            (1, 5, 1, 200, 2 * n, 0, 5)]:
        prm = dict(masked_params(seq_q, seq_k, heads, batch, group, masked),
                   walk_section=section)
        sync_replay.play_all(model, prm, grid, reference, seeds=2)


def walk_program_text(head_dim: int, masked: bool) -> str:
    st = stages.PRODUCTION.specialize(head_dim, masked=masked)
    return ptx.source(st, dict(st.defines))


# ---- the simulation -----------------------------------------------------------------------

def reference_simulation(p: Problem, section: int, grid: int, l2_bytes: int, latency=0.5):
    """The model played event by event with a heap (slow, plain): (loads, hits, strict, reads)."""
    per_cta = tile_walk.walk(p, section, grid)
    line = 2 * p.block_n * p.head_dim * 2
    capacity = max(1, l2_bytes // line)
    q_lines = max(1, p.block_m * p.head_dim * 2 // line)
    lru, unique = OrderedDict(), [0]
    hits = strict = reads = 0

    def touch(key, now):
        if key in lru:
            ready = lru[key]
            lru.move_to_end(key)
            return 2 if now >= ready else 1
        lru[key] = now + latency
        if len(lru) > capacity:
            lru.popitem(last=False)
        return 0

    events = [(0.0, c, 0, -1) for c in range(grid) if per_cta[c]]
    heapq.heapify(events)
    while events:
        t, c, i, step = heapq.heappop(events)
        m, bh = per_cta[c][i]
        first, count = p.kv_range(m)
        if step in (-1, count):                   # Q in / O out
            for _ in range(q_lines):
                unique[0] += 1
                touch(("x", unique[0]), t)
            if step == -1:
                heapq.heappush(events, (t + 0.5, c, i, 0))
            elif i + 1 < len(per_cta[c]):
                heapq.heappush(events, (t + 0.5, c, i + 1, -1))
            continue
        b, h = divmod(bh, p.heads)
        got = touch((b, h // p.group, first + step), t)
        hits += got > 0
        strict += got == 2
        reads += 1
        heapq.heappush(events, (t + 1.0, c, i, step + 1))
    loads = [sum(1.0 + p.kv_range(m)[1] for m, _ in tiles) for tiles in per_cta]
    return loads, hits, strict, reads


@pytest.mark.parametrize("masked", [True, False])
def test_simulation_equals_an_event_by_event_reference(masked):
    for batch, heads, group, seq, section, grid, l2 in [
            (2, 4, 1, 1024, 2, 5, 1 << 20), (1, 6, 3, 1500, 3, 4, 1 << 19),
            (2, 3, 1, 700, 1, 7, 1 << 18), (1, 8, 2, 900, 8, 6, 3 << 18)]:
        p = Problem.of(batch, heads, seq, seq, 128, heads // group, causal=masked)
        loads, hits, strict, reads = reference_simulation(p, section, grid, l2)
        got = tile_walk.simulate(p, section, grid=grid, l2_bytes=l2)
        assert got.busiest_over_mean == pytest.approx(max(loads) / np.mean(loads))
        assert got.kv_hit_rate == pytest.approx(hits / reads), (batch, heads, seq, section)
        assert got.kv_hit_rate_strict == pytest.approx(strict / reads)
        assert got.busiest_over_mean == pytest.approx(tile_walk.balance(p, section, grid=grid))


def test_an_l2_that_holds_everything_misses_only_first_reads():
    p = Problem.of(2, 4, 2048, 2048, 128, causal=True)
    got = tile_walk.simulate(p, 2, l2_bytes=1 << 40, other_traffic=False, latency=0.0)
    lines = p.batch * p.heads_kv * p.kv_tiles          # every K/V line read at least once
    reads = got.kv_read_bytes // (2 * p.block_n * p.head_dim * 2)
    assert got.kv_hit_rate == pytest.approx(1 - lines / reads)
    tiny = tile_walk.simulate(p, 2, l2_bytes=1, other_traffic=False)
    assert tiny.kv_hit_rate < got.kv_hit_rate


def test_the_walk_was_chosen_by_causal_16k():
    """The issue's case, causal (2, 16, 16384): today's m_block-major walk reuses K/V in L2
    for ~76% of the reads in the model (measured: 42% hit rate under ncu), head-major 94.5% but
    3% off balance; the sectioned walk balances as well as m_block-major and reuses more than
    either."""
    p = Problem.of(2, 16, 16384, 16384, 128, causal=True)
    section = tile_walk.section_pairs(p)
    today = tile_walk.simulate(p, tile_walk.today_section(p), alternate=False)
    head_major = tile_walk.balance(p, 1, alternate=False)
    new = tile_walk.simulate(p, section)
    assert tile_walk.today_section(p) == 32 and 1 < section <= 4
    assert new.busiest_over_mean < 1.005 and head_major > 1.02
    assert today.kv_hit_rate < 0.8 and new.kv_hit_rate > 0.95
    assert new.kv_dram_bytes < today.kv_dram_bytes / 5


# ---- the host's section ------------------------------------------------------------------

def test_section_pairs_fit_the_share_in_whole_groups_and_balance():
    for case in [(2, 16, 16384, 128, 0), (1, 32, 8192, 128, 8), (8, 16, 4096, 128, 0),
                 (4, 32, 8192, 128, 4), (1, 16, 16384, 128, 0), (4, 32, 8192, 64, 0)]:
        b, h, seq, d, hkv = case
        for masked in (True, False):
            p = Problem.of(b, h, seq, seq, d, hkv, causal=masked)
            s = tile_walk.section_pairs(p)
            assert 1 <= s <= p.bh and s % p.group == 0, (case, s)
            fits = (s // p.group) * p.kv_head_bytes <= tile_walk.L2_SHARE * tile_walk.H200_L2_BYTES
            assert fits or s == p.group, (case, s)
            best = min(tile_walk.balance(p, x) for x in range(p.group, s + 1, p.group))
            assert tile_walk.balance(p, s) <= best + tile_walk.BALANCE_TIE, (case, s)
    # dense: every size balances alike, so the fewest heads in flight: head-major
    assert tile_walk.section_pairs(Problem.of(4, 16, 8192, 8192, 128)) == 1
    # K/V of one head larger than the share: one group a section
    assert tile_walk.section_pairs(Problem.of(1, 4, 131072, 131072, 128, causal=True),
                                   l2_bytes=16 << 20) == 1


# (B, H, L, D, H_kv, window): old (whole K/V a head) and new (the band) sections
WINDOW_SECTIONS = [
    ((2, 16, 16384, 128, 0, (1024, 0)), 4, 17),      # the production window case
    ((4, 8, 32768, 128, 0, (4096, 4096)), 2, 5),
    ((2, 16, 16384, 64, 0, (256, 256)), 1, 16),
    ((8, 16, 4096, 128, 0, (1024, 0)), 15, 24),
    ((1, 16, 131072, 128, 0, (4096, 0)), 1, 7),
    ((1, 32, 8192, 128, 8, (512, 0)), 32, 32),       # every head fitted already: no change
]


@pytest.mark.parametrize("case, old, new", WINDOW_SECTIONS,
                         ids=lambda c: "x".join(map(str, c[:5])) + f"-w{c[5]}"
                         if isinstance(c, tuple) else str(c))
def test_window_sections_size_the_band_not_the_whole_kv(case, old, new):
    """A window's section is sized by its band (the keys its concurrent query blocks see), so
    more heads fit and the rule finds a better balanced size; its band fits the share, it
    balances within the tie of every fitting size, never worse than the whole-K/V rule's."""
    b, h, seq, d, hkv, window = case
    p = Problem.of(b, h, seq, seq, d, hkv, window=window)
    assert tile_walk.section_pairs(p) == old
    s = tile_walk.section_pairs(p, band=True)
    assert s == new and s % p.group == 0
    budget = tile_walk.L2_SHARE * tile_walk.H200_L2_BYTES
    grid = min(tile_walk.H200_SMS, p.tiles)

    def fits(x):
        return (x // p.group) * p.kv_band_bytes(-(-grid // x)) <= budget

    assert fits(s)
    fitting = [x for x in range(p.group, p.bh + 1, p.group) if fits(x)]
    assert tile_walk.balance(p, s) <= min(map(lambda x: tile_walk.balance(p, x), fitting)) \
        + tile_walk.BALANCE_TIE
    assert tile_walk.balance(p, s) <= tile_walk.balance(p, old) + tile_walk.BALANCE_TIE


def test_masks_that_see_every_key_keep_their_sections():
    """Causal, unmasked and half-unbounded windows see a head's whole K/V: the band rule gives
    the whole-K/V rule's section (the production set's only change is the window case)."""
    from ptxattn.tools import bench
    for c in bench.select_set("production").cases:
        p = tile_walk.problem_of_case(c)
        new, old = tile_walk.section_pairs(p, band=True), tile_walk.section_pairs(p)
        assert (new == old) == (c.name != "window1024-16k"), (c.name, old, new)
    for window in ((1024, -1), (-1, 1024), (-1, -1), (-1, 0), None):
        for b, h, seq, d, hkv in ((2, 16, 16384, 128, 0), (1, 32, 8192, 128, 8)):
            p = Problem.of(b, h, seq, seq, d, hkv, window=window)
            assert p.kv_band_bytes(1) == p.kv_head_bytes
            assert tile_walk.section_pairs(p, band=True) == tile_walk.section_pairs(p)


def test_a_windows_band_is_its_keys_not_its_heads():
    p = Problem.of(2, 16, 16384, 16384, 128, window=(1024, 0))
    tile = 2 * 128 * 128 * 2                           # K and V of one 128-key tile
    assert p.kv_band_bytes(1) == 9 * tile              # 1024 keys back + the block's own
    assert p.kv_band_bytes(8) == 16 * tile
    assert p.kv_band_bytes(10**6) == p.kv_head_bytes   # capped at the head's K/V
    wide = Problem.of(1, 1, 4096, 4096, 128, window=(8192, 8192))   # wider than the keys
    assert wide.kv_band_bytes(1) == wide.kv_head_bytes


def test_the_sector_ceiling_bounds_what_ncu_measured():
    """No walk beats first reads from HBM: the window case's ceiling is below issue 23's 85%
    (so no section reaches it), and every ncu figure of sessions 8-9 (natural clocks) lies
    below its case's ceiling."""
    measured = {  # (B, H, L, D, H_kv, causal, window): L2 hit %, bench/results/s8, s9
        (2, 16, 16384, 128, 0, False, (1024, 0)): 75.9, (8, 16, 4096, 128, 0, True, None): 81.84,
        (4, 16, 8192, 128, 0, True, None): 89.81, (8, 16, 4096, 128, 0, False, None): 94.9,
        (4, 32, 8192, 128, 4, True, None): 96.03, (1, 32, 8192, 128, 8, True, None): 97.19,
        (2, 16, 16384, 128, 0, False, None): 93.6, (1, 32, 6930, 64, 0, False, None): 91.98,
    }
    for (b, h, seq, d, hkv, causal, window), hit in measured.items():
        p = Problem.of(b, h, seq, seq, d, hkv, causal=causal, window=window)
        assert 100 * tile_walk.sector_hit_ceiling(p) >= hit, (b, h, seq, d, causal, window)
    window = Problem.of(2, 16, 16384, 16384, 128, window=(1024, 0))
    assert 0.84 < tile_walk.sector_hit_ceiling(window) < 0.85
    # a short query run against long keys: only the keys its window reaches count as firsts
    short = Problem.of(1, 1, 128, 16384, 128, window=(256, 0))
    assert tile_walk.sector_hit_ceiling(short) == pytest.approx(1 - (3 * 65536 + 32768)
                                                                / (3 * 65536 + 2 * 32768))


def test_walk_rules_and_forced_sections():
    p = Problem.of(2, 16, 16384, 16384, 128, window=(1024, 0))
    assert tile_walk.walk_section(p, "section:3") == (3, True)
    assert tile_walk.walk_section(p, "section:1000") == (32, True)     # the kernel clamps too
    assert tile_walk.walk_section(p, "l2-band")[0] == tile_walk.section_pairs(p, band=True)
    assert tile_walk.host_section(p, None, 132, "l2-band") == 17
    assert tile_walk.host_section(p, None, 132) == 4     # the band rule lost sustained
    for bad in ("section:0", "section:", "section:-2", "section:x", "snake", "Section:3"):
        with pytest.raises(ValueError, match="walk_rule: expected one of"):
            tile_walk.check_rule(bad)


# ---- the launcher's side ------------------------------------------------------------------

def launched_section(calls) -> int:
    """walk_section of the last recorded launch (tuple or packed form)."""
    from ptxattn import launch
    from test_steady import packed_bytes
    abi = launch.params_of(stages.PRODUCTION)
    call = calls["cuLaunchKernelEx"][-1]
    if isinstance(call[2], tuple):
        return int(call[2][0][launch.slot(abi, "walk_section")])
    raw = packed_bytes(call, [p.ctype for p in abi])[launch.slot(abi, "walk_section")]
    return int.from_bytes(raw, "little")


def test_the_launcher_passes_the_hosts_section(tagged):
    """attention() and prepare() pass host_section's value (section_pairs with the grid and the
    device's L2) as walk_section; walk_rule= picks another rule; a bad rule is refused before
    anything runs; a smaller L2 gives smaller sections."""
    from ptxattn import api as attn
    from test_steady import dev
    cases = [((4, 8, 1024, 64), True), ((1, 2, 128, 128), True), ((2, 16, 16384, 128), True),
             ((2, 16, 16384, 128), False)]
    for (b, h, seq, d), causal in cases:
        q, k, v = (dev((b, h, seq, d), i) for i in range(3))
        attn.prepare(q, k, v, causal=causal).launch()
        p = Problem.of(b, h, seq, seq, d, causal=causal)
        want = tile_walk.section_pairs(p, grid=min(132, p.tiles))
        assert launched_section(tagged) == want, ((b, h, seq, d), causal)
        band = tile_walk.section_pairs(p, grid=min(132, p.tiles), band=True)
        rules = (("today", tile_walk.today_section(p)), ("head-major", 1),
                 ("section:3", min(3, p.bh)), ("l2-band", band))
        for rule, section in rules:
            attn.prepare(q, k, v, causal=causal, walk_rule=rule).launch()
            assert launched_section(tagged) == section, (rule, (b, h, seq, d))
    launches = len(tagged["cuLaunchKernelEx"])
    with pytest.raises(ValueError, match="walk_rule: expected one of today, head-major, "
                                         "l2-walk, l2-band or section:N"):
        attn.prepare(q, k, v, walk_rule="snake")
    assert len(tagged["cuLaunchKernelEx"]) == launches
    from ptxattn import driver
    driver.context().l2_bytes = 8 << 20                # a smaller L2: fewer heads a section
    q, k, v = (dev((2, 16, 16384, 128), i) for i in range(3))
    attn.prepare(q, k, v, causal=True).launch()
    p = Problem.of(2, 16, 16384, 16384, 128, causal=True)
    assert launched_section(tagged) == tile_walk.section_pairs(p, 8 << 20, grid=132) == 1


def test_the_fast_path_gives_a_new_shape_its_own_section(tagged):
    """The steady call replays a prepared call's parameters per shape: each shape keeps the
    section its own build computed."""
    from ptxattn import api as attn
    from test_steady import dev
    shapes = [(4, 8, 1024, 64), (1, 2, 128, 128)]
    wants = []
    for shape in shapes:
        b, h, seq, d = shape
        p = Problem.of(b, h, seq, seq, d, causal=True)
        wants.append(tile_walk.section_pairs(p, grid=min(132, p.tiles)))
    assert wants[0] != wants[1]
    arrays = [tuple(dev(shape, 3 * i + j) for j in range(3)) for i, shape in enumerate(shapes)]
    for _ in range(3):                                   # miss, then hits, shapes interleaved
        for (q, k, v), want in zip(arrays, wants):
            attn.attention(q, k, v, causal=True)
            assert launched_section(tagged) == want
    assert len(tagged["builds"]) == 2


def test_host_section_is_section_pairs_per_device_and_cached():
    p = Problem.of(2, 16, 16384, 16384, 128, causal=True)
    assert tile_walk.host_section(p, None, 132) == tile_walk.section_pairs(p, grid=132)
    assert tile_walk.host_section(p, 50 << 20, 1000) == tile_walk.section_pairs(p, grid=1000)
    small_p = Problem.of(1, 2, 128, 128, 128, causal=True)        # 2 tiles: a grid of 2
    assert tile_walk.host_section(small_p, None, 132) == tile_walk.section_pairs(small_p, grid=2)
    assert tile_walk.host_section(p, 8 << 20, 132) == tile_walk.section_pairs(p, 8 << 20,
                                                                              grid=132)
    assert tile_walk.host_section(p, None, 132, "today") == tile_walk.today_section(p) == 32
    hits = tile_walk._cached_section.cache_info().hits
    tile_walk.host_section(p, None, 132)
    assert tile_walk._cached_section.cache_info().hits == hits + 1


# (B, H, Hkv, L, D, causal, section, CTAs): B*H not a multiple of the section, GQA, a section
# of 1 and one past B*H (clamped), few CTAs (each walks tiles of several sections)
EMULATED_WALKS = [
    (1, 3, 3, 260, 128, True, 2, 2),
    (1, 5, 5, 200, 128, False, 2, 3),
    (2, 3, 1, 130, 128, True, 4, 2),
    (1, 4, 2, 200, 64, True, 3, 2),
    (1, 3, 3, 140, 256, False, 10**6, 2),
    (1, 3, 3, 260, 128, True, 1, 3),
]


@pytest.mark.parametrize("case", EMULATED_WALKS, ids=lambda c: (
    f"B{c[0]}H{c[1]}:{c[2]}-L{c[3]}-D{c[4]}-{'causal' if c[5] else 'dense'}-S{c[6]}-ctas{c[7]}"))
def test_the_production_walk_on_the_emulator(emulated_gpu, monkeypatch, case):
    """attention() end to end on the CPU emulator with the section forced (host_section
    patched), against the float64 reference: every row written and within the bar."""
    from emulator_checks import check
    b, h, hkv, seq, d, causal, section, ctas = case
    monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", str(ctas))
    passed = []

    def forced(problem, l2_bytes, sm_count, rule="l2-walk"):
        passed.append(problem)
        return section
    monkeypatch.setattr(tile_walk, "host_section", forced)
    check(emulated_gpu, None, b, h, seq, seq, d, heads_kv=hkv, causal=causal)
    assert len(passed) == 1 and passed[0].bh == b * h and passed[0].masked == causal
    assert emulated_gpu.launches[-1][1][0] <= ctas


def test_predictions_table_names_every_walk_and_case():
    rows = tile_walk.predict({"causal-2x16x4k": Problem.of(2, 16, 4096, 4096, 128, causal=True),
                              "dense-1x4x2k": Problem.of(1, 4, 2048, 2048, 128)})
    text = tile_walk.format_predictions(rows)
    for name in ("causal-2x16x4k", "dense-1x4x2k", "today", "head-major", "l2-walk"):
        assert name in text
    assert rows["causal-2x16x4k"]["l2-walk"].section == tile_walk.section_pairs(
        Problem.of(2, 16, 4096, 4096, 128, causal=True))


# ---- on the GPU ----------------------------------------------------------------------------

def _check_walk_build(shape, *, heads_kv=None, causal=False, window=None, layout="bhld",
                      section=None, ctas=None, monkeypatch=None, seed=0):
    """The production build on the GPU with the host's section (or a forced one) against the
    float64 reference: every row checked is finite and within the bar; on failure the message
    names the section, the worst (batch, head) and rows."""
    from ptxattn import driver, tensors
    from ptxattn.api import prepare
    from ptxattn.reference import (attention_reference, error_metrics, passes, random_qkv,
                                   sample_rows)

    b, h, lq, lk, d = shape
    hkv = heads_kv or h
    if ctas is not None:
        monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", str(ctas))
    q, k, v = random_qkv(b, h, lq, lk, d, layout, seed=seed, heads_kv=hkv)
    qd, kd, vd = (tensors.from_numpy(x) for x in (q, k, v))
    out = tensors.empty(q.shape)
    out.fill_u16(0xFFFF)                           # NaN: an unwritten tile shows
    ctx = driver.context()
    problem = Problem.of(b, h, lq, lk, d, hkv, causal=causal, window=window)
    used = tile_walk.host_section(problem, ctx.l2_bytes, ctas or ctx.sm_count)
    with pytest.MonkeyPatch.context() as patch:
        if section is not None:                    # forced: the launcher's rule patched
            patch.setattr(tile_walk, "host_section", lambda *a, **k: section)
            used = section
        p = prepare(qd, kd, vd, layout=layout, out=out, causal=causal, window=window)
    p.launch()
    driver.synchronize()
    got = out.to_numpy().astype(np.float32)
    axis = 2 if layout == "bhld" else 1
    nan_rows = np.isnan(got).any(axis=-1)
    assert not nan_rows.any(), (f"{shape} S={used}: {int(nan_rows.sum())} rows not "
                                f"written (NaN), first at {np.argwhere(nan_rows)[:3].tolist()}")
    rows = sample_rows(lq, 256, seed=seed) if lq > 600 else np.arange(lq)
    ref = attention_reference(q, k, v, layout=layout, causal=causal, window=window, rows=rows)
    got = np.take(got, rows, axis=axis)
    worst = None
    for bi, hi in itertools.product(range(b), range(h)):
        sl = (bi, hi) if layout == "bhld" else (bi, slice(None), hi)
        m = error_metrics(got[sl], ref[sl])
        if not passes(m) and worst is None:
            worst = (bi, hi, m)
    assert worst is None, (f"{shape} S={used} {layout}: (batch, head) {worst[:2]}, "
                           f"{len(rows)} rows: {worst[2]}")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_walk_build_on_the_gpu(head_dim, causal, monkeypatch):
    """Small shapes, 3 persistent CTAs (each walks many tiles across sections), ragged
    lengths, the host's section and the clamped extremes 0 and 10^6."""
    for shape, hkv in [((2, 6, 300, 300, head_dim), None), ((1, 8, 513, 400, head_dim), 2)]:
        for section in (None, 0, 1, 2, 10**6):
            _check_walk_build(shape, heads_kv=hkv, causal=causal, section=section, ctas=3,
                              monkeypatch=monkeypatch)


@pytest.mark.gpu
def test_walk_build_bshd_window_and_full_grid_on_the_gpu(monkeypatch):
    _check_walk_build((2, 16, 1024, 1024, 128), causal=True, layout="bshd")
    _check_walk_build((1, 4, 1100, 900, 128), window=(200, 30))
    _check_walk_build((2, 16, 2048, 2048, 128), causal=True, ctas=132, monkeypatch=monkeypatch)


@pytest.mark.gpu
def test_window_band_sections_on_the_gpu(monkeypatch):
    """The band rule's sections on the full grid: the production window case's own section
    (17 of 32 pairs: a narrower last section of 15), and a shorter run of it with that
    section and the old one forced, and a bidirectional window (GQA)."""
    p = Problem.of(2, 16, 16384, 16384, 128, window=(1024, 0))
    assert tile_walk.host_section(p, None, 132, "l2-band") == 17
    _check_walk_build((2, 16, 16384, 16384, 128), window=(1024, 0), section=17, ctas=132,
                      monkeypatch=monkeypatch)
    for section in (4, 17, 30):
        _check_walk_build((2, 16, 4096, 4096, 128), window=(1024, 0), section=section,
                          ctas=132, monkeypatch=monkeypatch)
    _check_walk_build((2, 16, 4096, 4096, 128), heads_kv=4, window=(512, 512))

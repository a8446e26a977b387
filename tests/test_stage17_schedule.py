"""Stage 17's synchronisation, executed from its own PTX and replayed against real barrier rules
(CPU only).

Stage 17 (ptx/sm90/17_tiles_back_to_back.ptx) runs a persistent CTA's K/V steps on across its
tiles and double-buffers Q, so its parities are counted across tiles: Q buffer local_tile % 2
and its FULL/EMPTY parities, K/V ring positions g counted over the CTA's whole walk, and the
pingpong turns with one boundary step a tile. The GPU tests pass for the shapes they run; this
checks many CTAs, grids and tile counts (seq_k = 128: one K/V tile a Q tile, where the boundary
step follows the prologue directly).

How: test_production_schedule's interpreter runs the PTX's integer/predicate code for the
producer (thread 0) and both consumers (threads 128 and 256, one warpgroup each: their control
flow is uniform). Every synchronising statement (mbarrier init / try_wait.parity / arrive /
arrive.expect_tx, bar.sync / bar.arrive) gets a label in front, so the interpreter records its
operands (barrier address, parity, named barrier ID, guard) as the thread reaches it. The three
recorded sequences are then replayed together under the hardware's rules:
  - an mbarrier completes a phase when its arrivals reach the init count (a warpgroup's arrive
    is 128 arrivals, thread 0's is 1; the TMA's bytes land at once, the producer's best case
    for running ahead); try_wait.parity(p) passes iff the completed phase count is odd for p = 0,
    even for p = 1 (the phase of parity p is the one just completed);
  - a named barrier completes when the warpgroups arriving (bar.sync or bar.arrive) reach
    its count / 128; bar.sync blocks until then;
under several interleavings (producer first, either consumer first, random). The replay
asserts: no deadlock; each FULL wait sees the next fill of that barrier (not one behind, not
one ahead: a parity off by one either blocks for ever or sees the wrong fill) and its content
is the reference schedule's (Q of tile j; K/V tile i of tile j, in order across tiles); the
producer never refills a buffer before both consumers released its previous fill; a consumer
releases only what it acquired; the consumer's buffer index matches the barrier it waits on;
named barriers are never completed by hand-overs alone and none is left half arrived; both
consumers take the same number of turns; %p_last_tile is true on the CTA's last tile only.
"""

from __future__ import annotations

import random
import re
from functools import lru_cache

import pytest

from ptxattn import ptx, stages
from test_production_schedule import Program, Thread, _constant

STAGE_FILE = "17_tiles_back_to_back.ptx"
_SYNC = re.compile(r"(@(!?)(%\w+)\s+)?(mbarrier\.init|mbarrier\.try_wait\.parity|"
                   r"mbarrier\.arrive\.expect_tx|mbarrier\.arrive|bar\.sync|bar\.arrive)"
                   r"\S*\s+(.*);$")
# registers recorded at every synchronising statement besides its operands: the buffer and slot
# indices that the descriptors are made from, and the coordinates the producer's TMA loads read
CONTEXT = ("%q_buf", "%ring_slot", "%prev_slot", "%q_row", "%q_row1", "%head", "%batch",
           "%kv_row")
TILE_END = ("%tile", "%p_last_tile")


def stage17():
    (st,) = [s for s in stages.STAGES if s.file.endswith(STAGE_FILE)]
    return st


def instrument(text: str):
    """The PTX with a label `sync_N:` before each synchronising statement, and
    {label: (kind, guard, operands)}."""
    out, ops = [], {}
    for line in text.splitlines():
        m = _SYNC.match(line.split("//")[0].strip())
        if m:
            assert m.group(5).count(";") == 0, line      # one statement a line
            name = f"sync_{len(ops)}"
            guard = (m.group(2) == "!", m.group(3)) if m.group(1) else None
            args = [a.strip() for a in m.group(5).split(",")]
            ops[name] = (m.group(4), guard, args)
            out.append(f"{name}:")
        out.append(line)
    return "\n".join(out) + "\n", ops


class Model:
    """Stage 17's text (optionally mutated), instrumented and sliced once."""

    def __init__(self, text: str):
        self.text = text
        instrumented, self.ops = instrument(text)
        self.watch = {}
        for name, (kind, guard, args) in self.ops.items():
            # operands read (an mbarrier statement's first is its result: %p_ready, %state)
            read = args[1:] if kind.startswith("mbarrier.") and kind != "mbarrier.init" else args
            regs = set(CONTEXT) | {r for a in read for r in re.findall(r"%\w+", a)}
            if guard:
                regs.add(guard[1])
            self.watch[name] = tuple(sorted(regs))
        self.watch["tile_end"] = TILE_END
        self.program = Program(instrumented, {r for v in self.watch.values() for r in v},
                               watched_labels=set(self.watch))
        # barrier offsets (smem's base is 0 in the model: the carve-up adds them to it),
        # tile sizes and ring depth, from the stage's own #defines
        self.defines = {k: int(v) for k, v in re.findall(
            r"^#define (SMEM_BAR_\w+|BLOCK_[MN]|KV_STAGES) (\d+)", stage_file_text(), re.M)}

    def run(self, tid: int, ctaid: int, grid: int, prm: dict):
        return Thread(self.program, tid=tid, ctaid=ctaid, nctaid=grid, params=prm,
                      watch=self.watch).run().events


@lru_cache(maxsize=None)
def stage_file_text() -> str:
    return (stages.ptx_root() / stage17().file).read_text()


@lru_cache(maxsize=None)
def model() -> Model:
    st = stage17()
    return Model(ptx.source(st, dict(st.defines)))


def value(arg: str, regs: dict):
    if arg.startswith("%"):
        got = regs[arg]
        assert got is not None, f"model: {arg} not yet written where it is used"
        return got
    return _constant(arg)


def address(arg: str, regs: dict) -> int:
    m = re.fullmatch(r"\[(%\w+)(?:\+(\d+))?\]", arg)
    assert m, arg
    return value(m.group(1), regs) + int(m.group(2) or 0)


# ---- the replay ----------------------------------------------------------------------

WG = 128                          # threads a consumer (or the producer's) warpgroup stands for


class Replay:
    """Producer (thread 0), consumer 0, consumer 1 of one CTA, their recorded synchronising
    statements executed together under the mbarrier and named-barrier rules."""

    def __init__(self, m: Model, prm: dict, ctaid: int, grid: int):
        self.m, self.prm, self.ctaid, self.grid = m, prm, ctaid, grid
        d = m.defines
        self.q_full = {d["SMEM_BAR_Q"]: 0, d["SMEM_BAR_Q_1"]: 1}
        self.q_empty = {d["SMEM_BAR_Q_EMPTY"]: 0, d["SMEM_BAR_Q_EMPTY_1"]: 1}
        stages_ = d["KV_STAGES"]
        self.k_full = {d["SMEM_BAR_FULL_K"] + 8 * s: s for s in range(stages_)}
        self.v_full = {d["SMEM_BAR_FULL_V"] + 8 * s: s for s in range(stages_)}
        self.k_empty = {d["SMEM_BAR_EMPTY_K"] + 8 * s: s for s in range(stages_)}
        self.v_empty = {d["SMEM_BAR_EMPTY_V"] + 8 * s: s for s in range(stages_)}
        # the FULL barrier whose fills an EMPTY barrier releases
        self.full_of = {}
        for empty, full in ((self.q_empty, self.q_full), (self.k_empty, self.k_full),
                            (self.v_empty, self.v_full)):
            for e, i in empty.items():
                self.full_of[e] = next(f for f, j in full.items() if j == i)
        self.traces = [m.run(tid, ctaid, grid, prm) for tid in (0, 128, 256)]

    # the reference schedule: this CTA's tiles and what each step must read
    def reference(self):
        p, bm, bn = self.prm, self.m.defines["BLOCK_M"], self.m.defines["BLOCK_N"]
        m_blocks, kv_tiles = p["seq_q"] // bm, p["seq_k"] // bn
        tiles = list(range(self.ctaid, m_blocks * p["heads"] * p["batch"], self.grid))
        q, kv = [], []
        for t in tiles:
            m_block, bh = t % m_blocks, t // m_blocks
            head, batch = bh % p["heads"], bh // p["heads"]
            q.append(("Q", m_block * bm, m_block * bm + bm // 2, head, batch))
            kv += [(i * bn, head, batch) for i in range(kv_tiles)]
        return tiles, q, kv

    def play(self, order):
        m = self.m
        count, done, pending = {}, {}, {}        # mbarrier: init count, completed phases, arrivals
        fills = {}                               # FULL barrier -> contents, in fill order
        seen = [{}, {}]                          # consumer -> FULL barrier -> fills observed
        released = [{}, {}]                      # consumer -> EMPTY barrier -> arrivals made
        named = {}                               # id -> [needed units, units, syncers, generation]
        generation = {}                          # id -> generations completed
        turns = [0, 0]
        turn_order = []                          # turn barriers (1, 2) in completion order
        pcs = [0, 0, 0]
        blocked = [None, None, None]             # (named id, generation) a bar.sync waits on
        observed = [{"Q": [], "K": [], "V": []} for _ in range(2)]
        tile_ends = [[], []]
        events = [[e for e in tr] for tr in self.traces]

        def complete_named(bid):
            need, units, syncers, gen = named[bid]
            assert syncers, (f"named barrier {bid} completed by bar.arrive alone (a turn handed "
                             f"over twice)")
            generation[bid] = generation.get(bid, 0) + 1
            del named[bid]
            if bid in (1, 2):
                turn_order.append(bid)

        def arrive_mbar(addr, weight, who):
            assert addr in count, f"{who}: arrive on barrier {addr} never initialised"
            pending[addr] += weight
            assert pending[addr] <= count[addr], f"{who}: barrier {addr} over-arrived"
            if pending[addr] == count[addr]:
                pending[addr] = 0
                done[addr] += 1

        def step(t) -> bool:
            """Run thread t's next recorded statement, if it can go; False when blocked."""
            if blocked[t] is not None:
                bid, gen = blocked[t]
                if generation.get(bid, 0) <= gen:
                    return False
                blocked[t] = None
                pcs[t] += 1
                return True
            name, regs = events[t][pcs[t]]
            who = ("producer", "consumer 0", "consumer 1")[t]
            if name == "tile_end":
                assert t > 0
                tile_ends[t - 1].append((regs["%tile"], regs["%p_last_tile"]))
                pcs[t] += 1
                return True
            kind, guard, args = m.ops[name]
            if guard is not None and regs[guard[1]] == guard[0]:
                pcs[t] += 1                      # guard false: not executed
                return True
            if kind == "mbarrier.init":
                assert t == 0
                addr = address(args[0], regs)
                count[addr], done[addr], pending[addr] = value(args[1], regs), 0, 0
            elif kind == "mbarrier.try_wait.parity":
                addr, parity = address(args[1], regs), value(args[2], regs)
                assert parity in (0, 1), (who, parity)
                if done[addr] % 2 == parity:     # the phase of this parity is still open
                    return False
                if t > 0:
                    c = t - 1
                    for table, what, idx in ((self.q_full, "Q", "%q_buf"),
                                             (self.k_full, "K", "%ring_slot"),
                                             (self.v_full, "V", "%prev_slot")):
                        if addr in table:
                            # the descriptor reads buffer/slot idx: it must be this barrier's
                            assert regs[idx] == table[addr], (
                                f"{who}: waits on {what} buffer {table[addr]}'s FULL barrier "
                                f"but reads buffer {regs[idx]}")
                            n = seen[c].get(addr, 0)
                            assert done[addr] - 1 == n, (
                                f"{who}: {what} wait #{n} on buffer {table[addr]} (parity "
                                f"{parity}) passed on fill #{done[addr] - 1}")
                            seen[c][addr] = n + 1
                            observed[c][what].append(fills[addr][n])
                            break
                    else:
                        raise AssertionError(f"{who}: waits on barrier {addr}, not a FULL one")
                else:
                    full = self.full_of.get(addr)
                    assert full is not None, f"producer waits on {addr}, not an EMPTY one"
                    # it waits before its next fill of that buffer: for the release of every
                    # earlier fill, not one more (that would be a later phase of this parity)
                    n = len(fills.get(full, []))
                    assert done[addr] == n, (
                        f"producer: wait (parity {parity}) on EMPTY {addr} passed after "
                        f"{done[addr]} releases, before fill #{n}")
            elif kind == "mbarrier.arrive.expect_tx":
                assert t == 0, f"{who}: expect_tx"
                addr = address(args[1], regs)
                if addr in self.q_full:
                    assert regs["%q_buf"] == self.q_full[addr]
                    content = ("Q", regs["%q_row"], regs["%q_row1"], regs["%head"],
                               regs["%batch"])
                else:
                    assert addr in self.k_full or addr in self.v_full, addr
                    slot = self.k_full.get(addr, self.v_full.get(addr))
                    assert regs["%ring_slot"] == slot
                    content = (regs["%kv_row"], regs["%head"], regs["%batch"])
                n = len(fills.setdefault(addr, []))
                empty = next(e for e, f in self.full_of.items() if f == addr)
                assert done[empty] >= n, (
                    f"producer: fill #{n} of barrier {addr} while the consumers released "
                    f"{done[empty]} (buffer overwritten in use)")
                fills[addr].append(content)
                arrive_mbar(addr, 1, who)        # the bytes land at once
            elif kind == "mbarrier.arrive":
                assert t > 0, "the producer arrives only with expect_tx"
                addr = address(args[1], regs)
                full = self.full_of.get(addr)
                assert full is not None, f"{who}: plain arrive on {addr}, not an EMPTY barrier"
                c = t - 1
                r = released[c].get(addr, 0)
                assert r < seen[c].get(full, 0), (
                    f"{who}: release #{r} of barrier {addr} before acquiring that fill")
                released[c][addr] = r + 1
                arrive_mbar(addr, WG, who)
            else:                                # bar.sync / bar.arrive
                bid = value(args[0], regs)
                # no count: every thread of the CTA (BAR_CTA), the three warpgroups
                need = value(args[1], regs) // WG if len(args) > 1 else 3
                entry = named.setdefault(bid, [need, 0, 0, generation.get(bid, 0)])
                assert entry[0] == need, f"{who}: named barrier {bid} with two counts"
                entry[1] += 1
                if t > 0 and bid in (1, 2) and kind == "bar.sync":
                    assert bid == t, f"{who}: syncs on the other consumer's turn"
                    turns[t - 1] += 1
                if kind == "bar.sync":
                    entry[2] += 1
                    blocked[t] = (bid, entry[3])
                if entry[1] == need:
                    complete_named(bid)
                if kind == "bar.sync":
                    return True                  # (pc moves on once the generation completes)
            pcs[t] += 1
            return True

        live = [0, 1, 2]
        while live:
            # the first thread in this interleaving's order that can go takes one step
            moved = any(step(t) for t in order(live))
            live = [t for t in live if pcs[t] < len(events[t])]
            if not moved and live:
                where = {("producer", "consumer 0", "consumer 1")[t]:
                         (events[t][pcs[t]][0], self.m.ops.get(events[t][pcs[t]][0]),
                          blocked[t]) for t in live}
                raise AssertionError(f"deadlock: {where}")
        assert not named, f"named barriers left half arrived: {named}"
        assert turns[0] == turns[1], f"turns taken: {turns}"
        # pingpong: consumer 0's turn, then consumer 1's, and so on
        assert turn_order == [1, 2] * turns[0], turn_order
        tiles, q_ref, kv_ref = self.reference()
        for c in range(2):
            assert observed[c]["Q"] == q_ref, (c, observed[c]["Q"], q_ref)
            assert observed[c]["K"] == kv_ref, (c, observed[c]["K"], kv_ref)
            assert observed[c]["V"] == kv_ref, (c, observed[c]["V"], kv_ref)
            assert [tile for tile, _ in tile_ends[c]] == tiles
            flags = [flag for _, flag in tile_ends[c]]
            assert flags == [False] * (len(tiles) - 1) + [True], flags
        # every fill consumed by both consumers
        for addr, contents in fills.items():
            assert seen[0].get(addr, 0) == seen[1].get(addr, 0) == len(contents), addr
        return turns


def orders(seed_count=3):
    """Interleavings: a fixed priority (the first thread that can go takes the step: the
    producer running as far ahead as the barriers let it, or either consumer), and random
    ones."""
    def fixed(rank):
        def order(live):
            return [t for t in rank if t in live]
        return order

    out = [fixed((0, 1, 2)), fixed((1, 2, 0)), fixed((2, 1, 0)), fixed((1, 0, 2))]
    for seed in range(seed_count):
        rng = random.Random(seed)

        def shuffled(live, rng=rng):
            live = list(live)
            rng.shuffle(live)
            return live
        out.append(shuffled)
    return out


def play_all(m, prm, grid, seeds=3):
    for c in range(grid):
        r = Replay(m, prm, c, grid)
        for order in orders(seeds):
            r.play(order)


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

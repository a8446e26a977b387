"""A persistent kernel's synchronisation, executed from its own PTX and replayed against real
barrier rules (CPU only). Shared by test_stage17_schedule.py and test_stage18_sync.py (stages 17
and 18: a boundary step between tiles, two Q buffers) and test_production_sync.py (every build of
the production kernel: two Q buffers at D = 64 and 128, one at D = 256, a tile at a time); no
tests here.

How: test_production_schedule's interpreter runs the PTX's integer/predicate code for the
producer (thread 0) and every consumer (threads 128, 256[, 384]: thread 0 of each of the build's
CONSUMERS warpgroups, whose control flow is uniform). Every synchronising statement (mbarrier
init / try_wait.parity / arrive / arrive.expect_tx, bar.sync / bar.arrive) and every TMA load
gets a label in front, so the
interpreter records its operands (barrier address, parity, named barrier ID, guard; a load's
shared destination, tensor map, coordinates and barrier) as the thread reaches it. The recorded
sequences (one a warpgroup) are then replayed together under the hardware's rules:
  - an mbarrier completes a phase when its arrivals reach the init count (a warpgroup's arrive
    is 128 arrivals, thread 0's is 1; the TMA's bytes land at once, the producer's best case
    for running ahead); try_wait.parity(p) passes iff the completed phase count is odd for p = 0,
    even for p = 1 (the phase of parity p is the one just completed);
  - a named barrier completes when the warpgroups arriving (bar.sync or bar.arrive) reach
    its count / 128 (no count: the CTA's, .maxntid); bar.sync blocks until then;
under several interleavings (producer first, consumers first in either order, one consumer
ahead of the producer and the rest, random). The replay
asserts: no deadlock; each FULL wait sees the next fill of that barrier (not one behind, not
one ahead: a parity off by one either blocks for ever or sees the wrong fill) and its content
(the coordinates of the TMA loads that complete that fill) is the reference schedule's (Q of
tile j; K/V tile i of tile j, in order across tiles), and the consumers see the K and V fills in
the producer's order; a fill's loads write the buffer its barrier guards and bring the bytes its
expect_tx announced (Q: one 64-row box a consumer, in consumer order); the producer never
refills a buffer before every consumer released its previous fill (counted per consumer, not
from the EMPTY barrier's phases, so a wrong arrival count shows); a consumer releases only what
it acquired; the consumer's buffer index matches the barrier it waits on; each S = Q K^T (a K
FULL wait) reads the Q of its own tile, acquired and not yet released; named barriers are never
completed by hand-overs alone and none is left half arrived; a named barrier ID keeps one count
for the whole run, and one of a single warpgroup's count belongs to one warpgroup; consumer c
waits only on turn barrier c + 1 and hands over only to the next consumer's (the last to
consumer 0's), the turns complete in the order 1, 2, ..., N, 1, ... and every consumer takes the
same number; %p_last_tile is true on the CTA's last tile only.

What a build must give: its text, its #defines (barrier offsets SMEM_BAR_*, buffer offsets
SMEM_Q / SMEM_K / SMEM_V and sizes Q_TILE_BYTES / KV_TILE_BYTES, BLOCK_M, BLOCK_N, KV_STAGES,
CONSUMERS (BLOCK_M = 64 * CONSUMERS; .maxntid 128 * (CONSUMERS + 1)); SMEM_BAR_Q_1 /
SMEM_BAR_Q_EMPTY_1 where Q is double-buffered: buffer b, consumer c at SMEM_Q + (CONSUMERS * b
+ c) * Q_TILE_BYTES) and a reference schedule: reference(prm, ctaid, grid) -> (tiles, [Q
content per tile], [[K/V content per K/V tile] per tile]), contents as the TMA coordinates give
them: q_content(q_row, BLOCK_M, head, batch) = ("Q", q_row, q_row + 64, ..., head, batch), a
row a 64-row box, and (kv_row, kv_head, batch) (kv_head: the K/V head the query head reads,
head // heads_per_kv with GQA).
"""

from __future__ import annotations

import random
import re

from test_production_schedule import Program, Thread, _constant, _split_operands

WG = 128                          # threads a consumer (or the producer's) warpgroup stands for

_SYNC = re.compile(r"(@(!?)(%\w+)\s+)?(mbarrier\.init|mbarrier\.try_wait\.parity|"
                   r"mbarrier\.arrive\.expect_tx|mbarrier\.arrive|bar\.sync|bar\.arrive)"
                   r"\S*\s+(.*);$")
# a TMA load into shared memory that completes bytes on an mbarrier (one statement, two lines)
_LOAD = re.compile(r"(@(!?)(%\w+)\s+)?cp\.async\.bulk\.tensor\.\w+\.shared::cluster\.global\."
                   r"mbarrier::complete_tx::bytes\s+(.*);$")
# registers recorded at every synchronising statement besides its operands: the buffer and slot
# indices that the descriptors are made from
CONTEXT = ("%q_buf", "%ring_slot", "%prev_slot")
TILE_END = ("%tile", "%p_last_tile")
# the barrier and buffer offsets (and tile sizes) a build must define
BARRIERS = ("SMEM_BAR_Q", "SMEM_BAR_Q_EMPTY", "SMEM_BAR_FULL_K", "SMEM_BAR_FULL_V",
            "SMEM_BAR_EMPTY_K", "SMEM_BAR_EMPTY_V")
SIZES = ("SMEM_Q", "SMEM_K", "SMEM_V", "Q_TILE_BYTES", "KV_TILE_BYTES", "BLOCK_M", "BLOCK_N",
         "KV_STAGES", "CONSUMERS")
BOX_ROWS = 64                     # a Q box: one consumer warpgroup's query rows


def instrument(text: str):
    """The PTX with a label `sync_N:` before each synchronising statement and `load_N:` before
    each TMA load, {sync label: (kind, guard, operands)} and {load label: ("tma.load", guard,
    [destination, map, coordinates..., barrier])}."""
    out, ops, loads = [], {}, {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        code = line.split("//")[0].strip()
        if re.match(r"(@!?%\w+\s+)?cp\.async\.bulk\.tensor\.\S*\.global\.mbarrier", code):
            stmt = [line]                        # the operands follow on the next line(s)
            while not code.endswith(";"):
                i += 1
                stmt.append(lines[i])
                code = f"{code} {lines[i].split('//')[0].strip()}"
            m = _LOAD.match(code)
            assert m, code
            dst, src, bar = _split_operands(m.group(4))
            tmap, coords = re.fullmatch(r"\[(%\w+),\s*\{(.*)\}\]", src).groups()
            name = f"load_{len(loads)}"
            guard = (m.group(2) == "!", m.group(3)) if m.group(1) else None
            loads[name] = ("tma.load", guard, [dst, tmap] + [c.strip() for c in coords.split(",")]
                         + [bar])
            out += [f"{name}:"] + stmt
            i += 1
            continue
        m = _SYNC.match(code)
        if m:
            assert m.group(5).count(";") == 0, line      # one statement a line
            name = f"sync_{len(ops)}"
            guard = (m.group(2) == "!", m.group(3)) if m.group(1) else None
            args = [a.strip() for a in m.group(5).split(",")]
            ops[name] = (m.group(4), guard, args)
            out.append(f"{name}:")
        out.append(line)
        i += 1
    return "\n".join(out) + "\n", ops, loads


class Model:
    """One build's text (optionally mutated), instrumented and sliced once; defines: the
    build's #defines as ints (see the module's doc)."""

    def __init__(self, text: str, defines: dict, tile_end: str = "tile_end"):
        missing = [k for k in BARRIERS + SIZES if k not in defines]
        if missing:
            raise ValueError(f"defines: missing {', '.join(missing)}")
        self.text = text
        self.defines = {k: int(v) for k, v in defines.items()}
        self.q_buffers = 2 if "SMEM_BAR_Q_1" in self.defines else 1
        self.consumers = self.defines["CONSUMERS"]
        if self.consumers < 1 or self.defines["BLOCK_M"] != BOX_ROWS * self.consumers:
            raise ValueError(f"defines: BLOCK_M {self.defines['BLOCK_M']} is not "
                             f"{BOX_ROWS} rows for each of CONSUMERS {self.consumers}")
        # the CTA's threads, as the kernel declares them: what a bar.sync without a count waits
        # for, and a warpgroup for the producer and each consumer
        maxntid = re.search(r"^\s*\.maxntid\s+(\d+)\s*,\s*1\s*,\s*1\b", text, re.M)
        if maxntid is None:
            raise ValueError("text: no .maxntid N, 1, 1")
        self.cta_threads = int(maxntid.group(1))
        if self.cta_threads != WG * (self.consumers + 1):
            raise ValueError(f"text: .maxntid {self.cta_threads}, not a producer and "
                             f"CONSUMERS {self.consumers} warpgroups of {WG}")
        self.tids = tuple(WG * w for w in range(self.consumers + 1))
        instrumented, self.ops, self.loads = instrument(text)
        self.watch = {}
        for name, (kind, guard, args) in {**self.ops, **self.loads}.items():
            # operands read (an mbarrier statement's first is its result: %p_ready, %state; a
            # load's map is a parameter's address, not modelled)
            read = args[1:] if kind.startswith("mbarrier.") and kind != "mbarrier.init" else args
            if kind == "tma.load":
                read = [a for a in args if a != args[1]]
            regs = set(CONTEXT) | {r for a in read for r in re.findall(r"%\w+", a)}
            if guard:
                regs.add(guard[1])
            self.watch[name] = tuple(sorted(regs))
        # the label every tile's end passes (stages 14 and 18 call it last_pv), recorded as
        # "tile_end"
        if not re.search(rf"^\s*{tile_end}:", instrumented, re.M):
            raise ValueError(f"text: no label {tile_end}:")
        self.watch[tile_end] = TILE_END
        self.tile_end = tile_end
        self.program = Program(instrumented, {r for v in self.watch.values() for r in v},
                               watched_labels=set(self.watch))

    def run(self, tid: int, ctaid: int, grid: int, prm: dict):
        return Thread(self.program, tid=tid, ctaid=ctaid, nctaid=grid, params=prm,
                      watch=self.watch).run().events


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


def lineage_stage(file_name: str):
    """The lineage stage whose PTX file is ptx/sm90/<file_name>."""
    from ptxattn import stages
    (st,) = [s for s in stages.STAGES if s.file.endswith(file_name)]
    return st


def lineage_defines(stage) -> dict:
    """A lineage stage's barrier and buffer offsets (smem's base is 0 in the model: the carve-up
    adds them to it), tile sizes and ring depth, from its own #defines; and its two consumer
    warpgroups (the lineage has no CONSUMERS define: the replay checks it against BLOCK_M and
    .maxntid)."""
    from ptxattn import stages
    text = (stages.ptx_root() / stage.file).read_text()
    return {"CONSUMERS": 2, **{k: int(v) for k, v in re.findall(
        r"^#define (SMEM_\w+|BLOCK_[MN]|KV_STAGES|Q_TILE_BYTES|KV_TILE_BYTES) (\d+)",
        text, re.M)}}


def q_content(q_row: int, block_m: int, head: int, batch: int):
    """A Q fill's content: its 64-row boxes' first rows (one a consumer), head and batch."""
    return ("Q", *range(q_row, q_row + block_m, BOX_ROWS), head, batch)


def round_robin(prm: dict, ctaid: int, grid: int, block_m: int, block_n: int):
    """The unmasked walk, as a reference: CTA c takes tiles c, c + G, ...; tile t is m_block
    t % m_blocks of (batch, head) t // m_blocks (head-major, m_block fastest; m_blocks =
    ceil(seq_q / block_m)); each Q tile reads every K/V tile of its K/V head, head //
    heads_per_kv (1 without GQA)."""
    m_blocks = -(-prm["seq_q"] // block_m)
    kv_tiles = -(-prm["seq_k"] // block_n)
    tiles = list(range(ctaid, m_blocks * prm["heads"] * prm["batch"], grid))
    q, kv = [], []
    for t in tiles:
        m_block, bh = t % m_blocks, t // m_blocks
        head, batch = bh % prm["heads"], bh // prm["heads"]
        q.append(q_content(m_block * block_m, block_m, head, batch))
        kv.append([(i * block_n, head // prm.get("heads_per_kv", 1), batch)
                   for i in range(kv_tiles)])
    return tiles, q, kv


# ---- the replay ----------------------------------------------------------------------



class Replay:
    """The producer (thread 0) and every consumer (threads 128, 256, ...) of one CTA, their
    recorded synchronising statements executed together under the mbarrier and named-barrier
    rules. Thread t > 0 is consumer t - 1; its turn barrier is t."""

    def __init__(self, m: Model, prm: dict, ctaid: int, grid: int, reference):
        self.m, self.prm, self.ctaid, self.grid = m, prm, ctaid, grid
        self.reference = reference
        d = m.defines
        self.q_full = {d["SMEM_BAR_Q"]: 0}
        self.q_empty = {d["SMEM_BAR_Q_EMPTY"]: 0}
        if m.q_buffers == 2:
            self.q_full[d["SMEM_BAR_Q_1"]] = 1
            self.q_empty[d["SMEM_BAR_Q_EMPTY_1"]] = 1
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
        self.traces = [m.run(tid, ctaid, grid, prm) for tid in m.tids]
        # after play(): {named barrier ID: {thread: count}}, each thread's uses
        self.named_uses = {}

    def loads_after(self, pc: int):
        """The producer's TMA loads right after its statement pc (the loads of one
        expect_tx), each as (map, [coordinates], destination, barrier)."""
        out = []
        for name, regs in self.traces[0][pc + 1:]:
            if not name.startswith("load_"):
                break
            _, guard, args = self.m.loads[name]
            if guard is not None and regs[guard[1]] == guard[0]:
                continue
            out.append((args[1], [value(a, regs) for a in args[2:-1]], address(args[0], regs),
                        address(args[-1], regs)))
        return out

    def fill(self, addr: int, tx_bytes: int, regs, loads):
        """A fill's content from its loads, after checking that they complete on its barrier,
        write the buffer that barrier guards, bring the bytes announced and read whole tiles
        (coordinates 0 and 2: the first element of D and of its 64-column blocks)."""
        d = self.m.defines
        n = self.m.consumers
        assert loads and all(bar == addr for *_, bar in loads), (
            f"producer: expect_tx on barrier {addr}, loads completing on "
            f"{[bar for *_, bar in loads]}")
        assert all(c[0] == 0 and c[2] == 0 for _, c, _, _ in loads), loads
        if addr in self.q_full:
            b = self.q_full[addr]
            assert self.q_index(regs) == b
            # buffer b holds consumer 0's 64 rows, then consumer 1's, ...: a box each
            want = [("%tmap_q", d["SMEM_Q"] + (n * b + c) * d["Q_TILE_BYTES"])
                    for c in range(n)]
            size = d["Q_TILE_BYTES"]
            heads = {tuple(c[3:]) for _, c, _, _ in loads}
            assert len(heads) == 1, f"producer: Q boxes of several heads/batches: {loads}"
            (head_batch,) = heads
            content = ("Q", *(c[1] for _, c, _, _ in loads), *head_batch)
        else:
            assert addr in self.k_full or addr in self.v_full, addr
            slot = self.k_full.get(addr, self.v_full.get(addr))
            assert regs["%ring_slot"] == slot
            k = addr in self.k_full
            want = [("%tmap_k" if k else "%tmap_v",
                     d["SMEM_K" if k else "SMEM_V"] + slot * d["KV_TILE_BYTES"])]
            size = d["KV_TILE_BYTES"]
            (_, c, _, _), = loads[:1]
            content = (c[1], c[3], c[4])
        got = [(tmap, dst) for tmap, _, dst, _ in loads]
        assert got == want, f"producer: loads {got} for barrier {addr}, not {want}"
        assert tx_bytes == len(loads) * size, (
            f"producer: expect_tx of {tx_bytes} bytes, {len(loads)} loads of {size}")
        return content

    def q_index(self, regs) -> int:
        """The Q buffer a statement's descriptor reads (one buffer: always 0)."""
        return regs["%q_buf"] if self.m.q_buffers == 2 else 0

    def play(self, order):
        m = self.m
        n_cons = m.consumers
        threads = range(n_cons + 1)
        names = ["producer"] + [f"consumer {c}" for c in range(n_cons)]
        turn_ids = range(1, n_cons + 1)          # consumer c's turn: named barrier c + 1
        tiles, q_ref, kv_ref = self.reference(self.prm, self.ctaid, self.grid)
        kv_flat = [c for per_tile in kv_ref for c in per_tile]
        kv_owner = [j for j, per_tile in enumerate(kv_ref) for _ in per_tile]   # K/V i's tile
        count, done, pending = {}, {}, {}        # mbarrier: init count, completed phases, arrivals
        fills = {}                               # FULL barrier -> contents, in fill order
        fill_order = {"K": [], "V": []}          # K and V contents in the producer's order
        seen = [{} for _ in range(n_cons)]       # consumer -> FULL barrier -> fills observed
        released = [{} for _ in range(n_cons)]   # consumer -> EMPTY barrier -> arrivals made
        named = {}                               # id -> [needed units, units, syncers, generation]
        generation = {}                          # id -> generations completed
        named_count = {}                         # id -> its count (in warpgroups), the whole run
        self.named_uses = uses = {}              # id -> {thread: count}
        turns = [0] * n_cons
        turn_order = []                          # turn barriers (1..N) in completion order
        pcs = [0] * len(threads)
        blocked = [None] * len(threads)          # (named id, generation) a bar.sync waits on
        observed = [{"Q": [], "K": [], "V": []} for _ in range(n_cons)]
        tile_ends = [[] for _ in range(n_cons)]
        events = [[e for e in tr] for tr in self.traces]
        q_full_of = {i: a for a, i in self.q_full.items()}
        q_empty_of = {i: a for a, i in self.q_empty.items()}

        def complete_named(bid):
            need, units, syncers, gen = named[bid]
            assert syncers, (f"named barrier {bid} completed by bar.arrive alone (a turn handed "
                             f"over twice)")
            generation[bid] = generation.get(bid, 0) + 1
            del named[bid]
            if bid in turn_ids:
                turn_order.append(bid)

        def arrive_mbar(addr, weight, who):
            assert addr in count, f"{who}: arrive on barrier {addr} never initialised"
            pending[addr] += weight
            assert pending[addr] <= count[addr], f"{who}: barrier {addr} over-arrived"
            if pending[addr] == count[addr]:
                pending[addr] = 0
                done[addr] += 1

        def q_held(c, regs, who):
            """An S = Q K^T is about to read Q buffer %q_buf: consumer c must hold its latest
            fill (acquired, not released), and that fill must be the Q of the tile this K/V
            tile belongs to."""
            b = self.q_index(regs)
            full, empty = q_full_of[b], q_empty_of[b]
            n = seen[c].get(full, 0)
            assert n > released[c].get(empty, 0), (
                f"{who}: S = Q K^T reads Q buffer {b}, whose fill it has "
                f"{'released' if n else 'never acquired'}")
            i = len(observed[c]["K"]) - 1        # this K/V tile, counted over the CTA's walk
            if i < len(kv_owner):                # (past the reference: reported at the end)
                assert fills[full][n - 1] == q_ref[kv_owner[i]], (
                    f"{who}: K/V tile #{i} (of tile {tiles[kv_owner[i]]}) multiplied by Q "
                    f"{fills[full][n - 1]}, not {q_ref[kv_owner[i]]}")

        def named_barrier(t, kind, args, regs, who):
            """bar.sync / bar.arrive; True when thread t blocks (a bar.sync: its pc moves on
            once the generation completes)."""
            bid = value(args[0], regs)
            # no count: every thread of the CTA (BAR_CTA)
            need = (value(args[1], regs) if len(args) > 1 else m.cta_threads) // WG
            # an ID keeps one count: a turn reused for O staging (or two roles sharing an ID)
            # would mix arrivals of unrelated steps
            assert named_count.setdefault(bid, need) == need, (
                f"{who}: named barrier {bid} with count {need * WG}, elsewhere "
                f"{named_count[bid] * WG}")
            uses.setdefault(bid, {})[t] = need * WG
            if need == 1:                        # one warpgroup's: its own, nobody else's
                assert list(uses[bid]) == [t], (
                    f"{who}: named barrier {bid} of {WG} threads also used by "
                    f"{[names[u] for u in uses[bid] if u != t]}")
            if t > 0 and bid in turn_ids:
                c = t - 1
                if kind == "bar.sync":
                    assert bid == c + 1, (f"{who}: syncs on consumer {bid - 1}'s turn "
                                          f"(barrier {bid})")
                    turns[c] += 1
                else:                            # the hand-over: to the next consumer only
                    nxt = (c + 1) % n_cons
                    assert bid == nxt + 1, (
                        f"{who}: hands over to consumer {bid - 1}'s turn (barrier {bid}), "
                        f"not consumer {nxt}'s")
            entry = named.setdefault(bid, [need, 0, 0, generation.get(bid, 0)])
            assert entry[0] == need, f"{who}: named barrier {bid} with two counts"
            entry[1] += 1
            if kind == "bar.sync":
                entry[2] += 1
                blocked[t] = (bid, entry[3])
            if entry[1] == need:
                complete_named(bid)
            return kind == "bar.sync"

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
            who = names[t]
            if name.startswith("load_"):             # (read with its expect_tx)
                assert t == 0, f"{who}: a TMA load"
                pcs[t] += 1
                return True
            if name == m.tile_end:
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
                    for table, what, idx in ((self.q_full, "Q", None),
                                             (self.k_full, "K", "%ring_slot"),
                                             (self.v_full, "V", "%prev_slot")):
                        if addr in table:
                            # the descriptor reads buffer/slot idx: it must be this barrier's
                            got = self.q_index(regs) if idx is None else regs[idx]
                            assert got == table[addr], (
                                f"{who}: waits on {what} buffer {table[addr]}'s FULL barrier "
                                f"but reads buffer {got}")
                            n = seen[c].get(addr, 0)
                            assert done[addr] - 1 == n, (
                                f"{who}: {what} wait #{n} on buffer {table[addr]} (parity "
                                f"{parity}) passed on fill #{done[addr] - 1}")
                            seen[c][addr] = n + 1
                            observed[c][what].append(fills[addr][n])
                            if what == "K":
                                q_held(c, regs, who)
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
                content = self.fill(addr, value(args[2], regs), regs, self.loads_after(pcs[0]))
                if addr not in self.q_full:
                    fill_order["K" if addr in self.k_full else "V"].append(content)
                n = len(fills.setdefault(addr, []))
                empty = next(e for e, f in self.full_of.items() if f == addr)
                # every consumer, each counted on its own (the EMPTY barrier's phases complete
                # on its init count, which may be wrong)
                behind = [c for c in range(n_cons) if released[c].get(empty, 0) < n]
                assert done[empty] >= n and not behind, (
                    f"producer: fill #{n} of barrier {addr} while the consumers released "
                    f"{done[empty]} (consumers {behind} not all of theirs: buffer overwritten "
                    f"in use)")
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
            elif named_barrier(t, kind, args, regs, who):
                return True                      # blocked on a bar.sync (or passing it)
            pcs[t] += 1
            return True

        live = list(threads)
        while live:
            # the first thread in this interleaving's order that can go takes one step
            moved = any(step(t) for t in order(live))
            live = [t for t in live if pcs[t] < len(events[t])]
            if not moved and live:
                where = {names[t]: (events[t][pcs[t]][0], self.m.ops.get(events[t][pcs[t]][0]),
                                    blocked[t]) for t in live}
                raise AssertionError(f"deadlock: {where}")
        assert not named, f"named barriers left half arrived: {named}"
        assert len(set(turns)) == 1, f"turns taken: {turns}"
        # pingpong: consumer 0's turn, then consumer 1's, ..., then consumer 0's again
        assert turn_order == list(turn_ids) * turns[0], turn_order
        assert fill_order["K"] == kv_flat, ("the producer's K loads", fill_order["K"], kv_flat)
        assert fill_order["V"] == kv_flat, ("the producer's V loads", fill_order["V"], kv_flat)
        for c in range(n_cons):
            assert observed[c]["Q"] == q_ref, (c, observed[c]["Q"], q_ref)
            assert observed[c]["K"] == kv_flat, (c, observed[c]["K"], kv_flat)
            assert observed[c]["V"] == kv_flat, (c, observed[c]["V"], kv_flat)
            assert [tile for tile, _ in tile_ends[c]] == tiles
            flags = [flag for _, flag in tile_ends[c]]
            assert flags == [False] * (len(tiles) - 1) + [True], flags
        # every fill consumed by every consumer, and released by every one
        for addr, contents in fills.items():
            got = [seen[c].get(addr, 0) for c in range(n_cons)]
            assert got == [len(contents)] * n_cons, (
                f"barrier {addr}: {len(contents)} fills, observed {got} times by the consumers")
        for empty, full in self.full_of.items():
            for c in range(n_cons):
                assert released[c].get(empty, 0) == seen[c].get(full, 0), (
                    f"consumer {c}: {seen[c].get(full, 0)} fills of barrier {full} acquired, "
                    f"{released[c].get(empty, 0)} released")
        return turns


def orders(seed_count=3, consumers=2):
    """Interleavings of the producer (0) and consumers 1..N: a fixed priority (the first
    thread that can go takes the step: the producer running as far ahead as the barriers let
    it; the consumers first, in either order; consumer 0, then the producer; with more than two
    consumers, each middle one first), and random ones."""
    def fixed(rank):
        def order(live):
            return [t for t in rank if t in live]
        return order

    cons = tuple(range(1, consumers + 1))
    ranks = [(0, *cons), (*cons, 0), (*cons[::-1], 0), (1, 0, *cons[1:])]
    ranks += [(c, 0, *(x for x in cons if x != c)) for c in cons[1:-1]]
    out = [fixed(rank) for rank in ranks]
    for seed in range(seed_count):
        rng = random.Random(seed)

        def shuffled(live, rng=rng):
            live = list(live)
            rng.shuffle(live)
            return live
        out.append(shuffled)
    return out


def play_all(m: Model, prm: dict, grid: int, reference, seeds=3):
    """Every CTA of a launch of `grid` CTAs, under every interleaving of orders(seeds)."""
    for c in range(grid):
        r = Replay(m, prm, c, grid, reference)
        for order in orders(seeds, m.consumers):
            r.play(order)

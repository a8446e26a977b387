"""The production kernel's schedule, executed from its own PTX (CPU only).

The production kernel (ptx/sm90/production/) walks two nested schedules that no GPU test covers
exhaustively:
  - the persistent tile walk: CTA c of G takes round k's tile k*G + c, or k*G + G-1-c on odd
    rounds in the masked build (SNAKE_TILE); tile t is the sectioned walk's (m_block, (batch,
    head)) for the section walk_section (include/tile_walk.ptxh, ptxattn/tile_walk.tile_of);
    %p_last_tile must be true on its last tile only (consumer 1's last turn hand-over is
    skipped there, so a wrong flag hangs or races);
  - per Q tile, the K/V tiles it sees ([kv_first, kv_first + kv_count)): tile 0 in the
    prologue, then a front run of masked steps, the plain loop, a back run of masked steps
    (kv_masked_run / kv_loop / kv_back_run). A tile some row sees only in part must take the
    masked copy (or its scores leak past the window / diagonal / key tail).

This test runs the expanded PTX itself in a small interpreter: the 32-bit integer, predicate
and branch instructions that decide the branches are executed; everything else (wgmma, TMA,
mbarriers, the float softmax) is skipped, and a skipped instruction that writes a predicate
they read sets it true (an mbarrier wait succeeds at once, "some row rebased"). A skipped
instruction that writes an integer register they read is an error, so the model cannot
silently drift from the PTX. The interpreter records where each thread goes; the test compares that with the
attention mask's definition, row by row, over small exhaustive grids of lengths, windows,
diagonals and grid sizes, for every build of the build table (D = 64, 128, 256). BLOCK_M and
BLOCK_N come from the build (its generated layout header), not from here.
"""

from __future__ import annotations

import itertools
import re
from functools import lru_cache

import numpy as np
import pytest

from ptxattn import api as attn
from ptxattn import builds, launch, ptx, stages, tile_walk
from ptxattn.tools import ptxgen_layout
from ptxattn.launch import UNBOUNDED   # an unbounded window side, as the kernel reads it
from test_prepare import dev, gpu         # noqa: F401 - gpu is a fixture (a pretend driver)

MASK32 = 0xFFFFFFFF
PREDS_TRUE_WHEN_SKIPPED = True          # documented above: waits succeed, votes are "any"


def _s32(x: int) -> int:
    x &= MASK32
    return x - (1 << 32) if x & 0x80000000 else x


# ---- the interpreter ---------------------------------------------------------------------

_INT_TYPES = ("u32", "s32", "b32")
_ARITH = {"add", "sub", "mul", "mad", "shl", "shr", "and", "or", "xor", "min", "max", "rem",
          "div", "neg"}
_NO_DESTINATION = {"bar", "cp", "fence", "st", "stmatrix", "setmaxnreg", "wgmma"}
_CMP = {"eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "lt": lambda a, b: a < b,
        "le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b}


def _split_operands(text: str) -> list[str]:
    """Top-level comma split (keeps `[%map, {%a, %b}]` whole)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


@lru_cache(maxsize=None)
def _constant(text: str) -> int:
    """An immediate: a number or a constant expression left by the preprocessor (`128 - 1`)."""
    if not re.fullmatch(r"[0-9a-fA-FxX\s+\-*()<>]+", text):
        raise AssertionError(f"model: operand {text!r} is not an integer constant")
    return int(eval(text, {"__builtins__": {}}))   # digits and operators only (checked above)


class Program:
    """The kernel body, reduced to what decides the schedule.

    Parsed into (guard, opcode, operands) statements; then a backward slice from the branch
    guards and the watched registers keeps the 32-bit integer and predicate statements that
    feed them (the "modelled" ones). Everything else is dropped, except a dropped statement
    that writes a predicate the slice reads: an mbarrier wait, a vote, a float compare, which
    set it true here. A dropped statement that writes an integer register of the slice fails
    the build of the model, so the model cannot silently drift from the PTX. The run list
    keeps labels that are watched as events."""

    def __init__(self, text: str, watched: set[str], elements: bool = False,
                 watched_labels: set[str] | None = None):
        watched_labels = WATCHED_LABELS if watched_labels is None else watched_labels
        body = text[text.index("\n{", text.index(".entry")) + 2:text.rindex("}")]
        stmts: list[tuple[tuple[bool, str] | None, str, list[str]]] = []
        labels: dict[str, int] = {}
        pending = ""
        for line in body.splitlines():
            line = line.split("//")[0].strip()
            if not line or line.startswith("."):
                continue
            m = re.fullmatch(r"([A-Za-z_$][\w$]*):", line)
            if m and not pending:
                labels[m.group(1)] = len(stmts)
                continue
            pending = f"{pending} {line}".strip()
            if not pending.endswith(";"):
                continue
            stmt, pending = pending[:-1].strip(), ""
            guard = None
            g = re.match(r"@(!?)(%\w+)\s+", stmt)
            if g:
                guard, stmt = (g.group(1) == "!", g.group(2)), stmt[g.end():]
            op, _, rest = stmt.partition(" ")
            stmts.append((guard, op, _split_operands(rest)))

        def regs(texts):
            return {r for a in texts for r in re.findall(r"%[\w]+(?:\.[xyz])?", a)}

        # the slice: registers and predicates that decide branches or are watched
        keep = set(watched) | {g[1] for g, op, _ in stmts if g and op in ("bra.uni", "bra", "ret")}
        # elements: also the score mask, `selp.f32 %sN, -inf, %sN, P` (which slots P masks)
        masks = {i: (int(args[0][2:]), args[3]) for i, (_, op, args) in enumerate(stmts)
                 if elements and op == "selp.f32" and re.fullmatch(r"%s\d+", args[0])
                 and args[1] == "0fFF800000" and args[2] == args[0]}
        keep |= {pred for _, pred in masks.values()}
        while True:
            grown = set(keep)
            for guard, op, args in stmts:
                if self._modellable(op) and args and args[0] in keep:
                    grown |= regs(args[1:]) | ({guard[1]} if guard else set())
            if grown == keep:
                break
            keep = grown
        self.run_list: list[tuple] = []          # ("op", guard, op, args) / ("true", guard, pred)
        self.labels: dict[str, int] = {}
        at_label: dict[int, list[str]] = {}
        for name, i in labels.items():
            at_label.setdefault(i, []).append(name)
        for i, (guard, op, args) in enumerate(stmts + [(None, "ret", [])]):
            for name in at_label.get(i, ()):
                self.labels[name] = len(self.run_list)
                if name in watched_labels:
                    self.run_list.append(("event", name))
            if op in ("bra.uni", "bra"):
                self.run_list.append(("bra", guard, args[0]))
                continue
            if op == "ret":
                self.run_list.append(("ret", guard))
                continue
            if self._modellable(op) and args[0] in keep:
                self.run_list.append(("op", guard, _compile(op, args)))
                continue
            if i in masks:
                self.run_list.append(("mask", guard, *masks[i]))
                continue
            no_dst = op.split(".")[0] in _NO_DESTINATION or op.startswith("mbarrier.init")
            dst = args[0] if args and not no_dst else ""
            if dst not in keep:
                continue                           # nothing the schedule reads
            if dst.startswith("%p_") and op.split(".")[0] in ("mbarrier", "vote", "setp"):
                self.run_list.append(("true", guard, dst))
                continue
            raise AssertionError(f"model: `{op} {', '.join(args)}` writes {dst}, which decides "
                                 f"the schedule, and the model has no rule for it")

    @staticmethod
    def _modellable(op: str) -> bool:
        parts = op.split(".")
        if parts[0] in ("and", "or", "not") and parts[-1] == "pred":
            return True
        if parts[0] == "ld" and parts[1] == "param" and parts[-1] in _INT_TYPES:
            return True
        if op == "shfl.sync.idx.b32":            # %wg made uniform: lane 0's value (the same)
            return True
        if parts[-1] not in _INT_TYPES or "wide" in parts:   # (.wide: a 64-bit result)
            return False
        return parts[0] in _ARITH | {"mov", "setp", "selp"}


def _compile(op: str, args: list[str]):
    """A modelled statement as fn(regs, preds), which updates the two dicts."""
    parts = op.split(".")
    kind, typ = parts[0], parts[-1]
    dst = args[0]

    def src(a: str):
        if a.startswith("%"):
            return lambda r: r[a]
        c = 0 if a == "smem" else _constant(a)
        return lambda r: c

    def pred(a: str):
        name, neg = (a[1:], True) if a.startswith("!") else (a, False)
        return lambda p: p[name] != neg

    if typ == "pred":
        a = [pred(x) for x in args[1:]]
        if kind == "not":
            return lambda r, p: p.__setitem__(dst, not a[0](p))
        if kind == "and":
            return lambda r, p: p.__setitem__(dst, a[0](p) and a[1](p))
        return lambda r, p: p.__setitem__(dst, a[0](p) or a[1](p))
    if kind == "ld":
        name = re.fullmatch(r"\[(\w+)\]", args[1]).group(1)
        return lambda r, p: r.__setitem__(dst, r["@params"][name] & MASK32)
    if op == "shfl.sync.idx.b32" or kind == "mov":
        a = src(args[1])
        return lambda r, p: r.__setitem__(dst, a(r) & MASK32)
    conv = _s32 if typ == "s32" else (lambda x: x & MASK32)
    x = [src(v) for v in args[1:]]
    if kind == "setp":
        cmp = _CMP[parts[1]]
        if parts[2] in ("and", "or"):
            c = pred(args[3])
            if parts[2] == "and":
                return lambda r, p: p.__setitem__(dst, cmp(conv(x[0](r)), conv(x[1](r))) and c(p))
            return lambda r, p: p.__setitem__(dst, cmp(conv(x[0](r)), conv(x[1](r))) or c(p))
        return lambda r, p: p.__setitem__(dst, cmp(conv(x[0](r)), conv(x[1](r))))
    if kind == "selp":
        c = pred(args[3])
        return lambda r, p: r.__setitem__(dst, (x[0](r) if c(p) else x[1](r)) & MASK32)
    if kind in ("mul", "mad"):
        assert parts[1] == "lo", op
    if kind in ("rem", "div"):
        assert typ == "u32", op                  # (the kernel divides unsigned only)
    rule = {
        "add": lambda a: a[0] + a[1], "sub": lambda a: a[0] - a[1],
        "mul": lambda a: a[0] * a[1], "mad": lambda a: a[0] * a[1] + a[2],
        "shl": lambda a: a[0] << (a[1] & 31),
        "shr": lambda a: a[0] >> a[1],           # arithmetic for s32 (signed), logical for u32
        "and": lambda a: a[0] & a[1], "or": lambda a: a[0] | a[1], "xor": lambda a: a[0] ^ a[1],
        "min": lambda a: min(a[0], a[1]), "max": lambda a: max(a[0], a[1]),
        "rem": lambda a: a[0] % a[1], "div": lambda a: a[0] // a[1], "neg": lambda a: -a[0],
    }.get(kind)
    if rule is None:
        raise AssertionError(f"model: no rule for {op}")
    return lambda r, p: r.__setitem__(dst, rule([conv(f(r)) for f in x]) & MASK32)


class Thread:
    """One thread of one CTA, run from the kernel's entry to `ret`."""

    def __init__(self, prog: Program, *, tid: int, ctaid: int, nctaid: int, params: dict,
                 watch: dict[str, tuple[str, ...]], max_steps: int = 2_000_000):
        self.p, self.watch = prog, watch
        self.regs: dict = {"%tid.x": tid, "%ctaid.x": ctaid, "%nctaid.x": nctaid,
                           "@params": params}
        self.preds: dict[str, bool] = {}
        self.events: list[tuple[str, dict]] = []
        self.max_steps = max_steps

    def run(self):
        run_list, labels, pc = self.p.run_list, self.p.labels, 0
        regs, preds = self.regs, self.preds
        try:
            for _ in range(self.max_steps):
                item = run_list[pc]
                pc += 1
                what = item[0]
                if what == "event":
                    name = item[1]
                    if name in self.watch:
                        self.events.append((name, {r: (preds[r] if r in preds else regs.get(r))
                                                   for r in self.watch[name]}))
                    continue
                guard = item[1]
                if guard is not None and preds[guard[1]] == guard[0]:
                    continue                       # guard false: not executed
                if what == "true":
                    preds[item[2]] = PREDS_TRUE_WHEN_SKIPPED
                elif what == "mask":             # score slot item[2] masked? (to the last event)
                    self.events[-1][1].setdefault("masks", {})[item[2]] = preds[item[3]]
                elif what == "bra":
                    pc = labels[item[2]]
                elif what == "ret":
                    return self
                else:
                    item[2](regs, preds)
        except KeyError as exc:
            raise AssertionError(f"model: {exc.args[0]} read before the PTX wrote it") from None
        raise AssertionError("model: the thread did not finish (a loop that never ends?)")


# ---- the builds ------------------------------------------------------------------------

HEAD_DIMS = builds.HEAD_DIMS          # every build of the table


@lru_cache(maxsize=None)
def program(head_dim: int, masked: bool, elements: bool = False) -> Program:
    """The build's PTX as the model runs it."""
    st = stages.PRODUCTION.specialize(head_dim, masked=masked)
    watched = {r for w in (CONSUMER_WATCH, PRODUCER_WATCH) for regs in w.values() for r in regs}
    return Program(ptx.source(st, dict(st.defines)), watched, elements)


@lru_cache(maxsize=None)
def build_constant(head_dim: int, name: str) -> int:
    """A figure of the build table's row of this head dim, as the generated layout header
    (ptx/sm90/production/layout.ptxh) defines it."""
    return ptxgen_layout.numbers(builds.get(head_dim))[name]


CONSUMER_WATCH = {
    "consumer_tile_loop": ("%tile", "%local_tile", "%kv_base"),
    "wait_full_k0": (),                          # (the prologue's score mask follows)
    "wait_q": ("%m_block", "%head", "%batch", "%kv_first", "%kv_count", "%p_last_tile"),
    "mask_first_done": ("%p_edge", "%kv_base", "%key_base"),
    "mask_done_first": ("%kv_base", "%p_tail"),
    "masked_wait_full_k": ("%kv_global", "%kv_base", "%key_base"),
    "plain_wait_full_k": ("%kv_global", "%kv_base"),
    "tile_end": ("%kv_global", "%kv_end", "%p_last_tile"),
    "last_pv": ("%local_tile",),
}
PRODUCER_WATCH = {
    "producer_tile_loop": ("%tile", "%local_tile", "%kv_base"),
    "produce_q": ("%q_row", "%q_row1", "%head", "%batch"),
    "produce_k": ("%kv_global", "%kv_row", "%head_kv", "%batch"),
}
WATCHED_LABELS = set(CONSUMER_WATCH) | set(PRODUCER_WATCH)


def params(seq_q, seq_k, heads=1, batch=1, heads_per_kv=1, diag=0, left=UNBOUNDED,
           right=UNBOUNDED, section=2):
    """The kernel's parameters the model reads; section: walk_section (the kernel clamps it to
    [1, batch * heads]; 2 by default: a walk neither head-major nor m_block-major at most
    head counts, its last section narrower at odd ones)."""
    return dict(seq_q=seq_q, seq_k=seq_k, heads=heads, batch=batch, heads_per_kv=heads_per_kv,
                diag_offset=diag, window_left=left, window_right=right, walk_section=section)


def run_cta(head_dim, masked, prm, ctaid, nctaid, prog=None, tids=None):
    """(producer, consumer 0, consumer 1[, consumer 2]) of one CTA (thread 0 of each warpgroup,
    the build's CONSUMERS), each a list of watched events."""
    prog = prog or program(head_dim, masked)
    if tids is None:
        tids = tuple(128 * w for w in range(build_constant(head_dim, "CONSUMERS") + 1))
    out = []
    for tid, watch in ((t, PRODUCER_WATCH if t < 128 else CONSUMER_WATCH) for t in tids):
        out.append(Thread(prog, tid=tid, ctaid=ctaid, nctaid=nctaid, params=prm,
                          watch=watch).run().events)
    return out


def consumer_tiles(events):
    """Per tile of one consumer: its tile, the info at wait_q, its steps [(kv position, masked?,
    key_base)], the info at tile_end ("last") and at last_pv (its own last PV)."""
    tiles, cur = [], None
    for name, v in events:
        if name == "consumer_tile_loop":
            cur = {"tile": v["%tile"], "kv_base": v["%kv_base"], "steps": []}
            tiles.append(cur)
        elif name == "wait_q":
            cur.update(v)
        elif name == "wait_full_k0":
            prologue = v                       # its "masks" come before mask_*_done
        elif name in ("mask_first_done", "mask_done_first"):
            # tile 0 of the Q tile (the prologue): masked when the edge test held
            flag = v["%p_edge"] if name.endswith("_done") else v["%p_tail"]
            cur["steps"].append((v["%kv_base"], bool(flag), v.get("%key_base")))
            cur.setdefault("masks", []).append(prologue.get("masks"))
        elif name == "masked_wait_full_k":
            cur["steps"].append((v["%kv_global"], True, v.get("%key_base")))
            cur.setdefault("masks", []).append(v.get("masks"))
        elif name == "plain_wait_full_k":
            cur["steps"].append((v["%kv_global"], False, None))
            cur.setdefault("masks", []).append(v.get("masks"))
        elif name == "tile_end":
            cur["last"] = v
        elif name == "last_pv":
            cur["last_pv"] = v
    return tiles


# ---- the definition the schedule must meet --------------------------------------------

def truth(seq_q, seq_k, q_row, block_m, block_n, diag, left, right):
    """K/V tiles some row of the Q tile at q_row sees (sorted), and those it sees only in part:
    each row's key range clipped to [0, seq_k), against each tile's [t*N, t*N + N - 1]."""
    rows = np.arange(q_row, min(q_row + block_m, seq_q))[:, None]
    lo, hi = np.maximum(0, rows + diag - left), np.minimum(seq_k - 1, rows + diag + right)
    a = np.arange(-(-seq_k // block_n))[None, :] * block_n
    b = a + block_n - 1
    vis_lo, vis_hi = np.maximum(a, lo), np.minimum(b, hi)
    seen = (vis_lo <= vis_hi).any(axis=0)
    partial = ((vis_lo != a) | (vis_hi != b)).any(axis=0)
    return [int(t) for t in np.flatnonzero(seen)], {int(t) for t in np.flatnonzero(partial)}


def straddles(seq_q, seq_k, q_row, block_m, block_n, diag, left, right, key_base):
    """TILE_STRADDLES_EDGE's condition, as the PTX states it."""
    q_last = min(q_row + block_m - 1, seq_q - 1)
    below = q_last + diag - left
    above = min(q_row + diag + right, seq_k - 1)
    return key_base < below or key_base + block_n - 1 > above


def walk_of(prm, head_dim, masked, block_m, block_n):
    """(the walk's Problem, the section the kernel walks: walk_section clamped to [1, B*H])."""
    window = (prm["window_left"], prm["window_right"]) if masked else None
    p = tile_walk.Problem(prm["batch"], prm["heads"], prm["seq_q"], prm["seq_k"], head_dim,
                          prm["heads"] // prm["heads_per_kv"], window, block_m, block_n)
    return p, min(max(prm["walk_section"], 1), p.bh)


def check_q_tile(t, prm, head_dim, masked, block_m, block_n):
    """One consumer's record of one Q tile against the definition: the sectioned walk's tile
    (tile_walk.tile_of, the kernel's arithmetic, longest rows first in the masked build) and
    the K/V tiles its rows see."""
    seq_q, seq_k = prm["seq_q"], prm["seq_k"]
    problem, section = walk_of(prm, head_dim, masked, block_m, block_n)
    m_block, bh = tile_walk.tile_of(t["tile"], problem, section, alternate=True)
    assert (t["%head"], t["%batch"]) == (bh % prm["heads"], bh // prm["heads"]), (
        f"tile {t['tile']} (section {section}): (head, batch) "
        f"{(t['%head'], t['%batch'])}, the walk's {(bh % prm['heads'], bh // prm['heads'])}")
    assert t["%m_block"] == m_block, (f"tile {t['tile']} (section {section}): m_block "
                                      f"{t['%m_block']}, the walk's {m_block}")
    q_row = m_block * block_m
    positions = [s[0] for s in t["steps"]]
    count = len(positions)
    # consecutive ring positions from kv_base, each once, and the loop ends where it should
    assert positions == list(range(t["kv_base"], t["kv_base"] + count)), positions
    assert t["last"]["%kv_global"] == t["kv_base"] + count == t["last"]["%kv_end"]
    if not masked:
        n_tiles = -(-seq_k // block_n)
        assert count == n_tiles
        ragged = seq_k % block_n != 0
        for i, (_, was_masked, _) in enumerate(t["steps"]):
            assert was_masked == (ragged and i == n_tiles - 1), (i, t["steps"])
        return count
    diag, left, right = prm["diag_offset"], prm["window_left"], prm["window_right"]
    seen, partial = truth(seq_q, seq_k, q_row, block_m, block_n, diag, left, right)
    first = t["%kv_first"]
    tiles = list(range(first, first + count))
    if seen:
        assert tiles == seen, f"Q rows from {q_row}: visits K/V tiles {tiles}, sees {seen}"
    else:                              # no row sees a key: one fully masked tile, output 0
        assert count == 1 and 0 <= first < -(-seq_k // block_n)
    for i, (_, was_masked, key_base) in enumerate(t["steps"]):
        kv = first + i
        need = kv in partial
        assert was_masked == need, (
            f"Q rows from {q_row}, K/V tile {kv} (step {i} of {count}): "
            f"{'masked' if was_masked else 'plain'} copy, but some row sees it "
            f"{'only in part' if need else 'whole'}")
        assert need == straddles(seq_q, seq_k, q_row, block_m, block_n, diag, left, right,
                                 kv * block_n)
        if was_masked:
            assert key_base == kv * block_n, (i, key_base)
    return count


def check_launch(head_dim, masked, prm, grid, prog=None):
    """Every CTA of a launch: its threads agree, and the tiles are covered once each."""
    block_m = build_constant(head_dim, "BLOCK_M")
    block_n = build_constant(head_dim, "BLOCK_N")
    tiles = -(-prm["seq_q"] // block_m) * prm["heads"] * prm["batch"]
    done = []
    for c in range(grid):
        producer, *consumers = run_cta(head_dim, masked, prm, c, grid, prog)
        assert len(consumers) == build_constant(head_dim, "CONSUMERS")
        seqs = [consumer_tiles(events) for events in consumers]
        t0 = seqs[0]
        for other in seqs[1:]:                 # every consumer walks the same tiles and steps
            assert [t["tile"] for t in other] == [t["tile"] for t in t0]
            assert [t["steps"] for t in other] == [t["steps"] for t in t0]
        # the producer walks the same tiles and loads, per tile, the K/V tiles consumed
        p_tiles = [v["%tile"] for name, v in producer if name == "producer_tile_loop"]
        assert p_tiles == [t["tile"] for t in t0], (p_tiles, [t["tile"] for t in t0])
        loads = [v for name, v in producer if name == "produce_k"]
        consumed = [s[0] for t in t0 for s in t["steps"]]
        assert [v["%kv_global"] for v in loads] == consumed
        i = 0
        for t in t0:
            count = check_q_tile(t, prm, head_dim, masked, block_m, block_n)
            first = t["%kv_first"] if masked else 0
            for j in range(count):
                v = loads[i + j]
                assert v["%kv_row"] == (first + j) * block_n
                assert v["%batch"] == t["%batch"]
                assert v["%head_kv"] == t["%head"] // prm["heads_per_kv"]
            i += count
        # the producer's Q boxes: the consumers' tile (the second box 64 rows on)
        qs = [v for name, v in producer if name == "produce_q"]
        assert len(qs) == len(t0)
        for t, q in zip(t0, qs):
            assert (q["%head"], q["%batch"]) == (t["%head"], t["%batch"])
            assert q["%q_row"] == t["%m_block"] * block_m, (q, t["%m_block"])
            assert q["%q_row1"] == q["%q_row"] + 64
        # the last tile flag: true on this CTA's last tile only, for every consumer; each tile
        # runs from its own prologue to its own last PV
        for seq in seqs:
            flags = [t["last"]["%p_last_tile"] for t in seq]
            assert flags == [False] * (len(seq) - 1) + [True], flags
            assert all("last_pv" in t for t in seq)
        done += [t["tile"] for t in t0]
    assert sorted(done) == list(range(tiles)), f"grid {grid}: tiles done {sorted(done)}"
    return done


# ---- the tests -------------------------------------------------------------------------

def test_the_interpreter_reads_the_builds_constants():
    assert HEAD_DIMS == (64, 128, 256)
    assert build_constant(128, "BLOCK_N") == 128 and build_constant(256, "BLOCK_N") == 64
    assert build_constant(64, "BLOCK_N") == 128 and build_constant(128, "BLOCK_M") == 128
    assert build_constant(64, "BLOCK_M") == 192 and build_constant(64, "CONSUMERS") == 3
    for d in HEAD_DIMS:
        assert build_constant(d, "BLOCK_N") == stages.PRODUCTION_VARIANTS[(d, True)].block_n
        # the build the model runs is the one the table describes
        text = ptx.source(stages.PRODUCTION.specialize(d, True))
        assert f".maxntid {build_constant(d, 'CTA_THREADS')}, 1, 1" in text


def test_the_interpreter_fails_a_wrong_schedule():
    """The checks can fail: a consumer record with one tile masked wrongly is refused."""
    prm = params(300, 300, diag=0, left=UNBOUNDED, right=0)
    _, c0, _ = run_cta(128, True, prm, 0, 1)
    t = consumer_tiles(c0)
    check_q_tile(t[0], prm, 128, True, 128, 128)
    bad = dict(t[0], steps=[(p, not m, k) for p, m, k in t[0]["steps"]])
    with pytest.raises(AssertionError):
        check_q_tile(bad, prm, 128, True, 128, 128)


def masked_kv_cases(head_dim):
    """Small lengths, windows and diagonals around the build's tile sizes (both BLOCK_N and
    BLOCK_M: a Q tile's row range ends at q_row + BLOCK_M - 1)."""
    n, m = build_constant(head_dim, "BLOCK_N"), build_constant(head_dim, "BLOCK_M")
    lengths = sorted({1, n + 1, 2 * n + 5, 5 * n, m - 1, m + 1})
    sides = sorted({0, 1, n - 1, n + 1, UNBOUNDED})
    for seq_q, seq_k in itertools.product(lengths, repeat=2):
        diags = sorted({0, seq_k - seq_q, -3, 5})
        for diag, left, right in itertools.product(diags, sides, sides):
            if left == right == UNBOUNDED:
                continue                       # the unmasked build's case
            yield params(seq_q, seq_k, diag=diag, left=left, right=right)


def check_masked_kv_runs(head_dim, prog=None):
    n, m = build_constant(head_dim, "BLOCK_N"), build_constant(head_dim, "BLOCK_M")
    cases = 0
    for prm in masked_kv_cases(head_dim):
        (c0,) = run_cta(head_dim, True, prm, 0, 1, prog=prog, tids=(128,))
        for t in consumer_tiles(c0):
            check_q_tile(t, prm, head_dim, True, m, n)
        cases += 1
    return cases


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_masked_kv_runs_cover_each_tile_once_with_the_right_copy(head_dim):
    """Front run / plain loop / back run, exhaustive over small lengths, windows, diagonals,
    for every build of the table."""
    assert check_masked_kv_runs(head_dim) > 500


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_the_exhaustive_check_catches_a_q_row_range_off_by_one(head_dim):
    """A Q tile's last row one short (q_last = q_row + BLOCK_M - 2) in the K/V range: the last
    row's keys past the second-last's would go unvisited or unmasked. Caught in every build,
    D = 64's 192-row tiles among them."""
    block_m = build_constant(head_dim, "BLOCK_M")
    old = f"add.u32 %q_last, %q_row, {block_m} - 1;"
    prog = mutated(head_dim, old, f"add.u32 %q_last, %q_row, {block_m} - 2;")
    with pytest.raises(AssertionError, match=r"visits K/V tiles .*, sees|copy, but some row"):
        check_masked_kv_runs(head_dim, prog)


def kv_cases(head_dim):
    n = build_constant(head_dim, "BLOCK_N")
    for seq_q, seq_k in itertools.product((1, n + 1, 3 * n + 5), repeat=2):
        for diag, left, right in itertools.product(sorted({0, seq_k - seq_q, -3}),
                                                   (0, n - 1, n + 1, UNBOUNDED), (0, 1, n)):
            yield params(seq_q, seq_k, diag=diag, left=left, right=right)


def check_elements(t, prm, tid, block_m, block_n):
    """One consumer thread's score mask on each step of a Q tile against the definition: slot
    4j + h of the wgmma accumulator is row 16*warp + lane/4 (+ 8 for h >= 2) of this consumer's
    64, key 8j + 2*(lane % 4) + h % 2 of the tile; masked exactly when the row does not see
    the key (rows past seq_q are clipped by the store: not checked)."""
    seq_q, seq_k = prm["seq_q"], prm["seq_k"]
    diag, left, right = prm["diag_offset"], prm["window_left"], prm["window_right"]
    consumer, warp, lane = (tid >> 7) - 1, (tid & 127) >> 5, tid & 31
    row0 = t["%m_block"] * block_m + 64 * consumer + 16 * warp + lane // 4
    for i, ((_, was_masked, _), masks) in enumerate(zip(t["steps"], t["masks"])):
        key_base = (t["%kv_first"] + i) * block_n
        if not was_masked:
            assert masks is None                # the plain copy has no mask at all
        else:
            assert sorted(masks) == list(range(block_n // 2)), sorted(masks)
        for slot in range(block_n // 2):
            row = row0 + (8 if slot % 4 >= 2 else 0)
            key = key_base + 8 * (slot // 4) + 2 * (lane % 4) + slot % 2
            if row >= seq_q:
                continue
            hidden = not (max(0, row + diag - left) <= key <= min(seq_k - 1, row + diag + right))
            got = masks[slot] if was_masked else False
            assert got == hidden, (f"row {row} key {key} (thread {tid}, slot {slot}, step {i}): "
                                   f"{'masked' if got else 'kept'}, should be "
                                   f"{'masked' if hidden else 'kept'}")


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_score_mask_of_sampled_threads(head_dim):
    """The element mask (MASK_TILE_RANGE / MASK_RANGE) on the masked steps, for threads of
    every consumer, every lane % 4 and several warps and rows, over kv_cases."""
    prog = program(head_dim, True, elements=True)
    n = build_constant(head_dim, "BLOCK_N")
    # consumer 0: warps 0-3, lane % 4 = 0-3, rows 0 and 7 of a warp; consumer 1: two more;
    # a third consumer (D = 64): two more
    tids = [128 + 0, 128 + 32 + 1, 128 + 64 + 10, 128 + 96 + 31, 256 + 5, 256 + 64 + 30]
    if build_constant(head_dim, "CONSUMERS") == 3:
        tids += [384 + 2, 384 + 96 + 27]
    for prm in kv_cases(head_dim):
        for tid in tids:
            (events,) = run_cta(head_dim, True, prm, 0, 1, prog=prog, tids=(tid,))
            for t in consumer_tiles(events):
                check_elements(t, prm, tid, build_constant(head_dim, "BLOCK_M"), n)


def test_the_element_check_fails_a_wrong_mask():
    """The window's right edge one key too far in every thread: caught."""
    st = stages.PRODUCTION.specialize(128, masked=True)
    text = ptx.source(st, dict(st.defines))
    old = "add.s32 %row_lo_last, %tmp, %win_right;"
    assert old in text
    watched = {r for w in (CONSUMER_WATCH, PRODUCER_WATCH) for regs in w.values() for r in regs}
    prog = Program(text.replace(old, old + "\nadd.s32 %row_lo_last, %row_lo_last, 1;"), watched,
                   elements=True)
    with pytest.raises(AssertionError, match="should be masked"):
        for prm in kv_cases(128):
            (events,) = run_cta(128, True, prm, 0, 1, prog=prog, tids=(128,))
            for t in consumer_tiles(events):
                check_elements(t, prm, 128, 128, 128)


def mutated(head_dim, old, new):
    """The masked build with one statement changed: the model must notice."""
    st = stages.PRODUCTION.specialize(head_dim, masked=True)
    text = ptx.source(st, dict(st.defines))
    assert text.count(old) >= 1, old
    watched = {r for w in (CONSUMER_WATCH, PRODUCER_WATCH) for regs in w.values() for r in regs}
    return Program(text.replace(old, new), watched)


@pytest.mark.parametrize("old, new", [
    # the back run starts one tile late: the diagonal's tile would run unmasked
    ("add.s32 %tmp, %mask_above, 1;", "add.s32 %tmp, %mask_above, 129;"),
    # the front run ends one tile early: a window's left-edge tile would run unmasked
    ("add.s32 %tmp, %mask_below, 128 - 1;", "add.s32 %tmp, %mask_below, -1;"),
])
def test_the_model_catches_a_wrong_run_boundary(old, new):
    prog = mutated(128, old, new)
    with pytest.raises(AssertionError):
        for prm in kv_cases(128):
            (c0,) = run_cta(128, True, prm, 0, 1, prog=prog, tids=(128,))
            for t in consumer_tiles(c0):
                check_q_tile(t, prm, 128, True, 128, 128)


def test_the_model_catches_a_wrong_snake():
    """Odd rounds without the -1: tile k*G + G - c, one CTA past the round (a tile twice)."""
    prog = mutated(128, "@%p_odd add.u32 %tmp, %tmp, -1;", "")
    prm = params(128 * 5, 128, heads=3, diag=0, left=UNBOUNDED, right=0)
    with pytest.raises(AssertionError):
        check_launch(128, True, prm, 4, prog=prog)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("masked", [True, False])
def test_every_tile_once_across_ctas_and_the_last_tile_flag(head_dim, masked):
    """Tile walk (snake in the masked build) for every grid size up to the tile count, at the
    sections 1 (head-major), B*H (m_block-major) and 2 (the last section narrower at odd B*H)."""
    n = build_constant(head_dim, "BLOCK_N")
    for seq_q, heads, batch in [(128, 1, 1), (300, 2, 1), (513, 3, 2), (129, 2, 3)]:
        for seq_k in ((n - 5,) if heads * batch > 1 else (n - 5, 2 * n + 1)):
            tiles = -(-seq_q // build_constant(head_dim, "BLOCK_M")) * heads * batch
            # every grid up to 12, then a few up to one CTA per tile (the launcher: min(SMs, tiles))
            grids = {*range(1, min(tiles, 12) + 1), tiles // 2 + 1, max(tiles - 1, 1), tiles}
            for section in sorted({1, 2, heads * batch}):
                prm = params(seq_q, seq_k, heads=heads, batch=batch, heads_per_kv=heads,
                             diag=seq_k - seq_q, left=(n + 7) if masked else UNBOUNDED,
                             right=0 if masked else UNBOUNDED, section=section)
                for grid in sorted(grids) if section == 2 else (1, 5, tiles):
                    if grid <= tiles:
                        check_launch(head_dim, masked, prm, grid)


def walk_sections(p) -> dict:
    """The sections a walk test takes: head-major, m_block-major, the host's, one that does not
    divide B*H, and the kernel's clamps (0 and past B*H)."""
    return {"head-major": 1, "m_block-major": p.bh, "host": tile_walk.section_pairs(p),
            "not dividing": next(s for s in range(2, p.bh + 1) if p.bh % s) if p.bh > 2 else 2,
            "zero": 0, "huge": 10**6}


@pytest.mark.parametrize("head_dim, masked", [(128, True), (128, False), (64, True),
                                              (256, True)])
def test_every_section_walks_every_tile_once(head_dim, masked):
    """The sectioned walk at every kind of section (walk_sections), GQA and MHA, several grids:
    each consumer's tile is tile_of's (check_q_tile), every tile once across the CTAs."""
    n = build_constant(head_dim, "BLOCK_N")
    block_m = build_constant(head_dim, "BLOCK_M")
    for batch, heads, group, seq_q in [(2, 5, 1, 2 * block_m + 3), (1, 8, 4, 3 * block_m),
                                       (3, 3, 3, block_m - 1)]:
        seq_k = 2 * n + 9
        window = (-1, 0) if masked else None
        p = tile_walk.Problem(batch, heads, seq_q, seq_k, head_dim, heads // group, window,
                              block_m, build_constant(head_dim, "BLOCK_N"))
        for name, section in walk_sections(p).items():
            prm = params(seq_q, seq_k, heads=heads, batch=batch, heads_per_kv=group,
                         diag=seq_k - seq_q, left=UNBOUNDED,
                         right=0 if masked else UNBOUNDED, section=section)
            for grid in sorted({3, p.tiles // 2 + 1, p.tiles}):
                check_launch(head_dim, masked, prm, grid)


def test_the_walk_check_fails_a_wrong_walk():
    """Planted bugs in the walk (include/tile_walk.ptxh) are caught: the alternation dropped, a
    narrower last section ignored (pairs past B*H), section 0 unclamped (a division by zero:
    the interpreter refuses it)."""
    st = stages.PRODUCTION.specialize(128, masked=True)
    text = ptx.source(st, dict(st.defines))
    watched = {r for w in (CONSUMER_WATCH, PRODUCER_WATCH) for regs in w.values() for r in regs}
    bugs = [("@%p_walk_back sub.u32 %m_block, %m_blocks, %m_block;", ""),
            ("min.u32 %tmp, %tmp, %walk_section;", "mov.u32 %tmp, %walk_section;"),
            ("max.u32 %walk_section, %walk_section, 1;", "")]
    prm = params(300, 300, heads=5, batch=1, diag=0, left=UNBOUNDED, right=0, section=2)
    zero = dict(prm, walk_section=0)
    for old, new in bugs:
        assert text.count(old) >= 1, old
        prog = Program(text.replace(old, new), watched)
        with pytest.raises((AssertionError, ZeroDivisionError)):
            for case in (prm, zero):
                for grid in (3, 15):
                    check_launch(128, True, case, grid, prog=prog)
    for case in (prm, zero):                     # and the walk as it is passes
        check_launch(128, True, case, 3)


def test_snake_order_is_the_documented_one():
    """Round k of CTA c: k*G + c on even rounds, k*G + G-1-c on odd ones."""
    prm = params(128 * 5, 128, heads=3, batch=1, diag=0, left=UNBOUNDED, right=0)   # 15 tiles
    grid = 4
    for c in range(grid):
        _, c0, _ = run_cta(128, True, prm, c, grid)
        got = [t["tile"] for t in consumer_tiles(c0)]
        want = [k * grid + (c if k % 2 == 0 else grid - 1 - c) for k in range(4)]
        assert got == [w for w in want if w < 15]


@pytest.mark.parametrize("window", [(0, 2**31 - 1), (2**31 - 1, 0), (0, 2**32), (-1, 2**40)])
def test_huge_window_sides_reach_the_kernel_as_unbounded(window, gpu):
    """A window side of 2^30 or more sees every key, as -1 does; the kernel's s32 arithmetic
    must get UNBOUNDED for it. (0, 2^31 - 1) passed as is: q_last + right wraps negative and a
    Q tile visits one K/V tile (checked here through the model); 2^32 wraps to 0 in the s32
    parameter (a causal mask)."""
    q, k, v = (dev((1, 2, 300, 128), i) for i in range(3))
    attn.prepare(q, k, v, window=window).launch()
    (_, _, (values, types), _), = gpu["cuLaunchKernelEx"]
    want = tuple(UNBOUNDED if x < 0 or x >= UNBOUNDED else x for x in window)
    abi = launch.params_of(stages.PRODUCTION)
    left, right = (values[launch.slot(abi, name)] for name in ("window_left", "window_right"))
    assert (left, right) == want
    # and the kernel, given them, visits every K/V tile a row sees
    prm = params(300, 300, diag=0, left=left, right=right,
                 section=values[launch.slot(abi, "walk_section")])
    (c0,) = run_cta(128, True, prm, 0, 1, tids=(128,))
    for t in consumer_tiles(c0):
        check_q_tile(t, prm, 128, True, 128, 128)

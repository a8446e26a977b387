"""Synchronisation: named barriers, mbarriers, warp collectives, fences, setmaxnreg.

Named barriers (bar.sync / bar.arrive / barrier.*): a count in threads (a multiple of 32; none
means every live thread of the CTA), arrivals by whole converged warps; a barrier used with two
counts in one phase, or arrived past its count, is an error.

mbarriers: init count, pending arrivals, tx-count and the completed-phase count. A phase
completes when its arrivals and tx-count both reach zero. try_wait.parity(P) is true once the
phase of parity P has completed, i.e. when the parity of the phase in progress differs from P
(so waiting on the previous phase's parity passes at once, as on the hardware); a wait that
would fail parks the warp until the barrier moves. Arriving past the count, completing more tx
bytes than were expected, or using an address that holds no initialised mbarrier is an error.

shfl.sync / vote.sync: the lanes of the member mask must all be active (converged); a lane
outside the mask executing it is an error too.
"""

from __future__ import annotations

import numpy as np

from . import numeric as N
from .errors import SyncError, Unsupported
from .isa import REGISTER_FILE, WAIT, WARP, Wait, register
from .memops import address_reader, converge_wait, whole_warps
from .parse import Imm, Mem, Pair

MAX_TX = (1 << 20) - 1


class MBarrier:
    """An mbarrier object in shared memory: its phase, pending arrivals and tx-count."""

    def __init__(self, addr: int, count: int):
        self.addr = addr
        self.count = count
        self.pending = count
        self.tx = 0
        self.phase = 0                    # completed phases
        self.waiters: set[Group] = set()

    def describe(self) -> str:
        return (f"mbarrier at shared 0x{self.addr:x}: phase {self.phase} (parity "
                f"{self.phase & 1} in progress), {self.pending} of {self.count} arrivals "
                f"pending, tx-count {self.tx}")


def _uniform(values, what):
    v = np.asarray(values)
    if (v != v[0]).any():
        raise SyncError(f"{what} must be the same in every executing lane, got "
                        f"{sorted(set(v.tolist()))}")
    return int(v[0])


def _member_reader(prog, op):
    if isinstance(op, Imm):
        bits = int(op.value) & 0xFFFFFFFF
        return lambda g, idx: bits
    r = prog.reader(op, "b32")

    def read(g, idx):
        v = r(g, idx)
        return _uniform(v, "a member mask")
    return read


def _bits(lanes_in_warp: np.ndarray) -> int:
    b = 0
    for x in lanes_in_warp.tolist():
        b |= 1 << x
    return b


def converged(g, idx, member: int, what: str):
    """None when, in every warp of lanes idx, exactly the member-mask lanes execute; a Wait
    when some member lanes are alive but elsewhere (the group waits for them); an error when
    member lanes exited or a lane outside the mask executes."""
    if member == 0xFFFFFFFF and g.whole and len(idx) == g.idx.size:
        return None
    cta = g.cta
    wids = idx >> 5
    for wid in np.unique(wids).tolist():
        w = cta.warps[wid]
        here = _bits(idx[wids == wid] & 31)
        valid = (1 << w.lanes) - 1
        if here & ~member:
            raise SyncError(f"{what}: lanes {_lanes(here & ~member)} of warp {wid} execute it "
                            f"but are not in its member mask 0x{member:08x}")
        missing = member & ~here
        if missing:
            alive = _bits(np.flatnonzero(cta.alive[w.first:w.first + w.lanes])) & valid
            if missing & ~alive:
                raise SyncError(f"{what}: member mask 0x{member:08x} names lanes "
                                f"{_lanes(missing & ~alive)} of warp {wid}, which have exited")
            if len(idx) != g.idx.size:
                raise SyncError(f"{what}: member lanes {_lanes(missing)} of warp {wid} are "
                                f"left out by a guard predicate")
            return converge_wait(g, what)
    return None


def _lanes(bits: int) -> list[int]:
    return [i for i in range(32) if bits >> i & 1]


# ----------------------------------------------------------------------------- named barriers

def warp_exited(launch, cta) -> None:
    """A warp finished: barriers counting 'every live thread' may now be complete."""
    for b in cta.bars:
        if b.arrived and not b.explicit:
            b.expected = cta.live_threads()
            if b.arrived >= b.expected:
                _release(launch, b)


def _release(launch, b) -> None:
    waiters = b.waiters
    b.waiters = []
    b.arrived = 0
    b.expected = None
    b.explicit = False
    for g in waiters:
        launch.wake(g)


def _bar(prog, ins, blocking: bool):
    ops = ins.operands
    if len(ops) not in (1, 2):
        raise Unsupported(f"{ins.opcode} with {len(ops)} operands (bar.red is not supported)")
    rid = prog.reader(ops[0], "u32")
    rcount = prog.reader(ops[1], "u32") if len(ops) == 2 else None

    def bar(g, idx):
        warps = whole_warps(g, idx, ins.opcode)
        if warps is None:
            return converge_wait(g, ins.opcode)
        cta = g.cta
        ids = rid(g, idx)
        counts = rcount(g, idx) if rcount is not None else None
        # each warp arrives at its own barrier (the id and count are per warp: a group may hold
        # warps of several warpgroups taking turns on different barriers)
        by_bar: dict[tuple, list] = {}
        for k, w in enumerate(warps):
            sel = slice(32 * k, 32 * k + w.lanes)
            ident = _uniform(ids[sel], f"{ins.op} barrier id (warp {w.index})")
            count = _uniform(counts[sel], f"{ins.op} thread count (warp {w.index})") \
                if counts is not None else None
            by_bar.setdefault((ident, count), []).append(w)
        blocked = []
        for (ident, count), ws in by_bar.items():
            if ident > 15:
                raise SyncError(f"barrier id {ident} (0 to 15)")
            b = cta.bars[ident]
            if count is not None:
                if count % WARP or count == 0:
                    raise SyncError(f"barrier {ident}: thread count {count} is not a positive "
                                    f"multiple of {WARP}")
                explicit = True
            else:
                count = cta.live_threads()
                explicit = False
            if b.arrived and b.explicit and explicit and b.expected != count:
                raise SyncError(f"barrier {ident} is used with thread counts {b.expected} and "
                                f"{count} in the same phase")
            if b.arrived == 0:
                b.expected, b.explicit = count, explicit
            elif explicit and not b.explicit:
                b.expected, b.explicit = count, True
            b.arrived += WARP * len(ws)
            if b.arrived > b.expected:
                raise SyncError(f"barrier {ident}: {b.arrived} threads arrived, more than its "
                                f"count {b.expected}")
            if b.arrived == b.expected:
                _release(g.launch, b)
            elif blocking:
                blocked.append((b, ws))
        if not blocked:
            return None
        if len(blocked) == 1 and sum(len(ws) for _, ws in blocked) == len(warps):
            b = blocked[0][0]
            b.waiters.append(g)
            return Wait(b.describe, b, resume_next=True)
        parts = []
        for b, ws in blocked:
            lanes = np.concatenate([np.arange(w.first, w.first + w.lanes) for w in ws])
            parts.append((Wait(b.describe, b, resume_next=True, register=b.waiters.append),
                          lanes))
        return parts
    return prog.wrap(ins, bar, prog.regs_of(*ops), kind=WAIT)


@register("bar", "barrier")
def _bar_dispatch(prog, ins):
    kind = ins.parts[1] if len(ins.parts) > 1 else "sync"
    if kind == "cta":
        kind = ins.parts[2]
    if kind == "cluster":                               # barrier.cluster.arrive / wait
        from .cluster import compile_barrier_cluster
        return compile_barrier_cluster(prog, ins)
    if kind == "sync":
        return _bar(prog, ins, blocking=True)
    if kind == "arrive":
        return _bar(prog, ins, blocking=False)
    if kind == "warp":                                  # bar.warp.sync membermask
        member = _member_reader(prog, ins.operands[0])

        def warp_sync(g, idx):
            return converged(g, idx, member(g, idx), "bar.warp.sync")
        return prog.wrap(ins, warp_sync, prog.regs_of(*ins.operands), kind=WAIT)
    raise Unsupported(f"{ins.opcode}")


# ----------------------------------------------------------------------------- mbarriers

def _mbar_addr(prog, ins, op):
    if not isinstance(op, Mem):
        raise Unsupported(f"{ins.opcode}: expected [address]")
    return address_reader(prog, op, "shared")


def barrier_at(g, addr: int, what: str) -> MBarrier:
    cta = g.cta
    if addr >> 24:                                      # a peer's (cluster.py: mapa)
        from .cluster import resolve
        cta, addr = resolve(g, addr, what)
    b = cta.mbar.get(addr)
    if b is None:
        from .errors import MemoryFault
        raise MemoryFault(f"{what} on shared 0x{addr:x}, which holds no initialised mbarrier",
                          None, addr)
    return b


def complete_phase_if_done(launch, b: MBarrier) -> None:
    if b.pending == 0 and b.tx == 0:
        b.phase += 1
        b.pending = b.count
        for g in list(b.waiters):
            _unpark(launch, g)


def _unpark(launch, g) -> None:
    wait = g.wait
    if wait is None:
        return
    for b in (wait.obj or ()):
        b.waiters.discard(g)
    launch.wake(g)


def arrive(launch, b: MBarrier, count: int, what: str) -> int:
    """One thread's arrive-on of `count` (1 without a count operand); returns the state (the
    phase it arrived in). More than the pending count in one operation is an error."""
    state = b.phase
    if count > b.pending:
        why = ""
        if b.pending == 0 and b.tx > 0:
            why = (f"; the phase's arrivals are all in and it still waits for {b.tx} tx bytes: "
                   f"a new round on a buffer whose last load has not landed (refilled before "
                   f"its consumers released it?)")
        raise SyncError(f"{what}: an arrive of count {count} on an mbarrier with {b.pending} of "
                        f"{b.count} arrivals pending (phase {b.phase}): more arrivals than the "
                        f"count{why}")
    b.pending -= count
    complete_phase_if_done(launch, b)
    return state


def arrive_lanes(launch, b: MBarrier, counts: list[int], what: str, g=None, ins=None) -> list:
    """The arrivals of several lanes, one thread after another (as on the GPU: arrivals past
    a phase's count land in the next phase). Two phases completed by one instruction while
    warps wait on the barrier is a hazard: a waiter can miss the phase between."""
    states = []
    start = b.phase
    waited = bool(b.waiters)
    for c in counts:
        states.append(arrive(launch, b, c, what))
    if b.phase - start > 1 and waited:
        launch.hazard("mbarrier-phase-skipped",
                      f"one {what} completed {b.phase - start} phases of {b.describe()} while "
                      f"warps waited on it: a waiter on the parity of the phase between never "
                      f"sees it", g, ins)
    return states


def expect_tx(b: MBarrier, nbytes: int, what: str) -> None:
    if nbytes < 0 or nbytes > MAX_TX:
        raise SyncError(f"{what}: tx count {nbytes} outside 0..{MAX_TX}")
    b.tx += nbytes
    if b.tx > MAX_TX:
        raise SyncError(f"{what}: the mbarrier's tx-count reached {b.tx}, past {MAX_TX}")


def complete_tx(launch, b: MBarrier, nbytes: int, what: str) -> None:
    b.tx -= nbytes
    if b.tx < 0 and b.pending == 0:
        raise SyncError(f"{what}: {nbytes} bytes completed on {b.describe()}: more bytes than "
                        f"any expect_tx announced for this phase (a missing or short "
                        f"mbarrier.arrive.expect_tx?)")
    complete_phase_if_done(launch, b)


def _by_address(idx, addrs):
    """{address: positions in idx} (a warp's lanes usually name one barrier)."""
    a = addrs.tolist()
    if len(set(a)) == 1:
        return {a[0]: np.arange(len(a))}
    out: dict[int, list] = {}
    for j, x in enumerate(a):
        out.setdefault(x, []).append(j)
    return {k: np.array(v) for k, v in out.items()}


@register("mbarrier")
def _mbarrier(prog, ins):
    kind = ins.parts[1]
    ops = ins.operands
    if kind == "init":
        addr = _mbar_addr(prog, ins, ops[0])
        rcount = prog.reader(ops[1], "u32")

        def init(g, idx):
            addrs = addr(g, idx)
            counts = rcount(g, idx)
            cta = g.cta
            for j in range(len(idx)):
                a = int(addrs[j])
                _check_mbar_address(g, a, int(idx[j]), "mbarrier.init")
                n = int(counts[j])
                if not 1 <= n <= MAX_TX:
                    raise SyncError(f"mbarrier.init count {n} (1 to {MAX_TX})")
                old = cta.mbar.get(a)
                if old is not None and old.waiters:
                    raise SyncError(f"mbarrier.init at shared 0x{a:x} while warps wait on it")
                cta.mbar[a] = MBarrier(a, n)
                cta.mbar_words[a // 4: a // 4 + 2] = True
        return prog.wrap(ins, init, prog.regs_of(*ops))
    if kind == "inval":
        addr = _mbar_addr(prog, ins, ops[0])

        def inval(g, idx):
            for a in set(addr(g, idx).tolist()):
                if g.cta.mbar.pop(a, None) is not None:
                    g.cta.mbar_words[a // 4: a // 4 + 2] = False
        return prog.wrap(ins, inval, prog.regs_of(*ops))
    if kind in ("expect_tx", "complete_tx"):
        addr = _mbar_addr(prog, ins, ops[0])
        rtx = prog.reader(ops[1], "u32")

        def tx(g, idx):
            addrs, n = addr(g, idx), rtx(g, idx)
            for j in range(len(idx)):
                b = barrier_at(g, int(addrs[j]), f"mbarrier.{kind}")
                if kind == "expect_tx":
                    expect_tx(b, int(n[j]), "mbarrier.expect_tx")
                else:
                    complete_tx(g.launch, b, int(n[j]), "mbarrier.complete_tx")
        return prog.wrap(ins, tx, prog.regs_of(*ops))
    if kind in ("arrive", "arrive_drop"):
        if kind == "arrive_drop":
            raise Unsupported("mbarrier.arrive_drop")
        if "noComplete" in ins.parts:
            raise Unsupported("mbarrier.arrive.noComplete")
        with_tx = "expect_tx" in ins.parts
        state_op = ops[0]
        addr = _mbar_addr(prog, ins, ops[1])
        rarg = prog.reader(ops[2], "u32") if len(ops) > 2 else None
        write = prog.writer(state_op, "b64")

        def do_arrive(g, idx):
            addrs = addr(g, idx)
            arg = rarg(g, idx) if rarg is not None else None
            states = np.zeros(len(idx), np.uint64)
            for a, pos in _by_address(idx, addrs).items():
                b = barrier_at(g, a, ins.opcode)
                if with_tx:
                    for j in pos.tolist():
                        expect_tx(b, int(arg[j]), ins.opcode)
                    counts = [1] * len(pos)
                elif arg is None:
                    counts = [1] * len(pos)
                else:
                    counts = [int(x) for x in arg[pos].tolist()]
                if len(counts) <= b.pending and not with_tx and arg is None:
                    states[pos] = np.uint64(arrive(g.launch, b, len(counts), ins.opcode))
                else:
                    states[pos] = np.array(arrive_lanes(g.launch, b, counts, ins.opcode, g,
                                                        ins), np.uint64)
            write(g, idx, states)
        return prog.wrap(ins, do_arrive, prog.regs_of(*ops))
    if kind in ("try_wait", "test_wait"):
        parity = "parity" in ins.parts
        dst = ops[0]
        addr = _mbar_addr(prog, ins, ops[1])
        rarg = prog.reader(ops[2], "u32" if parity else "b64")
        write = prog.writer(dst, "pred")
        blocking = kind == "try_wait"
        def wait(g, idx):
            addrs = addr(g, idx)
            arg = rarg(g, idx)
            groups = _by_address(idx, addrs)

            def evaluate():
                ok = np.zeros(len(idx), np.bool_)
                pending = set()
                for a, pos in groups.items():
                    b = barrier_at(g, a, ins.opcode)
                    if parity:
                        done = (b.phase & 1) != (arg[pos].astype(np.int64) & 1)
                    else:
                        done = b.phase > arg[pos].astype(np.int64)
                    ok[pos] = done
                    if not done.all():
                        pending.add(b)
                return ok, pending
            ok, pending = evaluate()
            if pending and g.launch.land_loads_for(g.cta, pending):
                ok, pending = evaluate()      # the TMA loads these wait for have landed
            if not pending or not blocking:
                write(g, idx, ok)
                return None
            blist = tuple(pending)
            want = int(arg[0]) if parity else int(arg[0])

            def describe():
                return "; ".join(f"{b.describe()} [waiting for the phase of "
                                 f"{'parity ' if parity else 'state '}{want}]" for b in blist)

            def enrol(group):
                for b in blist:
                    b.waiters.add(group)
            w = Wait(describe, blist, register=enrol)
            if not ok.any():
                enrol(g)
                return w
            write(g, idx[ok], np.ones(int(ok.sum()), np.bool_))
            return (w, idx[~ok])
        return prog.wrap(ins, wait, prog.regs_of(*ops), kind=WAIT)
    if kind == "pending_count":
        raise Unsupported("mbarrier.pending_count")
    raise Unsupported(f"{ins.opcode}")


def _check_mbar_address(g, a: int, lane: int, what: str) -> None:
    from .errors import MemoryFault
    smem = g.cta.smem
    if a % 8:
        raise MemoryFault(f"{what}: mbarrier address shared 0x{a:x} is not 8-byte aligned",
                          lane, a)
    if a < 1024 or a + 8 > smem.window:
        raise MemoryFault(f"{what}: mbarrier at shared 0x{a:x} is outside the CTA's shared "
                          f"memory (0x400..0x{smem.window:x})", lane, a)


# ----------------------------------------------------------------------------- collectives

@register("shfl")
def _shfl(prog, ins):
    if "sync" not in ins.parts:
        raise Unsupported("shfl without .sync (removed for sm_70+)")
    mode = ins.parts[2]
    if mode not in ("up", "down", "bfly", "idx"):
        raise Unsupported(f"shfl mode .{mode}")
    t = ins.parts[-1]
    d, a, b, c, mem = ins.operands
    if isinstance(d, Pair):
        wd = prog.writer(d.first, t)
        wp = prog.writer(d.second, "pred")
    else:
        wd, wp = prog.writer(d, t), None
    ai = prog.reg(a.name) if hasattr(a, "name") and a.name in prog.reg_index else None
    ra = prog.reader(a, t)
    rb = prog.reader(b, "u32")
    rc = prog.reader(c, "u32")
    member = _member_reader(prog, mem)
    dt = N.DTYPE[t]

    def shfl(g, idx):
        bits = member(g, idx)
        res = converged(g, idx, bits, ins.opcode)
        if res is not None:
            return res
        lane = idx & 31
        base = idx - lane
        bval = rb(g, idx).astype(np.int64) & 31
        cval = rc(g, idx).astype(np.int64)
        clamp = cval & 31
        segmask = (cval >> 8) & 31
        max_lane = (lane & segmask) | (clamp & ~segmask)
        if mode == "up":
            j = lane - bval
            ok = j >= max_lane
        elif mode == "down":
            j = lane + bval
            ok = j <= max_lane
        elif mode == "bfly":
            j = lane ^ bval
            ok = j <= max_lane
        else:
            j = (lane & segmask) | (bval & ~segmask)
            ok = j <= max_lane
        j = np.where(ok, j, lane)
        if bits != 0xFFFFFFFF and ((bits >> j) & 1 == 0).any():
            bad = int(np.argmax((bits >> j) & 1 == 0))
            raise SyncError(f"{ins.opcode}: lane {int(lane[bad])} reads lane {int(j[bad])}, "
                            f"which is not in the member mask 0x{bits:08x}")
        src = base + j
        if ai is not None:
            val = g.r[ai][src]
            if val.dtype != dt:
                val = val.view(dt) if val.dtype.itemsize == dt.itemsize else val.astype(dt)
        else:
            val = ra(g, idx)
        wd(g, idx, val)
        if wp is not None:
            wp(g, idx, ok)
        return None
    return prog.wrap(ins, shfl, prog.regs_of(*ins.operands), kind=WAIT)


@register("vote")
def _vote(prog, ins):
    if "sync" not in ins.parts:
        raise Unsupported("vote without .sync")
    mode = ins.parts[2]
    if mode not in ("any", "all", "uni", "ballot"):
        raise Unsupported(f"vote mode .{mode}")
    d, a, mem = ins.operands
    rp = prog.reader(a, "pred")
    member = _member_reader(prog, mem)
    t = "b32" if mode == "ballot" else "pred"
    write = prog.writer(d, t)

    def vote(g, idx):
        bits = member(g, idx)
        res = converged(g, idx, bits, ins.opcode)
        if res is not None:
            return res
        p = rp(g, idx)
        if g.whole and len(idx) == g.idx.size and len(idx) % 32 == 0:
            pw = p.reshape(-1, 32)
            if mode == "any":
                out = np.repeat(pw.any(axis=1), 32)
            elif mode == "all":
                out = np.repeat(pw.all(axis=1), 32)
            elif mode == "uni":
                out = np.repeat(pw.all(axis=1) | ~pw.any(axis=1), 32)
            else:
                weights = np.uint32(1) << np.arange(32, dtype=np.uint32)
                out = np.repeat((pw * weights).sum(axis=1).astype(np.uint32), 32)
            write(g, idx, out)
            return None
        wids = idx >> 5
        out = np.zeros(len(idx), np.uint32 if mode == "ballot" else np.bool_)
        for wid in np.unique(wids).tolist():
            sel = wids == wid
            pv = p[sel]
            if mode == "any":
                out[sel] = pv.any()
            elif mode == "all":
                out[sel] = pv.all()
            elif mode == "uni":
                out[sel] = pv.all() or not pv.any()
            else:
                out[sel] = _bits((idx[sel] & 31)[pv])
        write(g, idx, out)
        return None
    return prog.wrap(ins, vote, prog.regs_of(*ins.operands), kind=WAIT)


@register("activemask")
def _activemask(prog, ins):
    write = prog.writer(ins.operands[0], "b32")

    def activemask(g, idx):
        wids = idx >> 5
        out = np.zeros(len(idx), np.uint32)
        for wid in np.unique(wids).tolist():
            sel = wids == wid
            out[sel] = _bits(idx[sel] & 31)
        write(g, idx, out)
    return prog.wrap(ins, activemask, prog.regs_of(*ins.operands))


@register("elect")
def _elect(prog, ins):
    d, mem = ins.operands
    member = _member_reader(prog, mem)
    if not isinstance(d, Pair):
        raise Unsupported("elect.sync needs d|p")
    wr = prog.writer(d.first, "b32")
    wp = prog.writer(d.second, "pred")

    def elect(g, idx):
        bits = member(g, idx)
        res = converged(g, idx, bits, ins.opcode)
        if res is not None:
            return res
        leader = min(_lanes(bits))
        lane = idx & 31
        wr(g, idx, np.full(len(idx), leader, np.uint32))
        wp(g, idx, lane == leader)
        return None
    return prog.wrap(ins, elect, prog.regs_of(*ins.operands), kind=WAIT)


# ----------------------------------------------------------------------------- fences

@register("fence", "membar")
def _fence(prog, ins):
    parts = ins.parts
    if ins.op == "fence" and len(parts) > 1 and parts[1] == "proxy":
        kind = parts[2] if len(parts) > 2 else ""
        if kind == "async":
            space = parts[3] if len(parts) > 3 else "all"
            clears = space in ("all", "shared::cta", "shared::cluster", "shared")

            def proxy_async(g, idx):
                if clears:
                    clear_unfenced(g, idx)
            return prog.wrap(ins, proxy_async)
        return prog.wrap(ins, lambda g, idx: None)    # tensormap / alias proxies: no-op
    return prog.wrap(ins, lambda g, idx: None)        # the emulator is sequentially consistent


def clear_unfenced(g, idx) -> None:
    """fence.proxy.async by lanes idx: their generic shared stores become visible to the async
    proxy."""
    cta = g.cta
    if not cta.unfenced:
        return
    smem = cta.smem
    mine_tids = idx.astype(np.int32) + 1
    keep = []
    for words, tids in cta.unfenced:
        mine = np.isin(tids, mine_tids)
        if mine.any():
            still = smem.unfenced[words[mine]] == tids[mine]
            smem.unfenced[words[mine][still]] = 0
        if not mine.all():
            keep.append((words[~mine], tids[~mine]))
    cta.unfenced = keep


# ----------------------------------------------------------------------------- setmaxnreg

@register("setmaxnreg")
def _setmaxnreg(prog, ins):
    action = ins.parts[1]
    (n_op,) = ins.operands
    if not isinstance(n_op, Imm):
        raise Unsupported("setmaxnreg needs an immediate count")
    n = int(n_op.value)
    if n % 8 or not 24 <= n <= 256:
        raise SyncError(f"setmaxnreg count {n}: a multiple of 8 from 24 to 256")
    if action not in ("inc", "dec"):
        raise Unsupported(f"setmaxnreg.{action}")
    def setmaxnreg(g, idx):
        warps = whole_warps(g, idx, "setmaxnreg")
        if warps is None:
            return converge_wait(g, "setmaxnreg")
        cta = g.cta
        launch = g.launch
        blocked = []
        for w in warps:
            key = ("setmaxnreg", w.wg, w.setmaxnreg_seq)
            seen = cta.wg_log.get(key)
            if seen is None:
                cta.wg_log[key] = (ins.index, n)
            elif seen != (ins.index, n):
                raise SyncError(f"warps of warpgroup {w.wg} disagree on their setmaxnreg #"
                                f"{w.setmaxnreg_seq}: pc {seen[0]} ({seen[1]}) and pc "
                                f"{ins.index} ({n}); the whole warpgroup must execute the "
                                f"same one")
            if action == "dec":
                if n > w.nregs:
                    raise SyncError(f"setmaxnreg.dec to {n} registers, above warp "
                                    f"{w.index}'s current {w.nregs}")
                cta.reg_pool_free += (w.nregs - n) * WARP
                w.nregs = n
            else:
                if n < w.nregs:
                    raise SyncError(f"setmaxnreg.inc to {n} registers, below warp "
                                    f"{w.index}'s current {w.nregs}")
                need = (n - w.nregs) * WARP
                if need > cta.reg_pool_free:
                    blocked.append(w)
                    continue
                cta.reg_pool_free -= need
                w.nregs = n
            w.setmaxnreg_seq += 1
        held = sum(x.nregs * WARP for x in cta.warps if not x.done) + cta.reg_pool_free
        per_sm = held * (launch.prog.fn.minnctapersm or 1)
        if per_sm > REGISTER_FILE:
            raise SyncError(f"register budget: the CTA's warps hold {held} registers "
                            f"(x {launch.prog.fn.minnctapersm or 1} CTAs/SM = {per_sm}), "
                            f"more than the {REGISTER_FILE} of an SM")
        if action == "dec":
            waiters = list(cta.reg_waiters)
            cta.reg_waiters.clear()
            for x in waiters:
                launch.wake(x)
        if not blocked:
            return None
        live = sum(x.nregs * WARP for x in cta.warps if not x.done)

        def describe():
            return (f"setmaxnreg.inc to {n}: needs {(n - blocked[0].nregs) * WARP} registers "
                    f"per warp, the CTA's pool has {cta.reg_pool_free} free ({live} held by "
                    f"live warps; {REGISTER_FILE} per SM)")

        def enrol(group):
            cta.reg_waiters.add(group)
        wait = Wait(describe, None, register=enrol)
        lanes = np.concatenate([np.arange(w.first, w.first + w.lanes) for w in blocked])
        if len(lanes) == len(idx):
            enrol(g)
            return wait
        return (wait, lanes)
    return prog.wrap(ins, setmaxnreg, kind=WAIT)

"""The machine: CTAs of warps, groups of lanes that run together, and the scheduler.

SIMT, vectorised over a CTA. Every register is one array with an element per thread of the CTA.
A *group* is a set of lanes at the same pc; an instruction runs once for the whole group, on
the slice (or index array) of its lanes, so warps that run in lockstep (a warpgroup, the
consumer warpgroups of a warp-specialised kernel) cost one NumPy operation per instruction
rather than one per warp. Semantically every thread is on its own (as with independent thread
scheduling): a branch that goes both ways splits a group, the part with the lower pc runs first
(structured code reconverges there), and groups merge whenever they meet at a pc. Collectives
(shfl.sync, vote.sync, bar, wgmma, setmaxnreg, ldmatrix/stmatrix .aligned) need their lanes
converged: lanes that arrive first wait at the instruction for the rest of their warp (or of the
member mask), and lanes that exited make it an error.

Warps keep what is theirs: wgmma and TMA-store groups in flight, the setmaxnreg register count.

Every CTA of the grid is resident at once (the kernels' grids are at most the SM count, or
small), so CTAs that meet through global memory (a tile counter, a semaphore) interleave as on
the GPU. The scheduler runs a group for a quantum of instructions or until it blocks (a named
barrier, an mbarrier wait that would fail, setmaxnreg.inc without free registers, a collective
waiting for its lanes). With a seed it picks groups and quanta at random, splits lockstep warps
apart at random, and completes asynchronous work (TMA loads, wgmma retirement, TMA store reads)
at random points, to shake out races.
"""

from __future__ import annotations

import random
import time
from collections import deque

import numpy as np

from . import asyncops, cluster as clusters, syncops
from . import numeric as N
from .errors import Deadlock, EmulatorError, Hazard, HazardError, Livelock, SyncError
from .isa import (BRANCH, MAX_SMEM_OPTIN, OP, REGISTER_FILE, WAIT, WARP,  # noqa: F401
                  YIELD, Wait)
from .memory import SharedMemory

class Warp:
    """What a warp owns beyond its lanes' registers."""

    def __init__(self, cta: "CTA", index: int, lanes: int):
        self.cta = cta
        self.launch = cta.launch
        self.index = index
        self.wg = index // 4
        self.lanes = lanes                 # 32, or fewer for a CTA's last, short warp
        self.partial = lanes != WARP       # some lanes missing or exited
        self.done = False
        # wgmma (asyncops): open ops and committed groups
        self.wg_open: list = []
        self.wg_groups: list[list] = []
        self.wg_pending: deque = deque()   # issued, not retired, in issue order
        self.wgmma_seq = 0
        self.setmaxnreg_seq = 0
        # bulk async-groups of TMA stores (asyncops)
        self.bulk_open: list = []
        self.bulk_groups: list[list] = []
        self.nregs = cta.launch.regs_at_launch

    @property
    def first(self) -> int:
        return self.index * WARP


class Group:
    """Lanes of one CTA at the same pc."""
    __slots__ = ("cta", "launch", "r", "pc", "idx", "L", "warps", "wbits", "whole", "nwarps",
                 "wait", "dead", "ident", "yielded")

    def __init__(self, cta: "CTA", pc: int, idx: np.ndarray):
        self.cta = cta
        self.launch = cta.launch
        self.r = cta.r
        self.pc = pc
        self.wait: Wait | None = None
        self.dead = False
        self.yielded = -1                  # pc of the instruction that last yielded (YIELD)
        self.ident = cta.next_group_id()
        self.set_lanes(idx)
        cta.groups.add(self)

    def set_lanes(self, idx: np.ndarray) -> None:
        idx = np.asarray(idx, np.int64)
        self.idx = idx
        n = idx.size
        first, last = int(idx[0]), int(idx[-1])
        contiguous = last - first + 1 == n
        self.L = slice(first, last + 1) if contiguous else idx
        if contiguous:
            wids = range(first >> 5, (last >> 5) + 1)
        else:
            wids = np.unique(idx >> 5).tolist()
        warps = self.cta.warps
        self.warps = [warps[i] for i in wids]
        self.nwarps = len(self.warps)
        self.wbits = 0
        for i in wids:
            self.wbits |= 1 << i
        self.whole = contiguous and first % WARP == 0 and (last + 1) % WARP == 0 and \
            not any(w.partial for w in self.warps)

    def clock(self, L) -> np.ndarray:
        return np.full(len(np.arange(self.cta.threads)[L]), self.launch.total_instructions,
                       np.uint64)

    def describe(self) -> str:
        lanes = self.idx.size
        ws = [w.index for w in self.warps]
        span = f"warps {ws[0]}..{ws[-1]}" if len(ws) > 3 else f"warp(s) {ws}"
        part = "" if self.whole else f" ({lanes} lanes)"
        return f"CTA {self.cta.ctaid} {span}{part}"


class NamedBarrier:
    """bar.sync / bar.arrive: counts in threads, arrivals by whole converged warps."""

    def __init__(self, ident: int):
        self.ident = ident
        self.expected: int | None = None
        self.explicit = False
        self.arrived = 0
        self.waiters: list[Group] = []

    def describe(self) -> str:
        exp = self.expected if self.expected is not None else "?"
        return f"named barrier {self.ident} ({self.arrived} of {exp} threads arrived)"


class CTA:
    def __init__(self, launch: "Launch", ctaid: tuple[int, int, int], linear: int):
        self.launch = launch
        self.ctaid = ctaid
        self.linear = linear
        prog = launch.prog
        T = launch.threads
        self.threads = T
        self.r = [N.poison(dt, T) for dt in prog.reg_dtype]
        self.sp = _special_registers(launch, self)
        self.alive = np.ones(T, np.bool_)
        window = prog.dyn_base + launch.dyn_smem
        self.smem = SharedMemory(window, prog.dyn_base, launch.dyn_smem)
        self.mbar: dict = {}                      # shared address -> syncops.MBarrier
        self.mbar_words = np.zeros(self.smem.async_readers.size, np.bool_)
        self.bars = [NamedBarrier(i) for i in range(16)]
        self.tma_loads: list = []                 # issued, not landed (asyncops.TmaLoad)
        nwarps = -(-T // WARP)
        self.warps = [Warp(self, i, min(WARP, T - i * WARP)) for i in range(nwarps)]
        self.live_warps = nwarps
        self.reg_pool_free = 0
        self.reg_waiters: set[Group] = set()
        self.wg_log: dict = {}                    # warpgroup-collective consistency checks
        nregs = len(prog.regs)
        self.touched = [0] * nregs                # warps that touched a wgmma register since
        #                                           their last wgmma.fence (bit per warp)
        self.inflight: dict[int, dict[int, list]] = {}    # reg -> warp -> in-flight wgmma ops
        self.unfenced: list = []                  # (words, writer tids + 1) not yet fenced
        self.groups: set[Group] = set()
        self.parked: dict[int, Group] = {}        # runnable (or converging) groups by pc
        self._gid = 0

    def next_group_id(self) -> int:
        self._gid += 1
        return self._gid

    def live_threads(self) -> int:
        return WARP * sum(1 for w in self.warps if not w.done)


def _special_registers(launch, cta) -> dict:
    T = launch.threads
    u32 = np.uint32
    t = np.arange(T, dtype=u32)
    bx, by, bz = launch.block
    gx, gy, gz = launch.grid
    cx, cy, cz = cta.ctaid
    lane = t & u32(31)

    def full(v, dt=u32):
        return np.full(T, v, dt)
    sp = {
        "%tid.x": t % u32(bx), "%tid.y": (t // u32(bx)) % u32(by), "%tid.z": t // u32(bx * by),
        "%ntid.x": full(bx), "%ntid.y": full(by), "%ntid.z": full(bz),
        "%ctaid.x": full(cx), "%ctaid.y": full(cy), "%ctaid.z": full(cz),
        "%nctaid.x": full(gx), "%nctaid.y": full(gy), "%nctaid.z": full(gz),
        "%laneid": lane, "%warpid": t >> u32(5), "%nwarpid": full(64),
        "%smid": full(cta.linear % launch.sm_count), "%nsmid": full(launch.sm_count),
        "%gridid": full(1, np.uint64),
        "%lanemask_eq": u32(1) << lane, "%lanemask_lt": (u32(1) << lane) - u32(1),
        "%dynamic_smem_size": full(launch.dyn_smem),
        "%total_smem_size": full(launch.dyn_smem + launch.prog.static_smem),
    }
    for name, value in clusters.special_registers(launch, cta.ctaid).items():
        sp[name] = full(value)                 # (a launch without clusters: clusters of one)
    sp["%lanemask_le"] = sp["%lanemask_lt"] | sp["%lanemask_eq"]
    sp["%lanemask_gt"] = ~sp["%lanemask_le"]
    sp["%lanemask_ge"] = ~sp["%lanemask_lt"]
    return sp


class Report:
    """What a launch did: counts, speed and the hazards found."""

    def __init__(self, launch: "Launch"):
        self.instructions = launch.total_instructions
        self.warp_instructions = launch.warp_instructions
        self.seconds = launch.seconds
        self.hazards = list(launch.hazards)
        self.ctas = len(launch.ctas)
        self.wgmma = launch.wgmma_count
        self.tma = launch.tma_count
        self.multicast = launch.multicast_count
        self.cluster = launch.cluster

    @property
    def rate(self) -> float:
        """Warp-instructions per second."""
        return self.warp_instructions / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        return (f"{self.warp_instructions} warp-instructions ({self.instructions} group steps) "
                f"in {self.seconds:.2f} s ({self.rate / 1e3:.0f}k warp-instr/s), {self.ctas} "
                f"CTA(s){self._clusters()}, {self.wgmma} wgmma, {self.tma} TMA ops, "
                f"{len(self.hazards)} hazard(s)")

    def _clusters(self) -> str:
        if self.cluster == (1, 1, 1):
            return ""
        return f" in clusters of {self.cluster}, {self.multicast} multicast TMA loads"



def registers_at_launch(prog, threads: int) -> int:
    """Per-thread registers the JIT gives a kernel that uses setmaxnreg: the most the launch
    bounds allow, 65536 / (threads rounded to warps * .minnctapersm), rounded down to 8."""
    bound = prog.fn.maxntid or prog.fn.reqntid
    nthreads = bound[0] * bound[1] * bound[2] if bound else threads
    nthreads = -(-nthreads // WARP) * WARP
    per = REGISTER_FILE // (nthreads * (prog.fn.minnctapersm or 1))
    return min(256, per // 8 * 8)


class Launch:
    """One kernel launch on the emulator. `params` are the parameter bytes laid out as the
    function declares them (Program.fn.params offsets)."""

    def __init__(self, prog, grid, block, dyn_smem: int, params: bytes, gmem,
                 *, seed: int | None = None, strict: bool = False, quantum: int = 256,
                 max_instructions: int = 5_000_000, sm_count: int = 132, source_map=None,
                 smem_limit: int = MAX_SMEM_OPTIN, cluster=(1, 1, 1)):
        self.prog = prog
        self.grid = tuple(grid)
        self.block = tuple(block)
        self.cluster = tuple(cluster)          # CTAs a cluster (cluster.py)
        clusters.check_dims(self.grid, self.cluster)
        self.threads = self.block[0] * self.block[1] * self.block[2]
        self.dyn_smem = int(dyn_smem)
        self.params = np.frombuffer(bytes(params), np.uint8).copy()
        if self.params.size < prog.fn.param_bytes:
            raise EmulatorError(f"{prog.name} takes {prog.fn.param_bytes} bytes of parameters, "
                                f"got {self.params.size}")
        self.gmem = gmem
        self.seed = seed
        self.rng = random.Random(seed) if seed is not None else None
        self.strict = strict
        self.quantum = quantum
        self.max_instructions = max_instructions
        self.sm_count = sm_count
        self.source_map = source_map
        self.hazards: list[Hazard] = []
        self._hazard_keys: set = set()
        self.total_instructions = 0
        self.warp_instructions = 0
        self.wgmma_count = 0
        self.tma_count = 0
        self.multicast_count = 0               # TMA loads issued with .multicast::cluster
        self.seconds = 0.0
        self._check_launch(smem_limit)
        self.regs_at_launch = registers_at_launch(prog, self.threads)
        self.ctas: list[CTA] = []
        self.ready: deque[Group] = deque()

    def _check_launch(self, smem_limit: int) -> None:
        prog = self.prog
        bound = prog.fn.reqntid or prog.fn.maxntid
        if self.threads < 1 or self.threads > 1024:
            raise EmulatorError(f"block {self.block}: {self.threads} threads (1 to 1024)")
        if bound is not None and self.threads > bound[0] * bound[1] * bound[2]:
            raise EmulatorError(f"block {self.block} has {self.threads} threads, more than the "
                                f"kernel's .maxntid/.reqntid {bound}")
        if prog.fn.reqntid is not None and tuple(self.block) != tuple(prog.fn.reqntid):
            raise EmulatorError(f"block {self.block} differs from .reqntid {prog.fn.reqntid}")
        total = self.dyn_smem + prog.static_smem
        if total > smem_limit:
            raise EmulatorError(f"{total} bytes of shared memory per CTA (dynamic "
                                f"{self.dyn_smem} + static {prog.static_smem}) exceed the "
                                f"{smem_limit} an sm_90 CTA may have")
        if any(g < 1 for g in self.grid):
            raise EmulatorError(f"grid {self.grid}: every dimension must be >= 1")

    # ------------------------------------------------------------------------- running
    def run(self) -> Report:
        start = time.perf_counter()
        gx, gy, gz = self.grid
        linear = 0
        for z in range(gz):
            for y in range(gy):
                for x in range(gx):
                    self.ctas.append(CTA(self, (x, y, z), linear))
                    linear += 1
        clusters.link(self)
        for cta in self.ctas:
            pool = sum(w.nregs * WARP for w in cta.warps)
            per_sm = pool * (self.prog.fn.minnctapersm or 1)
            if per_sm > REGISTER_FILE:
                raise SyncError(f"{len(cta.warps)} warps x {self.regs_at_launch} registers x "
                                f"{self.prog.fn.minnctapersm or 1} CTAs/SM exceed the "
                                f"{REGISTER_FILE} registers of an SM")
            g = Group(cta, 0, np.arange(cta.threads))
            self.park(g)
        try:
            with np.errstate(all="ignore"):       # IEEE results, as the GPU: no warnings
                self._schedule()
        finally:
            self.seconds = time.perf_counter() - start
        asyncops.finish(self)
        report = Report(self)
        if self.hazards:
            err = HazardError(self.hazards)
            err.report = report
            raise err
        return report

    def park(self, g: Group) -> None:
        """g is runnable (or waits to converge) at g.pc: merge it with a group already parked
        there, else park it and queue it to run."""
        cta = g.cta
        other = cta.parked.get(g.pc)
        if other is not None and other is not g:
            self._merge(other, g)
            if other.wait is not None and other.wait.converge:
                # lanes it waited for may have arrived: run the collective again
                other.wait = None
                self.ready.append(other)
            return
        cta.parked[g.pc] = g
        if g.wait is None:
            self.ready.append(g)

    def _merge(self, into: Group, other: Group) -> None:
        into.set_lanes(np.union1d(into.idx, other.idx))
        other.dead = True
        into.cta.groups.discard(other)
        if into.cta.parked.get(other.pc) is other:
            del into.cta.parked[other.pc]

    def _schedule(self) -> None:
        ready = self.ready
        rng = self.rng
        q = self.quantum
        while True:
            if not ready:
                if asyncops.progress(self, everything=True):
                    continue
                if all(c.live_warps == 0 for c in self.ctas):
                    return
                raise Deadlock(self.deadlock_report())
            if rng is None:
                g = ready.popleft()
                budget = q
            else:
                i = rng.randrange(len(ready))
                g = ready[i]
                del ready[i]
                budget = rng.randint(1, 2 * q)
            if g.dead or g.wait is not None:
                continue
            cta = g.cta
            if cta.parked.get(g.pc) is g:
                del cta.parked[g.pc]
            if rng is not None:
                if rng.random() < 0.25:
                    asyncops.progress(self, everything=False)
                if g.nwarps > 1 and rng.random() < 0.15:
                    self._split_warps(g, rng)
            self._run(g, budget)
            if not g.dead and g.wait is None:
                self.park(g)
            if self.total_instructions > self.max_instructions:
                raise Livelock(f"more than {self.max_instructions} instruction steps (groups "
                               f"of lanes) without finishing: an endless loop or a spin on a "
                               f"flag nobody sets? (raise max_instructions for a big shape)\n"
                               f"{self.deadlock_report().replace('no warp can make progress', 'where the warps are')}")

    def _split_warps(self, g: Group, rng) -> None:
        """Seeded runs: move some of a lockstep group's warps into a group of their own."""
        ws = [w.index for w in g.warps]
        k = rng.randint(1, len(ws) - 1)
        moved = set(rng.sample(ws, k))
        sel = np.isin(g.idx >> 5, list(moved))
        part = g.idx[sel]
        if part.size == 0 or part.size == g.idx.size:
            return
        g.set_lanes(g.idx[~sel])
        other = Group(g.cta, g.pc, part)
        g.cta.parked.setdefault(g.pc, other)
        self.ready.append(other)

    def _run(self, g: Group, budget: int) -> None:
        code = self.prog.code
        cta = g.cta
        parked = cta.parked
        touched = cta.touched
        n = 0
        wi = 0
        try:
            while n < budget:
                c = code[g.pc]
                n += 1
                wi += g.nwarps
                wr = c.wregs
                if wr:
                    if cta.inflight:
                        asyncops.check_registers(self, g, c)
                    b = g.wbits
                    for x in wr:
                        touched[x] |= b
                k = c.kind
                if k == OP:
                    c.fn(g)
                    g.pc += 1
                elif k == BRANCH:
                    self._branch(g, c)
                elif k == WAIT:
                    res = c.fn(g)
                    if res is None:
                        g.pc += 1
                    elif res is YIELD:
                        return
                    elif not self._block(g, res):
                        return
                else:
                    if not self._exit(g, c):
                        return
                if parked:
                    o = parked.get(g.pc)
                    if o is not None and o is not g:
                        self._merge(g, o)
        except EmulatorError as e:
            raise self.with_context(e, g) from None
        finally:
            self.total_instructions += n
            self.warp_instructions += wi

    def _block(self, g: Group, res) -> bool:
        """An instruction parked lanes: all of g (a Wait), or some ((Wait, lanes), or a list of
        them); True when g goes on running (with its other lanes, past the instruction)."""
        if isinstance(res, Wait):
            g.wait = res
            if res.converge:
                self.park(g)
            return False
        parts = [res] if isinstance(res, tuple) else res
        rest = g.idx
        for wait, lanes in parts:
            rest = np.setdiff1d(rest, lanes, assume_unique=True)
            blocked = Group(g.cta, g.pc, lanes)
            blocked.wait = wait
            if wait.register is not None:
                wait.register(blocked)
            if wait.converge:
                self.park(blocked)
        if rest.size == 0:
            g.dead = True
            g.cta.groups.discard(g)
            return False
        g.set_lanes(rest)
        g.pc += 1
        return True

    def _branch(self, g: Group, c) -> None:
        if c.guard is None:
            g.pc = c.target
            return
        p = g.r[c.guard][g.L]
        if c.neg:
            p = ~p
        if p.all():
            g.pc = c.target
            return
        if not p.any():
            g.pc += 1
            return
        idx = g.idx
        if c.uni:
            wids = idx >> 5
            both = np.intersect1d(wids[p], wids[~p])
            if both.size:
                wid = int(both[0])
                sel = wids == wid
                raise SyncError(f"bra.uni diverged in warp {wid}: lanes "
                                f"{(idx[sel & p] & 31).tolist()} branch, lanes "
                                f"{(idx[sel & ~p] & 31).tolist()} fall through")
        taken, rest = idx[p], idx[~p]
        if c.target > g.pc:                 # forward: the fall-through part runs first
            g.set_lanes(rest)
            other = Group(g.cta, c.target, taken)
            g.pc += 1
        else:                               # backward (a loop): the looping part first
            g.set_lanes(taken)
            other = Group(g.cta, g.pc + 1, rest)
            g.pc = c.target
        self.park(other)

    def _exit(self, g: Group, c) -> bool:
        idx = g.idx
        if c.guard is not None:
            p = g.r[c.guard][g.L]
            if c.neg:
                p = ~p
            if not p.any():
                g.pc += 1
                return True
            leaving = idx[p]
            rest = idx[~p]
        else:
            leaving, rest = idx, idx[:0]
        cta = g.cta
        cta.alive[leaving] = False
        for wid in np.unique(leaving >> 5).tolist():
            w = cta.warps[wid]
            w.partial = True
            if not cta.alive[w.first: w.first + w.lanes].any():
                self._warp_exit(w)
        if rest.size:
            g.set_lanes(rest)
            g.pc += 1
            return True
        g.dead = True
        cta.groups.discard(g)
        return False

    def _warp_exit(self, w: Warp) -> None:
        w.done = True
        asyncops.warp_exit(self, w)
        cta = w.cta
        cta.live_warps -= 1
        syncops.warp_exited(self, cta)
        if cta.live_warps == 0:
            asyncops.cta_exit(self, cta)

    def land_loads_for(self, cta, bars) -> bool:
        """A wait on these mbarriers would fail: land the TMA loads they wait for (asyncops)."""
        return asyncops.land_loads_for(self, cta, bars)

    # ------------------------------------------------------------------------- waking
    def wake(self, g: Group) -> None:
        wait = g.wait
        if wait is None or g.dead:
            return
        g.wait = None
        if wait.resume_next:
            g.pc += 1
        self.park(g)

    # ------------------------------------------------------------------------- reports
    def where(self, g: Group | None, ins=None, lane=None, address=None) -> str:
        if ins is None and g is not None:
            ins = self.prog.code[min(g.pc, len(self.prog.code) - 1)].ins
        parts = []
        if ins is not None:
            loc = f"line {ins.line}"
            if self.source_map is not None and ins.line:
                try:
                    mapped = self.source_map(ins.line)
                except Exception:
                    mapped = None
                if mapped:
                    loc += f" ({mapped[0]}:{mapped[1]})"
            parts.append(f"{loc}, pc {ins.index}: {ins.text}")
        if g is not None:
            parts.append(g.describe())
        if lane is not None:
            parts.append(f"thread {lane} (warp {lane // WARP}, lane {lane % WARP})")
        if address is not None:
            parts.append(f"address 0x{address:x}")
        return "; ".join(parts)

    def with_context(self, e: EmulatorError, g: Group) -> EmulatorError:
        if getattr(e, "_located", False):
            return e
        lane = getattr(e, "lane", None)
        addr = getattr(e, "address", None)
        e.args = (f"{e.args[0] if e.args else e}\n    at "
                  f"{self.where(g, lane=lane, address=addr)}",)
        e._located = True
        return e

    def hazard(self, kind: str, message: str, g: Group | None = None, ins=None,
               lane=None, address=None) -> None:
        where = self.where(g, ins, lane, address)
        key = (kind, ins.index if ins is not None else None, message)
        if key in self._hazard_keys:
            return
        self._hazard_keys.add(key)
        h = Hazard(kind, message, where)
        self.hazards.append(h)
        if self.strict:
            err = HazardError([h])
            err._located = True
            raise err

    def deadlock_report(self) -> str:
        lines = ["no warp can make progress:"]
        for cta in self.ctas:
            live = sorted((g for g in cta.groups if not g.dead), key=lambda g: g.idx[0])
            if not live:
                continue
            lines.append(f"  CTA {cta.ctaid}:")
            for g in live:
                ins = self.prog.code[g.pc].ins
                what = g.wait.describe() if g.wait is not None else "nothing (runnable)"
                lines.append(f"    {g.describe()}: pc {g.pc}, line {ins.line}: {ins.text}\n"
                             f"        waits on {what}")
            for b in cta.mbar.values():
                lines.append(f"    {b.describe()}")
            for b in cta.bars:
                if b.arrived:
                    lines.append(f"    {b.describe()}")
            for op in cta.tma_loads:
                lines.append(f"    pending {op.describe()}")
        return "\n".join(lines)

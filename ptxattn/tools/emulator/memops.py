"""Loads, stores, atomics and reductions; ldmatrix/stmatrix; addressing in every state space.

Every access is checked before it happens: inside the space (a live global allocation, the
CTA's shared window past its reserved first KiB and below the dynamic size, the parameter
buffer), naturally aligned (a vector access to its whole size), not on an mbarrier's 8 bytes.
Shared accesses also feed the hazard checks (memory.py's shadow arrays): a generic store to
bytes an in-flight wgmma or TMA store reads, or that a TMA load is still writing, is a race; so
is a generic load of bytes a TMA load has not landed yet.
"""

from __future__ import annotations

import numpy as np

from . import numeric as N
from .errors import MemoryFault, Unsupported
from .memory import (PARAM_GENERIC_BASE, SHARED_GENERIC_BASE, SHARED_GENERIC_SPAN,
                     check_alignment)
from .isa import WAIT, Wait, register
from .parse import Mem, Reg, Sym, Vec

SPACES = ("global", "shared", "shared::cta", "shared::cluster", "param", "param::entry",
          "param::func", "local", "const")
U64_MASK = (1 << 64) - 1


def space_of(parts) -> str | None:
    for p in parts:
        if p in SPACES:
            return {"shared::cta": "shared", "shared::cluster": "shared",
                    "param::entry": "param", "param::func": "param"}.get(p, p)
    return None


def vector_of(parts) -> int:
    for p in parts:
        if p in ("v2", "v4", "v8"):
            return int(p[1])
    return 1


def address_reader(prog, mem: Mem, space: str | None):
    """(g, idx) -> uint64 addresses, one per lane, of a [base + offset] operand in `space`
    (None: generic)."""
    if not isinstance(mem, Mem) or mem.coords:
        raise Unsupported(f"expected an address [..], got {mem!r}")
    off = np.uint64(mem.offset & U64_MASK)
    base = mem.base
    if base is None:
        return lambda g, idx: np.full(len(idx), off, np.uint64)
    if isinstance(base, Sym):
        if space == "param":
            p = prog.params.get(base.name)
            if p is None:
                raise Unsupported(f"[{base.name}] is not a parameter")
            const = np.uint64((p.offset + mem.offset) & U64_MASK)
        elif base.name in prog.shared_addr:
            addr = prog.shared_addr[base.name] + mem.offset
            if space is None:
                addr += SHARED_GENERIC_BASE
            const = np.uint64(addr & U64_MASK)
        else:
            raise Unsupported(f"address of {base.name} in .{space}")
        return lambda g, idx: np.full(len(idx), const, np.uint64)
    if isinstance(base, Reg):
        if base.name.startswith("%") and base.name in ("%tid.x",):
            raise Unsupported("special register as an address")
        i = prog.reg(base.name)
        st = prog.reg_dtype[i]
        if st.itemsize == 8:
            if off:
                return lambda g, idx: g.r[i].view(np.uint64)[idx] + off
            return lambda g, idx: g.r[i].view(np.uint64)[idx]
        if st.itemsize == 4:
            if off:
                return lambda g, idx: g.r[i].view(np.uint32)[idx].astype(np.uint64) + off
            return lambda g, idx: g.r[i].view(np.uint32)[idx].astype(np.uint64)
        raise Unsupported(f"address register {base.name} of .{prog.reg_type[i]}")
    raise Unsupported(f"address base {base!r}")


# ----------------------------------------------------------------------------- shared memory

def _check_shared(g, act, lanes, size, what):
    smem = g.cta.smem
    bad = smem.check(act, size)
    if bad is not None:
        a = int(act[bad])
        raise MemoryFault(f"{what} of {size} bytes at shared 0x{a:x} is outside the CTA's "
                          f"shared memory (usable 0x{0x400:x}..0x{smem.window:x}: "
                          f"{smem.dyn_size} dynamic bytes from 0x{smem.dyn_base:x})",
                          int(lanes[bad]), a)
    bad = check_alignment(act, size, "shared")
    if bad is not None:
        a = int(act[bad])
        raise MemoryFault(f"misaligned {what}: {size} bytes at shared 0x{a:x}",
                          int(lanes[bad]), a)
    words = smem.words_of(act, size)
    if g.cta.mbar_words[words].any():
        j = int(np.argmax(g.cta.mbar_words[words])) // max(1, size // 4)
        a = int(act[min(j, len(act) - 1)])
        raise MemoryFault(f"generic {what} touches an mbarrier object's 8 bytes at shared "
                          f"0x{a:x} (mbarriers are accessed only through mbarrier.* and "
                          f"async units)", int(lanes[min(j, len(lanes) - 1)]), a)
    return words


def shared_load(g, lanes, act, esize: int, count: int, what="ld.shared"):
    """(lanes, count) array of uint(esize) words at shared addresses `act` (one per lane)."""
    total = esize * count
    words = _check_shared(g, act, lanes, total, what)
    smem = g.cta.smem
    if smem.tma_pending[words].any():
        j = int(np.argmax(smem.tma_pending[words] > 0)) // max(1, -(-total // 4))
        g.launch.hazard("read-before-tma-landed",
                        f"{what} reads shared memory that an issued TMA load has not written "
                        f"yet: wait on its mbarrier first", g, lane=int(lanes[j]),
                        address=int(act[j]))
    view = smem.data.view(N.UNSIGNED[esize])
    idx = (act // np.uint64(esize)).astype(np.int64)
    if count == 1:
        return view[idx][:, None]
    return view[idx[:, None] + np.arange(count)]


def shared_store(g, lanes, act, values, esize: int, what="st.shared"):
    """values: (lanes, count) of uint(esize), stored at shared addresses `act`."""
    count = values.shape[1]
    total = esize * count
    words = _check_shared(g, act, lanes, total, what)
    note_generic_write(g, words, lanes, total, act, what)
    view = g.cta.smem.data.view(N.UNSIGNED[esize])
    idx = (act // np.uint64(esize)).astype(np.int64)
    view[idx[:, None] + np.arange(count)] = values


def note_generic_write(g, words, lanes, total, act, what):
    smem = g.cta.smem
    per = max(1, -(-total // 4))
    if smem.async_readers[words].any():
        j = int(np.argmax(smem.async_readers[words] > 0)) // per
        g.launch.hazard("write-during-async-read",
                        f"{what} writes shared memory that an in-flight asynchronous read "
                        f"(a wgmma operand, or a TMA store's source) has not finished with",
                        g, lane=int(lanes[j]), address=int(act[j]))
    if smem.tma_pending[words].any():
        j = int(np.argmax(smem.tma_pending[words] > 0)) // per
        g.launch.hazard("write-during-tma-load",
                        f"{what} writes shared memory that an issued TMA load will overwrite",
                        g, lane=int(lanes[j]), address=int(act[j]))
    tids = np.repeat(lanes.astype(np.int32) + 1, per) if per > 1 else lanes.astype(np.int32) + 1
    smem.unfenced[words] = tids
    g.cta.unfenced.append((words, tids))


# ----------------------------------------------------------------------------- global memory

def _global_locate(g, lanes, act, total: int, what: str):
    """The allocation (or per-lane (allocation, offset) pairs) of `total` bytes at each address,
    after the alignment check: a misaligned or out-of-allocation access is a MemoryFault."""
    bad = check_alignment(act, total, "global")
    if bad is not None:
        raise MemoryFault(f"misaligned {what}: {total} bytes at 0x{int(act[bad]):x}",
                          int(lanes[bad]), int(act[bad]))
    try:
        return g.launch.gmem.locate(act, total, lanes)
    except MemoryFault as e:
        e.args = (f"{what}: {e}",)
        raise


def global_gather(g, lanes, act, esize: int, count: int, what="ld.global"):
    alloc, offs = _global_locate(g, lanes, act, esize * count, what)
    dt = N.UNSIGNED[esize]
    if alloc is not None:
        view = alloc.data.view(dt)
        idx = offs // esize
        return view[idx[:, None] + np.arange(count)]
    out = np.empty((len(act), count), dt)
    for j, (a, off) in enumerate(offs):
        out[j] = a.data.view(dt)[off // esize: off // esize + count]
    return out


def global_scatter(g, lanes, act, values, esize: int, what="st.global"):
    count = values.shape[1]
    alloc, offs = _global_locate(g, lanes, act, esize * count, what)
    dt = N.UNSIGNED[esize]
    if alloc is not None:
        view = alloc.data.view(dt)
        idx = offs // esize
        view[idx[:, None] + np.arange(count)] = values
        return
    for j, (a, off) in enumerate(offs):
        a.data.view(dt)[off // esize: off // esize + count] = values[j]


def param_gather(g, lanes, act, esize: int, count: int, what="ld.param"):
    total = esize * count
    limit = g.launch.prog.fn.param_bytes
    bad = (act + np.uint64(total)) > np.uint64(limit)
    if bad.any():
        j = int(np.argmax(bad))
        raise MemoryFault(f"{what} of {total} bytes at parameter offset {int(act[j])} past the "
                          f"{limit} parameter bytes", int(lanes[j]), int(act[j]))
    bad = check_alignment(act, min(total, 8), "param")
    if bad is not None:
        raise MemoryFault(f"misaligned {what} at parameter offset {int(act[bad])}",
                          int(lanes[bad]), int(act[bad]))
    buf = g.launch.params
    idx = act.astype(np.int64)[:, None] + np.arange(total)
    return buf[idx].reshape(len(act), -1).copy().view(N.UNSIGNED[esize])


def _split_generic(addrs, lanes):
    """'shared' / 'param' / 'global' for the active lanes' generic addresses (one space)."""
    sh = (addrs >= np.uint64(SHARED_GENERIC_BASE)) & \
        (addrs < np.uint64(SHARED_GENERIC_BASE + SHARED_GENERIC_SPAN))
    pa = (addrs >= np.uint64(PARAM_GENERIC_BASE)) & \
        (addrs < np.uint64(PARAM_GENERIC_BASE + (1 << 20)))
    kinds = set()
    if sh.any():
        kinds.add("shared")
    if pa.any():
        kinds.add("param")
    if (~(sh | pa)).any():
        kinds.add("global")
    if len(kinds) != 1:
        raise Unsupported(f"one generic access spanning the {sorted(kinds)} spaces")
    return kinds.pop()


# ----------------------------------------------------------------------------- ld / st

def _without_cache_policy(ins) -> tuple:
    """The operands less a trailing cache-policy operand (.L2::cache_hint): a hint only."""
    if "L2::cache_hint" in ins.parts:
        return ins.operands[:-1]
    return ins.operands


def _value_type(t: str) -> tuple[int, np.dtype]:
    dt = N.DTYPE[t]
    return dt.itemsize, dt


def resolve_space(space, addrs, lanes):
    """(space, addresses in it) for an access; a generic address is classified by window."""
    if space is not None:
        return space, addrs
    sp = _split_generic(addrs, lanes)
    if sp == "shared":
        return sp, addrs - np.uint64(SHARED_GENERIC_BASE)
    if sp == "param":
        return sp, addrs - np.uint64(PARAM_GENERIC_BASE)
    return sp, addrs


@register("ld", "ldu")
def _ld(prog, ins):
    d, a = _without_cache_policy(ins)
    space = space_of(ins.parts)
    t = ins.parts[-1]
    if t not in N.DTYPE or t == "pred":
        raise Unsupported(f"ld of .{t}")
    count = vector_of(ins.parts)
    esize, dt = _value_type(t)
    dsts = d.items if isinstance(d, Vec) else (d,)
    if len(dsts) != count:
        raise Unsupported(f"{ins.opcode} with {len(dsts)} destinations")
    writers = [prog.writer(x, t) for x in dsts]
    addr = address_reader(prog, a, space)
    what = ins.opcode

    def load(g, idx):
        sp, addrs = resolve_space(space, addr(g, idx), idx)
        if sp == "shared":
            raw = shared_load(g, idx, addrs, esize, count, what)
        elif sp == "global" or sp == "const":
            raw = global_gather(g, idx, addrs, esize, count, what)
        elif sp == "param":
            raw = param_gather(g, idx, addrs, esize, count, what)
        else:
            raise Unsupported(f"ld from .{sp}")
        for j, write in enumerate(writers):
            write(g, idx, raw[:, j].view(dt))
    return prog.wrap(ins, load, prog.regs_of(d, a))


@register("st")
def _st(prog, ins):
    a, v = _without_cache_policy(ins)
    space = space_of(ins.parts)
    t = ins.parts[-1]
    if t not in N.DTYPE or t == "pred":
        raise Unsupported(f"st of .{t}")
    count = vector_of(ins.parts)
    esize, dt = _value_type(t)
    srcs = v.items if isinstance(v, Vec) else (v,)
    if len(srcs) != count:
        raise Unsupported(f"{ins.opcode} with {len(srcs)} sources")
    readers = [prog.reader(x, t) for x in srcs]
    addr = address_reader(prog, a, space)
    what = ins.opcode
    ut = N.UNSIGNED[esize]

    def store(g, idx):
        sp, addrs = resolve_space(space, addr(g, idx), idx)
        vals = np.stack([np.ascontiguousarray(r(g, idx)).view(ut) for r in readers], axis=1)
        if sp == "shared":
            shared_store(g, idx, addrs, vals, esize, what)
        elif sp == "global":
            global_scatter(g, idx, addrs, vals, esize, what)
        else:
            raise Unsupported(f"st to .{sp}")
    return prog.wrap(ins, store, prog.regs_of(a, v), writes=())


# ----------------------------------------------------------------------------- atomics

ATOM_OPS = ("add", "min", "max", "inc", "dec", "and", "or", "xor", "exch", "cas")


def _atom_apply(op: str, old, b, c, t: str):
    dt = N.DTYPE[t]
    if op == "add":
        return (old + b).astype(dt)
    if op == "min":
        return np.minimum(old, b) if dt.kind != "f" else np.fmin(old, b)
    if op == "max":
        return np.maximum(old, b) if dt.kind != "f" else np.fmax(old, b)
    if op == "inc":
        return dt.type(0) if old >= b else (old + dt.type(1)).astype(dt)
    if op == "dec":
        return b if (old == 0 or old > b) else (old - dt.type(1)).astype(dt)
    if op == "and":
        return old & b
    if op == "or":
        return old | b
    if op == "xor":
        return old ^ b
    if op == "exch":
        return b
    if op == "cas":
        return c if old == b else old
    raise Unsupported(f"atomic .{op}")


def _atomic(prog, ins, returns: bool):
    ops = _without_cache_policy(ins)
    if returns:
        d, a, rest = ops[0], ops[1], ops[2:]
    else:
        d, a, rest = None, ops[0], ops[1:]
    space = space_of(ins.parts)
    op = next((p for p in ins.parts[1:] if p in ATOM_OPS), None)
    if op is None:
        raise Unsupported(f"{ins.opcode}: no operation")
    if vector_of(ins.parts) != 1:
        return _vector_red(prog, ins, a, rest, op, space)
    t = ins.parts[-1]
    if t not in N.DTYPE:
        raise Unsupported(f"{ins.opcode}")
    if t in ("f16", "bf16", "f16x2", "bf16x2"):
        raise Unsupported(f"{ins.opcode}: half-precision atomics")
    esize, dt = _value_type(t)
    ut = N.UNSIGNED[esize]
    rb = prog.reader(rest[0], t)
    rc = prog.reader(rest[1], t) if len(rest) > 1 else None
    addr = address_reader(prog, a, space)
    write = prog.writer(d, t) if d is not None else None

    def atomic(g, idx):
        sp, addrs = resolve_space(space, addr(g, idx), idx)
        b = rb(g, idx)
        c = rc(g, idx) if rc is not None else None
        result = np.zeros(len(idx), dt)
        # one lane at a time, in lane order: lanes hitting one address see each other
        for j in range(len(idx)):
            one, at = idx[j:j + 1], addrs[j:j + 1]
            if sp == "shared":
                old = shared_load(g, one, at, esize, 1, ins.op).view(dt)[0, 0]
            else:
                old = global_gather(g, one, at, esize, 1, ins.op).view(dt)[0, 0]
            new = _atom_apply(op, old, b[j], None if c is None else c[j], t)
            val = np.array([[new]], dt).view(ut)
            if sp == "shared":
                shared_store(g, one, at, val, esize, ins.op)
            else:
                global_scatter(g, one, at, val, esize, ins.op)
            result[j] = old
        if write is not None:
            write(g, idx, result)
    return prog.wrap(ins, atomic, prog.regs_of(*ops))


def _vector_red(prog, ins, a, rest, op, space):
    """red/atom .v2/.v4/.v8 .f32 add/min/max (no return value)."""
    if op not in ("add", "min", "max") or not isinstance(rest[0], Vec):
        raise Unsupported(f"{ins.opcode}")
    t = ins.parts[-1]
    if t != "f32":
        raise Unsupported(f"{ins.opcode}: vector reductions of .{t}")
    srcs = rest[0].items
    readers = [prog.reader(x, t) for x in srcs]
    addr = address_reader(prog, a, space)
    count = len(srcs)

    def red(g, idx):
        sp, addrs = resolve_space(space, addr(g, idx), idx)
        if sp != "global":
            raise Unsupported(f"vector {ins.op} to .{sp}")
        vals = np.stack([r(g, idx) for r in readers], axis=1).astype(np.float32)
        for j in range(len(idx)):
            one, at = idx[j:j + 1], addrs[j:j + 1]
            old = global_gather(g, one, at, 4, count, ins.op).view(np.float32)[0]
            new = {"add": old + vals[j], "min": np.fmin(old, vals[j]),
                   "max": np.fmax(old, vals[j])}[op]
            global_scatter(g, one, at, new.astype(np.float32).view(np.uint32)[None, :], 4,
                           ins.op)
    return prog.wrap(ins, red, prog.regs_of(a, *rest))


@register("atom")
def _atom(prog, ins):
    return _atomic(prog, ins, returns=True)


@register("red")
def _red(prog, ins):
    return _atomic(prog, ins, returns=False)


# ----------------------------------------------------------------------------- matrices

def _matrix_shape(ins, vec) -> tuple[int, bool]:
    """(matrices, transposed) of an ldmatrix/stmatrix .m8n8 .b16, with one register each."""
    if "m8n8" not in ins.parts or ins.parts[-1] != "b16":
        raise Unsupported(f"{ins.opcode}")
    num = next((int(p[1]) for p in ins.parts if p in ("x1", "x2", "x4")), None)
    if num is None:
        raise Unsupported("ldmatrix/stmatrix without .x1/.x2/.x4")
    if not isinstance(vec, Vec) or len(vec.items) != num:
        raise Unsupported(f"{ins.opcode} needs {num} registers")
    return num, "trans" in ins.parts


def whole_warps(g, idx, what):
    """The warps of lanes idx, each of which must be all there (.sync.aligned); None when some
    warp's other lanes are elsewhere and the group should wait for them to converge."""
    from .errors import SyncError
    cta = g.cta
    if g.whole and len(idx) == g.idx.size:
        return g.warps
    wids = np.unique(idx >> 5)
    warps = []
    for wid in wids.tolist():
        w = cta.warps[wid]
        mine = idx[(idx >> 5) == wid]
        if mine.size != w.lanes:
            alive = cta.alive[w.first:w.first + w.lanes]
            if not alive.all():
                raise SyncError(f"{what} is .sync.aligned: all 32 lanes of warp {wid} must "
                                f"execute it, but lanes "
                                f"{np.flatnonzero(~alive).tolist()} have exited")
            if len(idx) != g.idx.size:
                raise SyncError(f"{what} is .sync.aligned: all 32 lanes of warp {wid} must "
                                f"execute it (a guard predicate left out lanes "
                                f"{sorted(set(range(32)) - set((mine & 31).tolist()))})")
            return None
        warps.append(w)
    return warps


@register("stmatrix")
def _stmatrix(prog, ins):
    a, v = ins.operands
    num, trans = _matrix_shape(ins, v)
    readers = [prog.reader(x, "b32") for x in v.items]
    addr = address_reader(prog, a, "shared")

    def stmatrix(g, idx):
        warps = whole_warps(g, idx, "stmatrix")
        if warps is None:
            return converge_wait(g, "stmatrix")
        addrs = addr(g, idx)
        regs = [r(g, idx) for r in readers]
        nw = len(warps)
        rows, row_addr = [], []
        for k in range(nw):
            lanes = slice(32 * k, 32 * k + 32)
            for i in range(num):
                reg = regs[i][lanes]
                halves = np.stack([reg & np.uint32(0xFFFF), reg >> np.uint32(16)], axis=1) \
                    .astype(np.uint16)
                mat = halves.reshape(8, 8)          # element (l // 4, 2 * (l % 4) + h)
                rows.append(mat.T if trans else mat)
                row_addr.append(addrs[32 * k + 8 * i: 32 * k + 8 * i + 8])
        data = np.ascontiguousarray(np.concatenate(rows)).view(np.uint64).reshape(-1, 2)
        rowa = np.concatenate(row_addr)
        threads = np.concatenate([idx[32 * k + 8 * i: 32 * k + 8 * i + 8]
                                  for k in range(nw) for i in range(num)])
        shared_store(g, threads, rowa, data, 8, "stmatrix")
    return prog.wrap(ins, stmatrix, prog.regs_of(a, v), kind=WAIT, writes=())


@register("ldmatrix")
def _ldmatrix(prog, ins):
    d, a = ins.operands
    num, trans = _matrix_shape(ins, d)
    writers = [prog.writer(x, "b32") for x in d.items]
    addr = address_reader(prog, a, "shared")

    def ldmatrix(g, idx):
        warps = whole_warps(g, idx, "ldmatrix")
        if warps is None:
            return converge_wait(g, "ldmatrix")
        addrs = addr(g, idx)
        out = [np.zeros(len(idx), np.uint32) for _ in range(num)]
        for k in range(len(warps)):
            sel = slice(32 * k + 0, 32 * k + 8 * num)
            raw = shared_load(g, idx[sel], addrs[sel], 8, 2, "ldmatrix")  # (8*num, 2) rows
            for i in range(num):
                mat = raw[8 * i: 8 * i + 8].view(np.uint16).reshape(8, 8)
                if trans:
                    mat = mat.T
                halves = np.ascontiguousarray(mat).reshape(32, 2).astype(np.uint32)
                out[i][32 * k: 32 * k + 32] = halves[:, 0] | (halves[:, 1] << np.uint32(16))
        for i in range(num):
            writers[i](g, idx, out[i])
    return prog.wrap(ins, ldmatrix, prog.regs_of(d, a), kind=WAIT)


def converge_wait(g, what):
    """Park the group at this collective until the rest of its warps' lanes arrive."""
    pc = g.pc

    def describe():
        return (f"the other lanes of its warps to reach the {what} at pc {pc} (a collective "
                f"needs the warp converged)")
    return Wait(describe, converge=True)

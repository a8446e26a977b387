"""The asynchronous units: TMA (cp.async.bulk.tensor loads, stores, reductions; plain bulk
copies) and the warpgroup tensor cores (wgmma), modelled strictly enough to catch real races.

TMA load: at issue, the destination bytes are marked pending; the data is read from global and
written to shared memory, and its bytes completed on the mbarrier, at a deferred point: when a
warp waits on that mbarrier and its expect_tx covers the bytes (or, with a seed, at random
points; or when nothing else can run). Never at issue. A load into bytes an in-flight wgmma or
TMA store still reads, or into bytes another load is still writing, is a hazard.

TMA store / reduce: at issue the source bytes must be fenced (fence.proxy.async after the
generic stores that wrote them), else a hazard; they are read, and global memory written, at
cp.async.bulk.wait_group(.read) (or earlier with a seed); a generic write to them before that
is a hazard. Elements outside the tensor are not written.

wgmma.mma_async: at issue the descriptors, the scale-d predicate and the operand footprint are
taken; the shared operands and A registers are read, and the accumulators written, when
wgmma.wait_group retires the group (default) or earlier at random with a seed. Between issue
and retire: a write to the operand bytes, any access to its accumulator or A registers by another
instruction, or a TMA load into its operands is a hazard. A wgmma whose registers were touched
since the last wgmma.fence, or whose shared operands hold unfenced generic stores or a TMA load
not yet landed, is a hazard at issue.

wgmma math: descriptors decoded per the PTX ISA (start address, LBO, SBO, base offset 0 only,
swizzle none/32B/64B/128B), K-major and MN-major canonical layouts for 16-bit types (K-major
only for 8-bit and tf32, as the ISA requires), register fragments of A (RS) and D per warp
(warp w of the warpgroup owns rows 16w..16w+15). Products are exact, sums in float64 and the
accumulator rounded to float32 once per instruction (the tensor core's internal rounding of its
partial sums is not modelled).
"""

from __future__ import annotations

import functools

import numpy as np

from . import numeric as N
from .errors import MemoryFault, SyncError, Unsupported
from .isa import WAIT, YIELD, Code, register, yield_once
from .memops import address_reader, converge_wait, whole_warps
from .memory import PARAM_GENERIC_BASE
from .parse import Imm, Mem, Vec
from .syncops import barrier_at, complete_tx
from .tensormap import SWIZZLE_BYTES, TensorMap, box_offsets, swizzle_addresses


# ============================================================================= TMA

def read_tensor_map(g, gaddr: int, lane: int) -> TensorMap:
    launch = g.launch
    if gaddr % 64:
        raise MemoryFault(f"tensor map at 0x{gaddr:x} is not 64-byte aligned", lane, gaddr)
    if PARAM_GENERIC_BASE <= gaddr < PARAM_GENERIC_BASE + launch.params.size:
        off = gaddr - PARAM_GENERIC_BASE
        if off + 128 > launch.params.size:
            raise MemoryFault(f"tensor map at parameter offset {off} runs past the parameters",
                              lane, gaddr)
        raw = launch.params[off:off + 128]
    else:
        a = launch.gmem.find(gaddr)
        if a is None or gaddr + 128 > a.end:
            raise MemoryFault(f"tensor map address 0x{gaddr:x} is neither in parameter space "
                              f"(cvta.param) nor in a global allocation", lane, gaddr)
        raw = a.data[gaddr - a.base: gaddr - a.base + 128]
    words = raw.copy().view(np.uint64)
    tm = TensorMap.decode(words)
    if tm is None:
        raise MemoryFault(f"the 128 bytes at 0x{gaddr:x} are not a tensor map made by "
                          f"cuTensorMapEncodeTiled (or were changed since)", lane, gaddr)
    return tm


class TmaLoad:
    __slots__ = ("cta", "warp", "ins", "tmap", "coords", "dst", "bar", "nbytes", "words",
                 "order")

    def describe(self) -> str:
        return (f"TMA load (line {self.ins.line}) of {self.nbytes} bytes into shared "
                f"0x{self.dst:x}, coordinates {tuple(self.coords)}, completing on the mbarrier "
                f"at 0x{self.bar.addr:x}")


class TmaStore:
    __slots__ = ("warp", "ins", "tmap", "coords", "src", "nbytes", "words", "reduce")


_order = [0]


def _words_range(start: int, nbytes: int) -> np.ndarray:
    return np.arange(start // 4, (start + nbytes + 3) // 4, dtype=np.int64)


def _check_smem_range(g, addr: int, nbytes: int, lane: int, what: str, align: int,
                      cta=None) -> None:
    cta = cta or g.cta
    smem = cta.smem
    if addr % align:
        raise MemoryFault(f"{what}: shared address 0x{addr:x} is not {align}-byte aligned",
                          lane, addr)
    if addr < 1024 or addr + nbytes > smem.window:
        raise MemoryFault(f"{what}: {nbytes} bytes at shared 0x{addr:x} leave the CTA's shared "
                          f"memory (0x400..0x{smem.window:x})", lane, addr)
    if cta.mbar_words[addr // 4: (addr + nbytes + 3) // 4].any():
        raise MemoryFault(f"{what}: the {nbytes} bytes at shared 0x{addr:x} overlap an "
                          f"mbarrier object", lane, addr)


def _tensor_operand(prog, op):
    if not isinstance(op, Mem) or not op.coords:
        raise Unsupported("expected a tensor operand [tmap, {coordinates}]")
    rmap = address_reader(prog, Mem(op.base, op.offset), None)
    rcoords = [prog.reader(c, "s32") for c in op.coords]
    return rmap, rcoords


def _cp_async_bulk_tensor(prog, ins):
    parts = ins.parts
    dims = next((p for p in parts if p.endswith("d") and p[:-1].isdigit()), None)
    if dims is None:
        raise Unsupported(f"{ins.opcode}: no dimension qualifier")
    mode = next((p for p in parts if p in ("tile", "im2col", "im2col_no_offs", "tile::gather4",
                                           "tile::scatter4")), "tile")
    if mode != "tile":
        raise Unsupported(f"{ins.opcode}: .{mode} mode")
    multicast = "multicast::cluster" in parts
    if any(p.startswith("multicast") for p in parts) and not multicast or \
            "cta_group::1" in parts:
        raise Unsupported(f"{ins.opcode}: {'.cta_group::1' if multicast else 'multicast'}")
    is_reduce = ins.op == "cp" and parts[1] == "reduce"
    load = "mbarrier::complete_tx::bytes" in parts
    ops = ins.operands
    if "L2::cache_hint" in parts:
        ops = ops[:-1]                      # the cache policy: a hint, no effect here
    if load:
        if len(ops) != 3 + multicast:
            raise Unsupported(f"{ins.opcode} with {len(ops)} operands")
        rdst = address_reader(prog, ops[0], "shared")
        rmap, rcoords = _tensor_operand(prog, ops[1])
        rbar = address_reader(prog, ops[2], "shared")
        rmask = prog.reader(ops[3], "u16") if multicast else None
        return prog.wrap(ins, _tma_load_fn(ins, rdst, rmap, rcoords, rbar, rmask),
                         prog.regs_of(*ops))
    if multicast:
        raise Unsupported(f"{ins.opcode}: multicast of a store")
    if "bulk_group" not in parts:
        raise Unsupported(f"{ins.opcode}")
    if len(ops) != 2:
        raise Unsupported(f"{ins.opcode} with {len(ops)} operands")
    rmap, rcoords = _tensor_operand(prog, ops[0])
    rsrc = address_reader(prog, ops[1], "shared")
    red = None
    if is_reduce:
        red = next((p for p in parts if p in ("add", "min", "max", "inc", "dec", "and", "or",
                                              "xor")), None)
        if red not in ("add", "min", "max"):
            raise Unsupported(f"{ins.opcode}: reduction .{red}")
    return prog.wrap(ins, _tma_store_fn(ins, rmap, rcoords, rsrc, red), prog.regs_of(*ops))


def _tma_load_fn(ins, rdst, rmap, rcoords, rbar, rmask=None):
    """A TMA load; with rmask (.multicast::cluster), one load a CTA of the mask (cluster.py:
    the same data, offsets and mbarrier offset in each)."""
    def issue(g, idx):
        dsts, maps, bars = rdst(g, idx), rmap(g, idx), rbar(g, idx)
        coords = [r(g, idx) for r in rcoords]
        masks = rmask(g, idx) if rmask is not None else None
        for j in range(len(idx)):
            lane = int(idx[j])
            tm = read_tensor_map(g, int(maps[j]), lane)
            if len(coords) != tm.rank:
                raise SyncError(f"{len(coords)} coordinates for a rank-{tm.rank} tensor map")
            if masks is None:
                targets = [g.cta]
            else:
                from .cluster import peers
                targets = peers(g, int(masks[j]), ins.opcode)
                g.launch.multicast_count += 1
            for cta in targets:
                _enqueue_load(g, ins, cta, tm, [int(c[j]) for c in coords], int(dsts[j]),
                              int(bars[j]), lane)
    return issue


def _enqueue_load(g, ins, cta, tm, coords, dst, bar, lane) -> None:
    """One TMA load into `cta` (g's own, or a peer of its cluster), issued by group g."""
    smem = cta.smem
    op = TmaLoad()
    op.cta, op.warp, op.ins, op.tmap = cta, g, ins, tm
    op.coords = coords
    op.dst = dst
    op.nbytes = tm.box_bytes
    _check_smem_range(g, op.dst, op.nbytes, lane, "TMA load destination", 128, cta)
    b = cta.mbar.get(bar) if cta is not g.cta else None
    op.bar = b or barrier_at(g, bar, "cp.async.bulk.tensor (its mbarrier)")
    if cta is not g.cta and b is None:
        raise SyncError(f"{ins.opcode}: no initialised mbarrier at shared 0x{bar:x} in "
                        f"CTA {cta.ctaid} (a multicast before the peer's init?)")
    op.words = _words_range(op.dst, op.nbytes)
    if smem.async_readers[op.words].any():
        g.launch.hazard("tma-overwrite-in-flight-read",
                        f"TMA load into shared 0x{op.dst:x}..0x{op.dst + op.nbytes:x} "
                        f"while an issued wgmma or TMA store still reads those bytes "
                        f"(a buffer refilled before its consumers released it?)",
                        g, ins, lane, op.dst)
    if smem.tma_pending[op.words].any():
        g.launch.hazard("tma-overlapping-loads",
                        f"TMA load into shared 0x{op.dst:x} overlaps another TMA load "
                        f"that has not landed", g, ins, lane, op.dst)
    smem.tma_pending[op.words] += 1
    _order[0] += 1
    op.order = _order[0]
    cta.tma_loads.append(op)
    g.launch.tma_count += 1


def land(launch, op: TmaLoad) -> None:
    """Perform a TMA load: global -> shared (OOB zero/NaN fill, swizzle), then complete_tx."""
    cta, tm = op.cta, op.tmap
    cta.tma_loads.remove(op)
    smem = cta.smem
    offs, ok = box_offsets(tm, op.coords)
    es = tm.element_bytes
    elems = np.zeros(offs.size, N.UNSIGNED[es])
    if tm.oob_fill == "NAN_REQUEST_ZERO_FMA":
        nan = {2: 0x7FFF, 4: 0x7FFFFFFF, 8: 0x7FF8000000000000}[es]
        if tm.dtype == "BFLOAT16":
            nan = 0x7FF7      # what the H200 writes (tests/test_gpu_emulator_parity.py, tma-box)
        elif tm.dtype == "FLOAT16":
            nan = 0x7E00
        elems[:] = nan
    if ok.any():
        addrs = np.uint64(tm.address) + offs[ok].astype(np.uint64)
        lo, hi = int(addrs.min()), int(addrs.max()) + es
        a = launch.gmem.find(lo)
        if a is None or hi > a.end:
            raise MemoryFault(
                f"TMA load (line {op.ins.line}, coordinates {tuple(op.coords)}) reads global "
                f"0x{lo:x}..0x{hi:x}, outside the allocation its tensor map names "
                f"({launch.gmem.describe(lo if a is None else hi - 1)}); {tm.describe()}",
                None, lo)
        view = a.data.view(N.UNSIGNED[es])
        elems[ok] = view[((addrs - np.uint64(a.base)) // np.uint64(es)).astype(np.int64)]
    raw = elems.view(np.uint8)
    _write_box(smem, op.dst, raw, tm.swizzle)
    smem.tma_pending[op.words] -= 1
    smem.unfenced[op.words] = 0                  # the async proxy wrote these bytes
    if smem.async_readers[op.words].any():
        launch.hazard("tma-overwrite-in-flight-read",
                      f"TMA load (issued at line {op.ins.line}) landed in shared "
                      f"0x{op.dst:x}..0x{op.dst + op.nbytes:x} while an issued wgmma or TMA "
                      f"store still reads those bytes", op.warp, op.ins, None, op.dst)
    complete_tx(launch, op.bar, op.nbytes, f"TMA load (line {op.ins.line})")


def _write_box(smem, dst: int, raw: np.ndarray, swizzle: str) -> None:
    if not SWIZZLE_BYTES[swizzle]:
        smem.data[dst:dst + raw.size] = raw
        return
    chunks = raw.reshape(-1, 16)
    addrs = dst + 16 * np.arange(chunks.shape[0], dtype=np.int64)
    sw = swizzle_addresses(addrs, swizzle)
    smem.data[(sw[:, None] + np.arange(16)).reshape(-1)] = chunks.reshape(-1)


def _read_box(smem, src: int, nbytes: int, swizzle: str) -> np.ndarray:
    if not SWIZZLE_BYTES[swizzle]:
        return smem.data[src:src + nbytes].copy()
    addrs = src + 16 * np.arange(nbytes // 16, dtype=np.int64)
    sw = swizzle_addresses(addrs, swizzle)
    return smem.data[(sw[:, None] + np.arange(16)).reshape(-1)].copy()


def land_loads_for(launch, cta, bars) -> bool:
    """A warp waits on `bars`: land the loads that complete on them and whose bytes an
    expect_tx has announced (issue order). With a seed, sometimes defer them further."""
    if launch.rng is not None and launch.rng.random() < 0.3:
        return False
    landed = False
    for op in list(cta.tma_loads):
        if op.bar in bars and op.bar.tx >= op.nbytes:
            land(launch, op)
            landed = True
    return landed


def progress(launch, everything: bool) -> bool:
    """Deferred asynchronous work. everything=True (no warp can run): land every pending TMA
    load (announced ones first). Otherwise (seeded runs, at random points): land one announced
    load, retire one warp's oldest wgmma group, or read one TMA store's source."""
    pending = [op for cta in launch.ctas for op in cta.tma_loads]
    if everything:
        if not pending:
            return False
        ready = [op for op in pending if op.bar.tx >= op.nbytes]
        for op in sorted(ready or pending, key=lambda o: o.order):
            if op in op.cta.tma_loads:
                land(launch, op)
        return True
    rng = launch.rng
    choice = rng.random()
    if choice < 0.5:
        ready = [op for op in pending if op.bar.tx >= op.nbytes]
        if ready:
            land(launch, rng.choice(ready))
            return True
    elif choice < 0.8:
        warps = [w for cta in launch.ctas for w in cta.warps if w.wg_groups and not w.done]
        if warps:
            w = rng.choice(warps)
            for op in w.wg_groups[0]:
                if not op.retired:
                    retire(launch, op)
            return True
    else:
        warps = [w for cta in launch.ctas for w in cta.warps if w.bulk_groups and not w.done]
        if warps:
            w = rng.choice(warps)
            for st in w.bulk_groups.pop(0):
                perform_store(launch, st)
            return True
    return False


def _tma_store_fn(ins, rmap, rcoords, rsrc, red):
    def issue(g, idx):
        maps, srcs = rmap(g, idx), rsrc(g, idx)
        coords = [r(g, idx) for r in rcoords]
        smem = g.cta.smem
        for j in range(len(idx)):
            lane = int(idx[j])
            tm = read_tensor_map(g, int(maps[j]), lane)
            if len(coords) != tm.rank:
                raise SyncError(f"{len(coords)} coordinates for a rank-{tm.rank} tensor map")
            st = TmaStore()
            st.warp = g.cta.warps[lane >> 5]
            st.ins, st.tmap = ins, tm
            st.coords = [int(c[j]) for c in coords]
            st.src = int(srcs[j])
            st.nbytes = tm.box_bytes
            st.reduce = red
            _check_smem_range(g, st.src, st.nbytes, lane, "TMA store source", 128)
            st.words = _words_range(st.src, st.nbytes)
            _async_read_checks(g, ins, lane, st.src, st.words, "TMA store")
            smem.async_readers[st.words] += 1
            st.warp.bulk_open.append(st)
            g.launch.tma_count += 1
    return issue


def _async_read_checks(g, ins, lane, addr, words, what) -> None:
    smem = g.cta.smem
    lo, hi = int(words[0]), int(words[-1]) + 1        # words are sorted: a quick look first
    if not smem.unfenced[lo:hi].any() and not smem.tma_pending[lo:hi].any():
        return
    unf = smem.unfenced[words]
    if unf.any():
        j = int(np.argmax(unf != 0))
        writer = int(unf[j]) - 1
        g.launch.hazard("unfenced-async-read",
                        f"{what} reads shared 0x{int(words[j]) * 4:x}, written by thread "
                        f"{writer} through the generic proxy (st.shared/stmatrix) with no "
                        f"fence.proxy.async since: the async proxy may not see that write",
                        g, ins, lane, addr)
    if smem.tma_pending[words].any():
        j = int(np.argmax(smem.tma_pending[words] > 0))
        g.launch.hazard("read-before-tma-landed",
                        f"{what} reads shared 0x{int(words[j]) * 4:x}, which an issued TMA load "
                        f"has not written yet (its mbarrier was not waited on)",
                        g, ins, lane, addr)


def perform_store(launch, st: TmaStore) -> None:
    smem = st.warp.cta.smem
    tm = st.tmap
    raw = _read_box(smem, st.src, st.nbytes, tm.swizzle)
    smem.async_readers[st.words] -= 1
    offs, ok = box_offsets(tm, st.coords)
    if not ok.any():
        return
    es = tm.element_bytes
    vals = raw.view(N.UNSIGNED[es])[ok]
    addrs = np.uint64(tm.address) + offs[ok].astype(np.uint64)
    lo, hi = int(addrs.min()), int(addrs.max()) + es
    a = launch.gmem.find(lo)
    if a is None or hi > a.end:
        raise MemoryFault(f"TMA store (line {st.ins.line}, coordinates {tuple(st.coords)}) "
                          f"writes global 0x{lo:x}..0x{hi:x}, outside the allocation of its "
                          f"tensor map; {tm.describe()}", None, lo)
    view = a.data.view(N.UNSIGNED[es])
    idx = ((addrs - np.uint64(a.base)) // np.uint64(es)).astype(np.int64)
    if st.reduce is None:
        view[idx] = vals
        return
    fdt = {"FLOAT32": np.float32, "FLOAT16": np.float16, "FLOAT64": np.float64,
           "UINT32": np.uint32, "INT32": np.int32, "UINT64": np.uint64,
           "INT64": np.int64}.get(tm.dtype)
    if tm.dtype == "BFLOAT16":
        old = N.bf16_bits_to_f32(view[idx])
        new = N.bf16_bits_to_f32(vals)
        res = {"add": old + new, "min": np.fmin(old, new), "max": np.fmax(old, new)}[st.reduce]
        view[idx] = N.f32_to_bf16_bits(res)
        return
    if fdt is None:
        raise Unsupported(f"TMA reduction on {tm.dtype}")
    old = view[idx].view(fdt)
    new = vals.view(fdt)
    if np.dtype(fdt).kind == "f":
        res = {"add": old + new, "min": np.fmin(old, new), "max": np.fmax(old, new)}[st.reduce]
    else:
        res = {"add": old + new, "min": np.minimum(old, new),
               "max": np.maximum(old, new)}[st.reduce]
    view[idx] = res.astype(fdt).view(N.UNSIGNED[es])


def _bulk_copy(prog, ins):
    """cp.async.bulk (non-tensor): shared <- global with complete_tx."""
    parts = ins.parts
    ops = ins.operands
    if "mbarrier::complete_tx::bytes" in parts:
        rdst = address_reader(prog, ops[0], "shared")
        rsrc = address_reader(prog, ops[1], "global")
        rsize = prog.reader(ops[2], "u32")
        rbar = address_reader(prog, ops[3], "shared")

        def issue(g, idx):
            sizes, srcs, dsts, bars = rsize(g, idx), rsrc(g, idx), rdst(g, idx), rbar(g, idx)
            for j in range(len(idx)):
                lane = int(idx[j])
                n = int(sizes[j])
                if n % 16:
                    raise MemoryFault(f"cp.async.bulk size {n} is not a multiple of 16", lane)
                op = TmaLoad()
                op.cta, op.warp, op.ins = g.cta, g, ins
                op.tmap = _FlatMap(int(srcs[j]), n)
                op.coords = [0]
                op.dst = int(dsts[j])
                op.nbytes = n
                _check_smem_range(g, op.dst, n, lane, "cp.async.bulk destination", 16)
                op.bar = barrier_at(g, int(bars[j]), "cp.async.bulk (its mbarrier)")
                op.words = _words_range(op.dst, n)
                smem = g.cta.smem
                if smem.async_readers[op.words].any():
                    g.launch.hazard("tma-overwrite-in-flight-read",
                                    "bulk copy into shared memory an in-flight async op reads",
                                    g, ins, lane, op.dst)
                smem.tma_pending[op.words] += 1
                _order[0] += 1
                op.order = _order[0]
                g.cta.tma_loads.append(op)
        return prog.wrap(ins, issue, prog.regs_of(*ops))
    if "bulk_group" in parts and ("global" in parts and "shared::cta" in parts):
        return _bulk_store(prog, ins)
    raise Unsupported(f"{ins.opcode}")


_BULK_TYPES = {"f32": "FLOAT32", "f16": "FLOAT16", "bf16": "BFLOAT16", "f64": "FLOAT64",
               "u32": "UINT32", "s32": "INT32", "u64": "UINT64", "s64": "INT64", "b32": "UINT32",
               "b64": "UINT64"}


def _bulk_store(prog, ins):
    """cp.async.bulk.global.shared::cta.bulk_group [dst], [src], size and its reduction form
    cp.reduce.async.bulk.global.shared::cta.bulk_group.op.type: as a TMA store, over a flat
    range of `size` bytes (a multiple of 16, both ends 16-byte aligned)."""
    ops = ins.operands
    if "L2::cache_hint" in ins.parts:
        ops = ops[:-1]
    if len(ops) != 3:
        raise Unsupported(f"{ins.opcode} with {len(ops)} operands")
    red = None
    dtype = "UINT8"
    if ins.parts[1] == "reduce":
        red = next((p for p in ins.parts if p in ("add", "min", "max", "inc", "dec", "and", "or",
                                                  "xor")), None)
        t = next((p for p in ins.parts if p in _BULK_TYPES), None)
        if red not in ("add", "min", "max") or t is None:
            raise Unsupported(f"{ins.opcode}: reduction .{red} .{t}")
        dtype = _BULK_TYPES[t]
    rdst = address_reader(prog, ops[0], "global")
    rsrc = address_reader(prog, ops[1], "shared")
    rsize = prog.reader(ops[2], "u32")

    def issue(g, idx):
        dsts, srcs, sizes = rdst(g, idx), rsrc(g, idx), rsize(g, idx)
        smem = g.cta.smem
        for j in range(len(idx)):
            lane = int(idx[j])
            n = int(sizes[j])
            dst = int(dsts[j])
            if n % 16 or dst % 16:
                raise MemoryFault(f"{ins.op} bulk store: size {n} and global address 0x{dst:x} "
                                  f"must be multiples of 16", lane, dst)
            st = TmaStore()
            st.warp = g.cta.warps[lane >> 5]
            st.ins = ins
            st.tmap = _FlatMap(dst, n, dtype)
            st.coords = [0]
            st.src = int(srcs[j])
            st.nbytes = n
            st.reduce = red
            _check_smem_range(g, st.src, n, lane, "bulk store source", 16)
            st.words = _words_range(st.src, n)
            _async_read_checks(g, ins, lane, st.src, st.words, "bulk store")
            smem.async_readers[st.words] += 1
            st.warp.bulk_open.append(st)
            g.launch.tma_count += 1
    return prog.wrap(ins, issue, prog.regs_of(*ops))


class _FlatMap:
    """A plain bulk copy seen as a rank-1 'tensor map' of `dtype` elements (for land() and
    perform_store())."""

    def __init__(self, address, n, dtype="UINT8"):
        from .tensormap import DTYPE_BYTES
        self.address, self.n = address, n
        self.dtype, self.rank, self.interleave, self.swizzle = dtype, 1, "NONE", "NONE"
        self.oob_fill = "NONE"
        self.element_bytes = DTYPE_BYTES[dtype]
        count = n // self.element_bytes
        self.dims, self.strides, self.box, self.element_strides = (count,), (), (count,), (1,)
        self.box_elements = (count,)
        self.box_bytes = n

    def describe(self):
        return f"bulk copy of {self.n} bytes from 0x{self.address:x}"


@register("cp")
def _cp(prog, ins):
    parts = ins.parts
    if parts[1] == "async" and len(parts) > 2 and parts[2] == "bulk":
        if len(parts) > 3 and parts[3] == "tensor":
            return _cp_async_bulk_tensor(prog, ins)
        if len(parts) > 3 and parts[3] == "commit_group":
            return prog.wrap(ins, _bulk_commit)
        if len(parts) > 3 and parts[3] == "wait_group":
            n = ins.operands[0]
            if not isinstance(n, Imm):
                raise Unsupported("cp.async.bulk.wait_group needs an immediate")
            return prog.wrap(ins, _bulk_wait(int(n.value)), kind=WAIT)
        if len(parts) > 3 and parts[3] == "prefetch":
            return prog.wrap(ins, lambda g, idx: None)
        return _bulk_copy(prog, ins)
    if parts[1] == "reduce" and parts[2] == "async" and parts[3] == "bulk":
        if len(parts) > 4 and parts[4] == "tensor":
            return _cp_async_bulk_tensor(prog, ins)
        return _bulk_copy(prog, ins)
    raise Unsupported(f"{ins.opcode} (Ampere cp.async is not emulated)")


def _warps_of(g, idx):
    if len(idx) == g.idx.size:
        return g.warps
    return [g.cta.warps[i] for i in np.unique(idx >> 5).tolist()]


def _bulk_commit(g, idx):
    for w in _warps_of(g, idx):
        w.bulk_groups.append(w.bulk_open)
        w.bulk_open = []


def _bulk_wait(n: int):
    def wait(g, idx):
        warps = _warps_of(g, idx)
        if any(len(w.bulk_groups) > n for w in warps) and yield_once(g):
            return YIELD
        for w in warps:
            while len(w.bulk_groups) > n:
                for st in w.bulk_groups.pop(0):
                    perform_store(g.launch, st)
    return wait


# ============================================================================= wgmma

class WgmmaOp:
    """One wgmma.mma_async of the warps of one warpgroup that issued it together."""
    __slots__ = ("cta", "warps", "ins", "m", "n", "k", "dtype", "atype", "btype", "a_desc",
                 "a_regs", "b_desc", "d_regs", "scale_d", "neg_a", "neg_b", "trans_a",
                 "trans_b", "a_words", "b_words", "a_addrs", "b_addrs", "shape", "lanes",
                 "retired", "wbits", "seq")


def _decode_desc(d: int) -> tuple:
    start = (d & 0x3FFF) << 4
    lbo = ((d >> 16) & 0x3FFF) << 4
    sbo = ((d >> 32) & 0x3FFF) << 4
    base = (d >> 49) & 0x7
    swz = {0: "NONE", 1: "128B", 2: "64B", 3: "32B"}[(d >> 62) & 0x3]
    return start, lbo, sbo, base, swz


def _offsets(major_mn: bool, swizzle: str, lbo: int, sbo: int, rows: tuple, k: int,
             esize: int) -> np.ndarray:
    """Byte offsets (pre-swizzle, from the start address) of elements (row, kk) of a wgmma
    operand, for the given rows of its M or N extent and kk in 0..k-1 (PTX ISA canonical
    layouts; T = 16 / esize elements per 16-byte unit)."""
    T = 16 // esize
    mn = np.asarray(rows, np.int64)[:, None]
    kk = np.arange(k, dtype=np.int64)[None, :]
    span = SWIZZLE_BYTES[swizzle]
    if not major_mn:                             # K-major
        r8, i = mn % 8, mn // 8
        e, j = kk % T, kk // T
        if span == 0:
            return r8 * 16 + i * sbo + e * esize + j * lbo
        return r8 * span + i * sbo + e * esize + j * 16
    e = mn % T                                   # MN-major
    r, j = kk % 8, kk // 8
    if span == 0:
        i = mn // T
        return e * esize + i * sbo + r * 16 + j * lbo
    chunks = span // 16
    c = (mn // T) % chunks
    i = mn // (T * chunks)
    return e * esize + c * 16 + i * lbo + r * span + j * sbo


@functools.lru_cache(maxsize=8192)
def _operand(desc: int, major_mn: bool, rows: tuple, k: int, esize: int):
    """(addresses, words) of a wgmma operand: what it reads, and its footprint."""
    start, lbo, sbo, base, swz = _decode_desc(desc)
    if base:
        raise Unsupported(f"wgmma descriptor with matrix base offset {base} (only 0)")
    offs = _offsets(major_mn, swz, lbo, sbo, rows, k, esize)
    addrs = swizzle_addresses(start + offs, swz)
    addrs.flags.writeable = False
    words = np.unique(addrs >> 2)
    words.flags.writeable = False
    return addrs, words


def _operand_checked(g, desc, major_mn, rows, k, esize, what):
    addrs, words = _operand(desc, major_mn, rows, k, esize)
    smem = g.cta.smem
    lo, hi = int(addrs.min()), int(addrs.max()) + esize
    if lo < 1024 or hi > smem.window:
        start, lbo, sbo, _, swz = _decode_desc(desc)
        raise MemoryFault(f"wgmma {what} (descriptor 0x{desc:016x}: start 0x{start:x}, LBO "
                          f"{lbo}, SBO {sbo}, swizzle {swz}) reads shared 0x{lo:x}..0x{hi:x}, "
                          f"outside the CTA's shared memory (0x400..0x{smem.window:x})",
                          None, lo)
    if esize > 1 and (addrs % esize).any():
        raise MemoryFault(f"wgmma {what}: misaligned element address", None, lo)
    return addrs, words


@functools.lru_cache(maxsize=256)
def _d_index(n: int, nw: int):
    """(row, col) in the op's (16*nw) x n result of accumulator register i in the op's lane
    j (warp j // 32 of the op, lane j % 32): arrays of shape (n/2, 32*nw)."""
    i = np.arange(n // 2)[:, None]
    j = np.arange(32 * nw)[None, :]
    lane = j % 32
    rows = 16 * (j // 32) + lane // 4 + 8 * ((i >> 1) & 1)
    cols = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1)
    return rows, cols


def _gather(smem, addrs: np.ndarray, etype: str) -> np.ndarray:
    """float64 elements at shared byte addresses (any shape)."""
    if etype in ("bf16", "f16"):
        bits = smem.data.view(np.uint16)[addrs >> 1]
        if etype == "bf16":
            return N.bf16_bits_to_f32(bits).astype(np.float64)
        return bits.view(np.float16).astype(np.float64)
    if etype in ("e4m3", "e5m2"):
        fmt = N.E4M3 if etype == "e4m3" else N.E5M2
        return smem.data[addrs].view(fmt).astype(np.float64)
    if etype == "tf32":
        bits = smem.data.view(np.uint32)[addrs >> 2] & np.uint32(0xFFFFE000)
        return bits.view(np.float32).astype(np.float64)
    raise Unsupported(f"wgmma element type .{etype}")


_ESIZE = {"bf16": 2, "f16": 2, "e4m3": 1, "e5m2": 1, "tf32": 4}
_K = {2: 16, 1: 32, 4: 8}


@register("wgmma")
def _wgmma(prog, ins):
    kind = ins.parts[1]
    if kind == "fence":
        def fence(g, idx):
            warps = whole_warps(g, idx, "wgmma.fence")
            if warps is None:
                return converge_wait(g, "wgmma.fence")
            keep = ~_bits_of(warps)
            touched = g.cta.touched
            for r in prog.wgmma_regs:
                touched[r] &= keep
            return None
        return prog.wrap(ins, fence, kind=WAIT)
    if kind == "commit_group":
        def commit(g, idx):
            warps = whole_warps(g, idx, "wgmma.commit_group")
            if warps is None:
                return converge_wait(g, "wgmma.commit_group")
            for w in warps:
                w.wg_groups.append(w.wg_open)
                w.wg_open = []
            return None
        return prog.wrap(ins, commit, kind=WAIT)
    if kind == "wait_group":
        (n_op,) = ins.operands
        if not isinstance(n_op, Imm):
            raise Unsupported("wgmma.wait_group needs an immediate")
        n = int(n_op.value)

        def wait(g, idx):
            warps = whole_warps(g, idx, "wgmma.wait_group")
            if warps is None:
                return converge_wait(g, "wgmma.wait_group")
            if any(len(w.wg_groups) > n for w in warps) and yield_once(g):
                return YIELD
            for w in warps:
                while len(w.wg_groups) > n:
                    for op in w.wg_groups.pop(0):
                        if not op.retired:
                            retire(g.launch, op)
            return None
        return prog.wrap(ins, wait, kind=WAIT)
    if kind != "mma_async":
        raise Unsupported(f"{ins.opcode}")
    if ins.guard is not None:
        raise Unsupported("a predicated wgmma")
    if "sp" in ins.parts:
        raise Unsupported("sparse wgmma (.sp)")
    shape = next(p for p in ins.parts if p.startswith("m64n"))
    mm, rest = shape[1:].split("n")
    n_str, k_str = rest.split("k")
    M, Nn, K = int(mm), int(n_str), int(k_str)
    dtype, atype, btype = ins.parts[-3:]
    if dtype not in ("f32", "f16"):
        raise Unsupported(f"wgmma accumulator .{dtype} (f32 and f16 only)")
    if atype not in _ESIZE or btype not in _ESIZE:
        raise Unsupported(f"wgmma .{atype}.{btype}")
    esize = _ESIZE[atype]
    if _ESIZE[btype] != esize or K != _K[esize] or M != 64 or Nn % 8 or not 8 <= Nn <= 256:
        raise Unsupported(f"wgmma shape {shape} with .{atype}.{btype}")
    ops = ins.operands
    d = ops[0]
    if not isinstance(d, Vec):
        raise Unsupported("wgmma accumulator must be a vector {..}")
    nd = Nn // 2 if dtype == "f32" else Nn // 4
    if len(d.items) != nd:
        raise SyncError(f"wgmma {shape}.{dtype} needs {nd} accumulator registers, got "
                        f"{len(d.items)}")
    d_regs = tuple(prog.reg(x.name) for x in d.items)
    for r in d_regs:
        if prog.reg_dtype[r].itemsize != 4:
            raise Unsupported(f"accumulator register {prog.regs[r].name} is not 32-bit")
    rs = isinstance(ops[1], Vec)
    sixteen = esize == 2
    if rs:
        a_regs = tuple(prog.reg(x.name) for x in ops[1].items)
        if len(a_regs) != 4:
            raise SyncError("wgmma with A in registers needs 4 registers")
        rest = ops[2:]
        names = ["b", "scale_d", "scale_a", "scale_b"] + (["trans_b"] if sixteen else [])
    else:
        a_regs = ()
        rest = ops[1:]
        names = ["a", "b", "scale_d", "scale_a", "scale_b"] + \
            (["trans_a", "trans_b"] if sixteen else [])
    if len(rest) != len(names):
        raise SyncError(f"{ins.opcode}: expected operands {names}, got {len(rest)}")
    args = dict(zip(names, rest))
    ra = prog.reader(args["a"], "b64") if not rs else None
    rb = prog.reader(args["b"], "b64")
    sd = args["scale_d"]
    if isinstance(sd, Imm):
        scale_d_const = bool(sd.value)
        rsd = None
    else:
        scale_d_const = None
        rsd = prog.reader(sd, "pred")
    imm = {}
    for key in ("scale_a", "scale_b", "trans_a", "trans_b"):
        if key in args:
            if not isinstance(args[key], Imm):
                raise SyncError(f"wgmma {key} must be an immediate")
            imm[key] = int(args[key].value)
    if imm.get("scale_a", 1) not in (1, -1) or imm.get("scale_b", 1) not in (1, -1):
        raise SyncError("wgmma imm-scale-a/b must be 1 or -1")
    if imm.get("trans_a", 0) not in (0, 1) or imm.get("trans_b", 0) not in (0, 1):
        raise SyncError("wgmma imm-trans-a/b must be 0 or 1")
    prog.wgmma_regs.update(d_regs)
    prog.wgmma_regs.update(a_regs)
    regs = d_regs + a_regs + prog.regs_of(*rest)

    def issue(g, idx):
        warps = whole_warps(g, idx, "wgmma.mma_async")
        if warps is None:
            return converge_wait(g, "wgmma.mma_async")
        launch = g.launch
        cta = g.cta
        bdesc = rb(g, idx)
        adesc = ra(g, idx) if ra is not None else None
        sdv = rsd(g, idx) if rsd is not None else None
        # one op per warpgroup among the group's warps. A wgmma is the warpgroup's: its four
        # warps issue it together, so a warp that gets here first waits for the others (which
        # keeps warps of a warpgroup from drifting an iteration apart)
        by_wg: dict[int, list] = {}
        for k, w in enumerate(warps):
            by_wg.setdefault(w.wg, []).append(k)
        for wg, ks in by_wg.items():
            live = sum(1 for x in cta.warps[4 * wg: 4 * wg + 4] if not x.done)
            if len(ks) < live:
                return converge_wait(g, f"wgmma.mma_async (issued by warpgroup {wg}'s four "
                                        f"warps together)")
        for wg, ks in by_wg.items():
            sel = _lanes_of(tuple(ks))
            op = WgmmaOp()
            op.cta, op.ins, op.m, op.n, op.k = cta, ins, M, Nn, K
            op.warps = [warps[k] for k in ks]
            op.wbits = _bits_of(op.warps)
            op.dtype, op.atype, op.btype = dtype, atype, btype
            op.shape = (M, Nn, K, dtype, atype, btype)
            op.d_regs, op.a_regs = d_regs, a_regs
            op.retired = False
            op.b_desc = _uniform64(bdesc[sel], "wgmma B descriptor")
            op.a_desc = _uniform64(adesc[sel], "wgmma A descriptor") if adesc is not None \
                else None
            if sdv is not None:
                v = sdv[sel]
                if (v != v[0]).any():
                    raise SyncError("wgmma scale-d predicate differs between lanes")
                op.scale_d = bool(v[0])
            else:
                op.scale_d = scale_d_const
            op.neg_a = imm.get("scale_a", 1) == -1
            op.neg_b = imm.get("scale_b", 1) == -1
            op.trans_a = bool(imm.get("trans_a", 0))
            op.trans_b = bool(imm.get("trans_b", 0))
            _log_warpgroup(cta, op, ins)
            first = [w.first for w in op.warps]
            op.lanes = (slice(first[0], first[-1] + 32)
                        if first == list(range(first[0], first[-1] + 1, 32))
                        else np.concatenate([np.arange(f, f + 32) for f in first]))
            rows = _rows_of(tuple(w.index % 4 for w in op.warps))
            if op.a_desc is not None:
                op.a_addrs, op.a_words = _operand_checked(g, op.a_desc, op.trans_a, rows, K,
                                                          esize, "A operand")
            else:
                op.a_addrs = op.a_words = None
            op.b_addrs, op.b_words = _operand_checked(g, op.b_desc, op.trans_b,
                                                      tuple(range(Nn)), K, esize, "B operand")
            _issue_checks(launch, g, op)
            smem = cta.smem
            if op.a_words is not None:
                smem.async_readers[op.a_words] += 1
            smem.async_readers[op.b_words] += 1
            inflight = cta.inflight
            for r in d_regs + a_regs:
                lst = inflight.get(r)
                if lst is None:
                    inflight[r] = [op]
                else:
                    lst.append(op)
            _order[0] += 1
            op.seq = _order[0]
            for w in op.warps:
                w.wg_open.append(op)
                w.wg_pending.append(op)
                w.wgmma_seq += 1
            launch.wgmma_count += len(op.warps)
        return None
    return Code(WAIT, issue_all(issue), ins, regs=regs)


@functools.lru_cache(maxsize=64)
def _lanes_of(ks: tuple) -> np.ndarray:
    """Positions, in a group's lanes, of the group's warps number ks (32 lanes each)."""
    return np.concatenate([np.arange(32 * k, 32 * k + 32) for k in ks])


@functools.lru_cache(maxsize=64)
def _rows_of(ranks: tuple) -> tuple:
    """The A rows (of the warpgroup's 64) that warps of these ranks in it own."""
    return tuple(r for q in ranks for r in range(16 * q, 16 * q + 16))


def issue_all(fn):
    return lambda g: fn(g, g.idx)


def _bits_of(warps) -> int:
    b = 0
    for w in warps:
        b |= 1 << w.index
    return b


def _log_warpgroup(cta, op, ins) -> None:
    """The four warps of a warpgroup must issue the same wgmma with the same descriptors
    (checked across issues when they are not issued together)."""
    if len(op.warps) == 4:
        return
    for w in op.warps:
        key = ("wgmma", w.wg, w.wgmma_seq)
        sig = (ins.index, op.a_desc, op.b_desc, op.scale_d)
        seen = cta.wg_log.get(key)
        if seen is None:
            cta.wg_log[key] = [sig, 1]
            continue
        if seen[0] != sig:
            raise SyncError(f"the warps of warpgroup {w.wg} disagree on their wgmma #"
                            f"{w.wgmma_seq}: (pc, A desc, B desc, scale-d) {seen[0]} vs {sig}")
        seen[1] += 1
        if seen[1] == 4:
            del cta.wg_log[key]


def _uniform64(v, what) -> int:
    if (v != v[0]).any():
        raise SyncError(f"{what} differs between lanes: "
                        f"{sorted(set(int(x) for x in v.tolist()))[:4]}")
    return int(v[0])


def _reg_names(launch, regs) -> str:
    names = [launch.prog.regs[r].name for r in regs]
    return ", ".join(names[:6]) + (f" (+{len(names) - 6} more)" if len(names) > 6 else "")


def _issue_checks(launch, g, op) -> None:
    cta = g.cta
    touched = [r for r in op.d_regs + op.a_regs if cta.touched[r] & op.wbits]
    if touched:
        launch.hazard("missing-wgmma-fence",
                      f"wgmma uses registers {_reg_names(launch, touched)} that other "
                      f"instructions accessed since the last wgmma.fence", g, op.ins)
    dset, aset = set(op.d_regs), set(op.a_regs)
    seen = set()
    for w in op.warps:
        for other in w.wg_pending:
            if other.retired or id(other) in seen:
                continue
            seen.add(id(other))
            o_d, o_a = set(other.d_regs), set(other.a_regs)
            if dset & o_a:
                launch.hazard("wgmma-register-conflict",
                              f"wgmma writes {_reg_names(launch, sorted(dset & o_a))}, an A "
                              f"operand of an in-flight wgmma (line {other.ins.line})", g, op.ins)
            if dset & o_d and other.shape != op.shape:
                launch.hazard("wgmma-register-conflict",
                              f"wgmma accumulates into {_reg_names(launch, sorted(dset & o_d))}, "
                              f"in flight in a wgmma of another shape (line {other.ins.line}): "
                              f"only same-shape chains are ordered", g, op.ins)
            if aset & o_d:
                launch.hazard("wgmma-register-conflict",
                              f"wgmma reads A register {_reg_names(launch, sorted(aset & o_d))}, "
                              f"an accumulator of an in-flight wgmma (line {other.ins.line})",
                              g, op.ins)
    for words, what in ((op.a_words, "A operand"), (op.b_words, "B operand")):
        if words is not None:
            _async_read_checks(g, op.ins, None, None, words, f"wgmma {what}")


def check_registers(launch, g, c) -> None:
    """An instruction other than a wgmma touches wgmma operand registers while some are in
    flight."""
    inflight = g.cta.inflight
    for r in c.wregs:
        ops = inflight.get(r)
        if not ops:
            continue
        for op in ops:
            common = op.wbits & g.wbits
            if common:
                wid = (common & -common).bit_length() - 1
                accumulator = r in op.d_regs
                role = "accumulator" if accumulator else "A operand"
                if not accumulator and c.writes is not None and r not in c.writes:
                    launch.hazard("wgmma-a-operand-read",
                                  f"{_reg_names(launch, [r])} is read while it is the A operand "
                                  f"of a wgmma issued at line {op.ins.line} and not yet retired "
                                  f"(warp {wid}): undefined behaviour in the PTX ISA "
                                  f"(wgmma.wait_group: \"accessing ... the input register "
                                  f"containing the fragments of matrix A\"), though only a read",
                                  g, c.ins)
                    break
                launch.hazard("wgmma-register-in-flight",
                              f"{_reg_names(launch, [r])} is the {role} of a wgmma issued at "
                              f"line {op.ins.line} and not yet retired by wgmma.wait_group "
                              f"(warp {wid}): this access races with the tensor core",
                              g, c.ins)
                break


def retire(launch, op: WgmmaOp) -> None:
    """Read the operands, multiply-accumulate, write the accumulators. A warpgroup's wgmmas
    retire in issue order: earlier ones of any of op's warps (issued apart, when the warps ran
    apart) go first, or a chain that starts with scale-d = 0 would overwrite later work."""
    for w in op.warps:
        while w.wg_pending and w.wg_pending[0] is not op:
            earlier = w.wg_pending[0]
            if earlier.retired:
                w.wg_pending.popleft()
            else:
                retire(launch, earlier)
    op.retired = True
    for w in op.warps:
        if w.wg_pending and w.wg_pending[0] is op:
            w.wg_pending.popleft()
    cta = op.cta
    smem = cta.smem
    if op.a_words is not None:
        smem.async_readers[op.a_words] -= 1
    smem.async_readers[op.b_words] -= 1
    for words, what in ((op.a_words, "A operand"), (op.b_words, "B operand")):
        if words is not None and smem.tma_pending[words].any():
            launch.hazard("read-before-tma-landed",
                          f"wgmma {what} read while a TMA load into it had not landed",
                          None, op.ins)
    nw = len(op.warps)
    if op.a_addrs is not None:
        A = _gather(smem, op.a_addrs, op.atype)                    # (16 nw, K)
    else:
        A = _a_from_registers(cta, op)
    B = _gather(smem, op.b_addrs, op.btype)                        # (N, K)
    if op.neg_a:
        A = -A
    if op.neg_b:
        B = -B
    prod = A @ B.T                                                 # (16 nw, N) float64
    rows, cols = _d_index(op.n, nw)
    r = cta.r
    L = op.lanes
    if op.dtype == "f32":
        if op.scale_d:
            cur = np.stack([r[x][L].view(np.float32) for x in op.d_regs])   # (N/2, 32 nw)
            vals = (prod[rows, cols] + cur).astype(np.float32)
        else:
            vals = prod[rows, cols].astype(np.float32)
        st = launch.prog.reg_dtype
        for i, x in enumerate(op.d_regs):
            r[x][L] = vals[i] if st[x] == np.float32 else vals[i].view(st[x])
    else:                                                          # f16 accumulators, packed
        rows2, cols2 = rows[0::2], cols[0::2]
        if op.scale_d:
            cur = np.stack([r[x][L].view(np.uint32) for x in op.d_regs])
            lo = (cur & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16)
            hi = (cur >> np.uint32(16)).astype(np.uint16).view(np.float16)
            both = np.empty((op.n // 2, 32 * nw))
            both[0::2], both[1::2] = lo, hi
            vals = (prod[rows, cols] + both).astype(np.float16).view(np.uint16)
        else:
            vals = prod[rows, cols].astype(np.float16).view(np.uint16)
        del rows2, cols2
        st = launch.prog.reg_dtype
        for i, x in enumerate(op.d_regs):
            r[x][L] = N.pack2_16(vals[2 * i + 1], vals[2 * i]).view(st[x])
    inflight = cta.inflight
    for x in op.d_regs + op.a_regs:
        lst = inflight.get(x)
        if lst is not None:
            lst.remove(op)
            if not lst:
                del inflight[x]


@functools.lru_cache(maxsize=32)
def _a_index(nw: int, per_reg: int):
    """(rows, cols) in the op's (16 nw) x K block of A of element e (of per_reg) of register
    q in the op's lane j: arrays of shape (4, per_reg, 32 nw). PTX ISA A fragments (m64nNk16
    for 16-bit types, m64nNk32 for 8-bit): register q holds row l/4 + 8*(q%2) of its warp's
    16, columns (per_reg * (l%4) + 8*per_reg/2*(q/2)) + e."""
    q = np.arange(4)[:, None, None]
    e = np.arange(per_reg)[None, :, None]
    j = np.arange(32 * nw)[None, None, :]
    lane = j % 32
    rows = 16 * (j // 32) + lane // 4 + 8 * (q & 1)
    cols = per_reg * (lane % 4) + 4 * per_reg * (q >> 1) + e
    return np.broadcast_to(rows, (4, per_reg, 32 * nw)), np.broadcast_to(cols, (4, per_reg,
                                                                           32 * nw))


def _a_from_registers(cta, op) -> np.ndarray:
    """The op's (16 nw) x K rows of A from each warp's four fragment registers."""
    nw = len(op.warps)
    A = np.zeros((16 * nw, op.k))
    bits = np.stack([cta.r[reg][op.lanes].view(np.uint32) for reg in op.a_regs])  # (4, 32nw)
    if op.atype in ("bf16", "f16"):
        halves = np.stack([bits & np.uint32(0xFFFF), bits >> np.uint32(16)], axis=1) \
            .astype(np.uint16)                                                   # (4, 2, 32nw)
        vals = N.bf16_bits_to_f32(halves) if op.atype == "bf16" else \
            halves.view(np.float16).astype(np.float32)
        rows, cols = _a_index(nw, 2)
    elif op.atype in ("e4m3", "e5m2"):
        fmt = N.E4M3 if op.atype == "e4m3" else N.E5M2
        by = np.stack([(bits >> np.uint32(8 * b)) & np.uint32(0xFF) for b in range(4)], axis=1)
        vals = by.astype(np.uint8).view(fmt).astype(np.float32)                  # (4, 4, 32nw)
        rows, cols = _a_index(nw, 4)
    else:
        raise Unsupported(f"wgmma with A in registers of .{op.atype}")
    A[rows, cols] = vals
    return A


# ============================================================================= exits

def warp_exit(launch, w) -> None:
    if w.wg_open or w.wg_groups:
        n = len(w.wg_open) + sum(len(x) for x in w.wg_groups)
        op = (w.wg_open or w.wg_groups[0])[0]
        launch.hazard("exit-with-wgmma-in-flight",
                      f"warp {w.index} exits with {n} wgmma operation(s) never retired by "
                      f"wgmma.wait_group (first issued at line {op.ins.line})", None, op.ins)
        for grp in w.wg_groups + [w.wg_open]:
            for op in grp:
                if not op.retired:
                    retire(launch, op)
        w.wg_groups, w.wg_open = [], []
    if w.bulk_open or w.bulk_groups:
        st = (w.bulk_open or w.bulk_groups[0])[0]
        launch.hazard("exit-with-tma-store-in-flight",
                      f"warp {w.index} exits with TMA stores not waited for by "
                      f"cp.async.bulk.wait_group(.read): its CTA's shared memory may be freed "
                      f"before they read it", None, st.ins)
        for grp in w.bulk_groups + [w.bulk_open]:
            for st in grp:
                perform_store(launch, st)
        w.bulk_groups, w.bulk_open = [], []


def cta_exit(launch, cta) -> None:
    if cta.tma_loads:
        op = cta.tma_loads[0]
        launch.hazard("exit-with-tma-load-in-flight",
                      f"CTA {cta.ctaid} finished with {len(cta.tma_loads)} TMA load(s) never "
                      f"waited for (first: {op.describe()})", op.warp, op.ins)
        cta.tma_loads.clear()
    for b in cta.mbar.values():
        if b.tx > 0:
            launch.hazard("mbarrier-unfinished-tx",
                          f"CTA {cta.ctaid} finished with {b.describe()}: expected bytes "
                          f"never arrived", None)


def finish(launch) -> None:
    """After the last warp: nothing may be left in flight."""
    for cta in launch.ctas:
        if cta.live_warps:
            cta_exit(launch, cta)

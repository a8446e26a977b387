"""A CPU emulator of the Hopper (sm_90a) PTX that ptxattn's kernels use.

Why: the kernels are checked on an H200 that is scarce. The emulator runs a kernel's expanded
PTX, exactly as the driver JIT would get it, on tiny shapes on any CPU, so that a new kernel's
logic (addressing, masks, barriers, pipelines, fragment layouts) is proven before it meets the
GPU, and a class of races the GPU may hide is proven absent. It is a tool (ptxattn.tools): the
runtime never imports it.

What it is (one module per concern):
  parse.py      PTX text -> functions: parameters (by-value .b8 arrays included), registers
                (%r<64> ranges), shared variables, labels, guarded instructions, vector and
                memory operands, tensor operands [map, {coords}], constant expressions.
  program.py    each instruction compiled once to a Python callable; arithmetic is generated
                source over CTA-wide NumPy register arrays (one element per thread).
  ops.py        arithmetic, logic, comparisons, moves, conversions (numeric.py: rounding).
  memops.py     ld/st/atom/red in every state space, ldmatrix/stmatrix, addressing and bounds.
  syncops.py    named barriers, mbarriers, shfl/vote/elect, fences, setmaxnreg.
  asyncops.py   TMA (loads, stores, reductions, bulk copies) and wgmma, deferred as the
                hardware may defer them, with the hazard checks.
  tensormap.py  what cuTensorMapEncodeTiled encodes, and the box geometry TMA walks.
  machine.py    CTAs, warps, groups of lanes, the scheduler, deadlock reports.
  cluster.py    thread-block clusters: distributed shared memory addresses, multicast, the
                cluster barrier.
  memory.py     the global address space and each CTA's shared memory with its shadow state.
  fake_driver.py  a fake of cuda.bindings.driver on top, so that ptxattn.attention() and every
                public entry point run end to end (tests use the `emulated_gpu` fixture).

Execution model: SIMT with every thread on its own. Lanes at one pc form a group that runs an
instruction once (warps in lockstep share one NumPy operation); a branch both ways splits a
group, the lower pc runs first and groups merge when they meet; collectives wait at the
instruction for the rest of their warp and fail if those lanes exited. All CTAs of a grid are
resident and interleaved, so CTAs that meet through global memory behave. The scheduler
switches at blocking points (bar.sync, mbarrier waits that would fail, setmaxnreg.inc without
registers, collectives waiting for their lanes), before a wgmma or bulk wait_group retires
work (so the rest of the CTA runs while it is in flight), and after a quantum; with a seed it
also switches, splits lockstep warps, lands TMA loads, retires wgmma groups and reads TMA store
sources at random points. wgmma is issued by a warpgroup's four warps together (a warp that
arrives first waits) and retires in issue order.

What it checks, with the instruction, pc, CTA, warp, lane and address in every message:
  - memory: any access outside a live allocation, outside the CTA's shared memory (past the
    launch's dynamic size, or in the reserved first KiB), misaligned, or on an mbarrier's bytes
    (MemoryFault); a TMA box that leaves the allocation its tensor map names;
  - synchronisation (SyncError): bar.uni/bar/shfl/vote/wgmma/setmaxnreg used by diverged or
    exited lanes, barrier counts mixed or exceeded, arrivals past an mbarrier's count, tx bytes
    beyond expect_tx, setmaxnreg past the SM's 64K registers, warps of a warpgroup issuing
    different wgmmas;
  - deadlock (Deadlock): no group can run; each group's pc and what it waits on is listed, with
    every mbarrier's phase, pending arrivals and tx-count, and pending TMA loads; a run past its
    instruction budget (5M steps by default: a spin nobody ends) is a Livelock, with the same
    report;
  - hazards (HazardError at the end of a launch, or at once with strict=True): a write to a
    wgmma's operands or registers between issue and retire; a wgmma or TMA store reading generic
    stores not followed by fence.proxy.async; a TMA load into bytes an issued wgmma or TMA store
    still reads (a ring slot refilled early), or read before it landed; registers touched
    between wgmma.fence and wgmma; async work left in flight at exit.

Numerics: see numeric.py (IEEE rounding modes, bf16/f16/e4m3 via ml_dtypes; ex2/lg2/rcp
.approx computed exactly and rounded, which the hardware approximates within 2 ulp) and
asyncops.py (wgmma accumulates in float64 and rounds once per instruction).

Clusters (cluster.py): a launch with cluster dims runs its CTAs as clusters: the cluster
registers, mapa/getctarank, mbarrier arrives on a peer's barrier, TMA .multicast::cluster loads
and barrier.cluster; a peer's shared memory or barrier touched after that peer exited is a
hazard (cluster-peer-exited).
Not supported yet (each raises Unsupported naming it, never a silent skip): multicast stores,
.cta_group TMA, generic ld/st into a peer's shared memory, im2col and gather4 TMA,
interleaved tensor maps, wgmma .sp and tf32 A-in-registers, descriptor base offsets, bar.red,
mbarrier.arrive_drop/noComplete/pending_count, Ampere cp.async, .local/.const/.global variables,
calls (.func), textures/surfaces, carry arithmetic (.cc), half-precision atomics and vector
reductions other than .f32, arithmetic qualifiers it does not model.
Not detected: races between generic-proxy accesses of different threads without a barrier
(memory is sequentially consistent here; a seeded run may still show them as wrong answers),
and the GPU's weaker memory ordering in general.

Options (Launch, FakeDriver, run_kernel): seed (random schedule and asynchronous completion),
strict (raise at the first hazard), quantum, max_instructions; extern_offset (FakeDriver,
Program) places the dynamic shared array past its declared alignment, to prove a kernel's
align-up code and the slack in its shared-memory budget.

Running a kernel: `python -m ptxattn.tools.emulate STAGE --shape BxHxLxD` (the CLI) or, from a
test, the `emulated_gpu` fixture and the public API; run_kernel() below for hand-made launches.
"""

from __future__ import annotations

import ctypes

from .errors import (Deadlock, EmulatorError, Hazard, HazardError, Livelock, MemoryFault,
                     ParseError, SyncError, Unsupported)
from .machine import Launch, Report
from .memory import GlobalMemory
from .parse import parse
from .program import Program

__all__ = ["run_kernel", "GlobalMemory", "Program", "Launch", "Report", "parse", "EmulatorError",
           "ParseError", "Unsupported", "MemoryFault", "SyncError", "Deadlock", "Livelock",
           "Hazard", "HazardError"]

_PROGRAMS: dict = {}


def program(ptx_text: str, name: str | None = None) -> Program:
    """The compiled entry function of a PTX text (cached by text and name)."""
    key = (ptx_text, name)
    prog = _PROGRAMS.get(key)
    if prog is None:
        prog = Program(parse(ptx_text), name)
        _PROGRAMS[key] = prog
    return prog


def run_kernel(ptx_text: str, grid, block, params=(), *, smem: int = 0,
               gmem: GlobalMemory | None = None, name: str | None = None, **options) -> Report:
    """Launch a kernel on the emulator. params: one value per declared parameter, as an int
    (a pointer or integer, sized by the declaration), a float, or bytes (a by-value struct such
    as a tensor map's 128 bytes). options: seed, strict, quantum, max_instructions."""
    prog = program(ptx_text, name)
    buf = bytearray(prog.fn.param_bytes)
    decl = prog.fn.params
    if len(params) != len(decl):
        raise EmulatorError(f"{prog.name} takes {len(decl)} parameters, got {len(params)}")
    for p, v in zip(decl, params):
        if isinstance(v, (bytes, bytearray)):
            data = bytes(v)
        elif isinstance(v, float) or p.ptype in ("f32", "f64"):
            data = bytes((ctypes.c_float if p.size == 4 else ctypes.c_double)(v))
        else:
            data = int(v).to_bytes(p.size, "little", signed=int(v) < 0)
        if len(data) != p.size:
            raise EmulatorError(f"parameter {p.name}: {len(data)} bytes for .{p.ptype} "
                                f"({p.size} bytes)")
        buf[p.offset:p.offset + p.size] = data
    return Launch(prog, _dim3(grid), _dim3(block), smem, bytes(buf),
                  gmem if gmem is not None else GlobalMemory(), **options).run()


def _dim3(v):
    v = (v,) if isinstance(v, int) else tuple(v)
    return tuple(int(x) for x in v) + (1,) * (3 - len(v))

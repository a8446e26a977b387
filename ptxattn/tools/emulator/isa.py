"""What every part of the emulator shares and nothing else provides: the kinds of compiled
instruction, the instruction table, how an instruction parks or yields its lanes, and the SM's
limits. (Kept apart so that the parts import in one direction: isa <- ops, memops, syncops,
asyncops <- program <- machine.)"""

from __future__ import annotations

OP, BRANCH, EXIT, WAIT = 0, 1, 2, 3       # falls through / branches / exits / may park lanes

WARP = 32
REGISTER_FILE = 65536                     # 32-bit registers per SM (sm_90)
MAX_SMEM_OPTIN = 227 * 1024               # dynamic shared memory a CTA may opt in to (sm_90)

TABLE: dict = {}                          # opcode -> compiler (program, instr) -> Code


def register(*names):
    """Register an instruction compiler for these opcodes."""
    def deco(fn):
        for n in names:
            TABLE[n] = fn
        return fn
    return deco


class Code:
    """One compiled instruction."""
    __slots__ = ("kind", "fn", "target", "guard", "neg", "ins", "regs", "wregs", "uni",
                 "writes")

    def __init__(self, kind, fn, ins, target=None, guard=None, neg=False, regs=(), uni=False,
                 writes=None):
        self.kind = kind
        self.fn = fn
        self.ins = ins
        self.target = target
        self.guard = guard
        self.neg = neg
        self.regs = tuple(regs)      # every register id it reads or writes
        self.wregs = ()              # those that are also wgmma operands (set by the Program)
        self.uni = uni
        self.writes = writes         # the registers it writes, when known (None: unknown)


class Wait:
    """Why a group is parked. resume_next: on wake, continue after the instruction
    (bar.sync); otherwise execute it again (an mbarrier wait, setmaxnreg.inc). converge: the
    group waits at a collective for lanes of its warps that are elsewhere; a group that reaches
    the same pc merges with it."""
    __slots__ = ("describe", "obj", "resume_next", "converge", "register")

    def __init__(self, describe, obj=None, resume_next=False, converge=False, register=None):
        self.describe = describe          # () -> str, for deadlock reports
        self.obj = obj
        self.resume_next = resume_next
        self.converge = converge
        self.register = register          # (group) -> None: enrol a group split off to wait


YIELD = object()   # an instruction's answer "let others run first, then execute me again"


def yield_once(g) -> bool:
    """True the first time a group reaches this instruction (it should yield), False when it
    comes back to it: the instructions where a warp waits for asynchronous work (wgmma and bulk
    wait_group) let the rest of the CTA run first, widening the window in which a race with the
    work in flight shows up as a hazard."""
    if g.yielded == g.pc:
        g.yielded = -1
        return False
    g.yielded = g.pc
    return True

"""A parsed PTX function compiled to Python: one callable per instruction.

Every register is one NumPy array per CTA with an element per thread, stored in its declared
type's dtype (f32 as float32, b32/u32 as uint32, pred as bool, ...); an instruction reads it as
its own type (a view when the width matches, a truncation or extension where PTX allows a wider
register). An instruction runs once for a group of lanes at the same pc (machine.py), on the
slice (or index array) L of those lanes: reads are r[i][L], writes r[i][L] = value.
Arithmetic is generated as Python source (one small function per instruction, compiled once per
kernel), so that executing an instruction costs one call and the NumPy operations themselves.

Instruction kinds: OP (runs, falls through), BRANCH, EXIT (ret/exit), WAIT (may return a Wait
that parks the warp until what it waits for happens).
"""

from __future__ import annotations

import re

import numpy as np

from . import numeric as N
from .errors import ParseError, Unsupported
from .isa import BRANCH, EXIT, OP, WAIT, Code  # noqa: F401  (re-exported)
from .memory import RESERVED_SHARED
from .parse import SINK, Function, Imm, Instr, Mem, Module, Not, Pair, Reg, Sym, Vec

SPECIAL = {
    "%tid.x", "%tid.y", "%tid.z", "%ntid.x", "%ntid.y", "%ntid.z",
    "%ctaid.x", "%ctaid.y", "%ctaid.z", "%nctaid.x", "%nctaid.y", "%nctaid.z",
    "%laneid", "%warpid", "%nwarpid", "%smid", "%nsmid", "%gridid",
    "%clusterid.x", "%clusterid.y", "%clusterid.z", "%nclusterid.x", "%nclusterid.y",
    "%nclusterid.z", "%cluster_ctaid.x", "%cluster_ctaid.y", "%cluster_ctaid.z",
    "%cluster_nctaid.x", "%cluster_nctaid.y", "%cluster_nctaid.z", "%cluster_ctarank",
    "%cluster_nctarank", "%is_explicit_cluster",
    "%lanemask_eq", "%lanemask_le", "%lanemask_lt", "%lanemask_ge", "%lanemask_gt",
    "%clock", "%clock_hi", "%clock64", "%globaltimer", "%globaltimer_lo", "%globaltimer_hi",
    "%dynamic_smem_size", "%total_smem_size",
}
SPECIAL_64 = {"%clock64", "%globaltimer", "%gridid"}


_REG_REF = re.compile(r"\br\[(\d+)\]")
_CONST_REF = re.compile(r"\bK\[(\d+)\]")
_TEMPLATES: dict[tuple, object] = {}


def _instantiate(body: str, consts: dict, extra: dict | None, name: str):
    """The function `def _f(g): <body>`, compiled once per shape of body: register indices and
    constants become closure variables, so that the thousands of instructions that differ
    only in their registers share one code object."""
    regs: list[int] = []
    kvals: list[int] = []

    def reg(m):
        i = int(m.group(1))
        if i not in regs:
            regs.append(i)
        return f"r[_a{regs.index(i)}]"

    def const(m):
        i = int(m.group(1))
        if i not in kvals:
            kvals.append(i)
        return f"_k{kvals.index(i)}"
    template = _CONST_REF.sub(const, _REG_REF.sub(reg, body))
    key = (template, tuple(sorted(extra)) if extra else ())
    make = _TEMPLATES.get(key)
    if make is None:
        params = [f"_a{i}" for i in range(len(regs))] + [f"_k{i}" for i in range(len(kvals))]
        src = f"def _make({', '.join(params)}):\n  def _f(g):\n" + \
            "\n".join("  " + line for line in template.splitlines()) + "\n  return _f\n"
        ns = {"np": np, "N": N}
        if extra:
            ns.update(extra)
        try:
            exec(compile(src, name, "exec"), ns)
        except SyntaxError as e:                 # a bug in a generator: show what it made
            raise RuntimeError(f"generated code does not compile: {e}\n{src}") from None
        make = ns["_make"]
        _TEMPLATES[key] = make
    return make(*regs, *(consts[i] for i in kvals))


class Program:
    """The compiled form of one entry function of a module."""

    def __init__(self, module: Module, name: str | None = None, extern_offset: int = 0):
        """extern_offset: place the .extern (dynamic) shared array that many bytes past its
        declared alignment (a multiple of 16), to prove a kernel's own align-up code and its
        slack in the shared-memory budget; 0 (the default) honours the declaration."""
        if extern_offset % 16:
            raise ValueError(f"extern_offset {extern_offset}: a multiple of 16 bytes")
        self.extern_offset = extern_offset
        if name is None:
            entries = [f for f in module.functions.values() if f.entry]
            if len(entries) != 1:
                raise ParseError(f"expected one .entry function, found {len(entries)}")
            fn = entries[0]
        else:
            fn = module.functions.get(name)
            if fn is None:
                raise ParseError(f"no function named {name!r}")
        if not fn.entry:
            raise Unsupported(f"{fn.name} is a .func: only .entry functions are launched")
        self.module = module
        self.fn = fn
        self.name = fn.name
        self.regs = list(fn.regs.values())
        self.reg_index = {r.name: r.index for r in self.regs}
        self.reg_type = [r.ptype for r in self.regs]
        self.reg_dtype = [N.DTYPE[r.ptype] if r.ptype in N.DTYPE else None for r in self.regs]
        for r in self.regs:
            if r.ptype not in N.DTYPE:
                raise Unsupported(f"register {r.name} of type .{r.ptype}")
        self._layout_shared(module, fn)
        self.params = {p.name: p for p in fn.params}
        self.consts: dict[int, np.ndarray] = {}
        self.wgmma_regs: set[int] = set()
        self.code: list[Code] = []
        from . import ops                                  # the instruction table
        for ins in fn.instrs:
            try:
                code = ops.compile_instruction(self, ins)
            except (Unsupported, ParseError) as e:
                raise type(e)(f"line {ins.line}: {e}\n    {ins.text}") from None
            except (ValueError, KeyError, IndexError, TypeError) as e:
                raise ParseError(f"line {ins.line}: cannot compile ({type(e).__name__}: {e})"
                                 f"\n    {ins.text}") from None
            self.code.append(code)
        for c in self.code:
            # accesses by wgmma instructions themselves are the async proxy's, not "other
            # instructions'" (asyncops: wgmma.fence and in-flight checks)
            if c.ins.op != "wgmma":
                c.wregs = tuple(r for r in c.regs if r in self.wgmma_regs)
        self.exit_index = len(self.code)
        # falling off the end of the body is a return
        end = Instr("ret", ("ret",), (), None, 0, "(end of function)", len(self.code))
        self.code.append(Code(EXIT, None, end))
        self.text_lines = module.text.splitlines()
        self.threads_max = fn.reqntid or fn.maxntid

    # -- shared memory layout: [reserved 1 KiB][static vars][extern array]
    def _layout_shared(self, module: Module, fn: Function) -> None:
        offset = RESERVED_SHARED
        self.shared_addr: dict[str, int] = {}
        self.extern_align = 16
        extern_names = []
        for var in list(module.shared) + list(fn.shared):
            if var.extern:
                extern_names.append(var)
                continue
            offset = -(-offset // var.align) * var.align
            self.shared_addr[var.name] = offset
            offset += var.size
        self.static_smem = offset - RESERVED_SHARED
        align = max([v.align for v in extern_names] + [16])
        self.extern_align = align
        self.dyn_base = -(-offset // align) * align + self.extern_offset
        for var in extern_names:
            self.shared_addr[var.name] = self.dyn_base

    # -- register access -----------------------------------------------------------------
    def reg(self, name: str) -> int:
        i = self.reg_index.get(name)
        if i is None:
            raise ParseError(f"undeclared register {name}")
        return i

    def const(self, value) -> str:
        """A name for a constant (a 0-d array) in generated code."""
        key = len(self.consts)
        self.consts[key] = value
        return f"K[{key}]"

    def read_expr(self, op, t: str, allow_wider: bool = True) -> tuple[str, tuple]:
        """(Python expression for operand `op` read as PTX type t over the lanes L, register
        ids read). Constants are 0-d arrays: they broadcast."""
        dt = N.DTYPE[t]
        if isinstance(op, Not):
            e, regs = self.read_expr(op.operand, t)
            return f"(~{e})", regs
        if isinstance(op, Reg):
            if op.name in SPECIAL:
                src = np.dtype(np.uint64) if op.name in SPECIAL_64 else np.dtype(np.uint32)
                e = f"S[{op.name!r}][L]"
                if op.name in ("%clock", "%clock64", "%globaltimer", "%globaltimer_lo",
                               "%globaltimer_hi", "%clock_hi"):
                    e = "g.clock(L)"
                if dt == src:
                    return e, ()
                if dt.itemsize == src.itemsize:
                    return f"{e}.view(np.{dt.name})", ()
                return f"{e}.astype(np.{dt.name})", ()
            i = self.reg(op.name)
            st = self.reg_dtype[i]
            e = f"r[{i}][L]"
            if st == dt:
                return e, (i,)
            if dt == np.bool_ or st == np.bool_:
                raise Unsupported(f"predicate register {op.name} read as .{t} (or the reverse)")
            if st.itemsize == dt.itemsize:
                return f"{e}.view(np.{dt.name})", (i,)
            if st.itemsize > dt.itemsize and allow_wider:
                # a wider register read as a narrower type: its low bits
                return (f"{e}.view(np.{N.UNSIGNED[st.itemsize].name})"
                        f".astype(np.{N.UNSIGNED[dt.itemsize].name}).view(np.{dt.name})"), (i,)
            if st.itemsize < dt.itemsize and allow_wider:
                # a narrower register where the instruction type is wider (cvt, ld/st
                # sources): zero- or sign-extended by the register's own type
                return f"{e}.astype(np.{dt.name})", (i,)
            raise Unsupported(f"register {op.name} (.{self.reg_type[i]}) read as .{t}")
        if isinstance(op, Imm):
            return self.const(self.imm_array(op, t)), ()
        if isinstance(op, Sym):
            return self.const(N.const_array(self.symbol_address(op.name), t)), ()
        raise Unsupported(f"operand {op!r} where a value of type .{t} is expected")

    def imm_array(self, op: Imm, t: str) -> np.ndarray:
        dt = N.DTYPE[t]
        if t == "pred":
            return N.const_array(bool(op.value), t)
        if dt.kind == "f":
            if op.bits == 32 and dt == np.float32:
                return np.array(op.raw, np.uint32).view(np.float32).reshape(())
            if op.bits == 64 and dt == np.float64:
                return np.array(op.raw, np.uint64).view(np.float64).reshape(())
            return np.array(op.value, dt)
        if op.bits is not None:                 # a float literal in an integer/bit context
            if op.bits == 32 and dt.itemsize == 4:
                return np.array(op.raw, np.uint32).view(dt).reshape(())
            if op.bits == 64 and dt.itemsize == 8:
                return np.array(op.raw, np.uint64).view(dt).reshape(())
            raise Unsupported(f"float literal as .{t}")
        return N.const_array(int(op.value), t)

    def symbol_address(self, name: str) -> int:
        if name in self.shared_addr:
            return self.shared_addr[name]
        p = self.params.get(name)
        if p is not None:
            return p.offset                      # parameter space: offset in the buffer
        raise ParseError(f"unknown symbol {name}")

    def write_stmt(self, op, t: str, value: str) -> tuple[str, tuple]:
        """(statement storing expression `value` (dtype of t) into `op` over L, register ids)."""
        if op is SINK:
            return "", ()
        if not isinstance(op, Reg) or op.name in SPECIAL:
            raise Unsupported(f"cannot write to {op!r}")
        i = self.reg(op.name)
        st = self.reg_dtype[i]
        dt = N.DTYPE[t]
        if st == dt:
            conv = value
        elif dt == np.bool_ or st == np.bool_:
            raise Unsupported(f"a .{t} result written to predicate/non-predicate {op.name}")
        elif st.itemsize == dt.itemsize:
            conv = f"np.asarray({value}, np.{dt.name}).view(np.{st.name})"
        elif st.itemsize > dt.itemsize:
            # extend into the wider register: sign-extend a signed type, else zero-extend
            wide = N.SIGNED[st.itemsize] if N.is_signed(t) else N.UNSIGNED[st.itemsize]
            conv = (f"np.asarray({value}, np.{dt.name}).astype(np.{wide.name})"
                    f".view(np.{st.name})")
        else:
            raise Unsupported(f"a .{t} result does not fit register {op.name} "
                              f"(.{self.reg_type[i]})")
        return f"r[{i}][L] = {conv}", (i,)

    def generate(self, ins: Instr, body: str, regs, kind=OP, extra: dict | None = None,
                 writes=None):
        """Compile generated statements (using g, r, L, S, K, np, N) into a Code."""
        guard = ""
        gregs = ()
        if ins.guard is not None:
            gi = self.reg(ins.guard[0])
            if self.reg_dtype[gi] != np.bool_:
                raise Unsupported(f"guard {ins.guard[0]} is not a predicate")
            p = f"~r[{gi}][L]" if ins.guard[1] else f"r[{gi}][L]"
            guard = (f"p_ = {p}\n    if not p_.all():\n        if not p_.any(): return None\n"
                     f"        L = g.idx[p_]\n    ")
            gregs = (gi,)
        src = (f"    r = g.r\n    L = g.L\n    S = g.cta.sp\n    {guard}{body}\n"
               f"    return None\n")
        fn = _instantiate(src, self.consts, extra, f"<ptx {ins.opcode}>")
        return Code(kind, fn, ins, regs=tuple(dict.fromkeys(tuple(regs) + gregs)),
                    writes=None if writes is None else tuple(writes))

    def wrap(self, ins: Instr, fn, regs=(), kind=OP, writes=None):
        """Code for a closure fn(g, idx) (idx: the executing lanes, an int64 index array into
        the CTA), with the instruction's guard applied in front."""
        if ins.guard is None:
            return Code(kind, lambda g: fn(g, g.idx), ins, regs=regs, writes=writes)
        gi = self.reg(ins.guard[0])
        neg = ins.guard[1]

        def guarded(g):
            p = g.r[gi][g.L]
            if neg:
                p = ~p
            if p.all():
                return fn(g, g.idx)
            if not p.any():
                return None
            return fn(g, g.idx[p])
        return Code(kind, guarded, ins, regs=tuple(regs) + (gi,), writes=writes)

    # -- helpers for other compilers: closures over (group, lanes)
    def reader(self, op, t: str):
        """A closure (g, idx) -> array of len(idx): operand `op` read as type t."""
        expr, _ = self.read_expr(op, t)
        ns = {"np": np, "K": self.consts}
        exec(f"def _r(g, L):\n    r = g.r\n    S = g.cta.sp\n    v = {expr}\n"
             f"    return np.broadcast_to(v, (len(L),)) if np.ndim(v) == 0 else v\n", ns)
        return ns["_r"]

    def writer(self, op, t: str):
        """A closure (g, idx, value) storing values of type t into register `op`."""
        if op is SINK:
            return lambda g, L, value: None
        stmt, _ = self.write_stmt(op, t, "value")
        ns = {"np": np}
        exec(f"def _w(g, L, value):\n    r = g.r\n    {stmt}\n", ns)
        return ns["_w"]

    def regs_of(self, *ops) -> tuple:
        out = []
        for op in ops:
            if isinstance(op, Reg) and op is not SINK and op.name not in SPECIAL:
                out.append(self.reg(op.name))
            elif isinstance(op, Not):
                out.extend(self.regs_of(op.operand))
            elif isinstance(op, Vec):
                out.extend(self.regs_of(*op.items))
            elif isinstance(op, Mem):
                if op.base is not None:
                    out.extend(self.regs_of(op.base))
                out.extend(self.regs_of(*op.coords))
            elif isinstance(op, Pair):
                out.extend(self.regs_of(op.first, op.second))
        return tuple(out)

    def source_line(self, line: int) -> str:
        if 1 <= line <= len(self.text_lines):
            return self.text_lines[line - 1].strip()
        return ""

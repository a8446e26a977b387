"""The instruction table: opcode -> compiler. Arithmetic, logic, comparisons, moves and
conversions are generated as source here; memory, synchronisation and the asynchronous units
live in memops.py, syncops.py and asyncops.py and register themselves in TABLE."""

from __future__ import annotations

import numpy as np

from . import numeric as N
from .errors import EmulatorError, Unsupported
from .parse import Instr, Pair, Sym, Vec
from .isa import BRANCH, EXIT, TABLE, Code, register

ROUNDING = ("rn", "rz", "rm", "rp")
INT_ROUNDING = ("rni", "rzi", "rmi", "rpi")


# The qualifiers each arithmetic opcode's compiler reads; any other (besides type names) is
# refused rather than ignored, so an instruction never runs with a modifier left out.
_TYPES = set(N.DTYPE) | {"e4m3", "e5m2"}
_CMP = {"eq", "ne", "lt", "le", "gt", "ge", "lo", "ls", "hi", "hs", "equ", "neu", "ltu", "leu",
        "gtu", "geu", "num", "nan"}
QUALIFIERS = {
    "add": {"rn", "rz", "rm", "rp", "ftz", "sat"}, "sub": {"rn", "rz", "rm", "rp", "ftz", "sat"},
    "mul": {"rn", "rz", "rm", "rp", "ftz", "sat", "lo", "hi", "wide"},
    "mad": {"rn", "rz", "rm", "rp", "ftz", "sat", "lo", "hi", "wide"},
    "fma": {"rn", "rz", "rm", "rp", "ftz", "sat"},
    "div": {"rn", "approx", "full", "ftz"}, "rem": set(), "abs": {"ftz"}, "neg": {"ftz"},
    "min": {"ftz", "NaN", "abs", "relu"}, "max": {"ftz", "NaN", "abs", "relu"},
    "and": set(), "or": set(), "xor": set(), "not": set(), "cnot": set(), "shl": set(),
    "shr": set(), "selp": set(), "setp": _CMP | {"and", "or", "xor", "ftz"}, "mov": set(),
    "cvt": {"rn", "rz", "rm", "rp", "rni", "rzi", "rmi", "rpi", "ftz", "sat", "relu",
            "satfinite"},
    "cvta": {"to", "param", "shared", "global", "shared::cta", "local", "const"},
    "rcp": {"rn", "approx", "ftz"}, "sqrt": {"rn", "approx", "ftz"},
    "rsqrt": {"approx", "ftz"}, "ex2": {"approx", "ftz"}, "lg2": {"approx", "ftz"},
    "sin": {"approx", "ftz"}, "cos": {"approx", "ftz"}, "tanh": {"approx"},
    "copysign": set(), "popc": set(), "clz": set(), "brev": set(), "bfe": set(), "bfi": set(),
}


def _check_qualifiers(ins: Instr) -> None:
    allowed = QUALIFIERS.get(ins.op)
    if allowed is None:
        return
    extra = [p for p in ins.parts[1:] if p not in allowed and p not in _TYPES]
    if extra:
        raise Unsupported(f"{ins.opcode}: qualifier(s) {', '.join('.' + x for x in extra)}")


def compile_instruction(prog, ins: Instr) -> Code:
    _check_qualifiers(ins)
    handler = TABLE.get(ins.op)
    if handler is None:
        _load_units()
        handler = TABLE.get(ins.op)
    if handler is None:
        raise Unsupported(f"opcode {ins.op} ({ins.opcode})")
    return handler(prog, ins)


def _load_units():
    from . import asyncops, memops, syncops  # noqa: F401  (they register their opcodes)


def _ops(ins: Instr, n: int | tuple) -> tuple:
    counts = n if isinstance(n, tuple) else (n,)
    if len(ins.operands) not in counts:
        raise Unsupported(f"{ins.op} with {len(ins.operands)} operands (expected "
                          f"{' or '.join(map(str, counts))})")
    return ins.operands


def _type(ins: Instr) -> str:
    t = ins.parts[-1]
    if t not in N.DTYPE:
        raise Unsupported(f"type .{t} in {ins.opcode}")
    return t


def _quals(ins: Instr) -> set:
    return set(ins.parts[1:-1])


def _rounding(quals, default="rn"):
    modes = [q for q in quals if q in ROUNDING]
    return modes[0] if modes else default


def _div_check(b):
    zero = np.asarray(b) == 0
    if zero.any():
        raise EmulatorError("integer division by zero in an active lane")
    return b


HELPERS = {"_div_check": _div_check}


def _gen(prog, ins: Instr, dst, t: str, expr: str, srcs, extra=None) -> Code:
    body, wregs = prog.write_stmt(dst, t, expr)
    return prog.generate(ins, body, tuple(srcs) + wregs, extra={**HELPERS, **(extra or {})},
                         writes=wregs)


def _read(prog, op, t):
    return prog.read_expr(op, t)


# ----------------------------------------------------------------------------- half types

def _half_binary(fmt: str, fn: str, a: str, b: str, packed: bool) -> str:
    """An f16/bf16 (or packed x2) op computed in float32 and rounded back (innocuous double
    rounding: 24 >= 2 * 11 + 2)."""
    dec = "N.bf16_bits_to_f32" if fmt == "bf16" else "_f16_to_f32"
    enc = "N.f32_to_bf16_bits" if fmt == "bf16" else "N.f32_to_f16_bits"
    if not packed:
        return f"{enc}({fn.format(f'{dec}({a})', f'{dec}({b})')})"
    lo = fn.format(f"{dec}(({a} & np.uint32(0xFFFF)).astype(np.uint16))",
                   f"{dec}(({b} & np.uint32(0xFFFF)).astype(np.uint16))")
    hi = fn.format(f"{dec}(({a} >> np.uint32(16)).astype(np.uint16))",
                   f"{dec}(({b} >> np.uint32(16)).astype(np.uint16))")
    return f"N.pack2_16({enc}({hi}), {enc}({lo}))"


def _f16_to_f32(bits):
    return np.asarray(bits, np.uint16).view(np.float16).astype(np.float32)


HELPERS["_f16_to_f32"] = _f16_to_f32

_HALF = {"f16": ("f16", False), "bf16": ("bf16", False), "f16x2": ("f16", True),
         "bf16x2": ("bf16", True)}


# ----------------------------------------------------------------------------- arithmetic

@register("add", "sub")
def _add(prog, ins):
    d, a, b = _ops(ins, 3)
    t = _type(ins)
    q = _quals(ins)
    if "cc" in q or ins.op in ("addc", "subc"):
        raise Unsupported("carry arithmetic (.cc)")
    sign = "+" if ins.op == "add" else "-"
    ea, ra = _read(prog, a, t)
    eb, rb = _read(prog, b, t)
    if t in _HALF:
        if q - {"rn"}:
            raise Unsupported(f"{ins.opcode}")
        fmt, packed = _HALF[t]
        expr = _half_binary(fmt, "({} " + sign + " {})", ea, eb, packed)
    elif t == "f32":
        mode = _rounding(q)
        if "ftz" in q:
            ea, eb = f"N.ftz({ea})", f"N.ftz({eb})"
        if mode == "rn":
            expr = f"({ea} {sign} {eb})"
        else:
            eb2 = eb if sign == "+" else f"(-{eb})"
            expr = f"N.add_f32({ea}, {eb2}, {mode!r})"
        if "ftz" in q:
            expr = f"N.ftz({expr})"
        if "sat" in q:
            expr = f"N.sat({expr})"
    elif t == "f64":
        if _rounding(q) != "rn":
            raise Unsupported("directed rounding on f64")
        expr = f"({ea} {sign} {eb})"
    elif "sat" in q:
        if t != "s32":
            raise Unsupported(f"{ins.opcode}")
        expr = (f"np.clip({ea}.astype(np.int64) {sign} {eb}.astype(np.int64), "
                f"-2**31, 2**31 - 1).astype(np.int32)")
    else:
        expr = f"({ea} {sign} {eb})"
    return _gen(prog, ins, d, t, expr, ra + rb)


@register("mul")
def _mul(prog, ins):
    d, a, b = _ops(ins, 3)
    t = _type(ins)
    q = _quals(ins)
    ea, ra = _read(prog, a, t)
    eb, rb = _read(prog, b, t)
    dt = t
    if t in _HALF:
        if q - {"rn"}:
            raise Unsupported(f"{ins.opcode}")
        fmt, packed = _HALF[t]
        expr = _half_binary(fmt, "({} * {})", ea, eb, packed)
    elif t == "f32":
        mode = _rounding(q)
        if "ftz" in q:
            ea, eb = f"N.ftz({ea})", f"N.ftz({eb})"
        expr = f"({ea} * {eb})" if mode == "rn" else f"N.mul_f32({ea}, {eb}, {mode!r})"
        if "ftz" in q:
            expr = f"N.ftz({expr})"
        if "sat" in q:
            expr = f"N.sat({expr})"
    elif t == "f64":
        expr = f"({ea} * {eb})"
    elif "wide" in q:
        dt = t[0] + str(N.bits_of(t) * 2)
        expr = f"N.mul_wide({ea}, {eb})"
    elif "hi" in q:
        expr = f"N.mul_hi({ea}, {eb})"
    elif "lo" in q or "24" in ins.parts[0]:
        expr = f"({ea} * {eb})"
    else:
        raise Unsupported(f"integer mul needs .lo, .hi or .wide: {ins.opcode}")
    return _gen(prog, ins, d, dt, expr, ra + rb)


@register("mad", "fma")
def _mad(prog, ins):
    d, a, b, c = _ops(ins, 4)
    t = _type(ins)
    q = _quals(ins)
    ea, ra = _read(prog, a, t)
    eb, rb = _read(prog, b, t)
    if t == "f32":
        mode = _rounding(q)
        ec, rc = _read(prog, c, t)
        if "ftz" in q:
            ea, eb, ec = f"N.ftz({ea})", f"N.ftz({eb})", f"N.ftz({ec})"
        expr = f"N.fma_f32({ea}, {eb}, {ec}, {mode!r})"
        if "ftz" in q:
            expr = f"N.ftz({expr})"
        if "sat" in q:
            expr = f"N.sat({expr})"
        return _gen(prog, ins, d, t, expr, ra + rb + rc)
    if t == "f64":
        ec, rc = _read(prog, c, t)
        return _gen(prog, ins, d, t, f"({ea} * {eb} + {ec})", ra + rb + rc)
    if t in _HALF:
        if "sat" in q or "ftz" in q or _rounding(q) != "rn":
            raise Unsupported(f"{ins.opcode}")
        fmt, packed = _HALF[t]
        ec, rc = _read(prog, c, t)
        dec = "N.bf16_bits_to_f32" if fmt == "bf16" else "_f16_to_f32"
        enc = "N.f32_to_bf16_bits" if fmt == "bf16" else "N.f32_to_f16_bits"
        if packed:
            halves = []
            for sh in ("(({x} & np.uint32(0xFFFF)).astype(np.uint16))",
                       "(({x} >> np.uint32(16)).astype(np.uint16))"):
                parts = [f"{dec}({sh.format(x=e)})" for e in (ea, eb, ec)]
                halves.append(f"{enc}(N.fma_f32({parts[0]}, {parts[1]}, {parts[2]}))")
            expr = f"N.pack2_16({halves[1]}, {halves[0]})"
        else:
            expr = f"{enc}(N.fma_f32({dec}({ea}), {dec}({eb}), {dec}({ec})))"
        return _gen(prog, ins, d, t, expr, ra + rb + rc)
    if ins.op == "fma":
        raise Unsupported(f"fma on .{t}")
    if "wide" in q:
        wt = t[0] + str(N.bits_of(t) * 2)
        ec, rc = _read(prog, c, wt)
        return _gen(prog, ins, d, wt, f"(N.mul_wide({ea}, {eb}) + {ec})", ra + rb + rc)
    ec, rc = _read(prog, c, t)
    if "hi" in q:
        return _gen(prog, ins, d, t, f"(N.mul_hi({ea}, {eb}) + {ec})", ra + rb + rc)
    if "lo" in q:
        return _gen(prog, ins, d, t, f"({ea} * {eb} + {ec})", ra + rb + rc)
    raise Unsupported(f"integer mad needs .lo, .hi or .wide: {ins.opcode}")


@register("div")
def _div(prog, ins):
    d, a, b = _ops(ins, 3)
    t = _type(ins)
    q = _quals(ins)
    ea, ra = _read(prog, a, t)
    eb, rb = _read(prog, b, t)
    if t == "f32":
        if "ftz" in q:
            ea, eb = f"N.ftz({ea})", f"N.ftz({eb})"
        mode = _rounding(q)
        if mode != "rn":
            raise Unsupported("div.f32 with directed rounding")
        expr = f"({ea}.astype(np.float64) / {eb}.astype(np.float64)).astype(np.float32)"
        if "ftz" in q:
            expr = f"N.ftz({expr})"
    elif t == "f64":
        expr = f"({ea} / {eb})"
    else:
        expr = f"N.div_trunc({ea}, _div_check({eb}))"
    return _gen(prog, ins, d, t, expr, ra + rb)


@register("rem")
def _rem(prog, ins):
    d, a, b = _ops(ins, 3)
    t = _type(ins)
    ea, ra = _read(prog, a, t)
    eb, rb = _read(prog, b, t)
    return _gen(prog, ins, d, t, f"N.rem_trunc({ea}, _div_check({eb}))", ra + rb)


@register("abs", "neg")
def _abs_neg(prog, ins):
    d, a = _ops(ins, 2)
    t = _type(ins)
    q = _quals(ins)
    ea, ra = _read(prog, a, t)
    if t in ("bf16", "f16", "bf16x2", "f16x2"):
        bit = "0x8000" if t in ("bf16", "f16") else "0x80008000"
        dt = "np.uint16" if t in ("bf16", "f16") else "np.uint32"
        expr = (f"({ea} ^ {dt}({bit}))" if ins.op == "neg"
                else f"({ea} & ~{dt}({bit}))")
        return _gen(prog, ins, d, t, expr, ra)
    if "ftz" in q:
        ea = f"N.ftz({ea})"
    expr = f"(-{ea})" if ins.op == "neg" else f"np.abs({ea})"
    if N.DTYPE[t].kind == "u":
        raise Unsupported(f"{ins.opcode}")
    return _gen(prog, ins, d, t, expr, ra)


@register("min", "max")
def _minmax(prog, ins):
    ops = _ops(ins, (3, 4))
    d, srcs = ops[0], ops[1:]
    t = _type(ins)
    q = _quals(ins)
    es, rs = [], ()
    for s in srcs:
        e, r = _read(prog, s, t)
        if "ftz" in q:
            e = f"N.ftz({e})"
        if "abs" in q:
            e = f"np.abs({e})"
        es.append(e)
        rs += r
    if t in _HALF:
        if len(srcs) != 2 or "abs" in q or "ftz" in q:
            raise Unsupported(f"{ins.opcode}")
        fmt, packed = _HALF[t]
        fn = ("np.fmin" if ins.op == "min" else "np.fmax") if "NaN" not in q else \
            ("np.minimum" if ins.op == "min" else "np.maximum")
        expr = _half_binary(fmt, fn + "({}, {})", es[0], es[1], packed)
        if "relu" in q:
            raise Unsupported(f"{ins.opcode}")
        return _gen(prog, ins, d, t, expr, rs)
    if t in ("f32", "f64"):
        fn = ("np.fmin" if ins.op == "min" else "np.fmax") if "NaN" not in q else \
            ("np.minimum" if ins.op == "min" else "np.maximum")
    elif N.DTYPE[t].kind in "ui":
        fn = "np.minimum" if ins.op == "min" else "np.maximum"
        if "relu" in q:
            pass
    else:
        raise Unsupported(f"{ins.opcode}")
    expr = es[0]
    for e in es[1:]:
        expr = f"{fn}({expr}, {e})"
    if "relu" in q:
        expr = f"np.maximum({expr}, 0).astype(np.{N.DTYPE[t].name})"
    return _gen(prog, ins, d, t, expr, rs)


@register("and", "or", "xor")
def _logic(prog, ins):
    d, a, b = _ops(ins, 3)
    t = _type(ins)
    sym = {"and": "&", "or": "|", "xor": "^"}[ins.op]
    ea, ra = _read(prog, a, t)
    eb, rb = _read(prog, b, t)
    return _gen(prog, ins, d, t, f"({ea} {sym} {eb})", ra + rb)


@register("not", "cnot")
def _not(prog, ins):
    d, a = _ops(ins, 2)
    t = _type(ins)
    ea, ra = _read(prog, a, t)
    if ins.op == "cnot":
        expr = f"({ea} == 0).astype(np.{N.DTYPE[t].name})"
    else:
        expr = f"(~{ea})"
    return _gen(prog, ins, d, t, expr, ra)


@register("shl", "shr")
def _shift(prog, ins):
    d, a, b = _ops(ins, 3)
    t = _type(ins)
    ea, ra = _read(prog, a, t)
    eb, rb = _read(prog, b, "u32")
    fn = "N.shl" if ins.op == "shl" else "N.shr"
    return _gen(prog, ins, d, t, f"{fn}({ea}, {eb})", ra + rb)


@register("selp")
def _selp(prog, ins):
    d, a, b, c = _ops(ins, 4)
    t = _type(ins)
    ea, ra = _read(prog, a, t)
    eb, rb = _read(prog, b, t)
    ec, rc = _read(prog, c, "pred")
    return _gen(prog, ins, d, t, f"np.where({ec}, {ea}, {eb})", ra + rb + rc)


_CMP_INT = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
            "lo": "<", "ls": "<=", "hi": ">", "hs": ">="}


def _compare(cmp: str, ea: str, eb: str, t: str) -> str:
    if t in ("f32", "f64", "f16", "bf16"):
        if t in ("f16", "bf16"):
            dec = "N.bf16_bits_to_f32" if t == "bf16" else "_f16_to_f32"
            ea, eb = f"{dec}({ea})", f"{dec}({eb})"
        nan = f"(np.isnan({ea}) | np.isnan({eb}))"
        base = cmp[:-1] if cmp.endswith("u") and cmp not in ("equ",) else cmp
        if cmp == "equ":
            base = "eq"
        if cmp == "num":
            return f"(~{nan})"
        if cmp == "nan":
            return nan
        if base not in _CMP_INT or base in ("lo", "ls", "hi", "hs"):
            raise Unsupported(f"float comparison .{cmp}")
        rel = f"({ea} {_CMP_INT[base]} {eb})"
        if cmp.endswith("u"):
            return f"({rel} | {nan})"
        if base == "ne":
            return f"({rel} & ~{nan})"
        return rel
    if cmp not in _CMP_INT:
        raise Unsupported(f"integer comparison .{cmp}")
    if cmp in ("lo", "ls", "hi", "hs") and N.DTYPE[t].kind == "i":
        u = N.UNSIGNED[N.DTYPE[t].itemsize].name
        ea, eb = f"{ea}.view(np.{u})", f"{eb}.view(np.{u})"
    return f"({ea} {_CMP_INT[cmp]} {eb})"


@register("setp")
def _setp(prog, ins):
    ops = _ops(ins, (3, 4))
    t = _type(ins)
    parts = ins.parts[1:-1]
    cmp = parts[0]
    boolop = next((p for p in parts[1:] if p in ("and", "or", "xor")), None)
    q = set(parts)
    ea, ra = _read(prog, ops[1], t)
    eb, rb = _read(prog, ops[2], t)
    if "ftz" in q:
        ea, eb = f"N.ftz({ea})", f"N.ftz({eb})"
    rel = _compare(cmp, ea, eb, t)
    srcs = ra + rb
    dst = ops[0]
    if boolop:
        if len(ops) != 4:
            raise Unsupported("setp with a boolean op needs a predicate c")
        ec, rc = _read(prog, ops[3], "pred")
        srcs += rc
        sym = {"and": "&", "or": "|", "xor": "^"}[boolop]
        p_expr = f"(t_ {sym} {ec})"
        q_expr = f"((~t_) {sym} {ec})"
    else:
        p_expr, q_expr = "t_", "(~t_)"
    body = f"t_ = {rel}\n    "
    regs = srcs
    if isinstance(dst, Pair):
        s1, w1 = prog.write_stmt(dst.first, "pred", p_expr)
        s2, w2 = prog.write_stmt(dst.second, "pred", q_expr)
        body += s1 + ("\n    " + s2 if s2 else "")
        regs += w1 + w2
    else:
        s1, w1 = prog.write_stmt(dst, "pred", p_expr)
        body += s1
        regs += w1
    return prog.generate(ins, body, regs, extra=HELPERS)


@register("set")
def _set(prog, ins):
    raise Unsupported("set (use setp)")


# ----------------------------------------------------------------------------- moves

@register("mov")
def _mov(prog, ins):
    d, a = _ops(ins, 2)
    t = _type(ins)
    if isinstance(d, Vec):                      # unpack: mov.b64 {%r0, %r1}, %rd
        ea, ra = _read(prog, a, t)
        n = len(d.items)
        width = N.bits_of(t) // n
        et = {8: "b8", 16: "b16", 32: "b32"}[width]
        ut = N.UNSIGNED[N.bits_of(t) // 8].name
        body, regs = f"a_ = {ea}.view(np.{ut})\n    ", ra
        for i, item in enumerate(d.items):
            piece = (f"((a_ >> np.{ut}({i * width})) & np.{ut}({(1 << width) - 1}))"
                     f".astype(np.{N.DTYPE[et].name})")
            s, w_ = prog.write_stmt(item, et, piece)
            if s:
                body += s + "\n    "
            regs += w_
        return prog.generate(ins, body, regs, extra=HELPERS)
    if isinstance(a, Vec):                      # pack: mov.b64 %rd, {%r0, %r1}
        n = len(a.items)
        width = N.bits_of(t) // n
        et = {8: "b8", 16: "b16", 32: "b32"}[width]
        ut = N.UNSIGNED[N.bits_of(t) // 8].name
        terms, regs = [], ()
        for i, item in enumerate(a.items):
            e, r = _read(prog, item, et)
            terms.append(f"({e}.astype(np.{ut}) << np.{ut}({i * width}))")
            regs += r
        expr = f"({' | '.join(terms)})"
        if N.DTYPE[t] != np.dtype(ut):
            expr = f"{expr}.view(np.{N.DTYPE[t].name})"
        return _gen(prog, ins, d, t, expr, regs)
    if isinstance(a, Sym):
        if a.name in prog.fn.labels:
            raise Unsupported("mov of a label address")
        expr = prog.const(N.const_array(prog.symbol_address(a.name), t))
        return _gen(prog, ins, d, t, expr, ())
    ea, ra = _read(prog, a, t)
    return _gen(prog, ins, d, t, ea, ra)


# ----------------------------------------------------------------------------- conversions

def _cvt_expr(prog, ins, dtype: str, atype: str, quals: set, ea: str) -> str:
    relu, satf = "relu" in quals, "satfinite" in quals
    frnd = next((q for q in quals if q in ROUNDING), None)
    irnd = next((q for q in quals if q in INT_ROUNDING), None)
    ftz = "ftz" in quals
    sat = "sat" in quals
    if atype == "f32" and ftz:
        ea = f"N.ftz({ea})"
    # float -> float
    if dtype in ("f32", "f64") and atype in ("f32", "f64", "f16", "bf16"):
        src = {"f16": f"_f16_to_f32({ea})", "bf16": f"N.bf16_bits_to_f32({ea})"}.get(atype, ea)
        if irnd:
            fn = {"rni": "np.rint", "rzi": "np.trunc", "rmi": "np.floor", "rpi": "np.ceil"}[irnd]
            src = f"{fn}({src})"
        expr = f"{src}.astype(np.{N.DTYPE[dtype].name})"
        if dtype == "f32" and atype == "f64" and frnd and frnd != "rn":
            expr = f"N.round_directed({src}, np.zeros(np.shape({src})), {frnd!r})"
        if dtype == "f32" and ftz:
            expr = f"N.ftz({expr})"
        if sat:
            expr = f"N.sat({expr})"
        return expr
    if dtype == "bf16" and atype == "f32":
        return f"N.f32_to_bf16_bits({ea}, {(frnd or 'rn')!r}, {relu}, {satf})"
    if dtype == "f16" and atype == "f32":
        return f"N.f32_to_f16_bits({ea}, {(frnd or 'rn')!r}, {relu}, {satf})"
    if dtype in ("e4m3x2", "e5m2x2") and atype == "f16x2":
        fmt = "E4M3" if dtype == "e4m3x2" else "E5M2"
        lo = f"_f16_to_f32(({ea} & np.uint32(0xFFFF)).astype(np.uint16))"
        hi = f"_f16_to_f32(({ea} >> np.uint32(16)).astype(np.uint16))"
        return (f"N.pack2_8(N.f32_to_fp8_bits({hi}, N.{fmt}, {relu}), "
                f"N.f32_to_fp8_bits({lo}, N.{fmt}, {relu}))")
    if dtype in ("f16x2", "bf16x2") and atype in ("e4m3x2", "e5m2x2"):
        fmt = "E4M3" if atype == "e4m3x2" else "E5M2"
        enc = "N.f32_to_f16_bits" if dtype == "f16x2" else "N.f32_to_bf16_bits"
        lo = f"N.fp8_bits_to_f32(({ea} & np.uint16(0xFF)).astype(np.uint8), N.{fmt})"
        hi = f"N.fp8_bits_to_f32(({ea} >> np.uint16(8)).astype(np.uint8), N.{fmt})"
        return f"N.pack2_16({enc}({hi}, 'rn', {relu}), {enc}({lo}, 'rn', {relu}))"
    dk, ak = N.DTYPE[dtype].kind, N.DTYPE[atype].kind
    int_d = dk in "ui" and dtype not in ("bf16", "f16x2", "bf16x2", "e4m3x2", "e5m2x2")
    int_a = ak in "ui" and atype not in ("bf16", "f16x2", "bf16x2", "e4m3x2", "e5m2x2")
    if int_d and int_a:
        if sat:
            if N.DTYPE[atype].itemsize == 8:
                raise Unsupported(f"cvt.sat from .{atype}")
            info = np.iinfo(N.DTYPE[dtype])
            return (f"np.clip({ea}.astype(np.int64), {info.min}, {info.max})"
                    f".astype(np.{N.DTYPE[dtype].name})")
        # extension by the source's signedness, truncation to the destination's width
        wide = N.SIGNED[8] if N.is_signed(atype) else N.UNSIGNED[8]
        return (f"{ea}.astype(np.{wide.name}).view(np.uint64)"
                f".astype(np.{N.UNSIGNED[N.DTYPE[dtype].itemsize].name})"
                f".view(np.{N.DTYPE[dtype].name})")
    if int_d and atype in ("f32", "f64", "f16", "bf16"):
        src = {"f16": f"_f16_to_f32({ea})", "bf16": f"N.bf16_bits_to_f32({ea})"}.get(atype, ea)
        fn = {"rni": "np.rint", "rzi": "np.trunc", "rmi": "np.floor", "rpi": "np.ceil",
              None: None}[irnd]
        if fn is None:
            raise Unsupported("float-to-int cvt needs .rni/.rzi/.rmi/.rpi")
        info = np.iinfo(N.DTYPE[dtype])
        return (f"np.where(np.isnan({src}), 0, np.clip({fn}({src}.astype(np.float64)), "
                f"{info.min}, {info.max})).astype(np.{N.DTYPE[dtype].name})")
    if dtype in ("f32", "f64", "f16") and int_a:
        mode = frnd or "rn"
        if mode != "rn":
            raise Unsupported(f"int-to-float cvt with .{mode}")
        if dtype == "f16":
            return f"N.f32_to_f16_bits({ea}.astype(np.float64).astype(np.float32))"
        return f"{ea}.astype(np.float64).astype(np.{N.DTYPE[dtype].name})"
    raise Unsupported(f"cvt .{dtype}.{atype}")


@register("cvt")
def _cvt(prog, ins):
    ops = _ops(ins, (2, 3))
    dtype, atype = ins.parts[-2], ins.parts[-1]
    quals = set(ins.parts[1:-2])
    if dtype not in N.DTYPE or atype not in N.DTYPE:
        raise Unsupported(f"cvt .{dtype}.{atype}")
    if len(ops) == 3:                           # a pair of f32 into a packed type
        d, a, b = ops
        if atype != "f32" or dtype not in ("bf16x2", "f16x2", "e4m3x2", "e5m2x2"):
            raise Unsupported(f"cvt .{dtype}.{atype} with two sources")
        ea, ra = _read(prog, a, "f32")
        eb, rb = _read(prog, b, "f32")
        relu, satf = "relu" in quals, "satfinite" in quals
        mode = next((q for q in quals if q in ROUNDING), "rn")
        if dtype == "bf16x2":
            if mode == "rn" and not relu and not satf:
                expr = (f"N.pack_bf16x2({ea}, {eb})")
            else:
                expr = (f"N.pack2_16(N.f32_to_bf16_bits({ea}, {mode!r}, {relu}, {satf}), "
                        f"N.f32_to_bf16_bits({eb}, {mode!r}, {relu}, {satf}))")
        elif dtype == "f16x2":
            expr = (f"N.pack2_16(N.f32_to_f16_bits({ea}, {mode!r}, {relu}, {satf}), "
                    f"N.f32_to_f16_bits({eb}, {mode!r}, {relu}, {satf}))")
        else:
            fmt = "E4M3" if dtype == "e4m3x2" else "E5M2"
            if not satf:
                raise Unsupported(f"cvt to .{dtype} without .satfinite")
            expr = (f"N.pack2_8(N.f32_to_fp8_bits({ea}, N.{fmt}, {relu}), "
                    f"N.f32_to_fp8_bits({eb}, N.{fmt}, {relu}))")
        return _gen(prog, ins, d, dtype, expr, ra + rb)
    d, a = ops
    ea, ra = prog.read_expr(a, atype)
    return _gen(prog, ins, d, dtype, _cvt_expr(prog, ins, dtype, atype, quals, ea), ra)


@register("cvta")
def _cvta(prog, ins):
    from .memory import PARAM_GENERIC_BASE, SHARED_GENERIC_BASE
    d, a = _ops(ins, 2)
    t = _type(ins)
    q = ins.parts[1:-1]
    to = "to" in q
    space = next((s for s in q if s in ("param", "shared", "global", "local", "const",
                                        "shared::cta")), None)
    ea, ra = _read(prog, a, t)
    if space == "global":
        return _gen(prog, ins, d, t, ea, ra)
    if space == "param":
        base = PARAM_GENERIC_BASE
    elif space in ("shared", "shared::cta"):
        base = SHARED_GENERIC_BASE
    else:
        raise Unsupported(f"cvta to/from .{space}")
    kb = prog.const(N.const_array(base, t))
    expr = f"({ea} - {kb})" if to else f"({ea} + {kb})"
    return _gen(prog, ins, d, t, expr, ra)


# ----------------------------------------------------------------------------- special math

_UNARY_F = {"rcp": "1.0 / {x}", "sqrt": "np.sqrt({x})", "rsqrt": "1.0 / np.sqrt({x})",
            "ex2": "np.exp2({x})", "lg2": "np.log2({x})", "sin": "np.sin({x})",
            "cos": "np.cos({x})", "tanh": "np.tanh({x})"}


@register(*_UNARY_F)
def _unary_float(prog, ins):
    d, a = _ops(ins, 2)
    t = _type(ins)
    q = _quals(ins)
    if t in ("f16", "bf16", "f16x2", "bf16x2") and ins.op in ("ex2", "tanh"):
        fmt, packed = _HALF[t]
        ea, ra = _read(prog, a, t)
        dec = "N.bf16_bits_to_f32" if fmt == "bf16" else "_f16_to_f32"
        enc = "N.f32_to_bf16_bits" if fmt == "bf16" else "N.f32_to_f16_bits"
        if packed:
            lo = _UNARY_F[ins.op].format(
                x=f"{dec}(({ea} & np.uint32(0xFFFF)).astype(np.uint16)).astype(np.float64)")
            hi = _UNARY_F[ins.op].format(
                x=f"{dec}(({ea} >> np.uint32(16)).astype(np.uint16)).astype(np.float64)")
            expr = (f"N.pack2_16({enc}(({hi}).astype(np.float32)), "
                    f"{enc}(({lo}).astype(np.float32)))")
        else:
            expr = f"{enc}(({_UNARY_F[ins.op].format(x=f'{dec}({ea}).astype(np.float64)')})" \
                   f".astype(np.float32))"
        return _gen(prog, ins, d, t, expr, ra)
    if t not in ("f32", "f64"):
        raise Unsupported(f"{ins.opcode}")
    ea, ra = _read(prog, a, t)
    if "ftz" in q:
        ea = f"N.ftz({ea})"
    x = f"{ea}.astype(np.float64)" if t == "f32" else ea
    expr = f"({_UNARY_F[ins.op].format(x=x)})"
    if t == "f32":
        expr = f"{expr}.astype(np.float32)"
        if "ftz" in q:
            expr = f"N.ftz({expr})"
    return _gen(prog, ins, d, t, expr, ra)


@register("copysign")
def _copysign(prog, ins):
    d, a, b = _ops(ins, 3)
    t = _type(ins)
    ea, ra = _read(prog, a, t)
    eb, rb = _read(prog, b, t)
    return _gen(prog, ins, d, t, f"np.copysign({eb}, {ea})", ra + rb)


@register("testp")
def _testp(prog, ins):
    d, a = _ops(ins, 2)
    t = _type(ins)
    kind = ins.parts[1]
    ea, ra = _read(prog, a, t)
    expr = {"finite": f"np.isfinite({ea})", "infinite": f"np.isinf({ea})",
            "number": f"~np.isnan({ea})", "notanumber": f"np.isnan({ea})",
            "normal": f"(np.isfinite({ea}) & (np.abs({ea}) >= np.finfo(np.{N.DTYPE[t].name})"
                      f".tiny))",
            "subnormal": f"((np.abs({ea}) < np.finfo(np.{N.DTYPE[t].name}).tiny) & "
                         f"({ea} != 0))"}.get(kind)
    if expr is None:
        raise Unsupported(ins.opcode)
    return _gen(prog, ins, d, "pred", expr, ra)


@register("popc", "clz", "brev")
def _bits1(prog, ins):
    d, a = _ops(ins, 2)
    t = _type(ins)
    ea, ra = _read(prog, a, t)
    dt = t if ins.op == "brev" else "u32"
    return _gen(prog, ins, d, dt, f"N.{ins.op}({ea})", ra)


@register("bfe")
def _bfe(prog, ins):
    d, a, b, c = _ops(ins, 4)
    t = _type(ins)
    ea, ra = _read(prog, a, t)
    eb, rb = _read(prog, b, "u32")
    ec, rc = _read(prog, c, "u32")
    return _gen(prog, ins, d, t, f"N.bfe({ea}, {eb}, {ec})", ra + rb + rc)


@register("bfi")
def _bfi(prog, ins):
    d, a, b, c, e = _ops(ins, 5)
    t = _type(ins)
    ea, ra = _read(prog, a, t)
    eb, rb = _read(prog, b, t)
    ec, rc = _read(prog, c, "u32")
    ee, re_ = _read(prog, e, "u32")
    return _gen(prog, ins, d, t, f"N.bfi({ea}, {eb}, {ec}, {ee})", ra + rb + rc + re_)


@register("prmt")
def _prmt(prog, ins):
    d, a, b, c = _ops(ins, 4)
    mode = ins.parts[2] if len(ins.parts) == 3 else None
    ea, ra = _read(prog, a, "b32")
    eb, rb = _read(prog, b, "b32")
    ec, rc = _read(prog, c, "b32")
    return _gen(prog, ins, d, "b32", f"N.prmt({ea}, {eb}, {ec}, {mode!r})", ra + rb + rc)


# ----------------------------------------------------------------------------- control flow

@register("bra")
def _bra(prog, ins):
    (target,) = _ops(ins, 1)
    if not isinstance(target, Sym) or target.name not in prog.fn.labels:
        raise Unsupported(f"branch target {target!r} (labels only)")
    code = Code(BRANCH, None, ins, target=prog.fn.labels[target.name],
                uni="uni" in ins.parts)
    if ins.guard is not None:
        code.guard = prog.reg(ins.guard[0])
        code.neg = ins.guard[1]
        code.regs = (code.guard,)
    return code


@register("ret", "exit")
def _ret(prog, ins):
    _ops(ins, 0)
    code = Code(EXIT, None, ins)
    if ins.guard is not None:
        code.guard = prog.reg(ins.guard[0])
        code.neg = ins.guard[1]
        code.regs = (code.guard,)
    return code


@register("trap", "brkpt")
def _trap(prog, ins):
    def trap(g, idx):
        raise EmulatorError(f"{ins.op} executed")
    return prog.wrap(ins, trap)


@register("mapa", "getctarank")
def _mapa(prog, ins):
    """Distributed shared memory addresses: cluster.py."""
    from .cluster import compile_mapa
    return compile_mapa(prog, ins)


@register("nanosleep", "pmevent", "prefetch", "prefetchu", "discard", "applypriority",
          "createpolicy", "griddepcontrol")
def _noop(prog, ins):
    if ins.op == "createpolicy":
        d = ins.operands[0]
        write = prog.writer(d, "b64")

        def policy(g, idx):
            write(g, idx, np.zeros(len(idx), np.uint64))
        return prog.wrap(ins, policy, prog.regs_of(d))
    return prog.wrap(ins, lambda g, idx: None, prog.regs_of(*ins.operands))

"""PTX text -> a Module of entry functions: parameters, registers, shared variables, labels and
instructions with parsed operands. Only the syntax our kernels (and PTX like them) use; anything
else is a ParseError naming the line, never a silent skip.
"""

from __future__ import annotations

import ast
import operator
import re
import struct
from dataclasses import dataclass, field

from .errors import ParseError

# ----------------------------------------------------------------------------- operands


@dataclass(frozen=True)
class Reg:
    name: str                       # "%r1", "%tid.x" (special registers keep their suffix)


@dataclass(frozen=True)
class Imm:
    value: int | float              # an integer, or a float (0f/0d literals keep their bits)
    bits: int | None = None         # 32 or 64 for 0fXXXXXXXX / 0dXXXXXXXXXXXXXXXX literals
    raw: int | None = None          # the literal's bit pattern


@dataclass(frozen=True)
class Sym:
    name: str                       # a label, parameter or variable name


@dataclass(frozen=True)
class Mem:
    base: Reg | Sym | None          # [%r+8], [name+4], [imm]
    offset: int = 0
    coords: tuple = ()              # a tensor operand: [%tmap, {%x, %y, ...}]


@dataclass(frozen=True)
class Vec:
    items: tuple                    # {%a, %b, ...}


@dataclass(frozen=True)
class Not:
    operand: object                 # !%p (a negated predicate source)


@dataclass(frozen=True)
class Pair:
    first: object                   # %p|%q (setp, shfl: the second destination)
    second: object


SINK = Reg("_")


# ----------------------------------------------------------------------------- declarations

# PTX type -> size in bytes
TYPE_BYTES = {
    "pred": 0, "b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2,
    "e4m3": 1, "e5m2": 1,
    "b32": 4, "u32": 4, "s32": 4, "f32": 4, "f16x2": 4, "bf16x2": 4, "tf32": 4,
    "b64": 8, "u64": 8, "s64": 8, "f64": 8, "b128": 16,
    "e4m3x2": 2, "e5m2x2": 2,
}


@dataclass
class Param:
    name: str
    ptype: str                      # "u64", "b8", ...
    count: int                      # array length (1 for a scalar)
    align: int
    offset: int = 0                 # byte offset in the parameter buffer

    @property
    def size(self) -> int:
        return TYPE_BYTES[self.ptype] * self.count


@dataclass
class RegDecl:
    name: str
    ptype: str
    index: int                      # register id in the function's file


@dataclass
class SharedVar:
    name: str
    align: int
    size: int                       # bytes; 0 for `.extern .shared x[]` (the dynamic part)
    extern: bool


@dataclass
class Instr:
    opcode: str                     # "add.f32", "wgmma.mma_async.sync.aligned.m64n64k16.f32..."
    parts: tuple                    # the opcode split at '.', e.g. ("add", "f32")
    operands: tuple
    guard: tuple | None             # (predicate register name, negated) or None
    line: int                       # 1-based line of the statement in the PTX text
    text: str                       # the statement as written (one line)
    index: int = 0                  # its position in the function (the "pc")

    @property
    def op(self) -> str:
        return self.parts[0]


@dataclass
class Function:
    name: str
    entry: bool
    params: list[Param]
    regs: dict[str, RegDecl] = field(default_factory=dict)
    instrs: list[Instr] = field(default_factory=list)
    labels: dict[str, int] = field(default_factory=dict)
    shared: list[SharedVar] = field(default_factory=list)   # declared inside the body
    maxntid: tuple[int, int, int] | None = None
    reqntid: tuple[int, int, int] | None = None
    minnctapersm: int | None = None
    param_bytes: int = 0

    def param(self, name: str) -> Param | None:
        for p in self.params:
            if p.name == name:
                return p
        return None


@dataclass
class Module:
    functions: dict[str, Function]
    shared: list[SharedVar]         # module-scope .shared / .extern .shared
    version: str = ""
    target: str = ""
    text: str = ""


# ----------------------------------------------------------------------------- tokenizing

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_IDENT = r"[A-Za-z_$%][\w$]*"
_LABEL = re.compile(rf"\s*({_IDENT})\s*:(?!:)")
_REG_RANGE = re.compile(r"^(%?[\w$]+)<(\d+)>$")
_REG_NAME = re.compile(r"%[\w$]+(\.[xyz])?")
_FLOAT_LIT = re.compile(r"[-+]?\d+\.\d*([eE][-+]?\d+)?|[-+]?\d+[eE][-+]?\d+")
_SYM_NAME = re.compile(r"[A-Za-z_$][\w$]*")


def _strip_comments(text: str) -> str:
    # keep newlines so that line numbers stay right
    return _COMMENT.sub(lambda m: "\n" * m.group(0).count("\n") + " ", text)


def _split_top(text: str, sep: str = ",") -> list[str]:
    """Split at `sep` outside (), [], {}."""
    if not any(c in text for c in "([{"):
        parts = [x.strip() for x in text.split(sep)]
        return parts if (len(parts) > 1 or parts[0]) else []
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    tail = "".join(cur).strip()
    if tail or out:
        out.append(tail)
    return out


# ----------------------------------------------------------------------------- constants

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Div: operator.floordiv, ast.Mod: operator.mod,
           ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitAnd: operator.and_,
           ast.BitOr: operator.or_, ast.BitXor: operator.xor}
_UNOPS = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}
_HEXFLOAT = re.compile(r"^0([fFdD])([0-9a-fA-F]+)$")
_INT = re.compile(r"^[-+]?(0[xX][0-9a-fA-F]+|0[bB][01]+|0[0-7]*|[1-9]\d*)[uU]?$")


def const_expr(text: str) -> int:
    """An integer constant expression as PTX writes them: 2 * 16384, (1 << 7) - 1, 0x40, 017."""
    t = text.strip()
    if _INT.match(t):
        return _int_literal(t)
    expr = re.sub(r"\b0[xX][0-9a-fA-F]+[uU]?\b|\b\d+[uU]?\b",
                  lambda m: str(_int_literal(m.group(0))), t)
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise ValueError(f"not a constant expression: {text!r}") from None
    return _eval(tree.body, text)


def _int_literal(t: str) -> int:
    t = t.rstrip("uU")
    sign = -1 if t.startswith("-") else 1
    t = t.lstrip("+-")
    if t[:2] in ("0x", "0X"):
        v = int(t, 16)
    elif t[:2] in ("0b", "0B"):
        v = int(t[2:], 2)
    elif len(t) > 1 and t.startswith("0"):
        v = int(t, 8)
    else:
        v = int(t)
    return sign * v


def _eval(node, text):
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_eval(node.left, text), _eval(node.right, text))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
        return _UNOPS[type(node.op)](_eval(node.operand, text))
    raise ValueError(f"not a constant expression: {text!r}")


def parse_operand(text: str):
    t = text.strip()
    if not t:
        raise ValueError("empty operand")
    if t == "_":
        return SINK
    if t.startswith("!"):
        return Not(parse_operand(t[1:]))
    if t.startswith("{"):
        if not t.endswith("}"):
            raise ValueError(f"unbalanced braces in {text!r}")
        return Vec(tuple(parse_operand(x) for x in _split_top(t[1:-1])))
    if t.startswith("["):
        if not t.endswith("]"):
            raise ValueError(f"unbalanced brackets in {text!r}")
        return _parse_mem(t[1:-1])
    if "|" in t:
        a, b = t.split("|", 1)
        return Pair(parse_operand(a), parse_operand(b))
    m = _HEXFLOAT.match(t)
    if m:
        raw = int(m.group(2), 16)
        if m.group(1) in "fF":
            if len(m.group(2)) != 8:
                raise ValueError(f"0f literal needs 8 hex digits: {text!r}")
            return Imm(struct.unpack("<f", struct.pack("<I", raw))[0], 32, raw)
        if len(m.group(2)) != 16:
            raise ValueError(f"0d literal needs 16 hex digits: {text!r}")
        return Imm(struct.unpack("<d", struct.pack("<Q", raw))[0], 64, raw)
    if t.startswith("%"):
        if not _REG_NAME.fullmatch(t):
            raise ValueError(f"bad register {text!r}")
        return Reg(t)
    if _FLOAT_LIT.fullmatch(t):
        return Imm(float(t), 64, struct.unpack("<Q", struct.pack("<d", float(t)))[0])
    if _SYM_NAME.fullmatch(t):
        return Sym(t)
    return Imm(const_expr(t))


def _parse_mem(inner: str) -> Mem:
    parts = _split_top(inner)
    if len(parts) == 2 and parts[1].startswith("{"):
        base = parse_operand(parts[0])
        coords = parse_operand(parts[1])
        return Mem(base, 0, coords.items)
    if len(parts) != 1:
        raise ValueError(f"bad address [{inner}]")
    t = parts[0].replace(" ", "")
    m = re.fullmatch(r"(%?[A-Za-z_$][\w$]*(?:\.[xyz])?)?([-+].+)?", t)
    if not m or (m.group(1) is None and m.group(2) is None):
        return Mem(None, const_expr(t))
    base_txt, off_txt = m.group(1), m.group(2)
    base = Reg(base_txt) if base_txt.startswith("%") else Sym(base_txt)
    off = const_expr(off_txt) if off_txt else 0
    return Mem(base, off)


# ----------------------------------------------------------------------------- statements

class _Scanner:
    """Statements, block braces and labels of a function body, with their line numbers."""

    def __init__(self, text: str, start: int):
        self.text = text
        self.pos = start

    def line_of(self, pos: int) -> int:
        return self.text.count("\n", 0, pos) + 1


def parse(text: str) -> Module:
    """Parse a whole PTX module (the text the driver JIT gets)."""
    clean = _strip_comments(text)
    line_starts = [0]
    for m in re.finditer("\n", clean):
        line_starts.append(m.end())

    def line_of(pos):
        lo, hi = 0, len(line_starts)
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            if line_starts[mid] <= pos:
                lo = mid
            else:
                hi = mid
        return lo + 1

    module = Module({}, [], text=text)
    pos, n = 0, len(clean)
    while pos < n:
        while pos < n and clean[pos].isspace():
            pos += 1
        if pos >= n:
            break
        if clean[pos] == "#":
            raise ParseError(f"line {line_of(pos)}: preprocessor directive left in the PTX "
                             "(expand it first, as ptxattn.ptx.source does)")
        # a function header runs to its '{' (or ';' for a declaration)
        m = re.compile(r"\s*(\.(visible|weak|extern)\s+)*\.(entry|func)\b").match(clean, pos)
        if m:
            brace = clean.find("{", pos)
            semi = clean.find(";", pos)
            if semi != -1 and (brace == -1 or semi < brace):
                pos = semi + 1                      # a prototype: nothing to run
                continue
            header = clean[pos:brace]
            fn = _parse_header(header, m.group(3) == "entry", line_of(pos))
            end = _parse_body(clean, brace, fn, module, line_of)
            module.functions[fn.name] = fn
            pos = end
            continue
        if clean.startswith((".version", ".target", ".address_size"), pos):
            # these directives end at the end of their line, without ';'
            eol = clean.find("\n", pos)
            eol = n if eol == -1 else eol
            _module_directive(" ".join(clean[pos:eol].split()).rstrip(";"), module,
                              line_of(pos))
            pos = eol + 1
            continue
        semi = clean.find(";", pos)
        if semi == -1:
            raise ParseError(f"line {line_of(pos)}: statement without ';': "
                             f"{clean[pos:pos + 60]!r}")
        stmt = " ".join(clean[pos:semi].split())
        _module_directive(stmt, module, line_of(pos))
        pos = semi + 1
    return module


def _module_directive(stmt: str, module: Module, line: int) -> None:
    words = stmt.split()
    if not words:
        return
    head = words[0]
    if head == ".version":
        module.version = words[1]
    elif head == ".target":
        module.target = " ".join(words[1:])
    elif head == ".address_size":
        if words[1] != "64":
            raise ParseError(f"line {line}: only .address_size 64 is supported")
    elif ".shared" in words:
        module.shared.append(_shared_var(stmt, line))
    elif head in (".global", ".const", ".extern", ".visible") or ".global" in words:
        raise ParseError(f"line {line}: module-scope variable not supported by the emulator: "
                         f"{stmt!r}")
    else:
        raise ParseError(f"line {line}: unknown module directive {stmt!r}")


def _shared_var(stmt: str, line: int) -> SharedVar:
    m = re.fullmatch(r"(\.extern\s+)?\.shared\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+([\w$]+)"
                     r"\s*\[\s*([^\]]*)\]", stmt)
    if not m:
        m2 = re.fullmatch(r"(\.extern\s+)?\.shared\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+([\w$]+)",
                          stmt)
        if not m2:
            raise ParseError(f"line {line}: cannot read the shared variable {stmt!r}")
        ptype, name = m2.group(3), m2.group(4)
        align = int(m2.group(2) or TYPE_BYTES.get(ptype, 1))
        return SharedVar(name, align, TYPE_BYTES[ptype], bool(m2.group(1)))
    ptype, name, count = m.group(3), m.group(4), m.group(5).strip()
    if ptype not in TYPE_BYTES:
        raise ParseError(f"line {line}: unknown type .{ptype} in {stmt!r}")
    align = int(m.group(2) or max(TYPE_BYTES[ptype], 1))
    extern = bool(m.group(1))
    if count == "":
        if not extern:
            raise ParseError(f"line {line}: an unsized shared array must be .extern: {stmt!r}")
        size = 0
    else:
        size = const_expr(count) * TYPE_BYTES[ptype]
    return SharedVar(name, align, size, extern)


def _parse_header(header: str, entry: bool, line: int) -> Function:
    m = re.search(r"\.(?:entry|func)\s+(?:\([^)]*\)\s*)?([\w$]+)\s*(\((.*?)\))?(.*)$", header,
                  re.S)
    if not m:
        raise ParseError(f"line {line}: cannot read the function header")
    name = m.group(1)
    params: list[Param] = []
    if m.group(3) and m.group(3).strip():
        for ptxt in _split_top(m.group(3)):
            params.append(_param(" ".join(ptxt.split()), line))
    offset = 0
    for p in params:
        offset = -(-offset // p.align) * p.align
        p.offset = offset
        offset += p.size
    fn = Function(name, entry, params, param_bytes=offset)
    tail = " ".join(m.group(4).split())
    for d in re.finditer(r"\.(maxntid|reqntid|minnctapersm|maxnreg|maxclusterrank|"
                         r"reqnctapercluster|explicitcluster|noreturn|pragma)\b([^.]*)", tail):
        kind, args = d.group(1), [a for a in d.group(2).replace(",", " ").split() if a]
        if kind in ("maxntid", "reqntid"):
            dims = tuple(int(a) for a in args) + (1,) * (3 - len(args))
            setattr(fn, kind, dims)
        elif kind == "minnctapersm":
            fn.minnctapersm = int(args[0])
    return fn


def _param(text: str, line: int) -> Param:
    m = re.fullmatch(r"\.param\s+(?:\.align\s+(\d+)\s+)?(?:\.ptr\s+\S+\s+)?\.(\w+)\s+([\w$]+)"
                     r"(?:\s*\[\s*(\d+)\s*\])?", text)
    if not m:
        raise ParseError(f"line {line}: cannot read the parameter {text!r}")
    ptype = m.group(2)
    if ptype not in TYPE_BYTES or ptype == "pred":
        raise ParseError(f"line {line}: unsupported parameter type .{ptype}")
    count = int(m.group(4)) if m.group(4) else 1
    align = int(m.group(1)) if m.group(1) else TYPE_BYTES[ptype]
    return Param(m.group(3), ptype, count, align)


def _parse_body(clean: str, brace: int, fn: Function, module: Module, line_of) -> int:
    """Statements from the '{' at `brace` to its '}'; returns the position after it."""
    pos = brace + 1
    n = len(clean)
    depth = 1
    scopes: list[dict[str, str]] = [{}]        # nested { } blocks: name -> register id name
    counter = [0]

    def declare(name: str, ptype: str, line: int) -> None:
        unique = name
        if any(name in s for s in scopes) or name in fn.regs:
            # a nested block re-declares a name: give it a file-wide unique name
            unique = f"{name}#{len(fn.regs)}"
        scopes[-1][name] = unique
        fn.regs[unique] = RegDecl(unique, ptype, counter[0])
        counter[0] += 1

    def resolve(op):
        if isinstance(op, Reg) and op is not SINK:
            for s in reversed(scopes):
                if op.name in s:
                    return Reg(s[op.name])
            return op
        if isinstance(op, Vec):
            return Vec(tuple(resolve(x) for x in op.items))
        if isinstance(op, Mem):
            return Mem(resolve(op.base) if op.base is not None else None, op.offset,
                       tuple(resolve(x) for x in op.coords))
        if isinstance(op, Pair):
            return Pair(resolve(op.first), resolve(op.second))
        if isinstance(op, Not):
            return Not(resolve(op.operand))
        return op

    while True:
        while pos < n and clean[pos].isspace():
            pos += 1
        if pos >= n:
            raise ParseError(f"function {fn.name}: missing '}}'")
        ch = clean[pos]
        if ch == "{":
            depth += 1
            scopes.append({})
            pos += 1
            continue
        if ch == "}":
            depth -= 1
            pos += 1
            if depth == 0:
                return pos
            scopes.pop()
            continue
        m = _LABEL.match(clean, pos)
        if m:
            name = m.group(1)
            if name in fn.labels:
                raise ParseError(f"line {line_of(pos)}: label {name} defined twice")
            fn.labels[name] = len(fn.instrs)
            pos = m.end()
            continue
        semi = _statement_end(clean, pos)
        if semi == -1:
            raise ParseError(f"line {line_of(pos)}: statement without ';'")
        line = line_of(pos)
        stmt = " ".join(clean[pos:semi].split())
        pos = semi + 1
        if not stmt:
            continue
        if stmt.startswith("."):
            _body_directive(stmt, fn, line, declare)
            continue
        try:
            ins = _instruction(stmt, line)
        except (ValueError, IndexError) as e:
            raise ParseError(f"line {line}: {e}: {stmt!r}") from None
        ins = Instr(ins.opcode, ins.parts, tuple(resolve(o) for o in ins.operands),
                    (resolve(Reg(ins.guard[0])).name, ins.guard[1]) if ins.guard else None,
                    line, stmt, len(fn.instrs))
        fn.instrs.append(ins)


def _statement_end(text: str, pos: int) -> int:
    # ';' never appears inside an operand, so the first one ends the statement
    return text.find(";", pos)


def _statement_end_nested(text: str, pos: int) -> int:
    depth = 0
    n = len(text)
    while pos < n:
        ch = text[pos]
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
            if depth < 0:
                return -1
        elif ch == ";" and depth == 0:
            return pos
        pos += 1
    return -1


def _body_directive(stmt: str, fn: Function, line: int, declare) -> None:
    words = stmt.split()
    head = words[0]
    if head == ".reg":
        m = re.fullmatch(r"\.reg\s+(?:\.v(\d)\s+)?\.(\w+)\s+(.*)", stmt)
        if not m or m.group(1):
            raise ParseError(f"line {line}: unsupported register declaration {stmt!r}")
        ptype = m.group(2)
        if ptype not in TYPE_BYTES:
            raise ParseError(f"line {line}: unknown register type .{ptype}")
        for item in _split_top(m.group(3)):
            item = item.replace(" ", "")
            r = _REG_RANGE.match(item)
            if r:
                for i in range(int(r.group(2))):
                    declare(f"{r.group(1)}{i}", ptype, line)
            else:
                declare(item, ptype, line)
    elif head in (".shared", ".extern") and ".shared" in words:
        fn.shared.append(_shared_var(stmt, line))
    elif head in (".pragma", ".loc", ".file"):
        pass
    elif head in (".local", ".param", ".const", ".global"):
        raise ParseError(f"line {line}: {head} variables inside a function are not supported "
                         f"by the emulator: {stmt!r}")
    else:
        raise ParseError(f"line {line}: unknown directive {stmt!r}")


def _instruction(stmt: str, line: int) -> Instr:
    guard = None
    rest = stmt
    if rest.startswith("@"):
        m = re.match(r"@(!?)(%[\w$]+)\s+", rest)
        if not m:
            raise ValueError("bad guard predicate")
        guard = (m.group(2), bool(m.group(1)))
        rest = rest[m.end():]
    sp = rest.find(" ")
    opcode, args = (rest, "") if sp == -1 else (rest[:sp], rest[sp + 1:])
    operands = tuple(parse_operand(a) for a in _split_top(args)) if args.strip() else ()
    return Instr(opcode, tuple(opcode.split(".")), operands, guard, line, stmt)

"""Offline inspection of a stage: PTX -> cubin (ptxas) -> SASS (nvdisasm) -> a summary.

What runs on the GPU is what the driver JIT makes of the PTX; `ptxas -arch=sm_90a` is the same
compiler, run whole-program, so its cubin is the closest offline view of that code. (Never use
nvJitLink or relocatable `-c` compiles for this: they silently drop `setmaxnreg`.)

Everything here works without a GPU. The NVIDIA tools come from, in this order: PATH,
$CUDA_HOME/bin (or $CUDA_PATH/bin), the PyPI wheels of the `tools` extra, /usr/local/cuda/bin.

    >>> from ptxattn import sass
    >>> asm = sass.assemble("stage1")                 # Assembled(cubin, log, ...)
    >>> text = sass.disassemble(asm.cubin)            # SASS text
    >>> print(sass.format_summary(sass.summarize(text, asm.log)))
    >>> sass.grep(text, "MUFU.EX2")
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .. import builds as _builds
from .. import stages as _stages
from ..errors import PtxattnError

TOOLS = ("ptxas", "nvdisasm", "cuobjdump")

# The PyPI wheel that ships each tool (the `tools` extra in pyproject.toml).
TOOL_WHEELS = {
    "ptxas": "nvidia-cuda-nvcc",
    "nvdisasm": "nvidia-cuda-nvdisasm",
    "cuobjdump": "nvidia-cuda-cuobjdump",
}

INSTALL_HINT = ("pip install 'ptxattn[tools]' (the nvidia-cuda-nvcc, nvidia-cuda-nvdisasm and "
                "nvidia-cuda-cuobjdump wheels), or install a CUDA toolkit and put its bin/ on PATH "
                "or set CUDA_HOME")

# Last-resort toolkit locations; a module attribute so tests can empty it.
DEFAULT_CUDA_HOMES: tuple[str, ...] = ("/usr/local/cuda",)


class ToolNotFoundError(PtxattnError):
    """No ptxas / nvdisasm / cuobjdump could be found."""


class AssemblyError(PtxattnError):
    """ptxas rejected the PTX. `log` holds its full output (for a stage, with each `line N;`
    mapped back to the stage file or include that it came from)."""

    def __init__(self, message: str, log: str):
        super().__init__(message)
        self.log = log


# --------------------------------------------------------------------------- tool discovery

@dataclass(frozen=True)
class Tool:
    name: str
    path: Path
    source: str      # where it was found: "PATH", "CUDA_HOME", "wheel nvidia-cuda-nvcc", ...


def _wheel_bin_dirs() -> list[tuple[str, Path]]:
    """bin/ folders inside the installed nvidia-cuda-* wheels, as (distribution, folder).

    The layout changed between releases (12.x: nvidia/cuda_nvcc/bin, 13.x: nvidia/cu13/bin), so
    the folders are read from each wheel's own file list rather than guessed.
    """
    found: list[tuple[str, Path]] = []
    for dist_name in dict.fromkeys(TOOL_WHEELS.values()):
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
        dirs: set[Path] = set()
        for entry in dist.files or ():
            parts = entry.parts
            if len(parts) >= 2 and parts[-2] == "bin" and parts[-1] in TOOLS:
                dirs.add(Path(dist.locate_file(entry)).parent)
        if not dirs:  # no RECORD: fall back to the known layouts under site-packages/nvidia
            root = Path(dist.locate_file("nvidia"))
            dirs.update(p.parent for t in TOOLS for p in root.glob(f"*/bin/{t}"))
        found.extend((dist_name, d) for d in sorted(dirs))
    return found


def _candidates(name: str):
    """Every place `name` might live, in search order, as (source, path)."""
    on_path = shutil.which(name)
    if on_path:
        yield "PATH", Path(on_path)
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            yield var, Path(home) / "bin" / name
    # The wheel that is meant to carry the tool first, then the others (a future release may
    # move tools between wheels).
    dirs = sorted(_wheel_bin_dirs(), key=lambda item: item[0] != TOOL_WHEELS[name])
    for dist_name, folder in dirs:
        yield f"wheel {dist_name}", folder / name
    for home in DEFAULT_CUDA_HOMES:
        yield home, Path(home) / "bin" / name


def locate(name: str) -> Tool | None:
    """The first usable `name` (ptxas, nvdisasm, cuobjdump), or None."""
    if name not in TOOLS:
        raise ValueError(f"tool: expected one of {', '.join(TOOLS)}, got {name!r}")
    for source, path in _candidates(name):
        if path.is_file() and os.access(path, os.X_OK):
            return Tool(name, path, source)
    return None


def find_tool(name: str) -> Tool:
    """Like locate(), but raise ToolNotFoundError naming what to install."""
    tool = locate(name)
    if tool is None:
        raise ToolNotFoundError(
            f"{name} not found (looked on PATH, in $CUDA_HOME/bin, in the {TOOL_WHEELS[name]} "
            f"wheel and in {', '.join(DEFAULT_CUDA_HOMES) or 'no default toolkit'}); "
            f"install it with: {INSTALL_HINT}")
    return tool


# "Cuda compilation tools, release 13.0, V13.0.88": the line every CUDA tool's --version ends with.
_RELEASE = re.compile(r"release (\d+)\.(\d+), V([\d.]+)")


def parse_version(text: str) -> str | None:
    """The full version ("13.0.88") from a CUDA tool's `--version` output, or None."""
    m = _RELEASE.search(text)
    return m.group(3) if m else None


def tool_version(tool: Tool) -> str | None:
    """`tool --version`, parsed; None when the tool does not say (or cannot be run)."""
    try:
        proc = subprocess.run([str(tool.path), "--version"], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_version(proc.stdout + proc.stderr)


def tool_report() -> dict[str, dict[str, str | None]]:
    """Which tools were found, where and which version, for `ptxattn info`."""
    report = {}
    for name in TOOLS:
        tool = locate(name)
        report[name] = {"path": str(tool.path) if tool else None,
                        "source": tool.source if tool else None,
                        "version": tool_version(tool) if tool else None}
    return report


def _release(version: str | None) -> tuple[str, ...] | None:
    return tuple(version.split(".")[:2]) if version else None


def version_mismatch(report: dict[str, dict[str, str | None]]) -> str | None:
    """A warning when ptxas and the disassembler that `disassemble` would use come from
    different CUDA releases (major.minor), else None.

    They are found independently (PATH first, then the wheels), so a toolkit's ptxas can end up
    beside a wheel's nvdisasm; an older disassembler may not know a newer cubin's encodings, and
    the figures no longer describe one toolchain.
    """
    ptxas = report.get("ptxas") or {}
    disasm_name = "nvdisasm" if (report.get("nvdisasm") or {}).get("path") else "cuobjdump"
    disasm = report.get(disasm_name) or {}
    a, b = _release(ptxas.get("version")), _release(disasm.get("version"))
    if a is None or b is None or a == b:
        return None
    return (f"ptxas {ptxas['version']} ({ptxas['source']}) and {disasm_name} {disasm['version']} "
            f"({disasm['source']}) come from different CUDA releases; take both from one "
            f"place (a toolkit's bin/ that holds both, first on PATH, or only the wheels)")


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=False)


# --------------------------------------------------------------------------- assemble / disassemble

@dataclass(frozen=True)
class Assembled:
    cubin: bytes
    log: str          # ptxas -v output (stderr and stdout)
    arch: str
    name: str         # what was assembled, e.g. "stage01"


def assemble_ptx(text: str, arch: str, name: str = "kernel", extra_args: tuple[str, ...] = ()
                 ) -> Assembled:
    """Assemble PTX text with `ptxas -arch=ARCH -v` (whole program, as the driver JIT does)."""
    ptxas = find_tool("ptxas")
    with tempfile.TemporaryDirectory(prefix="ptxattn-") as tmp:
        src = Path(tmp) / f"{name}.ptx"
        out = Path(tmp) / f"{name}.cubin"
        src.write_text(text)
        proc = _run([str(ptxas.path), f"-arch={arch}", "-v", *extra_args, "-o", str(out), str(src)])
        # Messages name the temporary file; the reader knows it by its stage name.
        log = (proc.stderr + proc.stdout).replace(str(src), f"{name}.ptx")
        if proc.returncode != 0 or not out.exists():
            errors = [ln.strip() for ln in log.splitlines() if "error" in ln.lower()
                      or "fatal" in ln.lower()]
            first = errors[0] if errors else (log.strip().splitlines() or ["no output"])[-1]
            raise AssemblyError(f"ptxas failed on {name} ({arch}): {first}", log)
        return Assembled(cubin=out.read_bytes(), log=log, arch=arch, name=name)


def assemble(stage, arch: str | None = None, defines: dict | None = None) -> Assembled:
    """Assemble a stage's expanded PTX for its arch (or `arch`) with ptxas -v."""
    from .. import ptx  # runtime module; imported here so that importing sass does no work

    stage = _stages.get_stage(stage)
    text = ptx.source(stage, defines=defines)
    try:
        return assemble_ptx(text, arch or stage.arch, name=stage.label)
    except AssemblyError as exc:
        # Line numbers in the log count lines of the expanded text: point them at the sources.
        annotated, where = ptx.annotate(ptx.expand(stage, defines), exc.log)
        message = str(exc)
        if where:
            file, line, src = where[0]
            message += f" [{file}:{line}: {src}]"
        raise AssemblyError(message, annotated) from None


def disassemble(cubin: bytes) -> str:
    """SASS text of a cubin: nvdisasm (keeps labels, so branches read), else cuobjdump."""
    tool = locate("nvdisasm") or locate("cuobjdump")
    if tool is None:
        raise ToolNotFoundError(
            f"neither nvdisasm nor cuobjdump found to disassemble SASS; install them with: "
            f"{INSTALL_HINT}")
    with tempfile.TemporaryDirectory(prefix="ptxattn-") as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        if tool.name == "nvdisasm":
            argv = [str(tool.path), "-c", str(path)]          # -c: code sections only
        else:
            argv = [str(tool.path), "--dump-sass", str(path)]
        proc = _run(argv)
    if proc.returncode != 0:
        raise RuntimeError(f"{tool.name} failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


# --------------------------------------------------------------------------- parsing

# "/*0330*/   @!P0 HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT, gsb0 ;" -- the same in
# nvdisasm and cuobjdump output (cuobjdump adds "/* 0x... */" encodings, ignored here).
_INSTR = re.compile(
    r"^\s*/\*(?P<addr>[0-9a-fA-F]{4,})\*/\s+\{?\s*"
    r"(?P<pred>@!?U?P(?:T|\d+)\s+)?"
    r"(?P<op>[A-Z][A-Za-z0-9_.]*)(?P<args>[^;]*);")

# Instruction classes, first match wins. A prefix matches a mnemonic exactly or up to a dot, so
# "BAR" takes BAR.SYNC but not BRA, and "LDS" takes LDS.128 but not LDSM.
CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("HGMMA", ("HGMMA",)),                      # wgmma.mma_async
    # tcgen05.mma (sm_100a): kind::f16 and tf32 -> UTCHMMA, f8f6f4 and block-scaled mx kinds
    # -> UTCQMMA, i8 -> UTCIMMA (UTCOMMA: mxf4); .ws and 2-CTA forms add a suffix
    ("UTCMMA", ("UTCHMMA", "UTCQMMA", "UTCIMMA", "UTCOMMA")),
    ("HMMA", ("HMMA",)),                        # mma.sync (warp-level tensor cores)
    ("WARPGROUP", ("WARPGROUP",)),              # wgmma fence / wait: ARRIVE, DEPBAR
    ("UTCBAR", ("UTCBAR",)),                    # tcgen05.commit: an mbarrier arrive when the
                                                # MMAs issued before it are done
    ("LDTM", ("LDTM",)),                        # tcgen05.ld: tensor memory -> registers
    ("STTM", ("STTM",)),                        # tcgen05.st: registers -> tensor memory
    ("UTC other", ("UTCCP", "UTCSHIFT", "UTCATOMSWS")),   # tcgen05.cp / .shift; alloc, dealloc
    ("TMA", ("UTMALDG", "UTMASTG", "UTMAPF", "UTMAREDG", "UTMACCTL", "UTMACMDFLUSH",
             "UBLKCP", "UBLKRED", "UBLKPF")),    # cp.async.bulk(.tensor) and friends
    ("MUFU.EX2", ("MUFU.EX2",)),                # the softmax exponentials
    ("MUFU other", ("MUFU",)),                  # rcp, lg2, ...
    ("FFMA", ("FFMA",)),
    ("FMUL", ("FMUL",)),
    ("FADD", ("FADD",)),
    ("FMNMX", ("FMNMX",)),                      # row max
    ("F2FP", ("F2FP",)),                        # f32 pairs -> bf16x2 (P, O)
    ("SYNCS", ("SYNCS",)),                      # mbarrier init / arrive / try_wait
    ("BAR", ("BAR",)),                          # CTA and named barriers
    ("FENCE/MEMBAR", ("FENCE", "MEMBAR")),
    ("SHFL", ("SHFL",)),
    ("LDS", ("LDS",)),
    ("STS", ("STS",)),
    ("LDSM", ("LDSM",)),                        # ldmatrix
    ("STSM", ("STSM",)),                        # stmatrix
    ("LDL", ("LDL",)),                          # local memory: spills or stack arrays
    ("STL", ("STL",)),
    ("LDG", ("LDG",)),
    ("STG", ("STG",)),
    ("USETMAXREG", ("USETMAXREG",)),            # setmaxnreg
    ("branch", ("BRA", "BRX", "JMP", "CALL", "RET", "EXIT", "BSSY", "BSYNC", "WARPSYNC")),
)
OTHER = "other"
CLASS_NAMES = tuple(name for name, _ in CLASSES) + (OTHER,)
# Classes of Blackwell's tensor cores and tensor memory: a Hopper summary lists them only where
# its SASS holds one (never), so that sm_90a summaries read as they always did.
BLACKWELL_CLASSES = frozenset({"UTCMMA", "UTCBAR", "LDTM", "STTM", "UTC other"})
HOPPER_CLASS_NAMES = tuple(n for n in CLASS_NAMES if n not in BLACKWELL_CLASSES)


def class_names(arch: str | None) -> tuple[str, ...]:
    """The classes a summary for `arch` lists (counts of 0 included): every class for sm_100
    and later, the Hopper set for anything else (sm_90a, or an arch the log did not give)."""
    digits = re.match(r"sm_(\d+)", arch or "")
    return CLASS_NAMES if digits and int(digits.group(1)) >= 100 else HOPPER_CLASS_NAMES


def classify(mnemonic: str) -> str:
    """The instruction class of a SASS mnemonic such as "MUFU.EX2" or "HGMMA.64x64x16.F32"."""
    for name, prefixes in CLASSES:
        for prefix in prefixes:
            if mnemonic == prefix or mnemonic.startswith(prefix + "."):
                return name
    return OTHER


def instructions(sass_text: str) -> list[tuple[str, str]]:
    """(mnemonic, normalized line) for every instruction in nvdisasm or cuobjdump output."""
    out = []
    for line in sass_text.splitlines():
        m = _INSTR.match(line)
        if m:
            pred = (m.group("pred") or "").strip()
            text = " ".join(filter(None, [f"/*{m.group('addr')}*/", pred,
                                          m.group("op") + m.group("args").rstrip()])) + " ;"
            out.append((m.group("op"), text))
    return out


def grep(sass_text: str, opcode: str) -> list[str]:
    """Instruction lines whose mnemonic is `opcode` or starts with it up to a dot.

    grep(text, "MUFU") finds MUFU.EX2 and MUFU.RCP; grep(text, "mufu.ex2") only the first.
    """
    want = opcode.strip().upper()
    return [line for op, line in instructions(sass_text)
            if op.upper() == want or op.upper().startswith(want + ".")]


def class_of_name(name: str) -> str | None:
    """The instruction class `name` spells (any case: "tma", "MUFU other"), or None."""
    want = " ".join(name.split()).upper()
    return next((c for c in CLASS_NAMES if c.upper() == want), None)


def class_opcodes(name: str) -> tuple[str, ...]:
    """The opcodes (mnemonic prefixes) a class holds; () for "other" (whatever no class takes)."""
    return next((prefixes for cls, prefixes in CLASSES if cls == name), ())


def grep_class(sass_text: str, name: str) -> list[str]:
    """Instruction lines of one class (classify(mnemonic) == name), e.g. every TMA opcode; NOPs
    are in no class, as in summarize()'s counts."""
    return [line for op, line in instructions(sass_text) if op != "NOP" and classify(op) == name]


@dataclass(frozen=True)
class GrepResult:
    """What `ptxattn sass --grep PATTERN` found: the lines, what PATTERN was read as, and a
    warning when it matched nothing that this arch's SASS could hold."""
    lines: list[str]
    label: str                      # the opcode, or "class TMA (UTMALDG, ...)"
    warning: str | None = None
    unknown: bool = False           # neither a class, nor a class's opcode, nor in this SASS


def grep_pattern(sass_text: str, pattern: str, arch: str | None = None) -> GrepResult:
    """--grep's reading of PATTERN: a class name (as the summary prints them: TMA, UTCMMA,
    "MUFU other") lists every instruction of that class; anything else is an opcode prefix
    (grep()). An opcode that matches nothing gets a warning: when it is no opcode of this arch's
    classes and appears nowhere in this SASS (a typo, or a class name of another arch), it is
    `unknown` (the CLI then exits 1)."""
    cls = class_of_name(pattern)
    if cls is not None:
        opcodes = class_opcodes(cls)
        held = ", ".join(opcodes) if opcodes else "every opcode no other class takes"
        lines = grep_class(sass_text, cls)
        warning = None
        if cls not in class_names(arch):
            warning = f"class {cls} is a Blackwell (sm_100a) class: no {arch or 'sm_90a'} SASS holds it"
        label = cls if opcodes == (cls,) else f"{cls} (class: {held})"
        return GrepResult(lines, label, warning)
    want = pattern.strip().upper()
    lines = grep(sass_text, want)
    if lines:
        return GrepResult(lines, want)
    root = want.split(".", 1)[0]
    mnemonics = sorted({op.split(".", 1)[0] for op, _ in instructions(sass_text)})
    in_classes = [c for c, prefixes in CLASSES
                  if any(p == want or p.startswith(want + ".") or p.split(".", 1)[0] == root
                         for p in prefixes)]
    usable = [c for c in in_classes if c in class_names(arch)]
    if root in mnemonics or usable:
        note = (f"no {want} in this SASS" + (f" (it has {root}.*: grep {root})"
                                             if root in mnemonics and root != want else ""))
        return GrepResult(lines, want, note)
    if in_classes:
        return GrepResult(lines, want, f"{want} is an opcode of class {in_classes[0]}, which "
                          f"only Blackwell (sm_100a) SASS holds; this is {arch or 'sm_90a'}",
                          unknown=True)
    return GrepResult(lines, want, (
        f"{want} is no opcode of this SASS and no instruction class; classes: "
        f"{', '.join(class_names(arch))}; opcodes here: {', '.join(mnemonics)}"), unknown=True)


_FUNC = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_BARRIERS = re.compile(r"used (\d+) barriers")
_SMEM = re.compile(r"(\d+) bytes smem")
# ptxas prints performance notes as "info" with a code, e.g. (C7508) 'setmaxnreg' ignored.
_WARNING = re.compile(r"warning|Potential Performance Loss|\(C\d{4}\)", re.IGNORECASE)


def parse_ptxas_log(log: str) -> dict:
    """The -v report: per entry function, and the warnings of the whole run.

    Returns {"functions": {name: {arch, registers, barriers, stack_frame, spill_stores,
    spill_loads, static_smem}}, "warnings": [...]}.
    """
    functions: dict[str, dict] = {}
    current: dict | None = None
    warnings = []
    for raw in log.splitlines():
        line = raw.strip()
        if m := _FUNC.search(line):
            current = functions.setdefault(m.group(1), {
                "arch": m.group(2), "registers": None, "barriers": None, "stack_frame": None,
                "spill_stores": None, "spill_loads": None, "static_smem": 0})
        elif current is not None and (m := _FRAME.search(line)):
            current["stack_frame"], current["spill_stores"], current["spill_loads"] = map(
                int, m.groups())
        elif current is not None and (m := _USED.search(line)):
            current["registers"] = int(m.group(1))
            if b := _BARRIERS.search(line):
                current["barriers"] = int(b.group(1))
            if s := _SMEM.search(line):
                current["static_smem"] = int(s.group(1))
        if _WARNING.search(line):
            warnings.append(re.sub(r"^ptxas\s+\w+\s*:\s*", "", line))
    return {"functions": functions, "warnings": warnings}


@dataclass
class SassSummary:
    function: str | None
    arch: str | None
    registers: int | None
    barriers: int | None
    stack_frame: int | None
    spill_stores: int | None
    spill_loads: int | None
    static_smem: int | None
    dynamic_smem: int | None            # from the stage registry: ptxas cannot know it
    instructions: int                   # NOP padding excluded
    classes: dict[str, int] = field(default_factory=dict)   # class_names(arch), CLASS_NAMES order
    opcodes: dict[str, int] = field(default_factory=dict)   # full mnemonics, most frequent first
    warnings: list[str] = field(default_factory=list)

    @property
    def spill_bytes(self) -> int | None:
        if self.spill_stores is None or self.spill_loads is None:
            return None
        return self.spill_stores + self.spill_loads

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["spill_bytes"] = self.spill_bytes
        return d


def summarize(sass_text: str, ptxas_log: str = "", *, function: str | None = None,
              dynamic_smem: int | None = None) -> SassSummary:
    """Registers, spills, shared memory (ptxas -v) and the instruction mix (SASS).

    `function` picks an entry from the log (default: the stage entry point, else the first).
    The instruction counts cover the whole SASS text: one stage is one entry function.
    """
    report = parse_ptxas_log(ptxas_log)
    funcs = report["functions"]
    if function is None:
        function = _stages.ENTRY if _stages.ENTRY in funcs else next(iter(funcs), None)
    info = funcs.get(function, {}) if function else {}

    mnemonics = Counter(op for op, _ in instructions(sass_text) if op != "NOP")
    counts = Counter()
    for op, n in mnemonics.items():
        counts[classify(op)] += n
    listed = class_names(info.get("arch"))
    classes = {name: counts[name] for name in CLASS_NAMES if name in listed or counts[name]}
    return SassSummary(
        function=function,
        arch=info.get("arch"),
        registers=info.get("registers"),
        barriers=info.get("barriers"),
        stack_frame=info.get("stack_frame"),
        spill_stores=info.get("spill_stores"),
        spill_loads=info.get("spill_loads"),
        static_smem=info.get("static_smem"),
        dynamic_smem=dynamic_smem,
        instructions=sum(mnemonics.values()),
        classes=classes,
        opcodes=dict(sorted(mnemonics.items(), key=lambda kv: (-kv[1], kv[0]))),
        warnings=report["warnings"],
    )


def to_json(summary: SassSummary, indent: int = 2) -> str:
    return json.dumps(summary.to_dict(), indent=indent)


# --------------------------------------------------------------------------- one call per stage

@dataclass(frozen=True)
class StageSass:
    stage: _stages.Stage
    assembled: Assembled
    sass: str
    summary: SassSummary


def _production_smem(stage, defines: dict) -> int:
    """The dynamic shared memory of the production build `defines` select: -d PTXATTN_FP8,
    the e4m3 row (builds.FP8_BUILDS) or the variant -d FP8_BLOCK_N=... names
    (builds.FP8_VARIANTS); -d BF16_BLOCK_N=..., a bf16 variant's (builds.BF16_VARIANTS);
    -d HEAD_DIM=..., that row's (PRODUCTION_VARIANTS); else the stage's. ValueError for a
    build there is none of."""
    head_dim = int(defines.get("HEAD_DIM", _builds.DEFAULT_HEAD_DIM))
    if str(defines.get("PTXATTN_FP8", "0")) != "0":
        return _builds.fp8_variant(head_dim, defines).smem_bytes
    if "BF16_BLOCK_N" in defines:
        return _builds.bf16_variant(head_dim, defines).smem_bytes
    if "HEAD_DIM" in defines:
        return stage.specialize(head_dim,
                                str(defines.get("PTXATTN_MASKED", "0")) != "0").smem_bytes
    return stage.smem_bytes


def inspect_stage(stage, arch: str | None = None, defines: dict | None = None) -> StageSass:
    """Assemble, disassemble and summarize one stage."""
    stage = _stages.get_stage(stage)
    asm = assemble(stage, arch=arch, defines=defines)
    text = disassemble(asm.cubin)
    smem = stage.smem_bytes
    if stage.production and defines:
        try:
            smem = _production_smem(stage, defines)
        except ValueError:
            pass                                  # no such build: ptxas said so already
    return StageSass(stage, asm, text, summarize(text, asm.log, dynamic_smem=smem))


BACKWARD_KEYS = ("bwd", "backward", "bwd_production")   # STAGE names of the production backward


def is_backward(key) -> bool:
    """Whether a STAGE key names a backward kernel: the production backward or b1..b3."""
    from .. import bwd_builds
    text = str(key).strip().lower()
    return text in BACKWARD_KEYS or text in {s.label for s in bwd_builds.STAGES}


def inspect_backward(key, defines: dict | None = None, variant: str | None = None,
                     arch: str | None = None) -> StageSass:
    """Assemble, disassemble and summarize a backward kernel: a lineage stage (b1..b3), or a
    build of the production backward (-d HEAD_DIM=64|128|256, -d PTXATTN_MASKED, and a
    build-table variant's switches from `variant`)."""
    from .. import backward, bwd_builds
    text = str(key).strip().lower()
    stage = bwd_builds.PRODUCTION if text in BACKWARD_KEYS else bwd_builds.get_stage(text)
    chosen = {k: ("1" if v is None else v) for k, v in (defines or {}).items()}
    smem = stage.smem_bytes
    if stage.production:
        head_dim = int(chosen.get("HEAD_DIM", bwd_builds.LINEAGE_HEAD_DIM))
        row = bwd_builds.build(head_dim, variant)
        chosen = {**backward.defines_for(stage, head_dim, "PTXATTN_MASKED" in chosen, variant),
                  **chosen}
        smem = row.smem_bytes
    elif variant is not None:
        raise ValueError(f"variant: build variants are the production backward's; "
                         f"{stage.title} has none")
    asm = assemble_ptx(backward.source(stage.file, chosen).text, arch or "sm_90a", stage.label)
    text_sass = disassemble(asm.cubin)
    return StageSass(stage, asm, text_sass, summarize(text_sass, asm.log,
                                                      function=backward.ENTRY,
                                                      dynamic_smem=smem))


def _num(value) -> str:
    return "-" if value is None else str(value)


def format_summary(s: SassSummary, title: str | None = None) -> str:
    """A short text report: resources, warnings, instruction mix."""
    lines = []
    if title:
        lines.append(title)
    lines.append(f"function      {_num(s.function)} ({_num(s.arch)})")
    lines.append(f"registers     {_num(s.registers)}   barriers {_num(s.barriers)}")
    lines.append(f"spills        {_num(s.spill_stores)} B stored, {_num(s.spill_loads)} B loaded"
                 f"   stack frame {_num(s.stack_frame)} B")
    lines.append(f"shared memory {_num(s.static_smem)} B static, {_num(s.dynamic_smem)} B dynamic")
    for w in s.warnings:
        lines.append(f"warning       {w}")
    lines.append(f"instructions  {s.instructions}")
    for name, n in s.classes.items():
        if n:
            lines.append(f"  {name:<14}{n:>7}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- diffs

def diff_ptx(a, b, defines_a: dict | None = None, defines_b: dict | None = None,
             context: int = 3) -> str:
    """Unified diff of two stages' expanded PTX (what the JIT sees, includes inlined)."""
    from .. import ptx

    sa, sb = _stages.get_stage(a), _stages.get_stage(b)
    ta = ptx.source(sa, defines=defines_a).splitlines(keepends=True)
    tb = ptx.source(sb, defines=defines_b).splitlines(keepends=True)
    return "".join(difflib.unified_diff(ta, tb, fromfile=f"{sa.label} {sa.file}",
                                        tofile=f"{sb.label} {sb.file}", n=context))


@dataclass(frozen=True)
class DiffRow:
    what: str
    a: int | None
    b: int | None

    @property
    def delta(self) -> str:
        if self.a is None or self.b is None or self.a == self.b:
            return ""
        if self.a == 0:
            return "new"
        return f"{100.0 * (self.b - self.a) / self.a:+.0f}%"


_RESOURCE_ROWS = (("registers", "registers"), ("spill bytes", "spill_bytes"),
                  ("stack frame", "stack_frame"), ("static smem", "static_smem"),
                  ("dynamic smem", "dynamic_smem"), ("instructions", "instructions"))


def diff_summaries(sa: SassSummary, sb: SassSummary) -> list[DiffRow]:
    """Resources and instruction classes side by side; classes absent from both are left out."""
    rows = [DiffRow(label, getattr(sa, attr), getattr(sb, attr)) for label, attr in _RESOURCE_ROWS]
    for name in CLASS_NAMES:
        a, b = sa.classes.get(name, 0), sb.classes.get(name, 0)
        if a or b:
            rows.append(DiffRow(name, a, b))
    return rows


def format_diff(rows: list[DiffRow], label_a: str = "a", label_b: str = "b") -> str:
    """Rows like `MUFU.EX2        128      96   -25%`."""
    width = max([len(r.what) for r in rows] + [12])
    lines = [f"{'':<{width}}  {label_a:>9}  {label_b:>9}  delta"]
    for r in rows:
        lines.append(f"{r.what:<{width}}  {_num(r.a):>9}  {_num(r.b):>9}  {r.delta}".rstrip())
    return "\n".join(lines)

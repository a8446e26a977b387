"""Read a stage's PTX and expand its C-preprocessor directives.

ptxas and the driver JIT do not run a preprocessor, so `#include`, `#define`
and `#if/#ifdef` are expanded here with pcpp. They also reject `#line`, so
the PTX that is loaded has none; instead we ask pcpp for line directives,
parse them into a map (expanded line -> original file and line) and strip
them. That map turns `ptxas application ptx input, line 123; error ...` from
the JIT log back into `ptx/sm90/include/x.ptxh:45`.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import PtxattnError
from .stages import Stage, get_stage, ptx_root

_LINE_DIRECTIVE = re.compile(r'^\s*#line\s+(\d+)\s+"(.*)"\s*$')
# ptxas / JIT diagnostics: "ptxas application ptx input, line 123; error   : ..."
_LOG_LINE = re.compile(r"\bline (\d+);")


@dataclass(frozen=True)
class Expanded:
    """PTX after preprocessing, with the way back to the sources."""
    text: str
    line_map: tuple[tuple[str, int], ...]   # index i: expanded line i+1 -> (file, line)
    sources: dict[str, list[str]] = field(default_factory=dict, compare=False, repr=False)

    def map_line(self, expanded_line: int) -> tuple[str, int] | None:
        if 1 <= expanded_line <= len(self.line_map):
            return self.line_map[expanded_line - 1]
        return None

    def source_text(self, file: str, line: int) -> str:
        lines = self.sources.get(file)
        if lines is None:
            try:
                lines = _resolve(file).read_text().splitlines()
            except OSError:
                lines = []
            self.sources[file] = lines
        return lines[line - 1].strip() if 1 <= line <= len(lines) else ""


class _Preprocessor:
    """pcpp, with errors collected instead of printed, and paths left absolute."""

    def __init__(self, include_dirs, defines):
        import pcpp  # imported here: only needed when a stage is actually read

        class P(pcpp.Preprocessor):
            def on_error(self, file, line, msg):
                self.errors.append(f"{_display(file)}:{line}: {msg}")
                self.return_code += 1

            def on_directive_unknown(self, directive, toks, ifpassthru, precedingtoks):
                if directive.value == "error":
                    text = "".join(t.value for t in toks).strip()
                    self.on_error(directive.source, directive.lineno, f"#error {text}")
                    return True
                if directive.value == "warning":
                    return True
                # Anything else (#pragma, typos) would reach ptxas as a '#' line it
                # cannot parse: report it here with its real location instead.
                self.on_error(directive.source, directive.lineno,
                              f"unsupported directive #{directive.value}")
                return True

        self.pp = P()
        self.pp.errors = []
        self.pp.line_directive = "#line"
        for d in include_dirs:
            self.pp.add_path(str(d))
        # add_path() rewrites paths in #line relative to the cwd: keep them absolute
        # instead, and show them relative to the repository ourselves (_display).
        self.pp.rewrite_paths = []
        for name, value in (defines or {}).items():
            value = 1 if value is True or value is None else value
            self.pp.define(f"{name} {value}")

    def run(self, path: Path) -> str:
        self.pp.parse(path.read_text(), str(path))
        out = io.StringIO()
        self.pp.write(out)
        if self.pp.errors or self.pp.return_code:
            raise PtxattnError("preprocessing failed:\n  " + "\n  ".join(self.pp.errors))
        return out.getvalue()


def expand_file(path: str | Path, include_dirs=(), defines: dict | None = None) -> Expanded:
    """Preprocess one .ptx file; `#include "x.ptxh"` is searched in include_dirs."""
    path = Path(path).resolve()
    dirs = [Path(d).resolve() for d in include_dirs] + [path.parent]
    raw = _Preprocessor(dirs, defines).run(path)

    lines: list[str] = []
    line_map: list[tuple[str, int]] = []
    file, next_line = _display(str(path)), 1
    for text in raw.splitlines():
        m = _LINE_DIRECTIVE.match(text)
        if m:
            next_line, file = int(m.group(1)), _display(m.group(2))
            continue
        # Blank lines are noise left by comments, #defines and macros that expand to
        # nothing (TRACE(...) without PTXATTN_TRACE): drop them, and trailing blanks, so
        # that the text is deterministic and a build variant only adds lines.
        # A multi-statement macro expands onto one line: give each statement a line of its
        # own, all mapped to the invocation, so listings, diffs and JIT errors stay readable.
        for piece in _one_statement_per_line(text.rstrip()):
            lines.append(piece)
            line_map.append((file, next_line))
        next_line += 1
    return Expanded("\n".join(lines) + "\n", tuple(line_map))


# `name:` at the start of a line (not the `::` of a state space such as shared::cta)
_LABEL_FIRST = re.compile(r"^([A-Za-z_$%][\w$]*:)(?!:)\s*")


def _one_statement_per_line(text: str) -> list[str]:
    """Split a line after each ';' (and after a leading label) into lines of the same indent.

    pcpp has removed comments already; a `//` left in (a comment pcpp kept) ends the line's
    code and stays with the last statement. A line with no ';' (a statement continued on the
    next line, a brace) is kept whole."""
    code, comment = text, ""
    if "//" in text:
        cut = text.index("//")
        code, comment = text[:cut].rstrip(), " " + text[cut:]
    indent = code[:len(code) - len(code.lstrip())]
    rest = code.strip()
    out: list[str] = []
    while rest:
        m = _LABEL_FIRST.match(rest)
        if m:                                   # labels stay on a line of their own, unindented
            out.append(m.group(1))
            rest = rest[m.end():]
            continue
        end = rest.find(";")
        if end < 0 or end == len(rest) - 1:
            out.append(indent + rest)
            break
        out.append(indent + rest[:end + 1])
        rest = rest[end + 1:].lstrip()
    if comment and out:
        out[-1] += comment
    return out or ([comment.strip()] if comment else [])


_CACHE: dict[tuple, Expanded] = {}


def expand(stage: Stage | str | int, defines: dict | None = None) -> Expanded:
    """The expanded stage with its line map, cached per (stage, defines). A build of the
    production kernel (Stage.specialize: HEAD_DIM, PTXATTN_MASKED) brings its own defines;
    `defines` are added to them, as attention.kernel() does."""
    stage = get_stage(stage)
    defines = {**dict(stage.defines), **(defines or {})} or None
    key = (stage.file, tuple(sorted((defines or {}).items())))
    if key not in _CACHE:
        path = ptx_root() / stage.file
        if not path.is_file():
            raise FileNotFoundError(f"{stage.label} ({stage.name}): no PTX file at {path}")
        _CACHE[key] = expand_file(path, include_dirs(path), defines)
    return _CACHE[key]


def include_dirs(path: Path) -> list[Path]:
    """Where a kernel file's `#include "x.ptxh"` is searched, after the including file's own
    folder (pcpp looks there first, for nested includes too): `include/` beside the file (the
    lineage: ptx/sm90/include), then its lineage's shared ptx/<arch>/include (a kernel in a
    folder of its own, ptx/sm90/production/forward.ptx)."""
    path = Path(path).resolve()
    dirs = [path.parent / "include"]
    try:
        arch = path.relative_to(ptx_root().resolve()).parts[0]
    except ValueError:                           # a file outside ptx/ (a test's copy)
        arch = None
    if arch is not None and ptx_root().resolve() / arch / "include" not in dirs:
        dirs.append(ptx_root().resolve() / arch / "include")
    return [d for d in dirs if d.is_dir()]


_INCLUDE_LINE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def source_files(stage: Stage | str | int) -> list[Path]:
    """The stage's own file and every file its `#include "..."` lines reach, each once, in the
    order first met: resolved as the preprocessor does (the including file's folder first, then
    include_dirs), whatever #if around them decides. What a reader (or a tool reading the
    sources' text) must read to see the whole kernel."""
    stage = get_stage(stage)
    top = (ptx_root() / stage.file).resolve()
    search = include_dirs(top)
    seen: list[Path] = []

    def visit(path: Path) -> None:
        if path in seen or not path.is_file():
            return
        seen.append(path)
        for name in _INCLUDE_LINE.findall(path.read_text()):
            found = next((d / name for d in [path.parent] + search if (d / name).is_file()), None)
            if found is not None:
                visit(found.resolve())

    visit(top)
    return seen


def source_text(stage: Stage | str | int) -> str:
    """The text of source_files(stage), concatenated (unexpanded: the sources as written)."""
    return "\n".join(p.read_text() for p in source_files(stage))


def source(stage: Stage | str | int, defines: dict | None = None) -> str:
    """Plain PTX for a stage: includes, macros and conditionals expanded, no '#' lines,
    no blank lines and no trailing whitespace (the text is for ptxas and the JIT)."""
    return expand(stage, defines).text


def map_line(stage: Stage | str | int, expanded_line: int,
             defines: dict | None = None) -> tuple[str, int] | None:
    """(original file, line) of a line of the expanded PTX, or None when out of range."""
    return expand(stage, defines).map_line(expanded_line)


def annotate(expanded: Expanded, log_text: str) -> tuple[str, list[tuple[str, int, str]]]:
    """Append `-> file:line: source` to each log line that names a PTX line."""
    out, where = [], []
    for text in log_text.splitlines():
        m = _LOG_LINE.search(text)
        loc = expanded.map_line(int(m.group(1))) if m else None
        if loc is None:
            out.append(text)
            continue
        src = expanded.source_text(*loc)
        where.append((loc[0], loc[1], src))
        out.append(f"{text}\n    -> {loc[0]}:{loc[1]}: {src}")
    return "\n".join(out), where


def annotate_log(stage: Stage | str | int, log_text: str, defines: dict | None = None) -> str:
    """A JIT/ptxas log with each `line N;` mapped back to the stage's sources."""
    return annotate(expand(stage, defines), log_text)[0]


def _resolve(file: str) -> Path:
    p = Path(file)
    return p if p.is_absolute() else ptx_root().parent / p


def _display(file: str) -> str:
    """Paths inside the repository are shown relative to it (ptx/sm90/x.ptx)."""
    p = Path(file)
    try:
        return str(p.resolve().relative_to(ptx_root().parent.resolve()))
    except ValueError:
        return str(p)

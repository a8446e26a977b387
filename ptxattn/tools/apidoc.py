"""docs/api.md, the API reference, written from the sources' docstrings.

    python -m ptxattn.tools.apidoc            # rewrite docs/api.md
    python -m ptxattn.tools.apidoc --check    # exit 1 when docs/api.md is not what it writes

Read with `ast`, nothing imported: the same bytes with or without torch, a GPU or the
package installed (tests/test_apidoc.py checks the committed file is current). It covers:
  - every name `ptxattn` exports (ptxattn/__init__.py's _EXPORTS), ptxattn.torch's __all__ and
    ptxattn.distributed's public names: signature and docstring; for a class its public methods
    and properties;
  - the exceptions (ptxattn/errors.py, and the few raised elsewhere);
  - every environment variable the code reads (found in the sources by what reads
    os.environ), with its default and meaning from ENVIRONMENT below: a variable read in the
    code but missing there, or listed there but read nowhere, fails the check.
"""

from __future__ import annotations

import argparse
import ast
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ptxattn"
OUT = ROOT / "docs" / "api.md"

# name -> (default, meaning). The default as the code applies it when the variable is unset.
ENVIRONMENT = {
    "PTXATTN_DEVICE": ("0", "The CUDA device ordinal ptxattn runs on (one device per process). "
                       "ptxattn.distributed sets it from the tensors' device when unset."),
    "PTXATTN_PERSISTENT_CTAS": ("unset (grid = SM count x CTAs per SM)",
                                "A testing knob: caps the grid of persistent kernels at N CTAs, "
                                "so that each CTA walks several tiles at small shapes."),
    "PTXATTN_CHECK_BOUNDS": ("unset (0)", "1: flash_attn_with_kvcache and flash_attn_varlen_func "
                             "check device lengths, offsets and block tables too and raise a "
                             "ValueError naming the first bad entry (waits for the GPU)."),
    "PTXATTN_POISON_WORKSPACE": ("unset (0)", "1: decode fills its split-KV workspace with NaN "
                                 "before each call (tests: a partial never written shows)."),
    "PTXATTN_LAUNCH": ("unset (ctypes where libcuda has cuLaunchKernelEx)",
                       "binding: every launch through cuda.bindings' cuLaunchKernelEx instead "
                       "of ptxattn.fastlaunch's ctypes call (a measurement knob); read when a "
                       "Launcher or LaunchSpec is built."),
    "PTXATTN_GRAPH_RUNS": ("1", "0: a serving plan's steady run() enqueues its frozen launches "
                           "one by one instead of as one CUDA graph of them (ptxattn.replay; "
                           "a measurement knob); read when a plan freezes the launches of "
                           "new addresses."),
    "CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM": (
        "0", "cuda.bindings' own switch to the per-thread default stream; ptxattn reads it "
             "too: set, every launch goes through the binding (which then resolves the "
             "_ptsz entry points), not ctypes."),
    "PTXATTN_DECODE_PDL": ("1", "0: the decode's combine kernel launches plainly instead of "
                           "with programmatic dependent launch (a measurement knob)."),
    "PTXATTN_PAGED_VARIANT": ("unset: warp_ahead (decode_builds.DEFAULT_PAGED_VARIANT)",
                              "A measurement knob: the paged decode's build variant, a name of "
                              "decode_builds.PAGED_VARIANTS (how a tile's pages become TMA "
                              "loads below a page of 128 keys); read per call."),
    "PTXATTN_DEBUG": ("unset", "Any value: the `ptxattn` command re-raises errors with their "
                      "traceback instead of printing one line."),
    "PTXATTN_SOURCE_COMMIT": ("unset", "The commit a benchmark results file declares it was "
                              "run from (`declared_commit`, beside the tree's hash), for a copy "
                              "of the tree whose .git is stale or missing."),
    "PTXATTN_REQUIRE_GPU": ("unset (0)", "Tests: 1 turns a skipped GPU test into a failure, so "
                            "that a GPU run cannot pass by skipping (tests/gpu_checks.py)."),
    "CUDA_HOME": ("unset", "Where `ptxattn sass` and the tools look for ptxas, nvdisasm and "
                  "cuobjdump after PATH (its bin/), before the pip wheels."),
    "CUDA_PATH": ("unset", "As CUDA_HOME (checked after it)."),
}
# Read by the CUDA driver, not by ptxattn; listed because they change what a user sees.
DRIVER_ENVIRONMENT = {
    "CUDA_CACHE_DISABLE": "1: the driver JIT compiles afresh instead of reading its compute "
                          "cache (~/.nv/ComputeCache), e.g. to see the JIT's resource report.",
    "CUDA_CACHE_PATH": "Where the driver keeps that cache (default ~/.nv/ComputeCache).",
    "CUDA_CACHE_MAXSIZE": "The cache's size in bytes; each build of a kernel takes an entry.",
}
# Files scanned for environment reads besides the package itself.
EXTRA_SOURCES = ("tests/gpu_checks.py",)
_ENV_METHODS = {"get", "setdefault", "pop", "encodekey"}


# --------------------------------------------------------------------------- sources

def _tree(path: Path) -> ast.Module:
    stat = path.stat()
    return _parsed(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=None)
def _parsed(path: str, _mtime: int, _size: int) -> ast.Module:
    return ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)


def _module_file(dotted: str) -> Path:
    rel = Path(*dotted.split("."))
    pkg = ROOT / rel / "__init__.py"
    return pkg if pkg.is_file() else (ROOT / rel).with_suffix(".py")


def _top_level(tree: ast.Module) -> dict[str, ast.AST]:
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node
    return out


def _resolve(module: str, name: str, depth: int = 0) -> tuple[str, ast.AST]:
    """(module, node) that defines `name` as seen from `module`, following `from .x import`."""
    tree = _tree(_module_file(module))
    found = _top_level(tree)
    if name in found:
        return module, found[name]
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and depth < 4:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    base = module if _module_file(module).name == "__init__.py" else \
                        module.rsplit(".", 1)[0]
                    for _ in range(node.level - 1):
                        base = base.rsplit(".", 1)[0]
                    target = f"{base}.{node.module}" if node.level else node.module
                    return _resolve(target, alias.name, depth + 1)
    raise LookupError(f"{name} not found in {module}")


def _literal(tree: ast.Module, name: str):
    node = _top_level(tree)[name]
    return ast.literal_eval(node.value)


def public_api() -> list[tuple[str, list[tuple[str, str, ast.AST]]]]:
    """[(section, [(public name, defining module, node)])] in the order the doc shows them."""
    init = _tree(PACKAGE / "__init__.py")
    exports = _literal(init, "_EXPORTS")
    core = [(name, *_resolve(f"ptxattn.{mod}", name)) for name, mod in exports.items()]
    torch_all = _literal(_tree(PACKAGE / "torch" / "__init__.py"), "__all__")
    torch = [(name, *_resolve("ptxattn.torch", name)) for name in torch_all]
    dist_tree = _tree(PACKAGE / "distributed.py")
    dist = [(name, "ptxattn.distributed", node) for name, node in _top_level(dist_tree).items()
            if not name.startswith("_") and isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    return [("ptxattn", core), ("ptxattn.torch", torch), ("ptxattn.distributed", dist)]


# --------------------------------------------------------------------------- rendering

def _signature(fn: ast.FunctionDef, drop_self: bool = False) -> str:
    args = fn.args
    if drop_self and args.posonlyargs + args.args:
        args = ast.arguments(posonlyargs=args.posonlyargs[1:] if args.posonlyargs else [],
                             args=args.args if args.posonlyargs else args.args[1:],
                             vararg=args.vararg, kwonlyargs=args.kwonlyargs,
                             kw_defaults=args.kw_defaults, kwarg=args.kwarg,
                             defaults=args.defaults)
    text = f"({ast.unparse(args)})"
    if fn.returns is not None:
        text += f" -> {ast.unparse(fn.returns)}"
    return text


def _doc(node) -> str:
    return ast.get_docstring(node, clean=True) or "(no docstring)"


def _block(text: str) -> list[str]:
    return ["```text", *text.splitlines(), "```", ""]


def _raised(fn: ast.AST) -> list[str]:
    names = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id[0].isupper():
                names.add(exc.id)
            elif isinstance(exc, ast.Attribute):
                names.add(exc.attr)
    return sorted(names)


def _is_property(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)


def _entry(qualified: str, node: ast.AST) -> list[str]:
    if isinstance(node, ast.FunctionDef):
        lines = [f"### `{qualified}`", "", f"```python\n{qualified}{_signature(node)}\n```", ""]
        lines += _block(_doc(node))
        raised = _raised(node)
        if raised:
            lines += [f"Raises in its own body: {', '.join(raised)}; the checks it calls raise "
                      f"ValueError/TypeError naming the argument ([Errors](#errors)).", ""]
        return lines
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in node.bases)
        lines = [f"### class `{qualified}`" + (f"({bases})" if bases else ""), ""]
        lines += _block(_doc(node))
        for item in node.body:
            if not isinstance(item, ast.FunctionDef):
                continue
            if item.name.startswith("_") and item.name != "__init__":
                continue
            if item.name == "__init__":
                lines += [f"```python\n{qualified}{_signature(item, drop_self=True)}\n```", ""]
                if ast.get_docstring(item):
                    lines += _block(_doc(item))
                continue
            kind = "property" if _is_property(item) else "method"
            head = (f"`{item.name}`" if kind == "property"
                    else f"`{item.name}{_signature(item, drop_self=True)}`")
            doc = ast.get_docstring(item, clean=True)
            lines += [f"- {kind} {head}" + (f": {' '.join(doc.split())}" if doc else "")]
        lines.append("")
        return lines
    value = ast.unparse(node.value) if isinstance(node, ast.Assign) else "?"
    if len(value) > 300:
        value = value[:300] + " ..."
    return [f"### `{qualified}`", "", f"A constant: `{value}`", ""]


def _anchor(title: str) -> str:
    return "".join(c for c in title.lower().replace(" ", "-") if c.isalnum() or c in "-_")


# --------------------------------------------------------------------------- environment

def _constants(paths) -> dict[str, object]:
    """Module-level NAME = "text" (or a tuple of such names) across the sources."""
    strings: dict[str, object] = {}
    tuples: dict[str, list[str]] = {}
    for path in paths:
        for node in _tree(path).body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                    isinstance(node.targets[0], ast.Name):
                name, value = node.targets[0].id, node.value
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    strings[name] = value.value
                elif isinstance(value, ast.Tuple) and all(isinstance(e, ast.Name)
                                                          for e in value.elts):
                    tuples[name] = [e.id for e in value.elts]
    for name, members in tuples.items():
        strings[name] = tuple(strings.get(m) for m in members)
    return strings


def _loop_values(tree: ast.AST) -> dict[str, tuple[str, ...]]:
    """`for var in ("A", "B"):` targets, by name."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and \
                isinstance(node.iter, (ast.Tuple, ast.List)) and \
                all(isinstance(e, ast.Constant) and isinstance(e.value, str)
                    for e in node.iter.elts):
            out[node.target.id] = tuple(e.value for e in node.iter.elts)
    return out


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" or \
        isinstance(node, ast.Name) and node.id == "environ"


def environment_defaults() -> dict[str, set[str]]:
    """The literal defaults the code passes with its reads (`os.environ.get(NAME, "1")`)."""
    return {name: set(d) for name, d in _scan()[1].items()}


def environment_reads() -> dict[str, set[str]]:
    """Every environment variable the sources read: name -> files reading it."""
    return _scan()[0]


def _scan():
    paths = [p for p in sorted(PACKAGE.rglob("*.py"))] + [ROOT / p for p in EXTRA_SOURCES]
    consts = _constants(paths)
    found: dict[str, set[str]] = {}
    defaults: dict[str, set[str]] = {}
    for path in paths:
        tree = _tree(path)
        loops = _loop_values(tree)

        def names_of(arg) -> tuple:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                return (arg.value,)
            if isinstance(arg, ast.Name):
                value = consts.get(arg.id, loops.get(arg.id))
                if isinstance(value, str):
                    return (value,)
                if isinstance(value, tuple):
                    return tuple(v for v in value if isinstance(v, str))
            if isinstance(arg, ast.Attribute):        # launch.PERSISTENT_CTAS_ENV
                value = consts.get(arg.attr)
                return (value,) if isinstance(value, str) else ()
            return ()

        for node in ast.walk(tree):
            arg = default = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in ("get", "getenv") and _is_environ(node.func.value) or \
                        node.func.attr == "getenv":
                    arg = node.args[0] if node.args else None
                    if len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                        default = node.args[1].value
                elif node.func.attr in _ENV_METHODS and _is_environ(node.func.value):
                    arg = node.args[0] if node.args else None
            elif isinstance(node, ast.Subscript) and _is_environ(node.value):
                arg = node.slice
            elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn))
                                                       for op in node.ops) \
                    and _is_environ(node.comparators[-1]):
                arg = node.left
            if arg is None:
                continue
            for name in names_of(arg):
                if name.startswith(("PTXATTN_", "CUDA_")) and \
                        "tools/emulator" not in str(path):
                    found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
                    if default is not None:
                        defaults.setdefault(name, set()).add(str(default))
    return found, defaults


# --------------------------------------------------------------------------- the page

def build() -> str:
    sections = public_api()
    lines = ["# ptxattn API reference", "",
             "Generated from the docstrings by `python -m ptxattn.tools.apidoc` (do not edit by "
             "hand; `tests/test_apidoc.py` fails when this file is not current).", "",
             "Contents: " + ", ".join(f"[`{s}`](#{_anchor(s)})" for s, _ in sections)
             + ", [Errors](#errors), [Environment variables](#environment-variables).", ""]
    for section, entries in sections:
        lines += [f"## {section}", ""]
        if section == "ptxattn.torch":
            lines += ["Needs the `torch` extra; importing it registers the custom ops.", ""]
        if section == "ptxattn.distributed":
            lines += ["Context-parallel (ring) attention over torch.distributed; needs the "
                      "`torch` extra.", ""]
        for name, module, node in entries:
            if not name.endswith("Error"):          # exceptions: in Errors below
                lines += _entry(f"{section}.{name}", node)
    lines += ["## Errors", "",
              "Bad arguments raise the built-in `ValueError` (a value out of range, shapes that "
              "do not agree) or `TypeError` (a wrong kind or dtype), naming the argument, what "
              "was expected and what was given, before anything is launched or written. "
              "Failures below the Python API raise a `ptxattn.PtxattnError` subclass:", ""]
    errors = _tree(PACKAGE / "errors.py")
    others = [("ptxattn.selfcheck", "SelfCheckError"),
              ("ptxattn.torch", "MissingModelLibraryError"),
              ("ptxattn.tools.bench", "MissingExtraError"),
              ("ptxattn.tools.sass", "ToolNotFoundError"),
              ("ptxattn.tools.sass", "AssemblyError")]
    for node in errors.body:
        if isinstance(node, ast.ClassDef):
            lines += _entry(f"ptxattn.{node.name}", node)
    for module, name in others:
        lines += _entry(f"{module}.{name}", _resolve(module, name)[1])
    reads = environment_reads()
    lines += ["## Environment variables", "",
              "Read by ptxattn (found in the sources by what reads `os.environ`):", "",
              "| variable | default | meaning | read in |", "|---|---|---|---|"]
    for name in sorted(ENVIRONMENT):
        default, meaning = ENVIRONMENT[name]
        where = ", ".join(f"`{p}`" for p in sorted(reads.get(name, ())))
        lines.append(f"| `{name}` | {default} | {meaning} | {where} |")
    lines += ["", "Read by the CUDA driver (not by ptxattn), and worth knowing:", "",
              "| variable | meaning |", "|---|---|"]
    for name, meaning in DRIVER_ENVIRONMENT.items():
        lines.append(f"| `{name}` | {meaning} |")
    lines += ["", "Preprocessor defines that select kernel builds (`PTXATTN_MASKED`, "
              "`PTXATTN_TRACE`, `HEAD_DIM`, ...) are not environment variables: `ptxattn ptx` "
              "and `ptxattn sass` take them as `-d NAME=VALUE`.", ""]
    return "\n".join(lines).rstrip() + "\n"


def undocumented_environment() -> tuple[list[str], list[str]]:
    """(read in the code but not in ENVIRONMENT, in ENVIRONMENT but read nowhere)."""
    reads = environment_reads()
    return sorted(set(reads) - set(ENVIRONMENT)), sorted(set(ENVIRONMENT) - set(reads))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ptxattn.tools.apidoc",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 when docs/api.md is not current")
    args = ap.parse_args(argv)
    missing, stale = undocumented_environment()
    if missing or stale:
        print(f"ENVIRONMENT in {__file__} is out of date: read but undescribed {missing}, "
              f"described but never read {stale}", file=sys.stderr)
        return 1
    text = build()
    if args.check:
        current = OUT.is_file() and OUT.read_text(encoding="utf-8") == text
        print("docs/api.md is current" if current else
              "docs/api.md is stale: python -m ptxattn.tools.apidoc")
        return 0 if current else 1
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

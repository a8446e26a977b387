"""The package's shape (docs/ARCHITECTURE.md): no import circle, and the runtime never reaches
the tools (CPU, no GPU, nothing imported but what the last test checks).

The import graph comes from the sources' AST: every `import` and `from ... import` anywhere in
a module, in a function body as well as at the top, since a lazy import is still a dependency
(the two circles that were here, attention <-> selfcheck and stages <-> stages_sm100, were
both made of lazy imports).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ptxattn"
TOOLS = "ptxattn.tools"
# `python -m ptxattn` runs the command line (ptxattn.tools.cli); nothing imports it.
ENTRY_POINTS = {"ptxattn.__main__"}


def module_names() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its own name)."""
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (a name imported from a package counts as
    the submodule when there is one, else as the package)."""
    modules = module_names()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules
                           else source for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:      # ptxattn.x.y -> ptxattn.x
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module `start` imports, directly or through others: module -> who imports it."""
    seen, todo = {}, [start]
    while todo:
        v = todo.pop()
        for w in sorted(graph[v]):
            if w not in seen and w != start:
                seen[w] = v
                todo.append(w)
    return seen


def is_tool(name: str) -> bool:
    return name == TOOLS or name.startswith(TOOLS + ".")


def test_the_graph_sees_the_package_and_its_imports():
    """The parser is not vacuous: known edges, lazy ones included, are found."""
    graph = import_graph()
    assert {"ptxattn.api", "ptxattn.launch", "ptxattn.tools.cli", "ptxattn.torch._op"} <= set(graph)
    assert "ptxattn.fastpath" in graph["ptxattn.api"]          # a top-level import
    assert "ptxattn.ptx" in graph["ptxattn.launch"]             # a lazy one, in kernel()
    assert "ptxattn.tools.bench" in graph["ptxattn.tools.guide"]   # within the tools
    assert "ptxattn.api" in graph["ptxattn.tools.bench"]         # `from .. import api`
    assert "ptxattn.fastpath" in graph["ptxattn.torch._op"]      # absolute `from ptxattn.x`
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_among_the_package_modules():
    found = circles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_runtime_module_imports_the_tools():
    graph = import_graph()
    bad = []
    for name in sorted(graph):
        if is_tool(name) or name in ENTRY_POINTS:
            continue
        via = reachable(graph, name)
        for tool in sorted(t for t in via if is_tool(t)):
            chain, step = [tool], tool
            while via[step] != name:
                step = via[step]
                chain.append(step)
            bad.append(" -> ".join([name] + chain[::-1]))
    assert not bad, "the runtime reaches the tools:\n  " + "\n  ".join(bad)


def test_importing_ptxattn_and_its_runtime_imports_no_tool():
    """At run time too: `import ptxattn`, its lazy attributes and every runtime module (the torch
    integration aside, which needs torch) load nothing of ptxattn.tools."""
    runtime = sorted(n for n in module_names() if not is_tool(n) and n not in ENTRY_POINTS
                     and not n.startswith("ptxattn.torch") and n != "ptxattn")
    code = ("import sys, importlib, ptxattn\n"
            "after_import = sorted(m for m in sys.modules if m.startswith('ptxattn.tools'))\n"
            "for name in ptxattn.__all__:\n"
            "    getattr(ptxattn, name)\n"
            f"for name in {runtime!r}:\n"
            "    importlib.import_module(name)\n"
            "print(after_import, sorted(m for m in sys.modules if m.startswith('ptxattn.tools')))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[]", "[]"], proc.stdout
    assert "ptxattn.api" in runtime and "ptxattn.fastpath" in runtime

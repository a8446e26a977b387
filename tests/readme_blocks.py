"""The fenced Python blocks under one README.md heading (for tests that run the docs)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
FRAMEWORKS_HEADING = "## Using ptxattn from PyTorch, JAX and CuPy"


def python_blocks(heading: str = FRAMEWORKS_HEADING, path: Path = README) -> list[str]:
    """Every ```python block between `heading` and the next heading of its level."""
    text = path.read_text()
    start = text.index(heading + "\n")
    level = heading.split(" ", 1)[0] + " "
    rest = text[start + len(heading) + 1:]
    end = re.search(rf"^{re.escape(level)}", rest, flags=re.M)
    section = rest[:end.start()] if end else rest
    return re.findall(r"^```python\n(.*?)^```$", section, flags=re.M | re.S)


def imported_packages(block: str) -> list[str]:
    """Top-level packages a block imports, in order (`import a.b as c`, `from a import b`)."""
    names = []
    for m in re.finditer(r"^(?:import|from)\s+([A-Za-z_]\w*)", block, flags=re.M):
        if m.group(1) not in names:
            names.append(m.group(1))
    return names

"""ptxattn's tools: the command line and what it runs over the library.

    cli           `ptxattn ...` / `python -m ptxattn ...` (info, list, run, ptx, sass, diff,
                  bench, trace)
    bench         the benchmark protocol (rounds, the cuDNN peer, intervals, results JSON)
    trace         per-CTA timelines of the stages' trace points
    sass          ptxas / nvdisasm / cuobjdump: resources, instruction mix, SASS diffs
    guide         docs/lineage/, the lineage guide, written from committed files
    golden        the golden fingerprints of every stage and build (tests/golden/)
    ptxgen, ptxgen_sm100
                  the generators of the committed macro headers in ptx/*/include/
    emulator, emulate
                  a CPU emulator of the sm_90a PTX the kernels use (correctness, races, out of
                  bounds, deadlocks on tiny shapes), and its command line

They import the runtime (ptxattn.api, stages, driver, ...); the runtime never imports them
(tests/test_architecture.py), so `import ptxattn` loads none of this.
"""

from pathlib import Path as _Path


def pip_extra(extra: str) -> str:
    """The pip command that adds an extra: `pip install -e '.[plot]'` when this package is a
    checkout's (an editable install or run from the tree), else `pip install 'ptxattn[plot]'`."""
    checkout = _Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / "ptx").is_dir():
        return f"pip install -e '.[{extra}]' (from the checkout, {checkout})"
    return f"pip install 'ptxattn[{extra}]'"

"""The Blackwell (sm_100a) lineage: one entry per hand-written kernel in ptx/sm100/.

The B200 steps of the published kernel, written in PTX with tcgen05 MMAs accumulating in tensor
memory. No B200 is lent to this project: these kernels are assembled with ptxas for sm_100a and
their SASS is checked in CI, but none has run here. The README beside them in ptx/sm100/
says what each stage is expected to do on a B200.

Kept apart from stages.py (the Hopper lineage and the production kernel) so that the two
lineages grow independently; stages.py's registry functions take an arch to reach these.
"""

from __future__ import annotations

from .stages import Stage


def _sm100(number: int, name: str, idea: str, **geometry) -> Stage:
    """A Blackwell stage: ptx/sm100/NN_name.ptx, built for sm_100a."""
    return Stage(number=number, name=name, idea=idea, arch="sm_100a",
                 file=f"sm100/{number:02d}_{name}.ptx", **geometry)


# In lineage order; a stage's diff from the one before it is its idea.
SM100_STAGES: tuple[Stage, ...] = ()

# What each stage's SASS must hold for its idea to be there (opcode names as cuobjdump prints
# them for sm_100a), checked in CI: stage number -> opcode prefixes.
SASS_NEEDS: dict[int, tuple[str, ...]] = {}

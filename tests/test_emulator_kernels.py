"""Known-good kernels (605 GPU tests passed on the H200) run on the CPU emulator and must meet
the project's bar against the float64 reference: this is what makes the emulator trustworthy
for kernels written without a GPU."""

from __future__ import annotations

import pytest
from emulator_checks import check


@pytest.mark.parametrize("shape", [(1, 1, 64, 128), (1, 2, 128, 128)])
@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_stage1_baseline(emulated_gpu, shape, layout):
    b, h, l, d = shape
    check(emulated_gpu, 1, b, h, l, l, d, layout=layout)

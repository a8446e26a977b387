"""The emulator's reading of the PTX ISA where no known-good kernel proves it (FP8 wgmma k32
operand layouts and the k32 A fragment, e4m3 conversions, red.global, TMA reduce-add, TMA box
element strides / 64B swizzle / NaN fill, acquire/release semaphores), proven on the H200: the hand-written kernels of
tests/emulator_kernels.py run on the GPU must give what NumPy expects, and what the emulator
gives. A failure names the case and how far the device is from each."""

from __future__ import annotations

import numpy as np
import pytest
from emulator_kernels import CASES, EXACT, Emulator, Gpu

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", sorted(CASES))
def test_hand_kernel_on_the_gpu_matches_numpy_and_the_emulator(name):
    device, want = CASES[name](Gpu())
    emulated, _ = CASES[name](Emulator())
    if name in EXACT:
        bad = np.flatnonzero(np.asarray(device).ravel() != np.asarray(want).ravel())
        assert bad.size == 0, (f"{name}: the GPU differs from NumPy at {bad.size} places, "
                               f"first {bad[:8].tolist()}: GPU {np.asarray(device).ravel()[bad[:8]]}"
                               f", NumPy {np.asarray(want).ravel()[bad[:8]]}")
        np.testing.assert_array_equal(device, emulated, err_msg=f"{name}: GPU vs emulator")
        return
    gap_ref = float(np.max(np.abs(np.asarray(device, np.float64) - want)))
    gap_emu = float(np.max(np.abs(np.asarray(device, np.float64) - emulated)))
    scale = float(np.max(np.abs(want))) or 1.0
    # FP8 tensor cores accumulate with fewer bits than fp32 (~14 retained, as reported for
    # Hopper): a layout error is O(1) relative, rounding 2^-14; the sums of integers are exact
    tol = 2e-3 * scale if name.startswith("fp8") else 1e-5 * scale + 1e-5
    assert gap_ref <= tol, (
        f"{name}: the GPU differs from NumPy by up to {gap_ref:.3g} (max |value| {scale:.3g}, "
        f"tolerance {tol:.3g}); from the emulator by {gap_emu:.3g}: the emulator's reading of "
        f"the ISA is wrong there")
    assert gap_emu <= tol, f"{name}: GPU vs emulator differ by {gap_emu:.3g} (tolerance {tol:.3g})"

"""The PTX the new kernels add (FP8 wgmma, e4m3 conversions, reductions to global memory,
TMA reduce-adds, semaphores), on the hand-written kernels of tests/emulator_kernels.py, against
NumPy. Unlike the bf16 paths, which the known-good kernels prove, these check the emulator's
reading of the PTX ISA (FP8 operand layouts, the k32 A fragment) only:
tests/test_gpu_emulator_parity.py runs the same kernels on the H200 to prove it."""

from __future__ import annotations

import numpy as np
import pytest
from emulator_kernels import CASES, EXACT, Emulator, spin_lock


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seed", [None, 5])
def test_hand_kernel_matches_numpy(name, seed):
    got, want = CASES[name](Emulator(seed=seed))
    if name in EXACT:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_spin_lock_between_ctas_under_fine_interleaving(seed):
    """Three instructions a slice: CTAs interleave inside the critical section's window."""
    got, want = spin_lock(Emulator(seed=seed), ctas=6, quantum=3)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_gpu_backend_of_the_parity_test_on_the_emulated_driver(emulated_gpu, name):
    """The host side of tests/test_gpu_emulator_parity.py (ptxattn.driver buffers, copies,
    cuTensorMapEncodeTiled, launches) run against the emulated driver, so that the device run
    cannot fail for a plumbing bug."""
    from emulator_kernels import Gpu
    got, want = CASES[name](Gpu())
    if name in EXACT:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)

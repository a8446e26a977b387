"""Serving kernels on the H200: the paged decode and append and the varlen prefill.

Every case of the emulator's file (tests/test_emulator_serving.py: shuffled page tables,
planted bad entries and lengths, host tables, varlen lengths 0/1/127-129, chunked prefill,
windows, the serving plans) runs here on the GPU, collected again with `emulated_gpu`
standing for the real device; then cases at serving sizes the emulator cannot reach (8k- and
32k-token caches, page sizes 16 to 256, 32:8 heads, a 16k-token varlen batch of 8 sequences,
paged varlen prefill and chunked prefill over 16- to 256-row pages). Outputs are poisoned
before each launch and checked against the float64 reference (decode_checks / varlen_checks).
"""

from __future__ import annotations

import numpy as np
import pytest
from decode_checks import paged_case, run_paged
from varlen_checks import paged_varlen_case, run_paged_varlen, run_varlen, varlen_case

import test_emulator_serving as emu

pytestmark = pytest.mark.gpu


@pytest.fixture
def emulated_gpu():
    """The emulator file's fixture, here: the H200 itself (the runtime's caches are live;
    conftest skips, or under PTXATTN_REQUIRE_GPU=1 fails, a gpu test without a GPU)."""
    yield None


# the emulator's cases, now on the device, but those that read the emulator's own launch log
# (the FakeDriver's .launches: how many launches, which kernel) - the device keeps none
EMULATOR_ONLY = {"test_prefill_plan_runs_layers_with_one_launch_each",
                 "test_prefill_plan_with_device_offsets_launches_the_tile_kernel",
                 "test_varlen_persistent_ctas_walk_several_tiles"}
for _name in dir(emu):
    if _name.startswith("test_") and _name not in EMULATOR_ONLY:
        globals()[_name] = getattr(emu, _name)


@pytest.mark.parametrize("page", [16, 64, 256])
@pytest.mark.parametrize("B,lengths", [(4, (8192, 1, 5000, 8191)), (2, (32768, 12345))])
def test_paged_decode_at_serving_sizes(emulated_gpu, B, lengths, page):
    rng = np.random.default_rng(page + sum(lengths))
    case = paged_case(rng, B=B, H=32, Hkv=8, Lq=1, D=128, page_size=page, lengths=lengths)
    run_paged(case, causal=True, what=f"H200 paged {page}")


@pytest.mark.parametrize("D", [64, 256])
def test_paged_decode_step_appends_at_other_head_dims(emulated_gpu, D):
    rng = np.random.default_rng(D)
    case = paged_case(rng, B=3, H=16, Hkv=4, Lq=1, D=D, page_size=64,
                      lengths=(3000, 64, 65), new=1)
    run_paged(case, causal=True, what=f"H200 paged append D{D}")


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_at_serving_sizes(emulated_gpu, causal):
    rng = np.random.default_rng(7 + causal)
    lens = (512, 4096, 1, 2047, 129, 3000, 1000, 4800)   # the float64 reference bounds sizes
    case = varlen_case(rng, lens, H=16, Hkv=4, D=128)
    run_varlen(case, causal=causal, what="H200 varlen")


def test_varlen_chunked_prefill_d64_d256(emulated_gpu):
    rng = np.random.default_rng(11)
    for D in (64, 256):
        case = varlen_case(rng, (1000, 7, 2048), (5000, 7, 9000), H=8, Hkv=2, D=D)
        run_varlen(case, causal=True, what=f"H200 varlen chunked D{D}")


@pytest.mark.parametrize("page", [16, 64, 256])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_paged_varlen_at_serving_sizes(emulated_gpu, page, D):
    """Chunked prefill against pages: lengths at the tile edges and a 4097-key sequence."""
    rng = np.random.default_rng(page + D)
    lens_q = (0, 1, 127, 128, 129, 512, 3)
    lens_k = (0, 1, 127, 128, 129, 4097, 2000)
    case = paged_varlen_case(rng, lens_q, lens_k, page_size=page, H=8, Hkv=2, D=D)
    run_paged_varlen(case, causal=True, what=f"H200 paged varlen {page}")


def test_paged_varlen_batch_of_37(emulated_gpu):
    rng = np.random.default_rng(37)
    lens_k = rng.integers(0, 1500, 37)
    lens_q = np.minimum(lens_k, rng.integers(1, 300, 37))
    case = paged_varlen_case(rng, lens_q, lens_k, page_size=16, H=16, Hkv=4, D=128)
    for causal in (False, True):
        run_paged_varlen(case, causal=causal, what="H200 paged varlen B=37")

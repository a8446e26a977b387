"""Known-good kernels (605 GPU tests passed on the H200) run on the CPU emulator and must meet
the project's bar against the float64 reference: this is what makes the emulator trustworthy
for kernels written without a GPU.

The default set is one representative per mechanism the emulator models, each at a tiny shape:
  stage 1   TMA without swizzle, wgmma SS with K- and MN-major descriptors, P through shared
            memory (st.shared + fence.proxy.async), plain stores;
  stage 2   wgmma RS (P as the A fragments in registers);
  stage 3   128-byte swizzle in TMA boxes and descriptors;
  stage 4   warp specialisation: producer/consumer, mbarrier FULL/EMPTY, setmaxnreg;
  stage 7   a 2-slot K/V ring with wgmma in flight across the softmax, named-barrier pingpong
            between two consumer warpgroups;
  stage 10  128-row K/V tiles (m64n128 S, 64-register accumulators);
  stage 12  stmatrix into shared memory and a TMA store (bulk groups, wait_group.read);
  stage 14  persistent CTAs walking several tiles (PTXATTN_PERSISTENT_CTAS caps the grid);
  stage 15  tiles from a global counter (atom.add across interleaved CTAs, fence.acq_rel);
  production at D = 64 (three consumers), 128 and 256: ragged Lq/Lk, LSE, causal with both
  diagonals, a sliding window, GQA, both layouts, persistent grids of 1 to 3 CTAs, and a seeded
  run (random interleaving and random completion of the asynchronous units).
Every other lineage stage runs once too (test_the_rest_of_the_lineage).
PTXATTN_EMULATOR_FULL=1 adds every stage at two more shapes and seeded production runs (~1 min
on an idle 2-core machine)."""

from __future__ import annotations

import os

import pytest
from emulator_checks import check

FULL = os.environ.get("PTXATTN_EMULATOR_FULL") == "1"
full_only = pytest.mark.skipif(not FULL, reason="the extended emulator matrix: set "
                                                "PTXATTN_EMULATOR_FULL=1 (minutes)")


@pytest.mark.parametrize("shape,layout", [((1, 1, 64, 128), "bhld"),
                                          ((1, 2, 128, 128), "bshd")])
def test_stage1_baseline(emulated_gpu, shape, layout):
    b, h, l, d = shape
    check(emulated_gpu, 1, b, h, l, l, d, layout=layout)


@pytest.mark.parametrize("stage,shape,layout", [
    (2, (1, 1, 128, 128), "bhld"),
    (3, (1, 1, 128, 128), "bshd"),
    (4, (1, 1, 128, 128), "bhld"),
    (7, (1, 1, 256, 128), "bhld"),
    (10, (1, 1, 256, 128), "bshd"),
    (12, (1, 2, 128, 128), "bhld"),
])
def test_lineage_stage(emulated_gpu, stage, shape, layout):
    b, h, l, d = shape
    check(emulated_gpu, stage, b, h, l, l, d, layout=layout)


@pytest.mark.parametrize("stage", [5, 6, 8, 9, 11, 13, 16, 17, 18])
def test_the_rest_of_the_lineage(emulated_gpu, stage):
    """Every other stage once, at the smallest shape it takes (seconds each)."""
    check(emulated_gpu, stage, 1, 1, 128, 128, 128)


@pytest.mark.parametrize("stage,ctas,shape", [(14, 1, (1, 2, 128, 128)),
                                              (15, 2, (1, 2, 256, 128))])
def test_persistent_stage_walks_several_tiles(emulated_gpu, monkeypatch, stage, ctas, shape):
    monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", str(ctas))
    b, h, l, d = shape
    check(emulated_gpu, stage, b, h, l, l, d)
    grid = emulated_gpu.launches[-1][1]
    assert grid == (ctas, 1, 1)


# (B, H, Hkv, Lq, Lk, D, layout, causal, window, diagonal, lse, persistent CTAs)
PRODUCTION = [
    (1, 2, 2, 200, 200, 128, "bhld", False, None, "bottom_right", True, None),
    (1, 1, 1, 300, 200, 128, "bhld", True, None, "bottom_right", False, 2),
    (1, 1, 1, 150, 260, 128, "bshd", True, None, "top_left", True, None),
    (1, 2, 1, 190, 190, 128, "bhld", False, (40, 20), "bottom_right", False, 1),
    (1, 4, 2, 190, 130, 64, "bshd", False, (64, 0), "bottom_right", True, None),
    (1, 3, 3, 100, 300, 64, "bhld", True, None, "bottom_right", False, 3),
    (2, 2, 1, 130, 130, 256, "bhld", True, None, "bottom_right", True, 2),
    (1, 1, 1, 70, 100, 256, "bshd", False, None, "bottom_right", False, None),
]


def _production(fake, monkeypatch, case, seed=0):
    b, h, hk, lq, lk, d, layout, causal, window, diagonal, lse, ctas = case
    if ctas is not None:
        monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", str(ctas))
    report = check(fake, None, b, h, lq, lk, d, heads_kv=hk, layout=layout, causal=causal,
                   window=window, diagonal=diagonal, return_lse=lse, seed=seed)
    if ctas is not None:
        assert fake.launches[-1][1][0] <= ctas
    return report


@pytest.mark.parametrize("case", PRODUCTION, ids=lambda c: (
    f"D{c[5]}-{c[6]}-L{c[3]}x{c[4]}-H{c[1]}:{c[2]}"
    f"{'-causal-' + c[9] if c[7] else ''}{'-win' if c[8] else ''}{'-lse' if c[10] else ''}"
    f"{f'-ctas{c[11]}' if c[11] else ''}"))
def test_production_kernel(emulated_gpu, monkeypatch, case):
    _production(emulated_gpu, monkeypatch, case)


def test_production_under_a_random_schedule(monkeypatch):
    """Random interleaving, random splitting of lockstep warps, TMA loads landing and wgmma
    groups retiring at random points: the same answer, no hazard."""
    from ptxattn.tools.emulator import fake_driver
    fake = fake_driver.install(monkeypatch, seed=1234)
    try:
        _production(fake, monkeypatch, (1, 2, 1, 200, 170, 128, "bhld", True, None,
                                        "bottom_right", True, 1), seed=3)
    finally:
        fake_driver.clear_runtime_caches()


@pytest.mark.parametrize("stage,shape", [(3, (1, 1, 128, 128)), (None, (1, 1, 130, 200, 128))])
def test_kernels_align_a_misaligned_dynamic_shared_base(monkeypatch, stage, shape):
    """The dynamic shared array 512 bytes past its declared 1024-byte alignment: the kernels'
    own align-up and the 1 KiB of slack in their budgets keep them right (a kernel without the
    slack would leave its window: a MemoryFault)."""
    from ptxattn.tools.emulator import fake_driver
    fake = fake_driver.install(monkeypatch, extern_offset=512)
    try:
        b, h, lq, *rest = shape
        lk = rest[0] if len(rest) == 2 else lq
        check(fake, stage, b, h, lq, lk, rest[-1], return_lse=stage is None)
    finally:
        fake_driver.clear_runtime_caches()


# ----------------------------------------------------------------------------- extended

@full_only
@pytest.mark.slow
@pytest.mark.parametrize("stage", list(range(1, 19)))
@pytest.mark.parametrize("shape", [(1, 2, 256, 128), (2, 1, 128, 128)])
def test_every_lineage_stage_full(emulated_gpu, stage, shape):
    b, h, l, d = shape
    check(emulated_gpu, stage, b, h, l, l, d)


@full_only
@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("case", PRODUCTION)
def test_production_kernel_seeded_full(monkeypatch, case, seed):
    from ptxattn.tools.emulator import fake_driver
    fake = fake_driver.install(monkeypatch, seed=seed)
    try:
        _production(fake, monkeypatch, case, seed=seed)
    finally:
        fake_driver.clear_runtime_caches()

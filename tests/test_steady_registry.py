"""The steady call and the stage pick's memory notice every registry the pick reads (CPU, the
recorded driver of test_prepare and the made-up Blackwell rows of test_sm100_runtime).

choice._pick_uncached reads, on a compute capability 10.0 device, stages.SM100_STAGES and
stages_sm100.FASTEST_FIRST (through stages.by_speed). A remembered call replayed after either
changed would launch the stage the old registry picked, where the full path now picks another
(or raises): the steady call's registry check must cover them, as choice.pick_stage's memory must.
"""

from __future__ import annotations

import pytest
from test_prepare import dev, gpu       # noqa: F401 - gpu is a fixture
from test_sm100_runtime import B200, D, passing, sm100   # noqa: F401 - sm100 is a fixture

from ptxattn import api as attn
from ptxattn import choice, fastpath, selfcheck, stages, stages_sm100


@pytest.fixture
def b200(gpu, sm100, monkeypatch):
    gpu["ctx"].compute_capability = B200
    monkeypatch.setattr(selfcheck, "run", passing)
    monkeypatch.setattr(fastpath, "_STEADY", {})
    return gpu


def call(gpu):
    """One attention() call of a shape both made-up stages take; the block size it launched
    with (384: stage 14, 128: stage 1)."""
    q, k, v, o = (dev((1, 2, 512, D), i) for i in range(4))
    attn.attention(q, k, v, out=o)
    return gpu["cuLaunchKernelEx"][-1][0].blockDimX


def test_a_swapped_blackwell_registry_is_a_miss(b200, sm100, monkeypatch):
    one, last = sm100
    assert call(b200) == call(b200) == last.threads          # the second call is a steady hit
    assert len(fastpath._STEADY) == 1
    monkeypatch.setattr(stages, "SM100_STAGES", (one,))
    assert call(b200) == one.threads                         # what the full path picks now


def test_a_changed_blackwell_speed_order_is_a_miss(b200, sm100, monkeypatch):
    one, last = sm100
    assert call(b200) == call(b200) == last.threads
    monkeypatch.setattr(stages_sm100, "FASTEST_FIRST", (1, 14), raising=False)
    assert choice.pick_stage(None, D, 512, 512, B200) is one  # the pick's memory noticed too
    assert call(b200) == one.threads


def test_a_new_parameter_pack_outlives_another_threads_eviction(gpu, monkeypatch):
    """A steady call that packs parameters for a new output address launches with the pack's
    address; another thread's call on the same entry may evict that pack (past _PACKS_MAX
    addresses) before the launch. The caller must hold the pack itself, not only its address,
    or the launch reads a freed void*[]. Here the "other thread" evicts every pack inside the
    (recorded) launch, and the pack launched must still be alive."""
    import gc
    import weakref

    from test_prepare import cu
    from test_steady import dev as array
    monkeypatch.setattr(fastpath, "_STEADY", {})
    q, k, v = (array((1, 2, 128, 128), i) for i in range(3))
    attn.attention(q, k, v)                 # the full path: remembered (a fresh output)
    (entry,) = fastpath._STEADY.values()
    alive = []

    def launch(config, function, address, extra):
        holders = next(p[1] for p in entry.packs.values() if p[0] == address)
        array_ref = weakref.ref(holders[-1])                       # the void*[] itself
        del holders
        with entry._lock:
            entry.packs.clear()                                    # evicted meanwhile
        gc.collect()
        alive.append(array_ref() is not None)
        return (0,)

    monkeypatch.setattr(cu, "cuLaunchKernelEx", launch)
    attn.attention(q, k, v)                 # a hit; its fresh output: a new address
    assert alive == [True]

"""A pretend GPU for CPU tests of the bench and CLI flows.

The driver answers device_info(), device arrays are NumPy arrays, and a "launch" writes the
NumPy reference (or, for stages listed in `wrong`, something off by 10%) into the output.
Timing returns fixed figures per stage. What these tests cover is the bookkeeping around the
GPU: checks, skips, errors, rounds, tables, exit codes. The GPU tests cover the real thing.
"""

from __future__ import annotations

import numpy as np

from ptxattn import attention, bench, driver, reference, tensors


class FakeDevice:
    def __init__(self, array):
        self.array = np.array(array)

    def to_numpy(self):
        return self.array.copy()

    def fill_u16(self, value):
        assert value == 0xFFFF                 # bf16 NaN: outputs are poisoned before a launch
        self.array[...] = np.nan


class FakePrepared:
    def __init__(self, q, k, v, stage, layout, out, launches, wrong):
        self.q, self.k, self.v, self.stage, self.layout, self.out = q, k, v, stage, layout, out
        self.stream = 0
        self._launches, self._wrong = launches, wrong

    def launch(self):
        n = self.stage.number
        self._launches[n] = self._launches.get(n, 0) + 1
        ref = reference.attention_reference(self.q.array, self.k.array, self.v.array,
                                            layout=self.layout)
        if n in self._wrong:
            ref = ref * 1.1
        self.out.array[...] = ref.astype(np.float32).astype(self.out.array.dtype)


def install(monkeypatch, ms_by_stage: dict[int, float], *, fail=(), wrong=()) -> dict[int, int]:
    """Patch the driver, tensors, attention.prepare and bench timing; returns the launch counts.

    fail: stage numbers whose prepare() raises; wrong: stages whose output is 10% off.
    """
    launches: dict[int, int] = {}

    def prepare(q, k, v, *, stage, layout, out, **_):
        if stage.number in fail:
            raise RuntimeError("fake JIT failure\nwith a second line")
        return FakePrepared(q, k, v, stage, layout, out, launches, set(wrong))

    def time_launch(fn, warmup=3, reps=20, **_):
        fn()
        return [ms_by_stage[fn.__self__.stage.number]] * reps

    def time_interleaved(fns, reps, **_):
        return [time_launch(fn, reps=reps) for fn in fns]

    monkeypatch.setattr(bench, "_import_torch", lambda: None)
    monkeypatch.setattr(bench, "time_launch", time_launch)
    monkeypatch.setattr(bench, "time_interleaved", time_interleaved)
    monkeypatch.setattr(bench, "gpu_clocks", lambda: {"clocks_sm": "1980"})
    monkeypatch.setattr(driver, "device_info", lambda: {
        "name": "Fake GPU", "compute_capability": (9, 0), "arch": "sm_90a", "sm_count": 132,
        "driver_version": 13000, "driver_version_str": "13.0", "total_memory": 141 << 30})
    monkeypatch.setattr(driver, "synchronize", lambda stream=None: None)
    monkeypatch.setattr(tensors, "from_numpy", lambda a, **_: FakeDevice(a))
    monkeypatch.setattr(tensors, "empty", lambda shape, **_: FakeDevice(
        np.zeros(shape, reference.BF16)))
    monkeypatch.setattr(attention, "prepare", prepare)
    return launches

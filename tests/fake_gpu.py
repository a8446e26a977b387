"""A pretend GPU for CPU tests of the bench and CLI flows.

The driver answers device_info(), device arrays are NumPy arrays, and a "launch" writes the
NumPy reference (or, for stages listed in `wrong`, something off by 10%) into the output.
Timing returns fixed figures per stage. What these tests cover is the bookkeeping around the
GPU: checks, skips, errors, rounds, tables, exit codes. The GPU tests cover the real thing.
"""

from __future__ import annotations

import numpy as np

from ptxattn import api, driver, reference, selfcheck, tensors
from ptxattn.tools import bench


class FakeDevice:
    def __init__(self, array):
        self.array = np.array(array)

    def to_numpy(self):
        return self.array.copy()

    def fill_u16(self, value):
        assert value == 0xFFFF                 # bf16 NaN: outputs are poisoned before a launch
        self.array[...] = np.nan


class FakePrepared:
    """One prepared call: a launch writes the reference (with the call's causal/window mask,
    GQA by shapes) into out, and with return_lse its log-sum-exp into .lse."""

    def __init__(self, q, k, v, stage, layout, out, launches, wrong, *, causal=False,
                 window=None, return_lse=False, wrong_lse=False):
        self.q, self.k, self.v, self.stage, self.layout, self.out = q, k, v, stage, layout, out
        self.stream = 0
        self.causal, self.window = causal, window
        b, h, lq = ((q.array.shape[0], q.array.shape[1], q.array.shape[2]) if layout == "bhld"
                    else (q.array.shape[0], q.array.shape[2], q.array.shape[1]))
        self.lse = FakeDevice(np.zeros((b, h, lq), np.float32)) if return_lse else None
        self._launches, self._wrong, self._wrong_lse = launches, wrong, wrong_lse

    def launch(self):
        n = self.stage.number
        self._launches[n] = self._launches.get(n, 0) + 1
        ref, lse = reference.attention_reference(self.q.array, self.k.array, self.v.array,
                                                 layout=self.layout, causal=self.causal,
                                                 window=self.window, return_lse=True)
        if n in self._wrong:
            ref = ref * 1.1
        self.out.array[...] = ref.astype(np.float32).astype(self.out.array.dtype)
        if self.lse is not None:
            self.lse.array[...] = lse + (0.01 if self._wrong_lse else 0.0)


def install(monkeypatch, ms_by_stage: dict, *, fail=(), wrong=(), wrong_lse=False,
            masks=True) -> dict[int, int]:
    """Patch the driver, tensors, prepare (api.prepare, and the self-check's own selfcheck._prepare)
    and bench timing; returns the launch counts.

    ms_by_stage: stage number -> ms of every launch; a key (number, "lse") times the LSE
    variant, (number, "causal") a masked call. fail: stage numbers whose prepare() raises;
    wrong: stages whose output is 10% off; wrong_lse: every LSE is off by 0.01.
    masks=False: prepare() takes no causal= / window= (as before the masked kernel).
    """
    launches: dict[int, int] = {}

    def prepare_masks(q, k, v, *, stage, layout, out, causal=False, window=None,
                      return_lse=False):
        if stage.number in fail:
            raise RuntimeError("fake JIT failure\nwith a second line")
        return FakePrepared(q, k, v, stage, layout, out, launches, set(wrong), causal=causal,
                            window=window, return_lse=return_lse, wrong_lse=wrong_lse)

    def prepare_dense(q, k, v, *, stage, layout, out, return_lse=False):
        return prepare_masks(q, k, v, stage=stage, layout=layout, out=out,
                             return_lse=return_lse)

    def time_launch(fn, warmup=3, reps=20, **_):
        fn()
        p = fn.__self__
        key = p.stage.number
        for extra, on in (("lse", p.lse is not None), ("causal", p.causal or p.window)):
            if on and (key, extra) in ms_by_stage:
                key = (key, extra)
        return [ms_by_stage[key]] * reps

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
    monkeypatch.setattr(api, "prepare", prepare_masks if masks else prepare_dense)
    monkeypatch.setattr(selfcheck, "_prepare", prepare_masks if masks else prepare_dense)
    monkeypatch.setattr(bench, "_poison_f32", lambda a: a.array.fill(np.nan))
    return launches

"""The kernels written without a GPU (split-KV decode and its combine, the backward lineage and
the production backward) on the CPU emulator, the emulator having been proven on the known-good
forward kernels: their answers against the float64 references, and what the emulator finds.

One finding is pinned as a strict expected failure, so that the test turns red (XPASS) the day
the kernel is fixed and the marker must go:
  - the production backward reads its dS^T registers with stmatrix (bwd.ptx:393) while the
    DK_GEMM that takes them as its A operand is in flight: undefined in the PTX ISA
    (wgmma.wait_group), though a read. Its gradients are checked with that one hazard kind
    set aside.
The other, the combine kernel's unpredicated partial-O loads past the workspace (split counts
not a multiple of COMBINE_BATCH), is fixed: a split of weight 0 is not read (decode_gen.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from ptxattn.tools.emulator import HazardError, fake_driver

GRAD_BOUND = 1e-2          # bwd_checks' bound without torch; the kernels sit at ~2.4e-3 here


@pytest.fixture
def emulated(monkeypatch):
    """emulated_gpu with options."""
    made = []

    def install(**options):
        fake = fake_driver.install(monkeypatch, **options)
        made.append(fake)
        return fake
    yield install
    fake_driver.clear_runtime_caches()


# ----------------------------------------------------------------------------- decode

DECODE = [dict(D=128, splits=1, Lmax=300, lengths=[300, 133]),
          dict(D=64, splits=1, Lmax=200, lengths=[200, 1], Lq=4, causal=True),
          dict(D=256, splits=1, Lmax=130, lengths=[129, 50], new=1),
          dict(D=128, splits=1, Lmax=300, lengths=[0, 300], H=8, Hkv=8, layout="bhld")]


@pytest.mark.parametrize("case", DECODE, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_decode_without_splits(emulated, case):
    import test_gpu_decode as T            # its run(): poisoned outputs, the reference, the bar
    fake = emulated()
    T.run(**case)
    for name, _, _, _, report in fake.launches:
        assert report is not None and not report.hazards, (name, report.hazards)


@pytest.mark.parametrize("splits", [2, 3])
def test_decode_with_splits_reads_only_its_workspace(emulated, splits):
    import test_gpu_decode as T
    emulated()
    T.run(D=128, splits=splits, Lmax=300, lengths=[300, 133])


# ----------------------------------------------------------------------------- backward

def _backward(fake, stage, B, H, Hkv, Lq, Lk, D, layout="bhld", **mask):
    import bwd_checks
    from ptxattn.reference_backward import attention_backward_reference
    q, k, v, out, lse, dout = bwd_checks.inputs(B, H, Hkv, Lq, Lk, D, layout=layout, **mask)
    grads = bwd_checks.run(q, k, v, out, lse, dout, stage=stage, layout=layout, **mask)
    ref = attention_backward_reference(q, k, v, dout, layout=layout, **mask)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        bound = GRAD_BOUND
        rel = bwd_checks.rel_l2(got, want)
        assert np.isfinite(np.asarray(got, np.float32)).all() and rel <= bound, \
            bwd_checks.describe(name, got, want, layout, bound)
    return fake.launches


def test_backward_lineage_b1(emulated):
    launches = _backward(emulated(), "b1", 1, 1, 1, 128, 128, 128)
    assert [n for n, *_ in launches][-3:] == ["ptxattn_bwd_preprocess", "ptxattn_bwd",
                                               "ptxattn_bwd_postprocess"]
    assert all(r is not None and not r.hazards for *_, r in launches)


@pytest.mark.parametrize("case", [
    dict(B=1, H=1, Hkv=1, Lq=128, Lk=128, D=128),
    dict(B=1, H=2, Hkv=1, Lq=100, Lk=150, D=64, causal=True),
    dict(B=1, H=1, Hkv=1, Lq=70, Lk=130, D=256, layout="bshd"),
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_production_backward_gradients(emulated, case):
    """Right gradients, and no hazard but the known A-operand read."""
    fake = emulated(ignore_hazards={"wgmma-a-operand-read"})
    launches = _backward(fake, None, **case)
    kinds = {h.kind for *_, r in launches if r is not None for h in r.hazards}
    assert kinds <= {"wgmma-a-operand-read"}, kinds


@pytest.mark.xfail(strict=True, raises=HazardError,
                   reason="known: bwd.ptx:393 reads the dS^T registers (stmatrix) while DK_GEMM "
                          "takes them as its A operand in flight: undefined in the PTX ISA")
def test_production_backward_has_no_hazard(emulated):
    _backward(emulated(), None, 1, 1, 1, 128, 128, 128)

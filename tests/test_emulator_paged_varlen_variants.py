"""The paged varlen build's producer variants that are not the default (kv_paged.ptxh): the
single producer thread of session 16 (PTXATTN_PAGED_WARP=0), the same with the table read a
tile ahead, and the warp with the table ahead. bench/experiments/paged_varlen_probe.py times
them against the default; these tests keep them correct, so that the probe measures kernels
that compute the right answer. The default build's own cases are test_emulator_serving.py's.

Each variant is the library's paged build with extra defines (a forward_build that adds them),
on the emulated GPU: ragged lengths with an empty sequence and a one-token one, pages smaller
and larger than a K/V tile, causal and a window, and a persistent grid of 2 CTAs (each CTA
walks several tiles, so the producer's per-tile state carries across Q tiles)."""

import dataclasses

import numpy as np
import pytest

from ptxattn import varlen
from varlen_checks import paged_varlen_case, run_paged_varlen

VARIANTS = {
    "thread": (("PTXATTN_PAGED_WARP", "0"),),
    "thread_ahead": (("PTXATTN_PAGED_WARP", "0"), ("PTXATTN_PAGED_TABLE_AHEAD", "1")),
    "warp_ahead": (("PTXATTN_PAGED_WARP", "1"), ("PTXATTN_PAGED_TABLE_AHEAD", "1")),
}


@pytest.fixture
def variant_build(monkeypatch):
    """Install a forward_build whose paged builds carry a variant's defines."""
    plain = varlen.forward_build

    def install(extra):
        def build(d, paged=False):
            st = plain(d, paged)
            return dataclasses.replace(st, defines=st.defines + extra) if paged else st
        monkeypatch.setattr(varlen, "forward_build", build)
        varlen._LAUNCHERS.clear()
    yield install
    varlen._LAUNCHERS.clear()


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("page,d", [(16, 64), (32, 128), (256, 256)])
def test_a_producer_variant_is_correct(emulated_gpu, variant_build, monkeypatch, name, page, d):
    variant_build(VARIANTS[name])
    rng = np.random.default_rng(page + d)
    case = paged_varlen_case(rng, (0, 1, 127, 129), (5, 1, 300, 400), page_size=page,
                             H=4, Hkv=2, D=d)
    run_paged_varlen(case, causal=True, what=name)
    run_paged_varlen(case, causal=False, window=(50, 3), what=f"{name} window")
    monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", "2")
    varlen._LAUNCHERS.clear()
    run_paged_varlen(case, causal=True, what=f"{name}, 2 CTAs")


def test_the_default_is_the_warp_producer():
    """The variants above differ from the default (else they would test nothing new)."""
    stage = varlen.forward_build(128, paged=True)
    defines = dict(stage.defines)
    assert defines.get("PTXATTN_PAGED_WARP", "1") == "1"
    assert "PTXATTN_PAGED_TABLE_AHEAD" not in defines
    from ptxattn import ptx
    src = ptx.source(stage, defines)
    assert "elect.sync" in src
    thread = dataclasses.replace(stage, defines=stage.defines + VARIANTS["thread"])
    assert "elect.sync" not in ptx.source(thread, dict(thread.defines))

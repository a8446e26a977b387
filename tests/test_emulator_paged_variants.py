"""Every build variant of the paged decode (ptxattn/decode_builds.PAGED_VARIANTS) on the CPU
emulator against the float64 reference: shuffled page tables at page sizes below a tile (16,
32) and one above, GQA and MQA, ragged lengths (0, 1, a page boundary, a partial tile), splits,
an append, a window, planted bad table entries (which must read nothing: the emulator faults
on any access outside an allocation) and the bounds report. Outputs are poisoned first
(fresh emulated memory is NaN). The same variants at serving sizes run on the H200
(tests/test_gpu_paged_variants.py)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ptxattn.tools.emulator", reason="the CPU emulator is not here")

from decode_checks import paged_case, run_paged  # noqa: E402

from ptxattn import decode  # noqa: E402
from ptxattn.decode_builds import PAGED_VARIANT_ENV, PAGED_VARIANTS  # noqa: E402

VARIANTS = list(PAGED_VARIANTS)
BUILDS = [v.name for v in PAGED_VARIANTS.values() if v.defines]    # their own kernels
ROW_GROUPS = [v.name for v in PAGED_VARIANTS.values() if v.row_group]

# (B, H, Hkv, Lq, D, page, lengths, splits, causal, new)
CORE = [
    (3, 8, 2, 1, 128, 16, (200, 17, 129), 2, True, 0),     # GQA 4, ragged, split
    (2, 4, 4, 2, 64, 32, (65, 1), 1, False, 1),            # an append, Lq 2, one split
]


def _run(monkeypatch, variant, B, H, Hkv, Lq, D, page, lengths, splits, causal, new,
         **kw):
    monkeypatch.setenv(PAGED_VARIANT_ENV, variant)
    rng = np.random.default_rng(sum(lengths) + page + D)
    case = paged_case(rng, B=B, H=H, Hkv=Hkv, Lq=Lq, D=D, page_size=page, lengths=lengths,
                      new=new)
    return run_paged(case, causal=causal, splits=splits, what=f"emulator {variant}", **kw)


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_meets_the_bar(emulated_gpu, monkeypatch, variant):
    _run(monkeypatch, variant, *CORE[0])


@pytest.mark.parametrize("variant", BUILDS)
def test_each_build_appends_then_attends(emulated_gpu, monkeypatch, variant):
    _run(monkeypatch, variant, *CORE[1])


@pytest.mark.parametrize("variant", ROW_GROUPS)
@pytest.mark.parametrize("D,page,lengths", [(256, 16, (100, 0)), (128, 256, (300, 5))])
def test_row_groups_at_other_head_dims_and_pages_above_a_tile(emulated_gpu, monkeypatch,
                                                              variant, D, page, lengths):
    """D 256: four swizzle atoms a row group; page 256: one box of a tile's rows in the
    middle of a page (its group row in the page)."""
    _run(monkeypatch, variant, 2, 2, 1, 1, D, page, lengths, 2, False, 0)


def test_a_window_over_pages_with_the_warp_producer(emulated_gpu, monkeypatch):
    monkeypatch.setenv(PAGED_VARIANT_ENV, "rowgroup_warp_ahead")
    rng = np.random.default_rng(5)
    case = paged_case(rng, B=2, H=4, Hkv=2, Lq=2, D=64, page_size=16, lengths=(150, 90))
    run_paged(case, window=(40, 0), splits=2, what="emulator rowgroup_warp_ahead window")


def _planted(case):
    table = case["table"].copy()
    num_pages = case["k_pages"].shape[0]
    table[0, 1] = -1
    table[1, 0] = num_pages
    table[0, 2] = 2**31 - 1          # row groups: 2^31 x groups per page must not wrap inside
    table[1, -1] = -7
    return table


@pytest.mark.parametrize("variant", BUILDS)
def test_bad_table_entries_read_nothing(emulated_gpu, monkeypatch, variant):
    monkeypatch.setenv(PAGED_VARIANT_ENV, variant)
    rng = np.random.default_rng(7)
    case = paged_case(rng, B=2, H=4, Hkv=2, Lq=1, D=64, page_size=16, lengths=(60, 40),
                      max_pages=5, new=1)
    run_paged(case, table=_planted(case), splits=2, what=f"emulator planted {variant}")


@pytest.mark.parametrize("variant", ["batched", "rowgroup_ahead", "rowgroup_warp"])
def test_the_bounds_report_names_the_bad_page(emulated_gpu, monkeypatch, variant):
    monkeypatch.setenv(PAGED_VARIANT_ENV, variant)
    rng = np.random.default_rng(8)
    case = paged_case(rng, B=2, H=4, Hkv=2, Lq=1, D=64, page_size=16, lengths=(60, 40),
                      max_pages=5)
    monkeypatch.setenv("PTXATTN_CHECK_BOUNDS", "1")
    monkeypatch.setattr(decode, "_is_capturing", lambda stream: False)   # not emulated
    with pytest.raises(ValueError, match=r"block_table: on the device, sequence \d's page"):
        run_paged(case, table=_planted(case), splits=1, what=f"emulator bounds {variant}")


def test_the_variants_launch_their_own_kernels(emulated_gpu, monkeypatch):
    """The knob is read per call: two calls of the same shape under two variants build two
    Launchers, each with its build's defines."""
    from ptxattn import decode_launch
    seen = {}
    for variant in ("today", "rowgroup_warp_ahead"):
        _run(monkeypatch, variant, 2, 4, 2, 1, 64, 16, (40, 20), 1, False, 0)
        seen[variant] = {launcher.variant for launcher in decode._LAUNCHERS.values()}
    assert seen["today"] == {"today"}
    assert seen["rowgroup_warp_ahead"] == {"today", "rowgroup_warp_ahead"}
    keys = [dict(k[2]) for k in decode_launch._FUNCTIONS if k[1] == decode_launch.DECODE_FILE]
    assert any(k.get("PTXATTN_PAGED_WARP") == 1 and k.get("PTXATTN_PAGED_ROW_GROUP") == 1
               for k in keys), keys

"""The paged decode's build variants (ptxattn/decode_builds.PAGED_VARIANTS, picked per call by
PTXATTN_PAGED_VARIANT) on the H200: every variant against the float64 reference at page sizes
below a tile (16, 32) on shuffled tables, GQA and MQA, ragged lengths (1, a page boundary, a
partial tile, full 8k and 32k sequences), splits; each variant's output bit for bit equal to
today's build on the same call (they differ in how the K/V tiles arrive, never in the math);
planted bad table entries; the other head dims for the row-group layout; and a small "does it
launch and write every element" check first. Outputs are poisoned before each launch; every
failure names the variant, the case, and the rows, heads and sizes of what is wrong.

    PTXATTN_REQUIRE_GPU=1 python -m pytest -q tests/test_gpu_paged_variants.py    # ~2 min
"""

from __future__ import annotations

import numpy as np
import pytest
from decode_checks import DeviceInt32, paged_case, run_paged

import ptxattn
from ptxattn import driver, tensors
from ptxattn.decode_builds import PAGED_VARIANT_ENV, PAGED_VARIANTS

pytestmark = pytest.mark.gpu

VARIANTS = list(PAGED_VARIANTS)
BUILDS = [v.name for v in PAGED_VARIANTS.values() if v.defines]
ROW_GROUPS = [v.name for v in PAGED_VARIANTS.values() if v.row_group]
SAME_SPLITS = [v.name for v in PAGED_VARIANTS.values() if v.split_factor == 1]


def _paged_out(case, variant, monkeypatch, splits=0, causal=True):
    """One call under `variant`: the bf16 output (poisoned with NaN before the launch)."""
    monkeypatch.setenv(PAGED_VARIANT_ENV, variant)
    q = case["q"]
    qd, kd, vd = (tensors.from_numpy(case[n]) for n in ("q", "k_pages", "v_pages"))
    out = tensors.empty(q.shape)
    out.fill_u16(0xFFFF)
    ptxattn.flash_attn_with_kvcache(
        qd, kd, vd, cache_seqlens=DeviceInt32(np.asarray(case["cached"], np.int32)),
        block_table=DeviceInt32(case["table"]), causal=causal, num_splits=splits, out=out)
    driver.synchronize()
    got = out.to_numpy()
    for x in (qd, kd, vd, out):
        x.free()
    return got


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_launches_and_writes_every_element(monkeypatch, variant):
    rng = np.random.default_rng(1)
    case = paged_case(rng, B=3, H=8, Hkv=2, Lq=1, D=128, page_size=16, lengths=(300, 1, 129))
    got = _paged_out(case, variant, monkeypatch).astype(np.float32)
    bad = np.argwhere(~np.isfinite(got))
    assert bad.size == 0, f"{variant}: {len(bad)} elements of {got.size} left unwritten (NaN), " \
        f"first (b, lq, h, d): {bad[:5].tolist()}"


@pytest.mark.parametrize("page", [16, 32])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("B,H,Hkv,lengths", [
    (4, 32, 8, (8192, 1, 5000, 8191)),          # GQA 4, ragged, a full 8k sequence
    (2, 8, 1, (32768, 12345)),                  # MQA, 32k
])
def test_each_variant_meets_the_bar_at_serving_sizes(monkeypatch, variant, page, B, H, Hkv,
                                                     lengths):
    monkeypatch.setenv(PAGED_VARIANT_ENV, variant)
    rng = np.random.default_rng(page + sum(lengths))
    case = paged_case(rng, B=B, H=H, Hkv=Hkv, Lq=1, D=128, page_size=page, lengths=lengths)
    run_paged(case, causal=True, what=f"H200 variant {variant} page {page}")


@pytest.mark.parametrize("page", [16, 32, 64])
def test_the_variants_equal_todays_build_bit_for_bit(monkeypatch, page):
    """Same call, same splits: only how the tiles arrive differs, so the output must not
    move by a bit (a difference is a layout or a page-number bug, never rounding)."""
    rng = np.random.default_rng(100 + page)
    case = paged_case(rng, B=8, H=32, Hkv=8, Lq=1, D=128, page_size=page,
                      lengths=(4096, 17, 1000, 129, 128, 3000, 1, 2048))
    splits = 2
    want = _paged_out(case, "today", monkeypatch, splits).astype(np.float32)
    assert np.isfinite(want).all(), "today's build left NaN"
    for variant in SAME_SPLITS:
        got = _paged_out(case, variant, monkeypatch, splits).astype(np.float32)
        diff = np.argwhere(got != want)
        if diff.size:
            rows = sorted({(int(b), int(h)) for b, _, h, _ in diff})
            raise AssertionError(
                f"page {page}: {variant} differs from today's build in {len(diff)} of "
                f"{got.size} elements (max |diff| {np.nanmax(np.abs(got - want)):.3g}, "
                f"{int(np.isnan(got).sum())} NaN); (batch, head) pairs: {rows[:12]}")


@pytest.mark.parametrize("variant", ROW_GROUPS)
@pytest.mark.parametrize("D", [64, 256])
def test_row_groups_at_the_other_head_dims(monkeypatch, variant, D):
    monkeypatch.setenv(PAGED_VARIANT_ENV, variant)
    rng = np.random.default_rng(D)
    case = paged_case(rng, B=3, H=16, Hkv=4, Lq=1, D=D, page_size=16,
                      lengths=(3000, 64, 65), new=1)
    run_paged(case, causal=True, what=f"H200 {variant} D{D} append")


def _planted(case):
    table = case["table"].copy()
    num_pages = case["k_pages"].shape[0]
    table[0, 1] = -1
    table[1, 0] = num_pages
    table[0, 2] = 2**31 - 1
    table[1, -1] = -7
    return table


@pytest.mark.parametrize("variant", BUILDS)
def test_bad_table_entries_read_as_zero_keys(monkeypatch, variant):
    monkeypatch.setenv(PAGED_VARIANT_ENV, variant)
    rng = np.random.default_rng(7)
    case = paged_case(rng, B=2, H=8, Hkv=2, Lq=1, D=128, page_size=16, lengths=(600, 400),
                      max_pages=40, new=1)
    run_paged(case, table=_planted(case), splits=2, what=f"H200 planted {variant}")


@pytest.mark.parametrize("variant", ["rowgroup_warp_ahead", "ahead"])
def test_the_bounds_report_names_the_bad_page(monkeypatch, variant):
    monkeypatch.setenv(PAGED_VARIANT_ENV, variant)
    monkeypatch.setenv("PTXATTN_CHECK_BOUNDS", "1")
    rng = np.random.default_rng(8)
    case = paged_case(rng, B=2, H=4, Hkv=2, Lq=1, D=128, page_size=16, lengths=(600, 400),
                      max_pages=40)
    with pytest.raises(ValueError, match=r"block_table: on the device, sequence \d's page"):
        run_paged(case, table=_planted(case), splits=1, what=f"H200 bounds {variant}")

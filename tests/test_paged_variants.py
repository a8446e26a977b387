"""The paged decode's build variants (issue 25: paged decode at page sizes below a tile), on the
CPU without the emulator: the table (ptxattn/decode_builds.PAGED_VARIANTS), the knob that picks
one (PTXATTN_PAGED_VARIANT), what each build assembles to (ptxas: no spills, the boxes it
issues), today's build left as it was, the row-group maps and their fallback, and the split
factor. The emulator runs them against the reference in tests/test_emulator_paged_variants.py;
the H200 in tests/test_gpu_paged_variants.py."""

from __future__ import annotations

import functools

import pytest

from ptxattn import decode, decode_launch, decode_plan, tma
from ptxattn.decode_builds import (DECODE_BUILDS, DEFAULT_PAGED_VARIANT,
                                   FALLBACK_PAGED_VARIANT, PAGED_VARIANT_ENV, PAGED_VARIANTS,
                                   paged_variant)
from ptxattn.tools import golden, sass

BUILD_VARIANTS = [v for v in PAGED_VARIANTS.values() if v.defines]


def test_the_default_is_the_measured_one_and_every_variant_has_a_reason():
    assert DEFAULT_PAGED_VARIANT == "warp_ahead"      # the H200's fastest at pages 16 and 32
    assert PAGED_VARIANTS["today"].defines == {}
    assert not paged_variant(FALLBACK_PAGED_VARIANT).row_group
    for v in PAGED_VARIANTS.values():
        assert v.why, f"{v.name}: no reason"
        assert v.split_factor >= 1
    # every build variant is its own build: no two share defines unless they share the kernel
    seen = {}
    for v in BUILD_VARIANTS:
        key = tuple(sorted(v.defines.items()))
        assert key not in seen, f"{v.name} and {seen.get(key)} are the same build"
        seen[key] = v.name


def test_the_knob_picks_a_variant_and_names_itself_when_wrong(monkeypatch):
    monkeypatch.delenv(PAGED_VARIANT_ENV, raising=False)
    assert paged_variant().name == DEFAULT_PAGED_VARIANT
    monkeypatch.setenv(PAGED_VARIANT_ENV, "rowgroup_warp")
    assert paged_variant().name == "rowgroup_warp"
    monkeypatch.setenv(PAGED_VARIANT_ENV, "  ")
    assert paged_variant().name == DEFAULT_PAGED_VARIANT
    monkeypatch.setenv(PAGED_VARIANT_ENV, "fastest")
    with pytest.raises(ValueError, match=r"PTXATTN_PAGED_VARIANT: 'fastest' is not a paged "
                                         r"build variant \(one of today, "):
        paged_variant()


def test_the_steady_path_and_the_launchers_are_keyed_on_the_variant():
    assert PAGED_VARIANT_ENV in decode._KNOB_NAMES
    # a Launcher of one variant is never handed to a call of another (its key names it)
    import inspect
    assert "paging.variant" in inspect.getsource(decode._launcher)


@pytest.mark.parametrize("variant", [v.name for v in BUILD_VARIANTS])
def test_variant_defines_reach_only_the_paged_decode_kernel(variant):
    defines = decode_launch.build_defines(128, True, variant)
    assert defines == {"HEAD_DIM": 128, "PTXATTN_PAGED": 1, **PAGED_VARIANTS[variant].defines}
    assert decode_launch.build_defines(128, False, variant) == {"HEAD_DIM": 128}


def test_todays_builds_are_unchanged_and_the_variants_are_fingerprinted():
    expected = golden.load_kernels()[decode_launch.DECODE_FILE]
    builds = [b for b in golden.kernel_builds() if b[0] == decode_launch.DECODE_FILE]
    names = {name for _, name, *_ in builds}
    assert names <= set(expected), f"unfingerprinted: {sorted(names - set(expected))}"
    for d in DECODE_BUILDS:
        for v in BUILD_VARIANTS:
            name = f"HEAD_DIM={d} PTXATTN_PAGED=1" + "".join(
                f" {k}={x}" for k, x in sorted(v.defines.items()))
            assert name in names, f"{v.name} at D {d} is not among the golden builds"
    # today's paged build is the variant-free one, byte for byte
    for d in DECODE_BUILDS:
        assert decode_launch.kernel_source(decode_launch.DECODE_FILE, d, True, "today") == \
            decode_launch.kernel_source(decode_launch.DECODE_FILE, d, True)


@functools.lru_cache(maxsize=None)
def _assembled(d: int, variant: str):
    try:
        sass.find_tool("ptxas")
    except Exception as e:                      # noqa: BLE001
        pytest.skip(f"no ptxas: {e}")
    text = decode_launch.kernel_source(decode_launch.DECODE_FILE, d, True, variant)
    a = sass.assemble_ptx(text, "sm_90a", name=f"decode.{d}.{variant}")
    return sass.parse_ptxas_log(a.log), sass.disassemble(a.cubin)


@pytest.mark.slow                               # ptxas: ~8 s a build
@pytest.mark.parametrize("d", sorted(DECODE_BUILDS))
@pytest.mark.parametrize("variant", [v.name for v in BUILD_VARIANTS])
def test_every_variant_assembles_without_spills_and_issues_its_boxes(d, variant):
    log, text = _assembled(d, variant)
    f = log["functions"]["ptxattn_decode"]
    assert f["spill_stores"] == 0 and f["spill_loads"] == 0, f"{variant} D {d}: spills {f}"
    assert not sass.grep(text, "LDL") and not sass.grep(text, "STL")
    assert f["registers"] <= 255
    v = PAGED_VARIANTS[variant]
    pages = DECODE_BUILDS[d].max_pages_per_tile
    boxes = 2 * pages * (1 if v.row_group else d // 64)        # K and V of one tile
    utma = len(sass.grep(text, "UTMALDG"))
    assert utma == boxes, f"{variant} D {d}: {utma} UTMALDG, expected {boxes} (a box per " \
        f"page{'' if v.row_group else ' and 64 columns of D'}, K and V)"
    hgmma = len(sass.grep(text, "HGMMA"))
    assert hgmma > 0, f"{variant} D {d}: no wgmma"


@pytest.mark.slow
@pytest.mark.parametrize("d", [128])
def test_the_warp_builds_issue_boxes_on_the_uniform_datapath(d):
    """The point of the warp producer (the SASS of today's build: each box wrapped in a
    per-lane loop, its operands moved over from vector registers): in the row-group warp
    builds every box is a plain UTMALDG with few R2UR between the first box and the last."""
    _, today = _assembled(d, "rowgroup")
    for variant in ("rowgroup_warp", "rowgroup_warp_ahead"):
        _, text = _assembled(d, variant)
        lines = [line for line in text.splitlines() if "/*" in line and "*/" in line]
        at = [i for i, line in enumerate(lines) if "UTMALDG" in line]
        between = lines[at[0]:at[-1]]
        r2ur = sum("R2UR" in line for line in between)
        elect_loops = sum("BRA.U.ANY" in line for line in between)
        assert elect_loops == 0, f"{variant}: {elect_loops} per-lane loops around its boxes"
        assert r2ur <= 2 * len(at), f"{variant}: {r2ur} R2UR among {len(at)} boxes"
    lines = [line for line in today.splitlines() if "/*" in line]
    assert sum("BRA.U.ANY" in line for line in lines) > 0, \
        "today's single-thread producer no longer loops per lane: revisit the warp variants"


# ---- the row-group maps -------------------------------------------------------------------

def test_row_group_geometry_folds_pages_into_row_groups():
    dims, strides, box = tma.row_group_geometry(10, 16, 8, 128, 16)
    row = 8 * 128 * 2                                   # Hkv x D x 2 bytes
    assert dims == (64, 8, 2, 8, 10 * 16 // 8)
    assert strides == (row, 128, 256, 8 * row)
    assert box == (64, 8, 2, 1, 2)                      # a page of 16 rows over all of D
    _, _, box = tma.row_group_geometry(10, 256, 8, 128, 128)
    assert box == (64, 8, 2, 1, 16)                     # a tile's 128 rows of a big page


def test_row_group_geometry_refuses_pages_that_do_not_fold():
    shape = (10, 16, 8, 128)
    spaced = (2 * 16 * 8 * 128, 8 * 128, 128, 1)        # every other page of a bigger pool
    with pytest.raises(ValueError, match="do not fold"):
        tma.row_group_geometry(*shape[:3], 128, 16, spaced)
    tma.row_group_geometry(1, 16, 8, 128, 16, spaced)   # one page: nothing to fold


class _View:
    def __init__(self, strides):
        self.strides = strides


def test_a_row_group_variant_falls_back_where_the_pages_do_not_fold(monkeypatch):
    build = DECODE_BUILDS[128]
    paging = decode_plan.Paging("device", page_size=16, num_pages=10, max_pages=4)
    packed = {"k_cache": _View((16 * 8 * 128, 8 * 128, 128, 1)),
              "v_cache": _View((16 * 8 * 128, 8 * 128, 128, 1))}
    spaced = {"k_cache": _View((2 * 16 * 8 * 128, 8 * 128, 128, 1)),
              "v_cache": _View((16 * 8 * 128, 8 * 128, 128, 1))}
    monkeypatch.setenv(PAGED_VARIANT_ENV, "rowgroup_ahead")
    assert decode._paged_variant_for(paging, packed, 8, 128, build) == "rowgroup_ahead"
    assert decode._paged_variant_for(paging, spaced, 8, 128, build) == FALLBACK_PAGED_VARIANT
    monkeypatch.setenv(PAGED_VARIANT_ENV, "warp")     # no layout change: any strides
    assert decode._paged_variant_for(paging, spaced, 8, 128, build) == "warp"


# ---- the split factor ---------------------------------------------------------------------

def test_the_split_factor_applies_below_a_tile_only():
    p16 = decode_plan.Paging("device", page_size=16, num_pages=1, max_pages=1,
                             variant="splits2x")
    p128 = decode_plan.Paging("device", page_size=128, num_pages=1, max_pages=1,
                              variant="splits2x")
    today = decode_plan.Paging("device", page_size=16, num_pages=1, max_pages=1)
    assert decode_plan.scaled_paged_splits(2, p16, 128, 256) == 4
    assert decode_plan.scaled_paged_splits(2, p128, 128, 256) == 2
    assert decode_plan.scaled_paged_splits(2, today, 128, 256) == 2
    assert decode_plan.scaled_paged_splits(2, None, 128, 256) == 2
    assert decode_plan.scaled_paged_splits(100, p16, 128, 256) == decode_plan.MAX_SPLITS
    assert decode_plan.scaled_paged_splits(3, p16, 128, 5) == 5      # at most the tiles


# ---- bench/serving_bench.py --variants: its bookkeeping (the timing runs on the H200) ----------

def _serving_bench():
    from bench_modules import bench_script
    return bench_script("serving_bench")


def test_the_benchmark_times_todays_build_first_and_names_unknown_variants():
    sb = _serving_bench()
    names = sb.variant_names("all")
    assert names[0] == "today" and sorted(names) == sorted(PAGED_VARIANTS)
    assert sb.variant_names("rowgroup, today") == ["today", "rowgroup"]
    with pytest.raises(SystemExit, match="--variants: fastest not among"):
        sb.variant_names("fastest")
    assert sb.VARIANT_PAGES == (16, 32, 64)


def test_variant_ratios_are_per_round_against_contiguous_and_today():
    sb = _serving_bench()
    import statistics

    class DB:
        median = staticmethod(statistics.median)

        @staticmethod
        def bootstrap_ci(xs, seed=0):
            return min(xs), max(xs)
    rounds = {"contiguous": [1.0, 1.0, 1.0], "today": [1.5, 1.4, 1.6],
              "rowgroup": [1.0, 1.1, 1.05]}
    rows = sb._variant_rows(DB, rounds, 1e9, 0, "today")
    assert rows["today"]["over_contiguous"]["median"] == pytest.approx(1 / 1.5)
    assert "over_today" not in rows["today"]
    assert rows["rowgroup"]["over_contiguous"]["median"] == pytest.approx(1 / 1.05)
    # per round, then the median: 1.5 / 1.0, 1.4 / 1.1, 1.6 / 1.05
    assert rows["rowgroup"]["over_today"]["median"] == pytest.approx(1.5)
    assert rows["rowgroup"]["over_today"]["ci"] == [pytest.approx(1.4 / 1.1),
                                                     pytest.approx(1.6 / 1.05)]
    assert rows["contiguous"]["tbs"] == pytest.approx(1.0)    # 1 GB in 1 ms
    rec = {"name": "b64_8k_page16_variants", "status": "ok", "plain": rows, "graph": rows,
           "variants": {"today": {"status": "ok"}, "rowgroup": {"status": "ok"}}}
    sb.print_variant_table(rec)                               # no crash on a full record

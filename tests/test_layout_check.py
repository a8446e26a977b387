"""include/layout_check.ptxh: the literal layout constants of stages 10-15 agree with their tile
shape, and a literal that disagrees stops the build with an #error naming it (CPU only).

The checks are exercised on a small file holding a stage's own #define block (not the whole
stage) so that each mutation costs one tiny pcpp run."""

import re

import pytest

from ptxattn import ptx, stages
from ptxattn.errors import PtxattnError

INCLUDE = stages.ptx_root() / "sm90" / "include"
CHECKED = [s for s in stages.all_kernels()
           if s.arch == "sm_90a" and re.match(r"1[0-5]_", s.file.split("/")[-1])]
_DEFINE = re.compile(r"^#define ([A-Z][A-Z0-9_]*) (\d+)\b", re.M)
# what a wrong value of each constant is: off by one unit of its kind
_WRONG = {"KV_STAGES": 4, "KV_STAGE_SHIFT": 2, "BLOCK_M_SHIFT": 6, "BLOCK_N_SHIFT": 6,
          "BLOCK_N": 64, "BLOCK_M": 64, "HEAD_DIM": 64, "CONSUMER_ROWS": 32}
LAYOUT = ("BLOCK_M", "BLOCK_N", "HEAD_DIM", "CONSUMER_ROWS", "BLOCK_M_SHIFT", "BLOCK_N_SHIFT",
          "Q_TILE_BYTES", "KV_TILE_BYTES", "KV_SLOT_DESC_STEP", "KV_STAGES", "KV_STAGE_SHIFT")


def _layout(stage) -> dict[str, int]:
    """The stage's numeric #defines up to the include of layout_check.ptxh."""
    text = (stages.ptx_root() / stage.file).read_text()
    head, sep, _ = text.partition('#include "layout_check.ptxh"')
    assert sep, f"{stage.file} does not include layout_check.ptxh"
    return {name: int(value) for name, value in _DEFINE.findall(head)
            if name in LAYOUT or name.startswith("SMEM_")}


def _expand(tmp_path, defines: dict[str, int]) -> str:
    src = tmp_path / "layout.ptx"
    src.write_text("".join(f"#define {k} {v}\n" for k, v in defines.items())
                   + '#include "layout_check.ptxh"\n.version 8.4\n')
    return ptx.expand_file(src, include_dirs=[INCLUDE]).text


def test_checked_stages_found():
    assert [s.file.split("/")[-1][:2] for s in CHECKED] == [str(n) for n in range(10, 16)]


@pytest.mark.parametrize("stage", CHECKED, ids=lambda s: s.label)
def test_stage_layout_passes_and_adds_no_statement(stage, tmp_path):
    layout = _layout(stage)
    assert set(LAYOUT) <= set(layout), f"missing: {sorted(set(LAYOUT) - set(layout))}"
    assert _expand(tmp_path, layout).split() == [".version", "8.4"]


@pytest.mark.parametrize("stage", [CHECKED[0], CHECKED[-1]], ids=lambda s: s.label)
def test_every_wrong_literal_is_named(stage, tmp_path):
    layout = _layout(stage)
    for name, value in layout.items():
        wrong = dict(layout)
        if name in _WRONG:
            wrong[name] = _WRONG[name]
        elif name.startswith("SMEM_BAR") or name == "SMEM_TILE_INFO":
            wrong[name] = value + 8          # one mbarrier off
        else:
            wrong[name] = value + 1024       # one swizzle atom off
        with pytest.raises(PtxattnError) as err:
            _expand(tmp_path, wrong)
        assert "#error" in str(err.value), name
        assert name in str(err.value), f"{name}={wrong[name]}: {err.value}"

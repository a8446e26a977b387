"""The launch-parameter table (ptxattn.launch) against every kernel's `.param` list (CPU).

launch.params_of(stage) is what the build packs and what the steady call re-packs by name; the
kernel reads its parameters by the names in its `.entry ptxattn_fwd(...)` list. Here each list,
parsed from the expanded PTX (ptxattn.ptx.source), must be the table's: the production kernel's
in each of its builds, every lineage stage's (a prefix of production's, plus stage 15's tile
counter), and every traced build's (the trace buffer last).
"""

from __future__ import annotations

import ctypes
import re
from concurrent.futures import ProcessPoolExecutor

import pytest

from ptxattn import driver, fp8_forward, launch, ptx, stages
from ptxattn.launch import LINEAGE_PARAMS, TILE_COUNTER, TRACE_BUF, params_of
from ptxattn.tools import golden

_ENTRY = re.compile(r"\.entry\s+ptxattn_fwd(?:_fp8)?\s*\((.*?)\)", re.S)   # (FP8: its own entry)
_DECL = re.compile(r"^\.param\s+(?P<type>.+?)\s+(?P<name>\w+)\s*(?P<array>\[\d+\])?$")
TRACE = {"PTXATTN_TRACE": "1"}


def declared(text: str) -> list[tuple[str, str]]:
    """(name, type) of each `.param` of ptxattn_fwd in PTX text, the type as the table writes
    it: the declaration's words between `.param` and the name, an array's length after them."""
    text = re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", " ", text, flags=re.S))
    (body,) = _ENTRY.findall(text)
    out = []
    for piece in body.split(","):
        m = _DECL.match(" ".join(piece.split()))
        assert m, f"not a .param declaration: {piece.strip()!r}"
        out.append((m["name"], " ".join(m["type"].split()) + (m["array"] or "")))
    return out


def table(params) -> list[tuple[str, str]]:
    return [(p.name, p.ptx) for p in params]


def traced(stage) -> bool:
    """The stage's file declares the trace buffer (TRACE_PARAM) in its parameter list."""
    return "TRACE_PARAM" in (stages.ptx_root() / stage.file).read_text()


def _declared_of(file: str) -> list[tuple[str, str]]:
    return declared(ptx.source(stages.get_stage(file_stage(file))))


def file_stage(file: str):
    return next(s for s in stages.SM100_STAGES if s.file == file)


# --------------------------------------------------------------------------- the table itself

PTX_OF_CTYPE = {driver.BY_VALUE: ".align 64 .b8[128]", driver.PTR: ".u64", driver.U64: ".u64",
                driver.U32: ".u32", driver.S32: ".s32", driver.F32: ".f32"}


def test_each_parameter_has_the_ptx_type_of_its_ctype():
    """A ctype and its .param agree in size and kind: the driver copies sizeof(ctype) bytes
    (128 for a by-value tensor map) into the slot the kernel reads as that type."""
    every = (LINEAGE_PARAMS + launch.PRODUCTION_PARAMS + (launch.WALK_SECTION,)
             + launch.VARLEN_PARAMS + launch.PAGED_PARAMS + (TILE_COUNTER, TRACE_BUF))
    for p in every:
        assert p.ptx == PTX_OF_CTYPE[p.ctype], p
        size = 128 if p.ctype is driver.BY_VALUE else ctypes.sizeof(p.ctype)
        bits = re.search(r"\.[busf](\d+)", p.ptx)
        count = re.search(r"\[(\d+)\]", p.ptx)
        assert size == int(bits[1]) // 8 * (int(count[1]) if count else 1), p
    names = [p.name for p in every]
    assert len(set(names)) == len(names), names


def test_the_lineage_list_is_a_prefix_of_productions():
    production = params_of(stages.PRODUCTION)
    for stage in stages.all_stages() + stages.SM100_STAGES:
        mine = params_of(stage)
        extra = (TILE_COUNTER,) if stage.dynamic_tiles else ()
        assert mine == production[:len(mine) - len(extra)] + extra, stage.label
    assert production[:len(LINEAGE_PARAMS)] == LINEAGE_PARAMS


def test_slots_are_found_by_name():
    production = params_of(stages.PRODUCTION)
    assert production[launch.slot(production, "lse_ptr")].name == "lse_ptr"
    assert production[launch.slot(production, "tmap_o")].ctype is driver.BY_VALUE
    with pytest.raises(ValueError, match="lse_ptr: not a parameter"):
        launch.slot(params_of(stages.get_stage(14)), "lse_ptr")


def test_pack_takes_every_parameter_by_name_and_nothing_else():
    params = params_of(stages.get_stage(1))
    values = {p.name: i for i, p in enumerate(params)}
    assert launch.pack(params, values) == (tuple(range(len(params))),
                                           tuple(p.ctype for p in params))
    with pytest.raises(ValueError, match=r"missing \['softmax_scale'\]"):
        launch.pack(params, {n: v for n, v in values.items() if n != "softmax_scale"})
    with pytest.raises(ValueError, match=r"not in the table \['lse_ptr'\]"):
        launch.pack(params, {**values, "lse_ptr": 0})


# --------------------------------------------------------------------------- against the PTX

def test_the_parser_reads_a_declaration_list():
    text = (".visible .entry ptxattn_fwd(\n  .param .align 64 .b8 tmap_q[128], // Q\n"
            "  .param .u64 o_ptr /* O */, .param .f32 softmax_scale\n)\n{ ret; }")
    assert declared(text) == [("tmap_q", ".align 64 .b8[128]"), ("o_ptr", ".u64"),
                              ("softmax_scale", ".f32")]


def production_builds():
    """The production kernel in every build variant the golden fingerprints cover (the default
    ptx.source reads, the masked build, head dims 64 and 256, the traced build): its defines
    select tiles and code, never the parameter list (the expansions are shared with
    tests/test_golden.py's, which run first in one session)."""
    varlen = stages.PRODUCTION.specialize(128, True, True)   # its ABI adds VARLEN_PARAMS
    return [(name, varlen if "PTXATTN_VARLEN" in defines else stages.PRODUCTION,
             defines or None)
            for name, defines in golden.variants(stages.PRODUCTION)]


@pytest.mark.parametrize("name,build,defines", production_builds(),
                         ids=[name for name, _, _ in production_builds()])
def test_the_production_kernel_declares_the_table(name, build, defines):
    trace = (TRACE_BUF,) if "PTXATTN_TRACE" in (defines or {}) else ()
    # the FP8 builds (ptxattn_fwd_fp8) are launched from fp8_forward's table: the production
    # kernel's parameters, then the descales
    params = fp8_forward.PARAMS if "PTXATTN_FP8" in (defines or {}) else params_of(build)
    assert declared(ptx.source(build, defines)) == table(params + trace)


def test_the_production_builds_cover_masks_head_dims_and_the_trace():
    names = [name for name, _, _ in production_builds()]
    assert {"default", "PTXATTN_TRACE=1", "PTXATTN_MASKED=1", "PTXATTN_VARLEN=1", "HEAD_DIM=64",
            "HEAD_DIM=256"} <= set(names), names
    # every build attention() runs differs from these by its defines only (Stage.specialize)
    for d, masked in stages.PRODUCTION_VARIANTS:
        build = stages.PRODUCTION.specialize(d, masked)
        assert build.file == stages.PRODUCTION.file and params_of(build) == params_of(
            stages.PRODUCTION)
        # the walk's section in every build but the varlen one (its tile table is its walk)
        assert params_of(build)[-1] == launch.WALK_SECTION
        varlen = stages.PRODUCTION.specialize(d, masked, varlen=True)
        assert params_of(varlen) == params_of(stages.PRODUCTION)[:-1] + launch.VARLEN_PARAMS


@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_paged_varlen_build_declares_the_table(d):
    """flash_attn_varlen_func(..., block_table=)'s build: the varlen ABI, then the paging."""
    paged = stages.PRODUCTION.specialize(d, True, True, paged=True)
    assert params_of(paged) == params_of(stages.PRODUCTION.specialize(d, True, True)) \
        + launch.PAGED_PARAMS
    assert declared(ptx.source(paged, dict(paged.defines))) == table(params_of(paged))


@pytest.mark.parametrize("stage", stages.all_stages(), ids=lambda s: s.label)
def test_each_hopper_stage_declares_the_table(stage):
    assert declared(ptx.source(stage)) == table(params_of(stage))
    if traced(stage):
        assert declared(ptx.source(stage, TRACE)) == table(params_of(stage) + (TRACE_BUF,))


def test_each_blackwell_stage_declares_the_table():
    files = [s.file for s in stages.SM100_STAGES]
    assert files, "no sm100 stage registered"
    with ProcessPoolExecutor(max_workers=2) as pool:       # pcpp: ~2 s a stage
        found = dict(zip(files, pool.map(_declared_of, files)))
    for stage in stages.SM100_STAGES:
        assert found[stage.file] == table(params_of(stage)), stage.label
    assert any(s.dynamic_tiles for s in stages.SM100_STAGES)   # stage 15's counter is seen

"""The backward's kernels as ptxas sees them, and the launcher's ABI against their parameter
lists (CPU only; assembling needs ptxas, found as `ptxattn info` finds it).

Every build assembles for sm_90a with no spills and no stack, within its register budget;
every launch the Python side builds passes exactly the parameters the kernel declares, in
order and of the right width, with the grid, block and shared memory of the table.
"""

from __future__ import annotations

import ctypes
import functools
import re

import numpy as np
import pytest

from ptxattn import backward, bwd_builds, driver, tensors, tma
from ptxattn.tools import sass
from ptxattn.reference import BF16

needs_ptxas = pytest.mark.skipif(sass.locate("ptxas") is None, reason="ptxas not found")

# (label, file, defines, entry, register limit)
KERNELS = [("preprocess", *backward.PREPROCESS[:1], {}, backward.PREPROCESS[1], 64),
           ("postprocess", *backward.POSTPROCESS[:1], {}, backward.POSTPROCESS[1], 64)]
KERNELS += [(s.label, s.file, {}, backward.ENTRY, 255) for s in bwd_builds.STAGES]
KERNELS += [(f"production_d{b.head_dim}{'_masked' if masked else ''}"
             + ("" if b.variant == bwd_builds.DEFAULT_VARIANT else f"_{b.variant}"),
             bwd_builds.PRODUCTION.file,
             backward.defines_for(bwd_builds.PRODUCTION, b.head_dim, masked, b.variant),
             backward.ENTRY, 168)
            for b in bwd_builds.all_builds() for masked in (False, True)]


@functools.lru_cache(maxsize=None)
def _assembly(file, defines: tuple):
    text = backward.source(file, dict(defines)).text
    return text, sass.assemble_ptx(text, "sm_90a", "bwd")


def _assembled(file, defines):
    text, asm = _assembly(file, tuple(sorted(defines.items())))
    return text, sass.parse_ptxas_log(asm.log)


@needs_ptxas
@pytest.mark.parametrize("label,file,defines,entry,limit", KERNELS, ids=[k[0] for k in KERNELS])
def test_assembles_without_spills(label, file, defines, entry, limit):
    _, report = _assembled(file, defines)
    f = report["functions"][entry]
    assert f["spill_stores"] == 0 and f["spill_loads"] == 0, f
    assert f["stack_frame"] == 0, f
    assert f["registers"] <= limit, f
    # no performance notes either (C7512: wgmma serialized for want of registers)
    assert not report["warnings"], report["warnings"]


def entry_params(text: str, entry: str) -> list[str]:
    """The PTX types of an entry's parameters, in order: "map" for a by-value tensor map."""
    head = text.split(f".entry {entry}(", 1)[1].split(")", 1)[0]
    out = []
    for p in head.split(","):
        m = re.search(r"\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)\s+\w+(\[\d+\])?", p)
        out.append("map" if m.group(2) == "[128]" else m.group(1))
    return out


_WIDTH = {"u64": (ctypes.c_uint64, ctypes.c_void_p), "u32": (ctypes.c_uint32,),
          "s32": (ctypes.c_int32,), "f32": (ctypes.c_float,), "map": (None,)}


class _Spec:
    made: list = []

    def __init__(self, function, grid, block, smem, params, cluster=(1, 1, 1), stream=0):
        self.function, self.grid, self.block, self.smem, self.params = (function, grid, block,
                                                                        smem, params)
        _Spec.made.append(self)


@pytest.fixture
def fake_launches(monkeypatch):
    """backward.build without a GPU: fake arrays and maps, LaunchSpecs recorded."""
    class Ctx:
        ordinal, max_smem_optin, sm_count = 0, 232448, 132

    next_ptr = [1 << 32]

    def empty(shape, *, stream=None, dtype=BF16, stream_owner=None):
        ptr = next_ptr[0]
        next_ptr[0] += (-(-int(np.prod(shape)) * np.dtype(dtype).itemsize // 4096) + 1) * 4096
        return tensors.DeviceArray(ptr, shape, device=0, dtype=dtype, stream=stream)

    monkeypatch.setattr(driver, "context", lambda: Ctx())
    monkeypatch.setattr(backward, "kernel", lambda file, entry, *a, **k: (file, entry))
    monkeypatch.setattr(tensors, "empty", empty)
    monkeypatch.setattr(tensors, "from_numpy", lambda x, stream=None: empty(x.shape,
                                                                             stream=stream))
    monkeypatch.setattr(driver, "memcpy_htod", lambda *a, **k: None)
    monkeypatch.setattr(tma, "_encode", lambda *a: "map")
    monkeypatch.setattr(driver, "LaunchSpec", _Spec)
    _Spec.made = []
    yield _Spec.made
    tma.clear_map_cache()


def _call(stage, head_dim, Lq, Lk, H=4, Hkv=4, layout="bhld", **kw):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, H, Lq, head_dim) if layout == "bhld"
                            else (2, Lq, H, head_dim)).astype(BF16)
    kv = rng.standard_normal((2, Hkv, Lk, head_dim) if layout == "bhld"
                             else (2, Lk, Hkv, head_dim)).astype(BF16)
    lse = np.zeros((2, H, Lq), np.float32)
    return backward.prepare_backward(q, kv, kv, q, lse, q, stage=stage, layout=layout, **kw)


CALLS = [(s.label, 128, 192, 256, {}) for s in bwd_builds.STAGES]
CALLS += [(None, 64, 200, 300, {}), (None, 128, 100, 1000, dict(causal=True, H=4, Hkv=2)),
          (None, 256, 77, 129, dict(window=(8, 0), deterministic=True, H=4, Hkv=1)),
          (None, 128, 100, 300, dict(variant="st_ahead", causal=True)),
          (None, 256, 77, 129, dict(variant="qsplit", deterministic=True, H=4, Hkv=2)),
          (None, 256, 200, 129, dict(variant="qsplit_dqred", H=4, Hkv=1)),
          (None, 64, 200, 300, dict(variant="dqred", window=(20, 5))),
          (None, 128, 200, 300, dict(variant="m80", causal=True, H=4, Hkv=2)),
          (None, 128, 170, 333, dict(variant="m80", deterministic=True))]


@pytest.mark.parametrize("stage,head_dim,Lq,Lk,kw", CALLS)
def test_every_launch_passes_what_its_kernel_declares(fake_launches, stage, head_dim, Lq, Lk,
                                                     kw):
    p = _call(stage, head_dim, Lq, Lk, **kw)
    kw = {k: v for k, v in kw.items() if k not in ("H", "Hkv")}
    pre, main, post = fake_launches
    plan = p.plan
    for spec in (pre, main, post):
        file, entry = spec.function
        declared = entry_params(backward.source(file, backward.defines_for(plan)).text, entry)
        values, types = spec.params
        assert len(values) == len(types) == len(declared), (entry, len(types), len(declared))
        for i, (want, got) in enumerate(zip(declared, types)):
            assert got in _WIDTH[want], f"{entry} parameter {i}: declared .{want}, passed {got}"
    rows = bwd_builds.padded_rows(Lq, plan.block_m)
    assert pre.grid == post.grid == (rows // backward.STATS_ROWS_PER_CTA, plan.heads, 2)
    assert main.grid == (-(-Lk // plan.block_n), plan.heads_kv, 2)
    assert main.block == (plan.stage.threads, 1, 1)
    assert main.smem == plan.stage.smem_for(head_dim, plan.variant)
    if plan.stage.production:
        unasked = bwd_builds.chosen_variant(head_dim, bool(kw.get("deterministic")), None)
        assert main.smem == plan.tiles.smem_bytes and plan.tiles.variant == kw.get(
            "variant", unasked or bwd_builds.DEFAULT_VARIANT)
    # the workspaces: (B, H, Lq_pad) stats, (B, H, Lq_pad, D) accumulator, fresh per call
    assert p.neg_lse.shape == p.delta.shape == (2, plan.heads, rows)
    assert p.dq_accum.shape == (2, plan.heads, rows, head_dim)
    if plan.deterministic:
        sem = main.params[0][-1]
        assert sem == p.semaphores.ptr != 0
        assert p.semaphores.shape == (2, plan.heads, rows // plan.block_m)
    elif plan.stage.production:
        assert main.params[0][-1] == 0
    if plan.stage.production:
        H, Hkv = plan.heads, plan.heads_kv
        extra = main.params[0][-5:-1]
        assert extra[0] == H // Hkv and extra[1] == (Lk - Lq)
        if plan.masked:            # an unbounded side arrives as Lq + Lk
            left, right = plan.window
            assert extra[2] == (Lq + Lk if left < 0 else left) and extra[3] == right
    again = _call(stage, head_dim, Lq, Lk, **dict(kw, **{k: v for k, v in
                                                      dict(H=plan.heads, Hkv=plan.heads_kv)
                                                      .items()}))
    assert again.dq_accum.ptr != p.dq_accum.ptr, "a workspace was reused between calls"


SETMAXNREG = [k for k in KERNELS if k[1] != bwd_builds.STAGES[0].file and k[3] == backward.ENTRY]


@needs_ptxas
@pytest.mark.skipif(sass.locate("nvdisasm") is None and sass.locate("cuobjdump") is None,
                    reason="no disassembler")
@pytest.mark.parametrize("label,file,defines,entry,limit", SETMAXNREG,
                         ids=[k[0] for k in SETMAXNREG])
def test_setmaxnreg_regions_stay_in_their_budgets(label, file, defines, entry, limit):
    """In the SASS, the code after the consumers' USETMAXREG.TRY_ALLOC (240) and after the
    producer warpgroup's USETMAXREG.DEALLOC (24) names no register past its budget (ptxas lays
    the consumer code out first, the producer warpgroup's after it)."""
    _, asm = _assembly(file, tuple(sorted(defines.items())))
    lines = sass.disassemble(asm.cubin).splitlines()
    alloc = [i for i, l in enumerate(lines) if "USETMAXREG.TRY_ALLOC" in l]
    dealloc = [i for i, l in enumerate(lines) if "USETMAXREG.DEALLOC" in l]
    assert len(alloc) == 1 and len(dealloc) == 1 and alloc[0] < dealloc[0]

    def highest(part):
        return max(int(r) for l in part for r in re.findall(r"\bR(\d+)\b", l))

    assert highest(lines[alloc[0]:dealloc[0]]) < bwd_builds.CONSUMER_REGS
    assert highest(lines[dealloc[0]:]) < bwd_builds.PRODUCER_REGS

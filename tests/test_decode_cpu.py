"""flash_attn_with_kvcache without a GPU: the build table and its generated header, the
kernels' parameter tables against their PTX, each kernel assembled (ptxas) without spills, the
split heuristic's decisions, validation and the lengths contract, and a NumPy model of the
kernels' index math (tiles per split, masks, packing, the combine) against the reference.

The GPU side is tests/test_gpu_decode.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from fakes import FakeDLPack

from ptxattn import decode, decode_builds, decode_launch, decode_plan
from ptxattn.tools import decode_gen, sass
from ptxattn.decode_builds import DECODE_BUILDS, ROWS
from ptxattn.decode_plan import choose_splits, m_tiles_of, packed_row
from ptxattn.decode_reference import (clamped_lengths, combine, cta_tiles, kvcache_reference,
                                      masked_runs, model_decode, tile_is_masked)

BASE = 0x7F00_0000_0000
HEAD_DIMS = sorted(DECODE_BUILDS)
# (file, entry, paged build, its parameter table)
KERNELS = ((decode_launch.DECODE_FILE, decode_launch.DECODE_ENTRY, False,
            decode_launch.decode_params(False)),
           (decode_launch.DECODE_FILE, decode_launch.DECODE_ENTRY, True,
            decode_launch.decode_params(True)),
           (decode_launch.COMBINE_FILE, decode_launch.COMBINE_ENTRY, False,
            decode_launch.COMBINE_PARAMS),
           (decode_launch.APPEND_FILE, decode_launch.APPEND_ENTRY, False,
            decode_launch.append_params(False)),
           (decode_launch.APPEND_FILE, decode_launch.APPEND_ENTRY, True,
            decode_launch.append_params(True)))


# --------------------------------------------------------------------------- build table, header

def test_committed_header_equals_the_generator_output():
    assert decode_gen.stale() == [], "run `python -m ptxattn.tools.decode_gen` and commit the header"


def test_a_hand_edit_of_the_header_is_caught(tmp_path):
    for name, text in decode_gen.headers().items():
        (tmp_path / name).write_text(text.replace("#define KV_STAGES 3", "#define KV_STAGES 4",
                                                  1))
    assert decode_gen.stale(tmp_path) == [decode_gen.HEADER]


def _row(d: int) -> dict[str, str]:
    text = decode_gen.header()
    m = re.search(rf"^#(?:el)?if HEAD_DIM == {d}\n(.*?)^#(?:elif|else)\b", text, re.M | re.S)
    assert m, d
    return {a: b for a, b in re.findall(r"^#define (\w+) (\S+)", m.group(1), re.M)}


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_header_rows_are_the_table(d):
    b, row = DECODE_BUILDS[d], _row(d)
    assert int(row["BLOCK_N"]) == b.block_n and 1 << int(row["BLOCK_N_SHIFT"]) == b.block_n
    assert int(row["KV_STAGES"]) == b.kv_stages
    assert int(row["SMEM_BYTES"]) == b.smem_bytes
    # the carve-up: Q, K ring, V ring, barriers, in that order, 1024-aligned tiles
    assert int(row["SMEM_K"]) == ROWS * d * 2
    assert int(row["SMEM_V"]) == int(row["SMEM_K"]) + b.kv_stages * b.block_n * d * 2
    assert int(row["SMEM_BAR_FULL_K"]) == int(row["SMEM_V"]) + b.kv_stages * b.block_n * d * 2
    for name in ("SMEM_K", "SMEM_V"):
        assert int(row[name]) % 1024 == 0
    assert int(row["SMEM_SEQ_LEN"]) == int(row["SMEM_BAR_EMPTY_V"]) + 8 * b.kv_stages
    assert int(row["SMEM_SEQ_LEN"]) + 8 + decode_builds.ALIGN_SLACK == b.smem_bytes
    # V's descriptor: LBO = the next 64 columns of D = block_n rows of 128 bytes
    bits = int(row["DESC_V_BITS"], 16)
    assert ((bits >> 16) & 0x3FFF) << 4 == b.block_n * 128
    assert ((bits >> 32) & 0x3FFF) << 4 == 1024 and bits >> 62 == 1
    # the Q chunks: 64 rows x D / 8 chunks over 128 threads
    assert int(row["Q_REGS"]) == 4 * ROWS * (d // 8) // 128
    assert int(row["COMBINE_COLS"]) * 32 == d
    assert 32 % int(row["COMBINE_BATCH"]) == 0      # a combine batch stays in one lane group


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_the_table_fits_an_sm(d):
    b = DECODE_BUILDS[d]
    b.check()
    per_sm = b.ctas_per_sm * (b.smem_bytes + decode_builds.SMEM_RESERVED_PER_CTA)
    assert per_sm <= decode_builds.SMEM_PER_SM


def test_build_for_names_the_head_dim():
    with pytest.raises(ValueError, match="q: head dim 96"):
        decode_builds.build_for(96)


# --------------------------------------------------------------------------- ABI, assembly

def _entry_params(file: str, entry: str, paged: bool = False) -> list[tuple[str, str]]:
    """(name, PTX type) of the .entry's parameters in one build (expanded: a build's own
    parameters sit behind #ifdef)."""
    text = decode_launch.kernel_source(file, 128, paged)
    m = re.search(rf"\.entry {entry}\((.*?)\)\s*\.maxntid", text, re.S)
    assert m, entry
    return [(p.group(2), p.group(1)) for p in
            re.finditer(r"\.param\s+(?:\.align \d+\s+)?(\.\w+)\s+(\w+)", m.group(1))]


_CTYPE_OF = {".b8": None, ".u64": ("c_void_p", "c_ulong", "c_uint64"), ".u32": ("c_uint",),
             ".s32": ("c_int",), ".f32": ("c_float",)}


@pytest.mark.parametrize("file,entry,paged,table", KERNELS,
                         ids=[k[1] + ("_paged" if k[2] else "") for k in KERNELS])
def test_parameter_tables_match_the_ptx(file, entry, paged, table):
    params = _entry_params(file, entry, paged)
    assert [n for n, _ in params] == [n for n, _ in table]
    for (name, ptx_type), (_, ctype) in zip(params, table):
        if ptx_type == ".b8":
            assert ctype is None, name                 # a tensor map, by value
        else:
            assert ctype is not None and ctype.__name__ in _CTYPE_OF[ptx_type], (name, ctype)


def test_per_call_slots_exist():
    for table, slots in ((decode_launch.DECODE_PARAMS, decode_launch.DECODE_PER_CALL),
                         (decode_launch.COMBINE_PARAMS, decode_launch.COMBINE_PER_CALL),
                         (decode_launch.APPEND_PARAMS, decode_launch.APPEND_PER_CALL)):
        assert set(slots) <= {n for n, _ in table}


def _assembled(file: str, d: int, paged: bool = False):
    try:
        sass.find_tool("ptxas")
    except Exception as e:                            # noqa: BLE001
        pytest.skip(f"no ptxas: {e}")
    text = decode_launch.kernel_source(file, d, paged)
    a = sass.assemble_ptx(text, "sm_90a", name=f"{file}.{d}{'.paged' if paged else ''}")
    return a, sass.parse_ptxas_log(a.log), sass.disassemble(a.cubin)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_decode_kernel_assembles_without_spills(d, paged):
    a, log, text = _assembled(decode_launch.DECODE_FILE, d, paged)
    f = log["functions"][decode_launch.DECODE_ENTRY]
    b = DECODE_BUILDS[d]
    assert f["spill_stores"] == 0 and f["spill_loads"] == 0 and f["stack_frame"] == 0, f
    # the registers fit the CTAs per SM the table is sized for (160 threads, 8-register steps)
    regs = -(-f["registers"] // 8) * 8
    assert regs * decode_builds.THREADS * b.ctas_per_sm <= decode_builds.REGISTERS_PER_SM, f
    hgmma = len(sass.grep(text, "HGMMA"))
    per_tile = d // 16 + b.block_n // 16           # QK^T k-steps + PV k-steps
    # prologue QK + last PV, and each copy of the step (masked, plain): a whole tile each
    assert hgmma == 3 * per_tile, (hgmma, per_tile)
    assert not sass.grep(text, "LDL") and not sass.grep(text, "STL")


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_combine_and_append_assemble(d):
    for file, entry, paged in ((decode_launch.COMBINE_FILE, decode_launch.COMBINE_ENTRY, False),
                               (decode_launch.APPEND_FILE, decode_launch.APPEND_ENTRY, False),
                               (decode_launch.APPEND_FILE, decode_launch.APPEND_ENTRY, True)):
        _, log, text = _assembled(file, d, paged)
        f = log["functions"][entry]
        assert f["spill_stores"] == 0 and f["stack_frame"] == 0, (file, paged, f)
    # every partial of a combine batch is loaded before the first is used (one latency a
    # batch, not one a split)
    _, _, text = _assembled(decode_launch.COMBINE_FILE, d)
    b = DECODE_BUILDS[d]
    ops = [ln for ln in text.splitlines() if "LDG.E.64" in ln or "LDG.E.128" in ln
           or "FFMA" in ln]
    first_fma = next(i for i, ln in enumerate(ops) if "FFMA" in ln)
    loads_per_split = max(1, b.combine_cols // 4)
    assert first_fma >= b.combine_batch * loads_per_split, ops[:first_fma + 2]


# --------------------------------------------------------------------------- the split heuristic

# (B, Hkv, Lq, group, Lmax, D, SMs) -> splits, with the reason in the comment
HEURISTIC = [
    ((64, 8, 1, 4, 8192, 128, 132), 1),       # 512 CTAs fill the SMs already
    ((8, 8, 1, 4, 32768, 128, 132), 2),       # 64 CTAs: 2 splits = 128 of 132 slots (97%)
    ((1, 8, 1, 4, 131072, 128, 132), 16),     # 8 CTAs: 16 splits, 128 of 132 slots (97%)
    ((1, 8, 1, 4, 8192, 128, 132), 16),       # 64 tiles: 13-15 splits give 5 a split, 16 give 4
    ((16, 8, 8, 4, 8192, 128, 132), 1),       # speculative: 128 CTAs of 32 packed rows
    ((1, 8, 1, 4, 512, 128, 132), 1),         # 4 K/V tiles: too short to split
    ((1, 8, 1, 4, 640, 128, 132), 5),         # 5 tiles: one a split, 40 CTAs
    ((2, 1, 16, 32, 65536, 128, 132), 8),     # MQA, 8 M tiles a sequence: 16 x 8 = 128 CTAs
    ((1, 1, 1, 1, 1 << 20, 128, 132), 123),   # one head of a million keys: 123 of 132 SMs
    ((4, 8, 1, 4, 8192, 64, 132), 8),         # D = 64: two CTAs an SM, 256 of 264 slots
]


@pytest.mark.parametrize("shape,expected", HEURISTIC, ids=[str(s) for s, _ in HEURISTIC])
def test_heuristic_decisions(shape, expected):
    b, hkv, lq, g, lmax, d, sms = shape
    build = DECODE_BUILDS[d]
    got = choose_splits(b, hkv, m_tiles_of(g, lq), lmax, build.block_n, sms, build.ctas_per_sm)
    assert got == expected


def test_heuristic_properties():
    rng = np.random.default_rng(5)
    for _ in range(500):
        b, hkv, m = (int(x) for x in rng.integers(1, 9, 3))
        lmax, sms = int(rng.integers(1, 300_000)), int(rng.choice([16, 78, 132]))
        n_blocks = -(-lmax // 128)
        s = choose_splits(b, hkv, m, lmax, 128, sms)
        assert 1 <= s <= min(decode_builds.MAX_SPLITS, max(1, n_blocks), max(sms, 1))
        if b * hkv * m >= 0.8 * sms or n_blocks <= 4:
            assert s == 1


def test_num_splits_overrides_and_is_capped_by_the_tiles():
    assert decode.plan_splits((1, 1, 32, 128), (1, 8192, 8, 128), sm_count=132,
                              num_splits=7) == 7
    assert decode.plan_splits((1, 1, 32, 128), (1, 300, 8, 128), sm_count=132,
                              num_splits=100) == 3           # 3 K/V tiles of 128
    assert decode.plan_splits((1, 1, 32, 128), (1, 8192, 8, 128), sm_count=132) == 16


# --------------------------------------------------------------------------- packing

def test_packed_rows_cover_every_query_once():
    for g, lq in ((1, 1), (4, 1), (4, 7), (8, 16), (32, 16), (16, 3)):
        seen = set()
        for m in range(m_tiles_of(g, lq)):
            for r in range(m * ROWS, min(g * lq, (m + 1) * ROWS)):
                seen.add(packed_row(r, g))
        assert seen == {(q, h) for q in range(lq) for h in range(g)}
    # BSHD, Lq = 1: a group's heads are the tile's consecutive rows
    assert [packed_row(r, 4) for r in range(4)] == [(0, 0), (0, 1), (0, 2), (0, 3)]


# --------------------------------------------------------------------------- the kernels' model

def _rand(shape, rng):
    return rng.standard_normal(shape).astype(np.float32)


MODEL_CASES = [
    # (B, H, Hkv, Lq, Lmax, lengths, splits, block_n, causal, window)
    (2, 4, 1, 1, 300, [1, 300], 3, 64, False, (-1, -1)),
    (2, 8, 2, 7, 200, [17, 200], 2, 64, True, (-1, -1)),
    (1, 4, 4, 16, 129, [129], 7, 64, True, (-1, -1)),
    (3, 4, 2, 2, 250, [0, 5, 250], 4, 64, False, (30, 0)),
    (1, 32, 1, 3, 140, [140], 2, 64, True, (-1, -1)),        # MQA: 96 packed rows, 2 M tiles
    (2, 2, 1, 4, 150, [150, 3], 5, 64, False, (2, 1)),       # rows that see no key of a split
    (1, 2, 2, 1, 90, [90], 5, 64, False, (-1, -1)),          # more splits than tiles
]


@pytest.mark.parametrize("case", MODEL_CASES, ids=[str(c[:7]) for c in MODEL_CASES])
def test_the_kernels_model_equals_the_reference(case):
    b, h, hkv, lq, lmax, lengths, splits, bn, causal, window = case
    rng = np.random.default_rng(sum(map(abs, case[:5])))
    q = _rand((b, lq, h, 32), rng)
    k = _rand((b, lmax, hkv, 32), rng)
    v = _rand((b, lmax, hkv, 32), rng)
    out, lse, _ = model_decode(q, k, v, lengths, splits=splits, block_n=bn, causal=causal,
                               window=window)
    ref, ref_lse = kvcache_reference(q, k, v, lengths, causal=causal, window=window)
    np.testing.assert_allclose(out, ref, atol=1e-9)
    assert (np.isneginf(lse) == np.isneginf(ref_lse)).all()
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=1e-9)


def test_splits_cover_each_rows_keys_once_and_masks_are_where_needed():
    rng = np.random.default_rng(1)
    for _ in range(400):
        bn = int(rng.choice([64, 128]))
        g, lq = int(rng.integers(1, 9)), int(rng.integers(1, 17))
        length = int(rng.integers(0, 2000))
        splits = int(rng.integers(1, 20))
        left = int(rng.choice([-1, 0, 3, 100]))
        right = int(rng.choice([-1, 0, 2, 50]))
        params = tuple(decode_plan.UNBOUNDED if x < 0 else x for x in (left, right))
        for m in range(m_tiles_of(g, lq)):
            tiles = [cta_tiles(length, lq, g, m, s, splits, params, bn) for s in range(splits)]
            covered = []
            for t in tiles:
                covered += range(t["lo"], t["hi"])
                assert t["lo"] >= 0 and t["hi"] * bn - bn < max(length, 1)
            assert len(covered) == len(set(covered)), "a tile in two splits"
            t0 = tiles[0]
            for r in range(t0["row0"], t0["row0"] + t0["live"]):
                row_q = r // g
                first = length - lq + row_q - params[0]
                last = min(length - lq + row_q + params[1], length - 1)
                need = {j // bn for j in range(max(first, 0), last + 1)}
                assert need <= set(covered), "a key some row sees is in no split"
                for t in tiles:
                    runs = masked_runs(t["lo"], t["hi"], t["mask_below"], t["mask_above"], bn)
                    for tile in range(t["lo"], t["hi"]):
                        whole = first <= tile * bn and tile * bn + bn - 1 <= last
                        if not whole:
                            assert tile in runs, "a partly seen tile skipped the mask"
                        if tile in runs:
                            assert tile_is_masked(tile, t["mask_below"], t["mask_above"], bn) \
                                or tile == t["lo"]


def test_combine_model_ignores_empty_splits_whatever_they_hold():
    rng = np.random.default_rng(2)
    o = rng.standard_normal((4, 3, 8))
    lse = rng.standard_normal((4, 3))
    lse[1, :] = -np.inf
    o[1] = np.nan                                   # an empty split's workspace: anything
    lse[:, 2] = -np.inf                             # row 2: no split saw a key
    out, total = combine(o, lse)
    assert np.isfinite(out).all()
    assert (out[2] == 0).all() and np.isneginf(total[2])
    keep = [0, 2, 3]
    w = np.exp(lse[keep, :2] - lse[keep, :2].max(axis=0))
    expect = (w[..., None] * o[keep, :2]).sum(0) / w.sum(0)[..., None]
    np.testing.assert_allclose(out[:2], expect, rtol=1e-12)
    np.testing.assert_allclose(total[:2], np.log(np.exp(lse[keep, :2]).sum(0)), rtol=1e-12)


def test_one_split_is_its_own_answer():
    o = np.arange(6.0).reshape(1, 2, 3)
    lse = np.array([[0.5, -np.inf]])
    out, total = combine(o, lse)
    np.testing.assert_array_equal(out[0], o[0, 0])
    assert (out[1] == 0).all() and total[0] == 0.5 and np.isneginf(total[1])


def test_lengths_are_clamped_as_the_kernels_clamp():
    got = clamped_lengths([-5, 0, 10, 1000, 2**31 - 1], seq_new=2, cache_len=100)
    assert list(got) == [2, 2, 12, 100, 100]


# --------------------------------------------------------------------------- validation

def _arrays(B=2, Lq=1, H=8, Hkv=2, D=128, Lmax=512, layout="bshd", new=0):
    def shape(h, l):
        return (B, l, h, D) if layout == "bshd" else (B, h, l, D)
    q = FakeDLPack(shape(H, Lq), ptr=BASE)
    kc = FakeDLPack(shape(Hkv, Lmax), ptr=BASE + (1 << 32))
    vc = FakeDLPack(shape(Hkv, Lmax), ptr=BASE + (2 << 32))
    extra = {}
    if new:
        extra = dict(k=FakeDLPack(shape(Hkv, new), ptr=BASE + (3 << 32)),
                     v=FakeDLPack(shape(Hkv, new), ptr=BASE + (4 << 32)))
    return q, kc, vc, extra


def test_a_valid_call_validates_without_the_driver(no_driver):
    q, kc, vc, extra = _arrays(new=3)
    lens = FakeDLPack((2,), ptr=BASE + (5 << 32), dtype="int32")
    call = decode.validate(q, kc, vc, cache_seqlens=lens, causal=True, **extra)
    assert (call.batch, call.seq_q, call.heads, call.heads_kv, call.head_dim) == (2, 1, 8, 2, 128)
    assert call.cache_len == 512 and call.seq_new == 3 and call.window == (-1, 0)
    assert call.lengths.kind == "device" and call.lengths.ptr == BASE + (5 << 32)
    assert call.group == 4 and call.m_tiles == 1
    assert call.out_strides == (1 * 8 * 128 * 2, 8 * 128 * 2, 128 * 2)   # bytes: batch, seq, head


def test_bhld_layout_reads_the_other_axes(no_driver):
    q, kc, vc, _ = _arrays(layout="bhld", Lq=3)
    call = decode.validate(q, kc, vc, layout="bhld")
    assert (call.seq_q, call.heads, call.heads_kv, call.cache_len) == (3, 8, 2, 512)
    assert call.lengths.kind == "full" and call.lengths.value == 512


def _err(kind, text, **kw):
    return kind, text, kw


@pytest.mark.parametrize("kind,text,kw", [
    _err(ValueError, "q: 17 query positions", Lq=17),
    _err(ValueError, "k_cache: 3 K/V heads do not divide q's 8", Hkv=3),
    _err(ValueError, "q: head dim 96", D=96),
    _err(ValueError, "layout", layout_arg="BSDH"),
], ids=["lq", "heads", "head_dim", "layout"])
def test_shape_errors_name_the_argument(no_driver, kind, text, kw):
    layout = kw.pop("layout_arg", None)
    q, kc, vc, extra = _arrays(**kw)
    with pytest.raises(kind, match=re.escape(text)):
        decode.validate(q, kc, vc, **extra, **({"layout": layout} if layout else {}))


def test_argument_errors(no_driver):
    q, kc, vc, extra = _arrays(new=2)
    cases = [
        (dict(cache_seqlens=None, **extra), ValueError, "cache_seqlens: k and v are appended"),
        (dict(cache_seqlens=511, **extra), ValueError, "outside [0, 510]"),
        (dict(cache_seqlens=-1), ValueError, "sequence 0 has length -1"),
        (dict(cache_seqlens=513), ValueError, "outside [0, 512]"),
        (dict(cache_seqlens=np.array([5, 600], np.int32)), ValueError,
         "sequence 1 has length 600"),
        (dict(cache_seqlens=np.array([5, 6], np.int64)), TypeError, "expected dtype int32"),
        (dict(cache_seqlens=FakeDLPack((2,), ptr=BASE + (6 << 32), dtype="float32")),
         TypeError, "cache_seqlens: expected dtype int32"),
        (dict(cache_seqlens=FakeDLPack((3,), ptr=BASE + (6 << 32), dtype="int32")),
         ValueError, "cache_seqlens: expected shape (2,)"),
        (dict(cache_seqlens=True), TypeError, "bool"),
        (dict(k=extra["k"]), ValueError, "v: k and v are appended together"),
        (dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
        (dict(softmax_scale="x"), TypeError, "softmax_scale"),
        (dict(num_splits=129), ValueError, "num_splits"),
        (dict(num_splits=1.5), TypeError, "num_splits"),
        (dict(return_lse=1), TypeError, "return_lse"),
        (dict(causal=1), TypeError, "causal"),
        (dict(window_size=(4, 2), causal=True), ValueError, "window"),
        (dict(window_size=(-2, 0)), ValueError, "window"),
        (dict(lse_out=FakeDLPack((2, 8, 1), ptr=BASE + (7 << 32), dtype="float32")),
         ValueError, "lse_out: given with return_lse=False"),
        (dict(out=FakeDLPack((2, 1, 8, 128), ptr=BASE)), ValueError, "out: overlaps q"),
        (dict(out=FakeDLPack((2, 1, 8, 64), ptr=BASE + (8 << 32))), ValueError,
         "out: expected q's shape"),
    ]
    for kw, kind, text in cases:
        with pytest.raises(kind, match=re.escape(text)):
            decode.validate(q, kc, vc, **kw)


def test_host_arrays_and_foreign_dtypes_are_refused(no_driver):
    q, kc, vc, _ = _arrays()
    with pytest.raises(TypeError, match="q: expected a CUDA array, got a NumPy"):
        decode.validate(np.zeros((2, 1, 8, 128), np.float32), kc, vc)
    with pytest.raises(TypeError, match="k_cache: expected dtype bfloat16"):
        decode.validate(q, FakeDLPack((2, 512, 2, 128), ptr=BASE + (1 << 32), dtype="float16"),
                        vc)


def test_shape_mismatches(no_driver):
    q, kc, vc, _ = _arrays()
    with pytest.raises(ValueError, match="v_cache: expected the same shape as k_cache"):
        decode.validate(q, kc, FakeDLPack((2, 256, 2, 128), ptr=BASE + (2 << 32)))
    with pytest.raises(ValueError, match="k_cache: batch 3 does not match q's batch 2"):
        decode.validate(q, FakeDLPack((3, 512, 2, 128), ptr=BASE + (1 << 32)),
                        FakeDLPack((3, 512, 2, 128), ptr=BASE + (2 << 32)))
    with pytest.raises(ValueError, match="k: expected 2 sequences, 2 K/V heads"):
        decode.validate(q, kc, vc, k=FakeDLPack((2, 1, 4, 128), ptr=BASE + (3 << 32)),
                        v=FakeDLPack((2, 1, 4, 128), ptr=BASE + (4 << 32)), cache_seqlens=0)
    with pytest.raises(ValueError, match="k_cache: expected a rank-4"):
        decode.validate(q, FakeDLPack((512, 2, 128), ptr=BASE + (1 << 32)), vc)


def test_misaligned_arrays(no_driver):
    q, kc, vc, _ = _arrays()
    with pytest.raises(ValueError, match="q: base address"):
        decode.validate(FakeDLPack((2, 1, 8, 128), ptr=BASE + 2), kc, vc)
    with pytest.raises(ValueError, match="k_cache"):
        decode.validate(q, FakeDLPack((2, 512, 2, 128), ptr=BASE + (1 << 32) + 8), vc)
    strided = FakeDLPack((2, 512, 2, 128), strides=(512 * 2 * 130, 2 * 130, 130, 1),
                         ptr=BASE + (1 << 32))
    with pytest.raises(ValueError, match="k_cache"):
        decode.validate(q, strided, vc)


def test_an_unbounded_window_side_reaches_the_kernel_as_2_to_the_30(no_driver):
    q, kc, vc, _ = _arrays()
    call = decode.validate(q, kc, vc, window_size=(100, -1))
    assert call.window_params == (100, 1 << 30)
    call = decode.validate(q, kc, vc, causal=True)
    assert call.window_params == (1 << 30, 0)


def test_workspace_size():
    q, kc, vc, _ = _arrays(B=3, Lq=2, H=8)
    call = decode.validate(q, kc, vc)
    call.splits = 5
    assert call.workspace_floats == 5 * 3 * 8 * 2 * (128 + 1)
    call.splits = 1
    assert call.workspace_floats == 0


class _FakeMap:
    """Stands in for a CUtensorMap in a parameter pack: 128 bytes with an address."""

    def __init__(self):
        import ctypes
        self.bytes = (ctypes.c_uint8 * 128)()

    def getPtr(self):
        import ctypes
        return ctypes.addressof(self.bytes)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_launcher_run_fills_every_per_call_slot_of_each_kernel(paged):
    """Launcher.run's values land in the slots they are named for (no GPU: packs and a
    recording launch), for one split (decode writes out and LSE) and for several (decode
    writes the workspace, the combine the output); a paged Launcher's kernels get the block
    table's address."""
    import functools
    import threading
    launched = []

    class Fn:
        def __init__(self, name):
            self.handle = name

    def values(table):
        return {n: (_FakeMap() if t is None else 0) for n, t in table}

    for splits in (1, 5):
        ln = decode_launch.Launcher.__new__(decode_launch.Launcher)
        ln.build, ln.splits, ln.rows, ln.lock = DECODE_BUILDS[128], splits, 6, threading.Lock()
        ln.append_fn, ln.decode_fn = Fn("append"), Fn("decode")
        ln.combine_fn = Fn("combine") if splits > 1 else None
        extra = decode_launch.PAGED_PER_CALL if paged else ()
        ln.decode = decode_launch.Pack(decode_launch.decode_params(paged),
                                       values(decode_launch.decode_params(paged)),
                                       decode_launch.DECODE_PER_CALL + extra)
        ln.combine = decode_launch.Pack(decode_launch.COMBINE_PARAMS,
                                        values(decode_launch.COMBINE_PARAMS),
                                        decode_launch.COMBINE_PER_CALL)
        ln.append_pack = decode_launch.Pack(decode_launch.append_params(paged),
                                            values(decode_launch.append_params(paged)),
                                            decode_launch.APPEND_PER_CALL + extra)
        launched.clear()

        def launch(fn, address):
            packs = {"decode": ln.decode, "combine": ln.combine, "append": ln.append_pack}
            pack = packs[fn]
            assert address == pack.address
            launched.append((fn, {n: h.value for n, h in pack.slot.items()
                                  if not isinstance(h, _FakeMap)}))
        ln.launches = {fn: functools.partial(launch, fn) for fn in ("append", "decode",
                                                                    "combine")}
        ln.run(q_ptr=0x1000, out_ptr=0x2000, lse_ptr=0x3000, ws_ptr=0x4000,
               seqlens_ptr=0x5000, seqlen_const=77, k_new_ptr=0x6000, v_new_ptr=0x7000,
               bounds_ptr=0x8000, block_table_ptr=0x9000)
        got = dict(launched)
        for kernel in ("append", "decode"):
            assert got[kernel].get("block_table_ptr") == (0x9000 if paged else None), kernel
        assert [f for f, _ in launched] == ["append", "decode"] + (["combine"] if splits > 1
                                                                   else [])
        assert (got["append"]["k_new"], got["append"]["v_new"], got["append"]["seqlens_ptr"],
                got["append"]["seqlen_const"]) == (0x6000, 0x7000, 0x5000, 77)
        d = got["decode"]
        assert (d["q_ptr"], d["seqlens_ptr"], d["bounds_ptr"], d["seqlen_const"]) == (
            0x1000, 0x5000, 0x8000, 77)
        if splits == 1:
            assert (d["o_ptr"], d["lse_ptr"], d["ws_ptr"] or 0, d["ws_lse_ptr"] or 0) == (
                0x2000, 0x3000, 0, 0)
        else:
            ws_lse = 0x4000 + 4 * splits * 6 * 128           # after the partial O
            assert (d["o_ptr"] or 0, d["lse_ptr"] or 0, d["ws_ptr"], d["ws_lse_ptr"]) == (
                0, 0, 0x4000, ws_lse)
            c = got["combine"]
            assert (c["ws_ptr"], c["ws_lse_ptr"], c["o_ptr"], c["lse_ptr"]) == (
                0x4000, ws_lse, 0x2000, 0x3000)


# --------------------------------------------------------------------------- the benchmark

def _bench_module():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "bench" / "decode_bench.py"
    spec = importlib.util.spec_from_file_location("decode_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_cases_and_figures():
    bench = _bench_module()
    assert bench.CASES["b1_128k"] == (1, 32, 8, 1, 131072, False)
    assert bench.CASES["spec_b16_8k"] == (16, 32, 8, 8, 8192, True)
    assert set(bench.CASES) == set(bench.TARGETS)
    assert bench.kv_bytes(1, 8, 8192) == 2 * 8 * 8192 * 128 * 2
    # unmasked pairs of bottom-right causal: query i of Lq sees L - Lq + i + 1 keys
    for lq, length in ((1, 5), (8, 8192), (4, 2)):
        brute = sum(1 for i in range(lq) for j in range(length) if j <= length - lq + i)
        assert bench.unmasked_pairs(lq, length, True) == brute
    assert bench.unmasked_pairs(3, 10, False) == 30
    row = bench.figures([2.0, 2.0, 2.2], [2.2, 2.4, 2.2], nbytes=4.8e9, flops=1e12, seed=0)
    assert row["tbs"] == pytest.approx(2.4) and row["ratio"] == pytest.approx(1.1)
    assert row["ratio_ci"][0] <= row["ratio"] <= row["ratio_ci"][1]
    assert row["pct_of_hbm_peak"] == pytest.approx(50.0)


def test_splits_keep_the_workspace_index_32_bit(no_driver):
    q, kc, vc, _ = _arrays(B=1 << 20, H=32, Hkv=8, Lmax=1 << 16)
    call = decode.validate(q, kc, vc, num_splits=128)
    rows = (1 << 20) * 32
    assert decode_plan.resolve_splits(call, 132) == ((1 << 31) - 1) // rows == 63
    q, kc, vc, _ = _arrays(B=1, Lmax=1 << 16)
    assert decode_plan.resolve_splits(decode.validate(q, kc, vc, num_splits=128), 132) == 128


def test_knobs_are_read_per_call(monkeypatch):
    for name in decode._KNOB_NAMES:
        monkeypatch.delenv(name, raising=False)
    assert not any(decode._on(v) for v in decode._knobs())
    monkeypatch.setenv("PTXATTN_CHECK_BOUNDS", "1")
    monkeypatch.setenv("PTXATTN_DECODE_PDL", "0")
    bounds, poison, pdl, paged = decode._knobs()
    assert decode._on(bounds) and not decode._on(poison) and not decode._on(pdl)
    assert paged is None                          # PTXATTN_PAGED_VARIANT unset: the default

"""The backward's build table and generated headers (CPU only): committed = generated, every
build fits the SM, the dQ accumulator's layout is one-to-one and is what the generated store
macros write, and each lineage stage's literal offsets are the table's."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from ptxattn import bwd_builds
from ptxattn.tools import ptxgen_bwd
from ptxattn.bwd_builds import BUILDS, CONSUMER_ROWS
from ptxattn.stages import ptx_root


def test_committed_headers_equal_the_generator_output():
    assert ptxgen_bwd.stale() == [], "run `python -m ptxattn.tools.ptxgen_bwd` and commit the headers"


def test_a_hand_edit_is_caught(tmp_path):
    for name, text in ptxgen_bwd.headers().items():
        (tmp_path / name).write_text(text)
    assert ptxgen_bwd.stale(tmp_path) == []
    (tmp_path / "gen_bwd_n64.ptxh").write_text(
        (tmp_path / "gen_bwd_n64.ptxh").read_text().replace("%dst15", "%dst14", 1))
    assert ptxgen_bwd.stale(tmp_path) == ["gen_bwd_n64.ptxh"]


ALL = bwd_builds.all_builds()
ALL_IDS = [f"d{b.head_dim}-{b.variant}" for b in ALL]


@pytest.mark.parametrize("b", ALL, ids=ALL_IDS)
def test_every_build_fits_an_sm(b):
    lay = b.layout()
    assert lay["smem_bytes"] <= bwd_builds.MAX_SMEM, lay
    assert b.peak_registers + 16 <= bwd_builds.CONSUMER_REGS, b.registers   # + addresses
    tiles = ["K", "V", "Q", "dO", "dS"] + (["P"] if b.query_split else []) + \
        ([] if b.dq_red else ["dQ"])
    for name in tiles:
        assert lay[name] % 1024 == 0, name
    assert ("dQ" in lay) != b.dq_red and ("P" in lay) == b.query_split
    assert b.block_m <= 256 and b.block_n <= 256                 # TMA box rows
    assert b.block_n == 2 * CONSUMER_ROWS if b.key_split else b.block_n == CONSUMER_ROWS
    assert b.dq_cols >= 64 and b.dkv_cols >= 64                  # whole 128-byte swizzle rows
    # dK and dV are staged in K's and V's place: a consumer's 64 rows each
    assert 2 * CONSUMER_ROWS * b.dkv_cols * 2 <= b.tile_bytes["K"]


@pytest.mark.parametrize("b", ptxgen_bwd.layout_rows(),
                         ids=[f"d{b.head_dim}-{b.variant}" for b in ptxgen_bwd.layout_rows()])
def test_the_layout_header_is_the_table(b):
    text = (ptx_root() / "sm90/include/gen_bwd_layout.ptxh").read_text()
    cond = ptxgen_bwd.block_condition(b)
    block = text.split(f"if {cond}\n", 1)[1].split("#elif", 1)[0].split("#else", 1)[0]
    defs = dict(re.findall(r"#define (\w+)\s+(\d+)\n", block))
    for name, value in b.layout().items():
        key = "SMEM_END" if name == "end" else "SMEM_BYTES" if name == "smem_bytes" \
            else f"SMEM_{name.upper()}"
        assert int(defs[key]) == value, key
    assert int(defs["BLOCK_M"]) == b.block_m and int(defs["BLOCK_N"]) == b.block_n
    assert int(defs["Q_STAGE_TX"]) == b.q_stage_tx and int(defs["Q_STAGES"]) == b.q_stages
    assert int(defs["QUERY_SPLIT"]) == b.query_split and int(defs["DQ_RED"]) == b.dq_red
    assert int(defs["SCORE_COLS"]) == b.score_cols
    assert ("SMEM_DQ" in defs) != b.dq_red


def test_every_build_lands_in_its_own_block():
    """Expanding the layout header with a build's defines gives that build's offsets (the
    blocks' conditions are exclusive and complete), for every build of the table."""
    from ptxattn import ptx
    from ptxattn.backward import defines_for
    inc = ptx_root() / "sm90/include"
    for b in bwd_builds.all_builds():
        probe = inc.parent / "production" / "_probe_layout.ptx"
        text = '#include "gen_bwd_layout.ptxh"\nSMEM_BYTES Q_STAGES QUERY_SPLIT DQ_RED\n'
        probe.write_text(text)
        try:
            got = ptx.expand_file(probe, [inc], defines_for(bwd_builds.PRODUCTION, b.head_dim,
                                                            False, b.variant)).text.split()
        finally:
            probe.unlink()
        assert got[-4:] == [str(b.smem_bytes), str(b.q_stages), str(int(b.query_split)),
                            str(int(b.dq_red))], (b.head_dim, b.variant, got[-4:])


ACCUMULATORS = [(d, b.block_m, b.dq_cols) for d, b in BUILDS.items()] + [(128, 64, 64)]


@pytest.mark.parametrize("d,block_m,dq_cols", ACCUMULATORS)
def test_dq_accumulator_layout_is_one_to_one_and_sliced(d, block_m, dq_cols):
    rows, cols = np.meshgrid(np.arange(3 * block_m), np.arange(d), indexing="ij")
    off = bwd_builds.dq_accum_offset(rows, cols, d, block_m, dq_cols)
    assert sorted(off.ravel().tolist()) == list(range(off.size))
    # a consumer's slice of one query block is one contiguous run of 64 x dq_cols floats
    for m in range(3):
        for c in range(block_m * d // (CONSUMER_ROWS * dq_cols)):
            lo = m * block_m * d + c * CONSUMER_ROWS * dq_cols
            inside = (off >= lo) & (off < lo + CONSUMER_ROWS * dq_cols)
            r, k = np.nonzero(inside)
            assert len(set(r)) == CONSUMER_ROWS and len(set(k)) == dq_cols
    # a warp's postprocess read of 64 columns of a row stays in one aligned 256 bytes
    for row in range(16):
        o = off[row, :64] if dq_cols >= 64 else off[row]
        assert o.max() - o.min() == 63 and o.min() % 64 == 0


def _macro_body(text, name):
    m = re.search(rf"#define {name}\b[^\n]*\\\n((?:[^\n]*\\\n)*[^\n]*)", text)
    return [s.strip() for s in m.group(1).replace("\\\n", " ").split(";") if s.strip()]


@pytest.mark.parametrize("n", ptxgen_bwd.ACC_WIDTHS)
@pytest.mark.parametrize("to", ["DQ_TO_SHARED", "DQ_RED_GLOBAL"])
def test_dq_store_macros_write_the_accumulator_layout(n, to):
    """Run the generated store macro for every thread of a warpgroup: the float each %dq value
    lands on is dq_accum_offset(row, col) of the value's (row, col) in the fragment layout."""
    body = _macro_body(ptxgen_bwd.headers()[f"gen_bwd_n{n}.ptxh"], f"{to}_N{n}")
    d = 2 * n                       # a head dim whose column-split slices are n wide
    for thread in range(128):
        warp, lane = divmod(thread, 32)
        row, quad = warp * 16 + lane // 4, lane % 4
        base = (row * n + 2 * quad) * 4                # %dq_row / %dq_grow: slice 0's
        regs = {"%dq_swz": lane // 4, "%dq_row": base, "%dq_grow": base}
        for s in body:
            op, *args = re.split(r"[ ,]+", s.replace("{", "").replace("}", ""))
            if op == "xor.b32":
                regs[args[0]] = regs[args[1]] ^ int(args[2])
            elif op == "shl.b32":
                regs[args[0]] = regs[args[1]] << int(args[2])
            elif op in ("add.u32", "add.s64"):
                regs[args[0]] = regs[args[1]] + regs[args[2]]
            elif op == "cvt.u64.u32":
                regs[args[0]] = regs[args[1]]
            else:
                assert op in ("st.shared.v2.f32", "red.global.add.v2.f32"), op
                addr, imm = re.match(r"\[(%\w+)\+(\d+)\]", args[0]).groups()
                at = (regs[addr] + int(imm)) // 4
                for k, reg in enumerate(args[1:3]):
                    i = int(reg[3:])
                    r = row + 8 * ((i >> 1) & 1)
                    c = 8 * (i >> 2) + 2 * quad + (i & 1)
                    want = bwd_builds.dq_accum_offset(r, c, d, CONSUMER_ROWS, n)
                    assert at + k == want, (thread, s, reg)


@pytest.mark.parametrize("n", ptxgen_bwd.ACC_WIDTHS + (ptxgen_bwd.HALF,))
def test_probabilities_read_their_query_columns(n):
    """SOFTMAX_PT / DS_N: value i of the score tile takes the neg_lse / delta of its column
    8 * (i >> 2) + (i & 1) (+ the thread's 2 * (l % 4), in ADDR)."""
    text = ptxgen_bwd.headers()[f"gen_bwd_n{n}.ptxh"]
    for name, op in ((f"SOFTMAX_PT_N{n}", "fma.rn.f32"), (f"DS_N{n}", "sub.f32")):
        body = _macro_body(text, name)
        col = None
        seen = []
        for s in body:
            if s.startswith("ld.shared.v2.f32"):
                col = int(re.search(r"ADDR\+(\d+)", s).group(1)) // 4
            elif s.startswith(op):
                reg = re.findall(r"%(?:st|dpt)(\d+)", s)[0]
                t = re.findall(r"T([01])", s)[0]
                seen.append((int(reg), col + int(t)))
        assert sorted(i for i, _ in seen) == list(range(n // 2))
        for i, c in seen:
            assert c == 8 * (i >> 2) + (i & 1), (name, i, c)


def test_ds_from_the_packed_probabilities_reads_the_half_pack_pt_wrote():
    """DS_PT_N80 (m80_edv): value i of dS^T multiplies (dP^T_i - delta of its column) by P^T_i
    unpacked from %pt<i / 2>, the half that PACK_PT_N80 wrote %st<i> into (cvt.rn.bf16x2's
    first source is the high half: a mask for odd i, a shift for even i), as the bf16 value."""
    import ml_dtypes
    text = ptxgen_bwd.headers()["gen_bwd_n80.ptxh"]
    packed_from = {}
    for s in _macro_body(text, "PACK_PT_N80"):
        dst, hi, lo = re.findall(r"%(?:pt|st)(\d+)", s)
        packed_from[int(dst)] = (int(lo), int(hi))
    body = _macro_body(text, "DS_PT_N80")
    rng = np.random.default_rng(0)
    st = rng.random(40).astype(np.float32)
    bits = st.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
    pt = {j: (int(bits[hi]) << 16) | int(bits[lo]) for j, (lo, hi) in packed_from.items()}
    unpacked, col, seen = None, None, []
    for s in body:
        if s.startswith("ld.shared.v2.f32"):
            col = int(re.search(r"ADDR\+(\d+)", s).group(1)) // 4
        elif s.startswith(("shl.b32", "and.b32")):
            j = int(re.search(r"%pt(\d+)", s).group(1))
            word = pt[j] << 16 if s.startswith("shl") else pt[j] & 0xFFFF0000
            unpacked = np.uint32(word & 0xFFFFFFFF).view(np.float32)
        elif s.startswith("sub.f32"):
            i = int(re.search(r"%dpt(\d+)", s).group(1))
            assert col + int(re.findall(r"T([01])", s)[0]) == 8 * (i >> 2) + (i & 1), s
        elif s.startswith("mul.f32"):
            i = int(re.search(r"%dpt(\d+)", s).group(1))
            assert "%pt_f32" in s, s
            seen.append(i)
            assert unpacked == st[i].astype(ml_dtypes.bfloat16).astype(np.float32), (i, s)
    assert sorted(seen) == list(range(40))


def _defines(path: Path) -> dict[str, int]:
    return {k: int(v) for k, v in
            re.findall(r"^#define (\w+) (\d+)\b", path.read_text(), flags=re.M)}


@pytest.mark.parametrize("stage", bwd_builds.STAGES, ids=lambda s: s.label)
def test_lineage_literals_are_the_table(stage):
    defs = _defines(ptx_root() / stage.file)
    lay = bwd_builds.LINEAGE_LAYOUTS[stage.number]
    for name, value in lay.items():
        if name in ("end", "smem_bytes"):
            continue
        key = f"SMEM_{name.upper()}"
        assert defs.get(key) == value, f"{stage.label}: {key} is {defs.get(key)}, table {value}"
    assert stage.smem_bytes == lay["smem_bytes"]
    assert defs["BLOCK_M"] == bwd_builds.LINEAGE_BLOCK_M
    assert defs["BLOCK_N"] == bwd_builds.LINEAGE_BLOCK_N
    assert defs["HEAD_DIM"] == bwd_builds.LINEAGE_HEAD_DIM


def test_the_lineage_tiles_are_the_d128_build():
    b = BUILDS[bwd_builds.LINEAGE_HEAD_DIM]
    assert (b.block_m, b.block_n) == (bwd_builds.LINEAGE_BLOCK_M, bwd_builds.LINEAGE_BLOCK_N)
    assert b.key_split and b.dq_cols == 64 and b.dkv_cols == 128


@pytest.mark.parametrize("consumer", [0, 1])
@pytest.mark.parametrize("name", ["STMATRIX_PT_N32", "STMATRIX_DST_N32"])
def test_a_half_tile_lands_in_its_consumers_columns(name, consumer):
    """A query-split consumer's stmatrix of its 64 keys x 32 queries: with %q_swz = %st_swz ^
    4c, lane group g of k-step t writes the 16-byte chunk of columns 32c + 16t + 8(g // 2) of
    its key row, at its 128-byte swizzled place (chunk ^ row % 8), and the two consumers'
    chunks tile every row exactly once."""
    body = _macro_body(ptxgen_bwd.headers()["gen_bwd_n32.ptxh"], name)
    seen = {}
    for c in (0, 1):
        for warp in range(4):
            for lane in range(32):
                row = warp * 16 + (lane & 15)
                st_swz = (lane >> 4) ^ (row & 7)
                regs = {"%q_swz": st_swz ^ (4 * c), "%p_row_0": row * 128, "%ds_row_0": row * 128}
                t = 0
                for s in body:
                    op, *a = re.split(r"[ ,]+", s.replace("{", "").replace("}", ""))
                    if op == "xor.b32":
                        regs[a[0]] = regs[a[1]] ^ int(a[2])
                    elif op == "mad.lo.u32":
                        regs[a[0]] = regs[a[1]] * int(a[2]) + regs[a[3]]
                    else:
                        addr = regs[a[0].strip("[]")]
                        r, chunk = divmod(addr, 128)
                        logical = (chunk // 16) ^ (r % 8)
                        want = (32 * c + 16 * t + 8 * (lane >> 4)) // 8
                        assert r == row and logical == want, (c, lane, t, logical, want)
                        seen[(r, logical)] = seen.get((r, logical), 0) + 1
                        t += 1
    assert sorted(seen) == [(r, k) for r in range(64) for k in range(8)]
    assert set(seen.values()) == {1}


DQ_T_BUILDS = [b for b in ALL if b.dq_t]


@pytest.mark.parametrize("b", DQ_T_BUILDS, ids=[f"d{b.head_dim}-{b.variant}" for b in DQ_T_BUILDS])
def test_the_transposed_dq_layout_is_one_to_one_and_sliced(b):
    """dq_t: a consumer's slice of a query block is the block's rows x dq_cols, one contiguous
    run, and a warp's postprocess read of 64 columns of a row stays in one aligned 256 bytes."""
    d, bm, n = b.head_dim, b.block_m, b.dq_cols
    rows, cols = np.meshgrid(np.arange(3 * bm), np.arange(d), indexing="ij")
    off = bwd_builds.dq_accum_offset(rows, cols, d, bm, n, dq_t=True)
    assert sorted(off.ravel().tolist()) == list(range(off.size))
    for m in range(3):
        for c in range(d // n):
            lo = m * bm * d + c * bm * n
            r, k = np.nonzero((off >= lo) & (off < lo + bm * n))
            assert set(r) == set(range(m * bm, (m + 1) * bm)) and set(k) == set(range(c * n, (c + 1) * n))
    for row in range(bm):
        o = off[row, :64]
        assert o.max() - o.min() == 63 and o.min() % 64 == 0


@pytest.mark.parametrize("b", DQ_T_BUILDS, ids=[f"d{b.head_dim}-{b.variant}" for b in DQ_T_BUILDS])
def test_the_transposed_dq_stores_write_the_layout_without_bank_conflicts(b):
    """DQT_TO_SHARED for every thread of both consumers, from bwd.ptx's setup (%dq_row: slice
    c, row 2q, column l/4; %dq_swz: 2w ^ q): value 4j + 2h + e (column 16w + 8h + l/4 of the
    slice, query row 8j + 2q + e) lands on dq_accum_offset, and each store of a warp hits 32
    distinct banks."""
    n, d = b.block_m, b.head_dim
    body = _macro_body(ptxgen_bwd.headers()[f"gen_bwd_n{n}.ptxh"], f"DQT_TO_SHARED_N{n}")
    seen = set()
    for c in (0, 1):
        for warp in range(4):
            banks = {}
            for lane in range(32):
                q = lane % 4
                regs = {"%dq_swz": (2 * warp) ^ q,
                        "%dq_row": (c * n * b.dq_cols + lane // 4 + q * 2 * b.dq_cols) * 4}
                k = 0
                for s in body:
                    op, *a = re.split(r"[ ,]+", s)
                    if op == "xor.b32":
                        regs[a[0]] = regs[a[1]] ^ int(a[2])
                    elif op == "shl.b32":
                        regs[a[0]] = regs[a[1]] << int(a[2])
                    elif op == "add.u32":
                        regs[a[0]] = regs[a[1]] + regs[a[2]]
                    else:
                        assert op == "st.shared.f32", op
                        addr, imm = re.match(r"\[(%\w+)\+(\d+)\]", a[0]).groups()
                        at = (regs[addr] + int(imm)) // 4
                        i = int(a[1][3:])
                        col = c * b.dq_cols + 16 * warp + 8 * ((i >> 1) & 1) + lane // 4
                        row = 8 * (i >> 2) + 2 * q + (i & 1)
                        assert at == bwd_builds.dq_accum_offset(row, col, d, n, b.dq_cols,
                                                                dq_t=True), (c, lane, s)
                        seen.add(at)
                        banks.setdefault(k, set()).add(at % 32)
                        k += 1
            assert all(len(v) == 32 for v in banks.values()), (c, warp)
    assert seen == set(range(n * d))


@pytest.mark.parametrize("b", DQ_T_BUILDS, ids=[f"d{b.head_dim}-{b.variant}" for b in DQ_T_BUILDS])
def test_the_transposed_ds_store_is_the_k_major_tile_of_dq_t(b):
    """STMATRIX_DST_T with bwd.ptx's lane address: every (key, query) of both consumers' dS^T
    lands once at the K-major place dQ^T's B reads: key block c = key / 64, query row, 16-byte
    chunk (key % 64) / 8 XOR row % 8, element key % 8. stmatrix .trans: matrix j of a k-step is
    register j (keys 8 (j & 1).., queries 8 (j >> 1).. of the warp's 16 x the step's 16), lane
    8j + r gives the address of its row r, which holds fragment column r: 8 keys."""
    n = b.block_m
    body = _macro_body(ptxgen_bwd.headers()[f"gen_bwd_n{n}.ptxh"], f"STMATRIX_DST_T_N{n}")
    assert len(body) == n // 16
    seen = {}
    for c in (0, 1):
        for warp in range(4):
            addr = {}
            for lane in range(32):      # bwd.ptx's %ds_base (buffer 0)
                j, r = lane >> 3, lane & 7
                chunk = (2 * warp + (j & 1)) ^ r
                addr[lane] = c * n * 128 + (8 * (j >> 1) + r) * 128 + chunk * 16
            for s in body:
                imm = int(re.search(r"\[%ds_row_0\+(\d+)\]", s).group(1))
                regs = [int(x) for x in re.findall(r"%dst(\d+)", s)]
                for j, reg in enumerate(regs):
                    t = reg // 4
                    assert reg % 4 == j
                    for r in range(8):           # memory row r of matrix j
                        at = addr[8 * j + r] + imm
                        for e in range(8):       # its 8 keys (fragment rows)
                            key = 64 * c + 16 * warp + 8 * (j & 1) + e
                            query = 16 * t + 8 * (j >> 1) + r
                            row, within = divmod(at + 2 * e - c * n * 128, 128)
                            want_chunk = ((key % 64) // 8) ^ (query % 8)
                            assert (at + 2 * e) // (n * 128) == key // 64
                            assert row == query and within == want_chunk * 16 + 2 * (key % 8), \
                                (c, warp, reg, r, e)
                            seen[(key, query)] = seen.get((key, query), 0) + 1
    assert sorted(seen) == [(k, q) for k in range(128) for q in range(n)]
    assert set(seen.values()) == {1}

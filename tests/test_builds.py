"""The production kernel's build table (ptxattn/builds.py) and its generated header
(ptx/sm90/production/layout.ptxh): the header is the generator's output, the preprocessor reads
the table's figures from it, the launcher's variants are the table's, a new head dim is one row,
and no offset, transaction-byte or barrier-ID literal is left in the production sources outside
the header (CPU only)."""

from __future__ import annotations

import dataclasses
import re
import shutil

import pytest

from ptxattn import builds, ptx, stages
from ptxattn.tools import ptxgen, ptxgen_layout, sass

PRODUCTION_DIR = stages.ptx_root() / "sm90" / "production"
SHARED_INCLUDE = stages.ptx_root() / "sm90" / "include"


# ---- the generated header ---------------------------------------------------------------------

def test_committed_layout_header_equals_the_generator_output():
    assert ptxgen_layout.stale() == [], "run `python -m ptxattn.tools.ptxgen_layout` and commit the header"


def test_a_hand_edit_of_the_layout_header_is_caught(tmp_path):
    for name, text in ptxgen_layout.headers().items():
        (tmp_path / name).write_text(text)
    assert ptxgen_layout.stale(tmp_path) == []
    name = ptxgen_layout.NAME
    (tmp_path / name).write_text((tmp_path / name).read_text().replace("229376", "229384", 1))
    assert ptxgen_layout.stale(tmp_path) == [name]


def _probe(tmp_path, names, defines):
    """Each name's expansion under `defines`, as the preprocessor reads layout.ptxh."""
    probe = tmp_path / "probe.ptx"
    probe.write_text('#include "layout.ptxh"\n' + "".join(f"@key_{n}= {n} ;\n" for n in names))
    text = ptx.expand_file(probe, [PRODUCTION_DIR, SHARED_INCLUDE], defines).text
    return dict(re.findall(r"^@key_(\w+)= (.*?) ;$", text, re.M))


@pytest.mark.parametrize("head_dim", builds.HEAD_DIMS)
def test_the_preprocessor_reads_each_rows_figures(tmp_path, head_dim):
    b = builds.get(head_dim)
    want = ptxgen_layout.numbers(b)
    got = _probe(tmp_path, sorted(want), {"HEAD_DIM": str(head_dim)})
    assert {k: int(v) for k, v in got.items()} == want
    # the products written as products: their values are the table's
    got = _probe(tmp_path, ["Q_TX_BYTES", "Q_BUFFER_BYTES"], {"HEAD_DIM": str(head_dim)})
    assert eval(got["Q_TX_BYTES"]) == b.q_tx_bytes == b.consumers * b.q_box_bytes
    assert eval(got["Q_BUFFER_BYTES"]) == b.q_buffer_bytes


def test_the_default_build_and_an_unknown_head_dim(tmp_path):
    assert _probe(tmp_path, ["HEAD_DIM", "CONSUMERS"], None) == {
        "HEAD_DIM": str(builds.DEFAULT_HEAD_DIM),
        "CONSUMERS": str(builds.get(builds.DEFAULT_HEAD_DIM).consumers)}
    with pytest.raises(Exception, match="HEAD_DIM must be 64, 128 or 256"):
        _probe(tmp_path, ["CONSUMERS"], {"HEAD_DIM": "96"})


# ---- the table's figures ----------------------------------------------------------------------

# The figures each build had when they were written by hand (production.ptx's table before the
# build table): a derivation that moves any of them changes the kernel.
HAND_WRITTEN = {
    64: dict(SMEM_K=49152, SMEM_V=81920, SMEM_O=114688, SMEM_BAR_Q=139264, SMEM_BAR_FULL_K=139272,
             SMEM_BAR_FULL_V=139288, SMEM_BAR_EMPTY_K=139304, SMEM_BAR_EMPTY_V=139320,
             SMEM_BAR_Q_EMPTY=139336, SMEM_BAR_Q_1=139344, SMEM_BAR_Q_EMPTY_1=139352,
             Q_TILE_BYTES=8192, KV_TILE_BYTES=16384, KV_SLOT_DESC=1024, CONSUMER_REGS=160,
             CTA_THREADS=512, BAR_O_0=4, BLOCK_M=192, BLOCK_N=128),
    128: dict(SMEM_K=65536, SMEM_V=131072, SMEM_O=196608, SMEM_BAR_Q=229376,
              SMEM_BAR_FULL_K=229384, SMEM_BAR_FULL_V=229400, SMEM_BAR_EMPTY_K=229416,
              SMEM_BAR_EMPTY_V=229432, SMEM_BAR_Q_EMPTY=229448, SMEM_BAR_Q_1=229456,
              SMEM_BAR_Q_EMPTY_1=229464, Q_TILE_BYTES=16384, KV_TILE_BYTES=32768,
              KV_SLOT_DESC=2048, CONSUMER_REGS=240, CTA_THREADS=384, BAR_O_0=3, BLOCK_M=128,
              BLOCK_M_SHIFT=7, BLOCK_N=128),
    256: dict(SMEM_K=65536, SMEM_V=131072, SMEM_O=0, SMEM_BAR_Q=196608, SMEM_BAR_FULL_K=196616,
              SMEM_BAR_FULL_V=196632, SMEM_BAR_EMPTY_K=196648, SMEM_BAR_EMPTY_V=196664,
              SMEM_BAR_Q_EMPTY=196680, Q_TILE_BYTES=32768, KV_TILE_BYTES=32768,
              KV_SLOT_DESC=2048, CONSUMER_REGS=240, CTA_THREADS=384, BAR_O_0=3, BLOCK_M=128,
              BLOCK_M_SHIFT=7, BLOCK_N=64, O_STAGED_IN_Q=1),
}
HAND_WRITTEN_SMEM = {64: 136 * 1024 + 128 + 1024, 128: 14 * 16384 + 128 + 1024,
                     256: 12 * 16384 + 128 + 1024}


@pytest.mark.parametrize("head_dim", sorted(HAND_WRITTEN))
def test_the_derived_figures_are_the_hand_written_ones(head_dim):
    b = builds.get(head_dim)
    figures = ptxgen_layout.numbers(b)
    assert {k: figures.get(k) for k in HAND_WRITTEN[head_dim]} == HAND_WRITTEN[head_dim]
    assert b.smem_bytes == HAND_WRITTEN_SMEM[head_dim]
    # the two-buffer builds have buffer 1's barriers; D = 256 (O in Q) has not
    assert ("SMEM_BAR_Q_1" in figures) == (b.q_buffers == 2) == (head_dim != 256)


def test_the_launchers_variants_are_the_build_table():
    assert set(stages.PRODUCTION_VARIANTS) == {(d, m) for d in builds.HEAD_DIMS
                                               for m in (False, True)}
    for (d, _), v in stages.PRODUCTION_VARIANTS.items():
        b = builds.get(d)
        assert (v.block_n, v.kv_stages, v.smem_bytes, v.block_m, v.threads) == (
            b.block_n, b.kv_stages, b.smem_bytes, b.block_m, b.threads)
        build = stages.PRODUCTION.specialize(d)
        assert (build.block_m, build.block_n, build.threads, build.smem_bytes) == (
            b.block_m, b.block_n, b.threads, b.smem_bytes)
    assert stages.PRODUCTION.head_dims == builds.HEAD_DIMS
    assert ptxgen.HEAD_DIMS == tuple(sorted({128} | set(builds.HEAD_DIMS)))


@pytest.mark.parametrize("change, reason", [
    (dict(head_dim=256, block_n=128), "registers do not fit"),          # S 64 + P 32 + O 128
    (dict(head_dim=256, q_buffers=2, o_staged_in_q=False), "bytes of shared memory"),
    (dict(head_dim=128, q_buffers=2, o_staged_in_q=True), "O staged in Q needs the one Q buffer"),
    (dict(head_dim=128, kv_stages=3), "power of two"),
    (dict(head_dim=128, consumers=8), "named barriers"),
    (dict(head_dim=96), "multiple of 64"),
])
def test_a_row_that_cannot_be_built_is_refused(change, reason):
    base = builds.get(change["head_dim"] if change["head_dim"] in builds.BY_HEAD_DIM else 128)
    with pytest.raises(ValueError, match=reason):
        dataclasses.replace(base, **change).check()


# ---- a new head dim is one row ------------------------------------------------------------------

D192 = builds.Build(head_dim=192, consumers=2, block_n=64, kv_stages=2, q_buffers=1,
                    o_staged_in_q=True, why="a test row: a fourth head dim")


def test_a_new_head_dim_is_one_row(tmp_path, monkeypatch):
    """A row for D = 192 and nothing else: the generators write its header and macros, the
    unchanged production sources expand with HEAD_DIM=192 (and assemble, where ptxas is)."""
    D192.check()
    table = builds.BUILDS + (D192,)
    monkeypatch.setattr(builds, "BUILDS", table)
    monkeypatch.setattr(builds, "HEAD_DIMS", tuple(sorted(b.head_dim for b in table)))
    monkeypatch.setattr(ptxgen, "HEAD_DIMS", tuple(sorted({128} | set(builds.HEAD_DIMS))))
    work = tmp_path / "sm90"
    shutil.copytree(PRODUCTION_DIR, work / "production")
    shutil.copytree(SHARED_INCLUDE, work / "include")
    for name, text in ptxgen.headers().items():
        (work / "include" / name).write_text(text)
    for name, text in ptxgen_layout.headers().items():
        (work / "production" / name).write_text(text)
    for masked in (False, True):
        defines = {"HEAD_DIM": "192", **({"PTXATTN_MASKED": "1"} if masked else {})}
        text = ptx.expand_file(work / "production" / "forward.ptx", [work / "include"],
                               defines).text
        assert ".maxntid 384, 1, 1" in text and "wgmma.mma_async.sync.aligned.m64n192k16" in text
        assert "add.u32 %st_row_2, %st_row_0, 16384;" in text     # O's third 64 columns
        if sass.locate("ptxas") is not None:
            s = sass.summarize(sass.disassemble(sass.assemble_ptx(text, "sm_90a", "d192").cubin))
            assert s.classes["HGMMA"] > 0


# ---- no layout literal outside the generated header ------------------------------------------

# Numbers a production source may #define itself: policies and flags, not layout figures
OWN_DEFINES = {"SW_EXP2_PER_8", "KV_STEP_MASKED",
               "P_SHIFT_LOG2", "REBASE_LOG2_FP8",      # (FP8 measurement knobs: softmax.ptxh)
               "PTXATTN_MASKED",       # a switch, not a figure: the varlen build implies it
               # the paged K/V reads' switches (decode_kv_paged.ptxh, as the paged varlen
               # build includes it: kv_paged.ptxh picks its batched reads)
               "PTXATTN_PAGED_ROW_GROUP", "PTXATTN_PAGED_TABLE_AHEAD",
               "PTXATTN_PAGED_BATCHED_READS", "PTXATTN_PAGED_WARP", "KV_BATCHED", "KV_VARIANT"}
# shared-memory address registers: a literal added to one is an offset
_SMEM_REGS = re.compile(r"%(smem_base|sQ1?|sK|sV|sO|q_base|bar_\w+|slot_bar|st_row_\d|o_bar)\b")
_NUMBER = re.compile(r"(?<![\w%.])-?(?:0x[0-9a-fA-F]+|\d+)(?![\w.])")
# thread-index arithmetic shifts by literals (warpgroup, warp, quad row, chunk parity); and two
# more a shift: local_tile / 2 (the two Q buffers' use count) and float32 elements to bytes;
# the varlen epilogue's row-by-row O store: bf16 elements to bytes, and 8 rows of O's row
# stride (elements) in bytes; the K/V multicast build's query blocks to pairs of blocks; the
# paged varlen build's block-table row (int32 entries to bytes) and key rows to the 8-row
# groups of the row-group layout
_SHIFT_SOURCES = re.compile(r"^%(thread|lane|wg_thread)$")
_SHIFT_OK = {("%local_tile", "1"), ("%lse_addr", "2"), ("%state", "1"), ("%lse_addr", "4"),
             ("%m_blocks", "1"), ("%wide", "2"), ("%kv_page_row", "3")}


def production_sources() -> dict[str, str]:
    """The production kernel's own sources (its folder; the shared includes are the
    lineage's), the generated header left out."""
    files = [p for p in ptx.source_files(stages.PRODUCTION) if p.parent == PRODUCTION_DIR]
    assert {p.name for p in files} >= {"forward.ptx", "barriers.ptxh", "scheduler.ptxh",
                                        "masks.ptxh", "softmax.ptxh", "consumer.ptxh",
                                        "kv_step.ptxh", "epilogue.ptxh", "producer.ptxh",
                                        "layout.ptxh"}
    return {p.name: p.read_text() for p in files if p.name != ptxgen_layout.NAME}


def _statements(text: str) -> list[str]:
    """The instructions of a source, macro bodies included: comments dropped, continuation
    lines joined, code split at ';' (a statement may span lines), what precedes an instruction
    (macro invocations such as TRACE(EV_X) or OTHER_TURN, labels, a guard) stripped."""
    text = re.sub(r"//[^\n]*", "", text).replace("\\\n", " ")
    code = []
    for line in text.splitlines():
        d = re.match(r"\s*#\s*define\s+\w+(?:\([^)]*\))?\s+(.*)$", line)
        if d:
            code.append(d.group(1) + ";")             # a macro body ends its statements
        elif not line.lstrip().startswith("#"):
            code.append(line)
    out = []
    for stmt in " ".join(code).split(";"):
        stmt = _strip_prefix(stmt)
        if stmt:
            out.append(re.sub(r"\s+", " ", stmt))
    return out


def _strip_prefix(stmt: str) -> str:
    """stmt without the macro invocations (balanced parentheses), labels and guard before its
    instruction."""
    stmt = stmt.strip()
    while True:
        m = re.match(r"[A-Z][A-Z0-9_]*", stmt) or re.match(r"\w+(?:##\w+)*(?=:)", stmt)
        if not m:
            break
        end = m.end()
        if stmt[end:end + 1] == "(":
            depth = 0
            for i in range(end, len(stmt)):
                depth += {"(": 1, ")": -1}.get(stmt[i], 0)
                if depth == 0:
                    end = i + 1
                    break
        if stmt[end:end + 1] == ":":
            end += 1
        stmt = stmt[end:].strip()
    return re.sub(r"^@!?%\w+\s+", "", stmt)


def layout_literals(name: str, text: str) -> list[str]:
    """Each offset, transaction-byte, descriptor-step, shift, barrier-ID or thread-count literal
    of one source, as `file: statement (why)`."""
    found = []
    for line in re.sub(r"//[^\n]*", "", text).replace("\\\n", " ").splitlines():
        d = re.match(r"\s*#\s*define\s+(\w+)\s+(-?\d+)\s*$", line)
        if d and d.group(1) not in OWN_DEFINES:
            found.append(f"{name}: #define {d.group(1)} {d.group(2)} (a number)")
    for stmt in _statements(text):
        op, _, rest = stmt.partition(" ")
        args = [a.strip() for a in re.split(r",(?![^\[{]*[\]}])", rest)] if rest else []
        numbers = [a for a in args if _NUMBER.fullmatch(a)]
        why = None
        if op.startswith(("bar.", "barrier.")) and numbers:
            why = "a named barrier ID or count"
        elif op.startswith("mbarrier.arrive.expect_tx") and re.search(r"\d", args[-1]):
            why = "transaction bytes"
        elif op.startswith("mbarrier.init") and numbers and numbers != ["1"]:
            why = "an arrival count"
        elif re.search(r"\[[^\]]*[+-]\s*\d+\s*\]", rest) and (
                ".shared" in op or op.startswith("mbarrier")):
            why = "a shared-memory offset"
        elif op.split(".")[0] in ("add", "sub", "mad", "and") and numbers and any(
                _SMEM_REGS.fullmatch(a) for a in args[1:]):
            why = "a shared-memory offset"
        elif op.startswith("mul.wide") and numbers and args and args[0].endswith("_desc"):
            why = "a descriptor step"
        elif op.split(".")[0] in ("shl", "shr") and numbers and not (
                _SHIFT_SOURCES.match(args[1]) or (args[1], args[2]) in _SHIFT_OK):
            why = "a shift amount"
        if why:
            found.append(f"{name}: {stmt} ({why})")
    return found


def test_no_layout_literal_outside_the_generated_header():
    found = [f for name, text in sorted(production_sources().items())
             for f in layout_literals(name, text)]
    assert not found, "literals that belong in the build table:\n  " + "\n  ".join(found)


@pytest.mark.parametrize("old, new, why", [
    ("bar.sync BAR_CTA;", "bar.sync 0;", "named barrier"),
    ("bar.arrive BAR_TURN_0, BAR_TURN_THREADS;", "bar.arrive 1, BAR_TURN_THREADS;", "named barrier"),
    ("[%q_buf_bar], Q_TX_BYTES;", "[%q_buf_bar], 32768;", "transaction bytes"),
    ("[%slot_bar], KV_TX_BYTES;", "[%slot_bar], 32768;", "transaction bytes"),
    ("%smem_base, SMEM_K;", "%smem_base, 65536;", "shared-memory offset"),
    ("%ring_slot, MBAR_BYTES, %bar_empty_k;", "%ring_slot, 8, %bar_empty_k;", "shared-memory offset"),
    ("%ring_slot, KV_SLOT_DESC;", "%ring_slot, 2048;", "descriptor step"),
    ("%key_first, BLOCK_N_SHIFT;", "%key_first, 7;", "shift amount"),
    ("MBAR_INIT_RING(%bar_empty_k, KV_EMPTY_ARRIVALS)",
     "@%p_leader mbarrier.init.shared::cta.b64 [%bar_empty_k+8], 256;", "offset|arrival count"),
])
def test_the_literal_scan_catches_a_planted_literal(old, new, why):
    hits = [(name, text) for name, text in production_sources().items() if old in text]
    assert hits, old
    name, text = hits[0]
    found = layout_literals(name, text.replace(old, new, 1))
    assert found and re.search(why, " ".join(found)), found
    assert not layout_literals(name, text)


def test_the_literal_scan_catches_a_hand_written_define():
    assert layout_literals("x.ptxh", "#define SMEM_K 65536\n") == [
        "x.ptxh: #define SMEM_K 65536 (a number)"]

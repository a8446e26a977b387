"""The Blackwell (sm_100a) lineage's PTX, checked without a B200 (CPU only).

Every stage in ptxattn.stages.SM100_STAGES expands (pcpp) and assembles with
`ptxas -arch=sm_100a` with no spills, and its SASS holds the opcodes its idea needs
(SASS_NEEDS). The registry rows agree with the defines in the PTX they describe, the
descriptor constants in include/umma.ptxh decode to the fields their comments promise, and
the generated header is the generator's output. None of this runs a kernel: nothing here
says a stage computes attention correctly, only that it is the program it claims to be.
"""

from __future__ import annotations

import functools
import os
import re
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from ptxattn import ptx
from ptxattn.tools import ptxgen_sm100, sass
from ptxattn.stages import SWIZZLE_128B, SWIZZLE_NONE, ptx_root
from ptxattn.stages import SM100_STAGES
from ptxattn.stages_sm100 import HOPPER_SAME_IDEA, SASS_NEEDS

SM100 = ptx_root() / "sm100"
INCLUDE = SM100 / "include"

requires_ptxas = pytest.mark.skipif(sass.locate("ptxas") is None,
                                    reason="no ptxas anywhere (pip install 'ptxattn[tools]')")
requires_disassembler = pytest.mark.skipif(
    sass.locate("nvdisasm") is None and sass.locate("cuobjdump") is None,
    reason="no nvdisasm or cuobjdump anywhere (pip install 'ptxattn[tools]')")


def _defines(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2)
            for m in re.finditer(r"^#define\s+(\w+)\s+(\S+)", text, re.MULTILINE)}


def _build(file: str) -> tuple[dict, str]:
    """(ptxas -v report, SASS text) of one stage."""
    path = ptx_root() / file
    expanded = ptx.expand_file(path, [path.parent / "include"])
    try:
        asm = sass.assemble_ptx(expanded.text, "sm_100a", name=path.stem)
    except sass.AssemblyError as exc:        # point at the source line, not the expanded one
        annotated, _ = ptx.annotate(expanded, exc.log)
        return {"error": f"{exc}\n{annotated}"}, ""
    try:
        text = sass.disassemble(asm.cubin)
    except sass.ToolNotFoundError:           # the SASS tests skip; the ptxas ones still run
        text = ""
    return sass.parse_ptxas_log(asm.log), text


@functools.lru_cache(maxsize=1)
def _all_built() -> dict[str, tuple[dict, str]]:
    """Every stage built once per test session, ptxas and nvdisasm runs overlapped on the
    machine's cores (CI has 2), so that the per-stage tests below only read results."""
    files = [s.file for s in SM100_STAGES]
    with ProcessPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return dict(zip(files, pool.map(_build, files)))


def _built(file: str) -> tuple[dict, str]:
    report, text = _all_built()[file]
    assert "error" not in report, report.get("error")
    return report, text


# --------------------------------------------------------------------------- generated header

def test_committed_header_equals_the_generator_output():
    assert ptxgen_sm100.stale() == [], "run `python -m ptxattn.tools.ptxgen_sm100` and commit the header"


def test_a_hand_edit_of_the_header_is_caught(tmp_path):
    for name, text in ptxgen_sm100.headers().items():
        (tmp_path / name).write_text(text)
    assert ptxgen_sm100.stale(tmp_path) == []
    name = ptxgen_sm100.HEADER
    (tmp_path / name).write_text((tmp_path / name).read_text().replace("%s127", "%s126", 1))
    assert ptxgen_sm100.stale(tmp_path) == [name]


def test_generated_mma_steps_walk_the_tiles_and_come_back():
    """Each MMA macro's descriptor steps sum to what its rewind takes back, and the swizzled
    QK^T steps cross to the second half of D (128 rows x 128 bytes on) after 4 k-steps."""
    text = ptxgen_sm100.header()
    for macro in ("QK_SS_NOSWZ", "PV_SS_NOSWZ", "PV_TS_NOSWZ", "QK_SS_SW128", "PV_TS_SW128"):
        body = text.split(f"#define {macro}(")[1].split("\n\n")[0]
        assert body.count("tcgen05.mma.cta_group::1.kind::f16") == 8, macro   # 128 / k16
        for reg in ("DA", "DB"):
            fwd = sum(int(n) for n in re.findall(rf"add\.s64 {reg}, {reg}, (\d+);", body))
            back = re.findall(rf"sub\.s64 {reg}, {reg}, (\d+);", body)
            if fwd:
                assert back == [str(fwd)], (macro, reg)
    # early PV's two halves issue exactly PV_TS_SW128's k-steps, in order
    mmas = {m: re.findall(r"tcgen05\.mma[^;]*\[TA[^\]]*\]", text.split(f"#define {m}(")[1].split("\n\n")[0])
            for m in ("PV_TS_SW128", "PV_TS_SW128_LO", "PV_TS_SW128_HI")}
    assert mmas["PV_TS_SW128_LO"] + mmas["PV_TS_SW128_HI"] == mmas["PV_TS_SW128"]
    assert len(mmas["PV_TS_SW128_LO"]) == len(mmas["PV_TS_SW128_HI"]) == 4
    sw = text.split("#define QK_SS_SW128(")[1].split("\n\n")[0]
    steps = [int(n) for n in re.findall(r"add\.s64 DA, DA, (\d+);", sw)]
    assert steps == [2, 2, 2, 128 * 128 // 16 - 6, 2, 2, 2]


# --------------------------------------------------------------------------- descriptors

def _smem_desc(lbo: int, sbo: int, swizzle: int) -> int:
    """PTX ISA tcgen05 shared memory descriptor, start address 0."""
    return (lbo >> 4) << 16 | (sbo >> 4) << 32 | 1 << 46 | swizzle << 61


def _instr_desc(m: int, n: int, b_mn_major: bool) -> int:
    """.kind::f16 instruction descriptor: f32 accumulator, bf16 A and B, A K-major."""
    return 1 << 4 | 1 << 7 | 1 << 10 | int(b_mn_major) << 16 | (n >> 3) << 17 | (m >> 4) << 24


def test_descriptor_constants_encode_the_documented_fields():
    d = {k: int(v, 0) for k, v in _defines((INCLUDE / "umma.ptxh").read_text()).items()
         if k.startswith(("DESC_", "IDESC_"))}
    rows, core, atom = 128, 16, 1024
    assert d["DESC_KMAJOR_128ROWS"] == _smem_desc(lbo=rows * core, sbo=8 * core, swizzle=0)
    assert d["DESC_MNMAJOR_128ROWS"] == _smem_desc(lbo=8 * core, sbo=rows * core, swizzle=0)
    assert d["DESC_KMAJOR_SW128"] == _smem_desc(lbo=16, sbo=atom, swizzle=2)
    assert d["DESC_MNMAJOR_SW128_128ROWS"] == _smem_desc(lbo=rows * 128, sbo=atom, swizzle=2)
    assert d["IDESC_QK"] == _instr_desc(128, 128, b_mn_major=False)
    assert d["IDESC_PV"] == _instr_desc(128, 128, b_mn_major=True)


# --------------------------------------------------------------------------- registry rows

def test_rows_are_the_files_in_lineage_order():
    assert [s.number for s in SM100_STAGES] == list(range(1, len(SM100_STAGES) + 1))
    assert sorted(SASS_NEEDS) == [s.number for s in SM100_STAGES]
    on_disk = sorted(p.name for p in SM100.glob("[0-9][0-9]_*.ptx"))
    assert on_disk == [Path(s.file).name for s in SM100_STAGES]
    for s in SM100_STAGES:
        assert s.arch == "sm_100a" and s.file == f"sm100/{s.number:02d}_{s.name}.ptx"
        assert s.head_dims == (128,) and not s.production


@pytest.mark.parametrize("stage", SM100_STAGES, ids=lambda s: s.label)
def test_row_geometry_matches_the_ptx(stage):
    text = (ptx_root() / stage.file).read_text()
    d = _defines(text)
    assert int(re.search(r"\.maxntid (\d+), 1, 1", text).group(1)) == stage.threads
    assert int(d["BLOCK_M"]) == stage.block_m and int(d["BLOCK_N"]) == stage.block_n
    # a Q box is one MMA tile of 128 rows; BLOCK_M holds one or two of them
    assert stage.q_box_rows == 128 and stage.block_m % stage.q_box_rows == 0
    # everything the kernel places in shared memory fits the launch's dynamic shared memory
    # after the 1 KiB the kernel may skip to align its base
    offsets = [int(v) for k, v in d.items() if k.startswith("SMEM_")]
    assert max(offsets) + 8 <= stage.smem_bytes - 1024
    assert stage.smem_bytes <= 227 * 1024                      # sm_100's opt-in maximum
    # tensor memory: a power of two of at least 32 columns, at most 512; every region inside
    cols = int(d["TMEM_COLS"])
    assert cols in (32, 64, 128, 256, 512)
    tiles = stage.block_m // 128
    assert int(d["TMEM_O"]) + 128 * tiles <= cols
    # swizzle in the row (what the launcher's tensor maps do) = swizzle in the descriptors
    uses_sw128 = "DESC_KMAJOR_SW128" in text
    assert uses_sw128 == (stage.swizzle == SWIZZLE_128B)
    assert ("DESC_KMAJOR_128ROWS" in text) == (stage.swizzle == SWIZZLE_NONE)
    # a persistent stage strides through the tile list by the grid size (the launcher sizes
    # its grid by the SM count); the others take their tile from ctaid alone
    assert ("%nctaid.x" in text) == stage.persistent


@pytest.mark.parametrize("stage", SM100_STAGES, ids=lambda s: s.label)
def test_header_says_the_one_change_and_the_hopper_counterpart(stage):
    head = (ptx_root() / stage.file).read_text().split(".version")[0]
    assert head.startswith(f"// Stage {stage.number} (sm_100a) - ")
    if stage.predecessor is not None:            # a minor step may build on an earlier stage
        assert f"The one change against stage {stage.predecessor}:" in head
        hopper = HOPPER_SAME_IDEA.get(stage.number, stage.number)
        assert f"Against Hopper stage {hopper}" in head
    # every mbarrier the kernel places in shared memory is in its header's barrier table
    # (by its name, e.g. S_FULL_g for SMEM_BAR_S_FULL, or bar_q for SMEM_BAR_Q in stages 1-3)
    text = (ptx_root() / stage.file).read_text()
    for name in re.findall(r"^#define SMEM_BAR_(\w+)\s", text, re.MULTILINE):
        row = rf"^//\s+({name}(_[gs])?|bar_{name.lower()})\s"     # a row of the table
        assert re.search(row, head, re.MULTILINE), (stage.label, name)


# --------------------------------------------------------------------------- ptxas and SASS

@requires_ptxas
@pytest.mark.parametrize("stage", SM100_STAGES, ids=lambda s: s.label)
def test_stage_assembles_for_sm100a_without_spills(stage):
    report, _ = _built(stage.file)
    f = report["functions"]["ptxattn_fwd"]
    assert f["arch"] == "sm_100a"
    assert (f["spill_stores"], f["spill_loads"], f["stack_frame"]) == (0, 0, 0), f
    # a launch gives each thread at most what the busiest SM sub-partition has: 512 registers
    # a lane over its warps (4 sub-partitions take the warps in turn)
    warps_per_subpartition = -(-stage.threads // 32 // 4)
    assert f["registers"] <= min(255, 512 // warps_per_subpartition // 8 * 8), f
    # 'setmaxnreg ignored' and the like would silently change what the stage is
    assert report["warnings"] == []


@requires_ptxas
@requires_disassembler
@pytest.mark.parametrize("stage", SM100_STAGES, ids=lambda s: s.label)
def test_stage_sass_holds_what_its_idea_needs(stage):
    _, text = _built(stage.file)
    opcodes = {m for m, _ in sass.instructions(text)}
    missing = [need for need in SASS_NEEDS[stage.number]
               if not any(op.startswith(need) for op in opcodes)]
    assert missing == [], f"{stage.label}: no {missing} in its SASS"



# --------------------------------------------------------------------------- the minor steps

# The kernel ABI every sm_100a stage shares (ptx/sm100/README.md), in order; a stage that takes
# its tiles from a global counter adds tile_counter, which the launcher passes last.
ABI = ("tmap_q", "tmap_k", "tmap_v", "tmap_o", "o_ptr", "o_row_stride", "o_head_stride",
       "o_batch_stride", "seq_q", "seq_k", "heads", "batch", "softmax_scale")


def _params(text: str) -> tuple[str, ...]:
    entry = re.search(r"\.entry ptxattn_fwd\((.*?)\)", text, re.DOTALL).group(1)
    return tuple(re.findall(r"\.param\s[^,]*?(\w+)(?:\[\d+\])?\s*(?:,|//|$)", entry, re.MULTILINE))


@pytest.mark.parametrize("stage", SM100_STAGES, ids=lambda s: s.label)
def test_kernel_parameters_are_what_the_launcher_passes(stage):
    params = _params((ptx_root() / stage.file).read_text())
    assert params == ABI + (("tile_counter",) if stage.dynamic_tiles else ()), stage.label


def test_the_minor_steps_are_registered():
    """Issue 15's minor steps: the dynamic scheduler (15) on stage 14, and the TMA-store
    epilogue (16) built on 14 too, its diff against 14 one idea."""
    by_number = {s.number: s for s in SM100_STAGES}
    assert by_number[15].name == "dynamic_scheduler" and by_number[15].dynamic_tiles
    assert by_number[15].predecessor == 14 and by_number[15].persistent
    assert by_number[16].name == "tma_store_epilogue" and not by_number[16].dynamic_tiles
    assert by_number[16].predecessor == 14 and by_number[16].persistent
    assert [s.number for s in SM100_STAGES if s.dynamic_tiles] == [15]


@requires_ptxas
@requires_disassembler
@pytest.mark.parametrize("stage", SM100_STAGES, ids=lambda s: s.label)
def test_only_the_dynamic_scheduler_takes_tiles_from_a_global_counter(stage):
    """The counter's atom.add is in the SASS of the dynamic stage only: one fetch before the
    first tile, one a tile ahead in the loop, and the finish count that lets the last CTA
    reset the counter (3); and none of its roles still strides the static list by the grid."""
    _, text = _built(stage.file)
    atomics = [m for m, _ in sass.instructions(text) if m.startswith("ATOMG")]
    if stage.dynamic_tiles:
        assert len(atomics) >= 3 and all(m.startswith("ATOMG.E.ADD") for m in atomics), atomics
        source = (ptx_root() / stage.file).read_text()
        assert "add.u32 %tile, %tile, %n_ctas" not in source
        # the three roles that do not load read every tile from the load warp's ring
        assert len(re.findall(r"^\s+TAKE_TILE\(\w+\)", source, re.MULTILINE)) == 3
    else:
        assert atomics == [], f"{stage.label}: a global atomic without a tile counter"


@requires_ptxas
@requires_disassembler
@pytest.mark.parametrize("stage", SM100_STAGES, ids=lambda s: s.label)
def test_o_leaves_by_tma_store_exactly_where_the_stage_says(stage):
    """A stage whose idea needs UTMASTG stores O only through the TMA (no thread stores a row
    to global memory) from a 1024-byte aligned staging tile that fits its shared memory; every
    other stage leaves tmap_o unread, as the ABI note says."""
    _, text = _built(stage.file)
    opcodes = [m for m, _ in sass.instructions(text)]
    stores_tma = any(m.startswith("UTMASTG") for m in opcodes)
    assert stores_tma == ("UTMASTG" in SASS_NEEDS[stage.number]), stage.label
    source = (ptx_root() / stage.file).read_text()
    if stores_tma:
        assert not any(m.startswith("STG") for m in opcodes), stage.label
        d = _defines(source)
        staging = int(d["SMEM_STAGE"])
        assert staging % 1024 == 0                           # 128-byte swizzle atoms
        assert staging + 128 * 128 * 2 <= stage.smem_bytes - 1024
        assert stage.swizzle == SWIZZLE_128B                 # the O map's swizzle = the staging's
    else:
        body = re.sub(r"//[^\n]*", "", source.split(".entry")[1])
        body = body.replace(".param .align 64 .b8 tmap_o[128]", "")
        assert not re.search(r"\btmap_o\b", body), f"{stage.label} reads tmap_o"


def _tma_sw128_offset(row: int, col: int) -> int:
    """Byte offset of bf16 O[row, col] in a TMA box (64, 128, 2) with 128-byte swizzle, as the
    TMA unit lays it out in (and reads it from) 1024-byte aligned shared memory: [col / 64][row]
    [64], the 16-byte unit u of each 128-byte row at u ^ (row % 8)."""
    half, c = divmod(col, 64)
    unit, byte = divmod(2 * c, 16)
    return half * 128 * 128 + row * 128 + (unit ^ (row % 8)) * 16 + byte


def test_staged_o_lands_where_the_tma_store_reads_it():
    """Stage 16's staging writes, simulated from the macros as written (STAGE_O_ROW in
    epilogue_tma.ptxh, the generated STS_OB_SW128): every element of a 128 x 128 O tile goes
    to the byte the O map's swizzled box holds it at, and no two share one."""
    text = (INCLUDE / "epilogue_tma.ptxh").read_text()
    half_bytes = int(re.search(r"^#define STAGE_HALF_BYTES (\d+)", text, re.MULTILINE).group(1))
    body = text.split("#define STAGE_O_ROW(")[1].split("\n\n")[0]
    chunks = [(int(off or 0), int(c), 0 if h == "0" else half_bytes)
              for off, c, h in re.findall(r"STAGE_O_CHUNK\(MY_O(?:\+(\d+))?, ROW, X16, T, (\d+), "
                                          r"(0|STAGE_HALF_BYTES), INV\)", body)]
    assert len(chunks) == 4                                    # 4 x 32 columns = D
    gen = ptxgen_sm100.header().split("#define STS_OB_SW128(")[1].split("\n\n")[0]
    units = re.findall(r"xor\.b32 T, X16, C(?: \+ (\d+))?;.*?st\.shared\.v4\.b32 \[T\+HALF\], "
                       r"\{([^}]*)\};", gen, re.DOTALL)
    assert len(units) == 4
    seen = {}
    for row in range(128):
        x16 = (row % 8) * 16
        for col0, c, half in chunks:
            for extra, regs in units:
                addr = half + row * 128 + ((c + int(extra or 0)) ^ x16)
                for i, reg in enumerate(r.strip() for r in regs.split(",")):
                    pair = int(reg.removeprefix("%ob"))        # %ob<k>: columns 2k (low), 2k + 1
                    for lane in (0, 1):
                        col = col0 + 2 * pair + lane
                        seen[(row, col)] = addr + 4 * i + 2 * lane
    assert len(seen) == 128 * 128 and len(set(seen.values())) == 128 * 128
    wrong = [(rc, a) for rc, a in seen.items() if a != _tma_sw128_offset(*rc)]
    assert wrong == [], wrong[:4]


class _MBarrier:
    """An mbarrier as the PTX ISA has it: `count` arrivals complete a phase; try_wait.parity P
    passes once the phase of parity P has completed, i.e. while the current phase's parity is
    not P. A waiter that fell two phases behind would wait on the wrong phase: counted here."""

    def __init__(self, count):
        self.count, self.pending, self.completed = count, count, 0

    def arrive(self):
        self.pending -= 1
        if self.pending == 0:
            self.completed, self.pending = self.completed + 1, self.count

    def ready(self, phase: int) -> bool:
        """try_wait.parity for the waiter's phase (its index, not only its parity)."""
        assert self.completed <= phase + 1, "a waiter fell two phases behind"
        return (self.completed & 1) != (phase & 1)


def test_stage15_tile_ring_hands_every_role_every_tile_in_order():
    """Stage 15's tile index ring, with the parities of its barrier table, under random
    interleavings: the load warp publishes index n in slot n & 1 (waiting, from n = 2 on, for
    TILE_EMPTY's use (n >> 1) - 1), every reader takes index n from TILE_FULL's use n >> 1 and
    gives it back. Every reader sees exactly the load warp's list and the end, none waits on a
    phase two behind, and nothing deadlocks. The arrival count is the PTX's TILE_READERS."""
    import random
    d = _defines((SM100 / "15_dynamic_scheduler.ptx").read_text())
    readers = int(d["TILE_READERS"])
    softmax, correction = 2 * int(d["SOFTMAX_THREADS"]), 128
    assert readers == 1 + softmax + correction          # MMA lane 0, both softmax WGs, correction
    # one simulated reader per role, each arriving for all its threads at once
    roles = {"mma": 1, "softmax": softmax, "correction": correction}
    for seed in range(40):
        rng = random.Random(seed)
        tiles = [rng.randrange(100) for _ in range(rng.randrange(0, 7))] + [10**6]   # + the end
        full, empty = [_MBarrier(1) for _ in range(2)], [_MBarrier(readers) for _ in range(2)]
        index = [None, None]
        seen = {r: [] for r in roles}

        def load():
            for n, tile in enumerate(tiles):
                s, u = n & 1, n >> 1
                if n >= 2:
                    while not empty[s].ready(u - 1):
                        yield
                index[s] = tile
                full[s].arrive()
                for _ in range(rng.randrange(3)):       # the tile's loads
                    yield

        def reader(role):
            n = 0
            while True:
                s, u = n & 1, n >> 1
                while not full[s].ready(u):
                    yield
                tile = index[s]
                for _ in range(roles[role]):
                    empty[s].arrive()
                seen[role].append(tile)
                if tile >= 10**6:
                    return
                n += 1
                for _ in range(rng.randrange(4)):       # the tile's work
                    yield

        running = [load()] + [reader(r) for r in roles]
        for _ in range(10_000):
            if not running:
                break
            task = rng.choice(running)
            try:
                next(task)
            except StopIteration:
                running.remove(task)
        assert not running, f"seed {seed}: deadlock"
        assert all(got == tiles for got in seen.values()), (seed, seen, tiles)

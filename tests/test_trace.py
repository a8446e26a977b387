"""ptxattn.tools.trace on the CPU: the event table, the traced build, parse/intervals/render, the CLI.

The buffers here are built the way trace.ptxh writes them (32-byte records in per-warp slots),
so everything after the copy back from the GPU is covered; tests/test_trace_gpu.py records
real ones.
"""

from __future__ import annotations

import ctypes
import json
import re
import struct
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from cli_helpers import cli, one_clean_error
from ptxattn import driver, ptx, stages
from ptxattn.tools import sass
from ptxattn.tools import trace as T
from ptxattn.errors import NoGpuError

TRACE_PTXH = stages.ptx_root() / "sm90" / "include" / "trace.ptxh"
TRACED = T.traced_stages()
SVG = "{http://www.w3.org/2000/svg}"




def record_bytes(clock, globaltimer, code, warp):
    """One record exactly as TRACE(EVENT) stores it: v2.u64, then v2.u32, 8 bytes untouched."""
    return struct.pack("<QQII8x", clock, globaltimer, code, warp)


def buffer(events_by_warp, warps=T.MAX_WARPS):
    """A zeroed trace buffer with each warp's (clock, globaltimer, code) records in its slot."""
    raw = bytearray(warps * T.TRACE_PER_WARP * T.RECORD_BYTES)
    for warp, records in events_by_warp.items():
        for i, (clock, gt, code) in enumerate(records):
            at = (warp * T.TRACE_PER_WARP + i) * T.RECORD_BYTES
            raw[at:at + T.RECORD_BYTES] = record_bytes(clock, gt, code, warp)
    return bytes(raw)


C = T.CODES


@pytest.fixture
def untraced(monkeypatch):
    """A kernel without trace points: the production kernel today. Should every kernel gain
    them, stage 2 is made to look untraced, so the refusals below are still exercised."""
    for s in stages.all_kernels():
        if not T.has_trace_points(s):
            return s
    fake = stages.get_stage(2)
    real = T.has_trace_points
    monkeypatch.setattr(T, "has_trace_points", lambda s: stages.get_stage(s) is not fake and real(s))
    return fake


TILES = 4


def consumer_records(start, tiles=TILES, gt0=1_000_000):
    """A stage-12-like consumer lane: QK^T of tile i in flight across the PV issue of i-1."""
    out, clock = [], start

    def ev(name, dt=0):
        nonlocal clock
        clock += dt
        out.append((clock, gt0 + clock // 2, C[name]))     # 0.5 ns per cycle

    ev("TURN_WAIT"), ev("TURN_GRANTED", 40), ev("KV_WAIT"), ev("KV_READY", 300)
    ev("QK_ISSUE", 4), ev("QK_DONE", 500), ev("SOFTMAX_BEGIN", 2), ev("SOFTMAX_END", 1500)
    for _ in range(tiles - 1):
        ev("TURN_WAIT", 4), ev("TURN_GRANTED", 60), ev("KV_WAIT"), ev("KV_READY", 10)
        ev("QK_ISSUE", 4), ev("KV_WAIT", 6), ev("KV_READY", 8), ev("PV_ISSUE", 4)
        ev("QK_DONE", 450), ev("SOFTMAX_BEGIN", 2), ev("SOFTMAX_END", 1500), ev("PV_DONE", 3)
    ev("KV_WAIT", 4), ev("KV_READY", 8), ev("PV_ISSUE", 4), ev("PV_DONE", 400)
    ev("EPILOGUE_BEGIN", 2), ev("EPILOGUE_END", 1200)
    return out


def producer_records(tiles=TILES, gt0=1_000_000):
    out, clock = [], 0
    for i in range(tiles):
        if i >= 2:
            out += [(clock, gt0 + clock // 2, C["EMPTY_WAIT"])]
            clock += 2000
            out += [(clock, gt0 + clock // 2, C["EMPTY_READY"])]
        clock += 20
        out += [(clock, gt0 + clock // 2, C["TMA_ISSUE"])]
        clock += 20
        out += [(clock, gt0 + clock // 2, C["TMA_ISSUE"])]
    return out


@pytest.fixture
def warp_specialized():
    raw = buffer({0: producer_records(), 4: consumer_records(100), 8: consumer_records(700)})
    return T.Trace(12, "tma_store_epilogue", 384, (1, 2, 512, 512, 128), "bhld", T.parse(raw),
                   gpu="NVIDIA H200", kernel_ms=0.05)


# --------------------------------------------------------------------------- the kernel side

def test_event_table_matches_trace_ptxh():
    text = TRACE_PTXH.read_text()
    defined = {m.group(1): int(m.group(2))
               for m in re.finditer(r"^#define EV_(\w+)\s+(\d+)\b", text, re.M)}
    assert defined, "no EV_ defines found in trace.ptxh"
    assert defined == T.CODES
    assert {code: name for name, code in defined.items()} == T.EVENTS
    per_warp = re.search(r"^#define TRACE_PER_WARP\s+(\d+)", text, re.M)
    assert int(per_warp.group(1)) == T.TRACE_PER_WARP
    assert T.BUFFER_BYTES == 16 * 4096 * 32
    # every event is drawn: as one end of a bar, or as a tick
    drawn = {k.begin for k in T.KINDS} | {k.end for k in T.KINDS if k.end}
    assert drawn == set(T.CODES)


def test_traced_stages_are_found_by_their_trace_points(untraced):
    numbers = [s.number for s in TRACED]
    # issue 17: every stage of the lineage is traced, with the same vocabulary
    assert numbers == [s.number for s in stages.all_stages()]
    for s in stages.all_stages():
        path = stages.ptx_root() / s.file
        if path.is_file():
            assert (s in TRACED) == ("TRACE(" in path.read_text())
    with pytest.raises(ValueError,
                       match=rf"{untraced.label}.*no trace points.*stage01 \(baseline\)"):
        T.check_traced(untraced)
    assert T.check_traced("baseline") is stages.get_stage(1)


# The text TRACE_PARAM adds to the last parameter's line; every other traced line is new.
TRACE_PARAM_TEXT = " , .param .u64 trace_buf"
TRACE_NAMES = re.compile(r"%p?_?trace_|%p_trace|\btrace_buf\b")


@pytest.mark.parametrize("stage", TRACED, ids=lambda s: s.label)
def test_without_the_define_the_stage_is_the_untraced_kernel(stage):
    plain = ptx.source(stage)
    traced = ptx.source(stage, defines=T.DEFINES)
    assert "globaltimer" not in plain and "trace_buf" not in plain and "%trace_" not in plain
    assert "globaltimer" in traced and "trace_buf" in traced
    plain_lines = [line for line in plain.splitlines() if line.strip()]
    assert len(plain_lines) == len(plain.splitlines())   # ptx.source drops blank lines itself
    # The untraced lines are an ordered subsequence of the traced ones ...
    it = iter(plain_lines)
    want = next(it, None)
    extra = []
    params = 0
    for number, line in enumerate(traced.splitlines(), 1):
        if line.endswith(TRACE_PARAM_TEXT):
            params += 1
            line = line[:-len(TRACE_PARAM_TEXT)]
        if line == want:
            want = next(it, None)
        else:
            extra.append((number, line))
    assert want is None, f"untraced line missing from the traced build: {want!r}"
    assert params == 1
    # ... and every added line comes from TRACE_REGS, TRACE_SETUP or TRACE: each of its
    # statements touches the trace registers.
    assert extra
    n_points = len(re.findall(r"^\s*TRACE\(", (stages.ptx_root() / stage.file).read_text(), re.M))
    # one statement a line (ptx.py splits macros): count the invocations they come from
    traced_map = ptx.expand(stage, T.DEFINES)
    assert len({traced_map.map_line(number) for number, _ in extra}) == n_points + 2
    for _, line in extra:
        statements = [s.strip() for s in line.split(";") if s.strip()]
        assert statements and all(TRACE_NAMES.search(s) for s in statements), line


@pytest.mark.parametrize("stage", TRACED, ids=lambda s: s.label)
def test_trace_buf_is_the_last_kernel_parameter(stage):
    """prepare() appends extra_params after the ABI's parameters (and after a stage's own, such
    as the dynamic scheduler's tile_counter): the PTX must declare trace_buf last."""
    def params(text):
        head = re.search(r"\.entry\s+ptxattn_fwd\s*\((.*?)\)", text, re.S).group(1)
        return [p.split()[-1] for p in head.replace("\n", " ").split(",") if p.strip()]

    plain, traced = params(ptx.source(stage)), params(ptx.source(stage, defines=T.DEFINES))
    assert traced == plain + ["trace_buf"]
    own = 1 if getattr(stage, "dynamic_tiles", False) else 0
    assert len(plain) == 13 + own                        # the kernel ABI, then the stage's own


needs_ptxas = pytest.mark.skipif(sass.locate("ptxas") is None,
                                 reason="no ptxas (pip install 'ptxattn[tools]')")


@needs_ptxas
@pytest.mark.parametrize("stage", TRACED, ids=lambda s: s.label)
def test_traced_build_assembles(stage):
    asm = sass.assemble(stage, defines=T.DEFINES)
    assert asm.cubin


# --------------------------------------------------------------------------- parse

def test_parse_reads_records_slot_by_slot_and_skips_empty_ones():
    raw = buffer({0: [(10, 1005, C["TMA_ISSUE"]), (30, 1015, C["KV_WAIT"])],
                  4: [(12, 1006, C["QK_ISSUE"])]})
    events = T.parse(raw)
    assert events == [T.Event(0, 10, 1005, 11), T.Event(0, 30, 1015, 1),
                      T.Event(4, 12, 1006, 3)]
    assert [e.name for e in events] == ["TMA_ISSUE", "KV_WAIT", "QK_ISSUE"]
    assert T.parse(np.frombuffer(raw, np.uint8)) == events          # a NumPy buffer too
    assert T.parse(bytes(T.BUFFER_BYTES)) == []
    assert T.full_slots(raw) == ()
    assert T.parse(T.pack(events)) == events                          # pack is parse's inverse


def test_parse_rejects_a_torn_buffer_and_names_unknown_codes():
    with pytest.raises(ValueError, match="multiple of 32 bytes"):
        T.parse(bytes(33))
    (e,) = T.parse(record_bytes(1, 2, 99, 0))
    assert e.name == "EVENT_99"


def test_a_full_slot_is_reported():
    full = [(i, i, C["TMA_ISSUE"]) for i in range(T.TRACE_PER_WARP)]
    raw = buffer({0: full, 4: [(1, 1, C["QK_ISSUE"])]})
    assert T.full_slots(raw) == (0,)
    assert len(T.parse(raw)) == T.TRACE_PER_WARP + 1


# --------------------------------------------------------------------------- intervals

def test_intervals_pair_in_order_and_overlapping_work_gets_its_own_row(warp_specialized):
    ivs = T.intervals(warp_specialized.events, strict=True)
    consumer = [i for i in ivs if i.warp == 4]
    kinds = {k: [i for i in consumer if i.kind == k] for k in ("qk", "pv", "softmax", "kv_wait")}
    assert len(kinds["qk"]) == len(kinds["pv"]) == len(kinds["softmax"]) == TILES
    assert len(kinds["kv_wait"]) == 2 * TILES            # K, then V of the tile before
    assert [i.index for i in kinds["qk"]] == list(range(TILES))
    for i in consumer:
        assert i.end >= i.start
    # PV of tile 0 is issued before, and done after, the QK^T and softmax of tile 1
    pv0, qk1, sm1 = kinds["pv"][0], kinds["qk"][1], kinds["softmax"][1]
    assert pv0.start < qk1.end and pv0.end > sm1.end
    assert len({pv0.row, qk1.row, sm1.row}) == 3
    producer = [i for i in ivs if i.warp == 0]
    assert sum(i.kind == "tma" and i.start == i.end for i in producer) == 2 * TILES
    assert sum(i.kind == "empty_wait" for i in producer) == TILES - 2


def test_unbalanced_events_are_dropped_or_raise():
    events = [T.Event(4, 1, 0, C["QK_DONE"]), T.Event(4, 2, 0, C["QK_ISSUE"]),
              T.Event(4, 3, 0, C["QK_DONE"]), T.Event(4, 4, 0, C["PV_ISSUE"])]
    (iv,) = T.intervals(events)
    assert (iv.kind, iv.start, iv.end) == ("qk", 2, 3)
    with pytest.raises(T.UnbalancedTraceError, match="warp 4: QK_DONE .* no QK_ISSUE"):
        T.intervals(events, strict=True)
    with pytest.raises(T.UnbalancedTraceError, match="PV_ISSUE never ended"):
        T.intervals(events[1:], strict=True)


def test_time_base_from_globaltimer_then_clock_rate(warp_specialized):
    def lane(cycles, ns):
        return [T.Event(0, 1000, 5000, 11), T.Event(0, 1000 + cycles, 5000 + ns, 11)]

    def base(events, clock_khz=None):
        t = T.Trace(1, "baseline", 128, (1, 1, 64, 64, 128), "bhld", events, clock_khz=clock_khz)
        return t.ns_per_cycle, t.ns_per_cycle_source

    # a long globaltimer span wins over the nominal clock rate
    assert base(lane(40_000, 25_000), 2_000_000) == (pytest.approx(0.625), "globaltimer")
    # a short one does not (globaltimer may tick in microseconds) ...
    assert base(lane(4_000, 2_500), 2_000_000) == (pytest.approx(0.5), "device clock rate")
    # ... unless there is nothing else; with no time at all the axis is in cycles
    assert base(lane(4_000, 2_500)) == (pytest.approx(0.625), "globaltimer, short span")
    assert base(lane(4_000, 0)) == (None, "none")
    assert base([]) == (None, "none")
    assert warp_specialized.ns_per_cycle == pytest.approx(0.5, rel=1e-3)
    t = T.Trace(1, "baseline", 128, (1, 1, 64, 64, 128), "bhld", lane(2000, 0),
                clock_khz=2_000_000)
    assert t.span_us == pytest.approx(1.0) and t.span_cycles == 2000
    t.clock_khz = None
    assert t.span_us is None


def test_roles_follow_warp_specialization():
    assert T.role(0, 128).startswith("warpgroup 0")
    assert T.role(0, 384).startswith("producer")
    assert T.role(4, 384).startswith("consumer 0") and T.role(8, 384).startswith("consumer 1")
    assert T.traced_warps(128) == (0,) and T.traced_warps(384) == (0, 4, 8)


# --------------------------------------------------------------------------- render, JSON

def test_render_svg_draws_lanes_bars_ticks_axis_and_legend(warp_specialized, tmp_path):
    path = tmp_path / "sub" / "trace.svg"
    text = T.render_svg(warp_specialized, path)
    assert path.read_text(encoding="utf-8") == text
    root = ET.fromstring(text.encode())
    assert root.tag == f"{SVG}svg"
    texts = [el.text or "" for el in root.iter(f"{SVG}text")]
    title = texts[0]
    assert title.startswith("stage12 tma_store_epilogue") and "\u00b5s" in title
    assert any("B=1 H=2 Lq=512 Lk=512 D=128 bhld" in t and "NVIDIA H200" in t for t in texts)
    for lane in ("producer (warpgroup 0)", "consumer 0 (warpgroup 1)", "consumer 1 (warpgroup 2)"):
        assert lane in texts
    for row in ("TMA issue", "waits", "QK\u1d40 (wgmma)", "softmax, epilogue", "PV (wgmma)"):
        assert row in texts
    assert "time since the first event (\u00b5s)" in texts
    for kind in T.KINDS:
        assert kind.label in texts                       # every kind occurs: all in the legend
    ivs = warp_specialized.intervals()
    bars = [r for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    assert len(bars) == sum(1 for i in ivs if i.kind != "tma")
    ticks = [ln for ln in root.iter(f"{SVG}line") if ln.find(f"{SVG}title") is not None]
    assert len(ticks) == sum(1 for i in ivs if i.kind == "tma")
    xs = [float(r.get("x")) + float(r.get("width")) for r in bars]
    assert min(float(r.get("x")) for r in bars) >= 250 - 1e-6 and max(xs) <= 1200 - 30 + 1
    assert T.render_svg(warp_specialized) == text        # deterministic, no timestamps


def test_render_svg_of_a_single_warpgroup_and_of_nothing(tmp_path):
    events = [T.Event(0, c, 0, C[n]) for c, n in
              [(0, "TMA_ISSUE"), (1, "KV_WAIT"), (50, "KV_READY"), (51, "QK_ISSUE"),
               (90, "QK_DONE"), (91, "SOFTMAX_BEGIN"), (200, "SOFTMAX_END")]]
    t = T.Trace(1, "baseline", 128, (1, 1, 64, 64, 128), "bhld", events)
    root = ET.fromstring(T.render_svg(t).encode())
    texts = [el.text for el in root.iter(f"{SVG}text")]
    assert "warpgroup 0: computes, thread 0 issues TMA" in texts
    assert "time since the first event (kcycles)" in texts      # no time base: cycles
    assert "PV (wgmma)" not in texts                             # rows without work are left out
    empty = T.Trace(1, "baseline", 128, (1, 1, 64, 64, 128), "bhld", [])
    assert "no events recorded" in T.render_svg(empty)


def test_json_round_trip(warp_specialized, tmp_path):
    path = warp_specialized.write_json(tmp_path / "t.json")
    data = json.loads(path.read_text())
    assert data["format"] == "ptxattn-trace/1" and data["label"] == "stage12"
    assert data["shape"] == {"batch": 1, "heads": 2, "seq_q": 512, "seq_k": 512, "head_dim": 128}
    assert data["roles"]["4"].startswith("consumer 0")
    assert data["events"][0] == {"warp": 0, "clock": 20, "globaltimer": 1_000_010, "code": 11,
                                 "event": "TMA_ISSUE"}
    assert len(data["intervals"]) == len(warp_specialized.intervals())
    assert all("start_us" in i for i in data["intervals"])
    back = T.Trace.read_json(path)
    assert back.events == warp_specialized.events and back.shape == warp_specialized.shape
    assert T.render_svg(back) == T.render_svg(warp_specialized)
    with pytest.raises(ValueError, match="ptxattn-trace/1"):
        T.Trace.from_dict({"format": "something else"})


# --------------------------------------------------------------------------- record (faked GPU)

def test_record_builds_the_traced_variant_and_zeroes_the_buffer(monkeypatch):
    """record() with the driver replaced: what it asks prepare() for, and the order of work."""
    from ptxattn import api
    from ptxattn.tools import bench

    log = []
    device = {}
    events = {0: producer_records(), 4: consumer_records(100), 8: consumer_records(700)}

    class Buf:
        def __init__(self, n):
            self.ptr, self.nbytes = 0xBEEF00, n
            device["mem"] = bytearray(b"\xab" * n)          # garbage until zeroed
            log.append(("alloc", n))

        def close(self):
            log.append("free")

    class Out:
        def to_numpy(self):
            return "out"

    class Prepared:
        stream = 7
        out = Out()

        def launch(self):
            log.append("launch")
            assert device["mem"] == bytes(len(device["mem"])), "launched on a dirty buffer"
            device["mem"][:] = buffer(events)

    def prepare(q, k, v, **kw):
        log.append(("prepare", kw["stage"].number, kw["defines"], kw["extra_params"]))
        return Prepared()

    def memset(ptr, value, count, stream=None):
        assert (ptr, value, count, stream) == (0xBEEF00, 0, T.BUFFER_BYTES, 7)
        device["mem"][:] = bytes(count)
        log.append("zero")

    def dtoh(dst, src, stream=None):
        assert src == 0xBEEF00 and stream == 7
        dst[...] = np.frombuffer(bytes(device["mem"]), np.uint8)
        log.append("copy")

    class Timer:
        def start(self, stream=None):
            log.append("start")

        def stop(self, stream=None):
            log.append("stop")

        def elapsed_ms(self):
            return 0.25

    monkeypatch.setattr(driver, "device_info", lambda: {"name": "Fake H200",
                                                        "clock_khz": 1_980_000})
    monkeypatch.setattr(driver, "DeviceBuffer", Buf)
    monkeypatch.setattr(driver, "memset_u8", memset)
    monkeypatch.setattr(driver, "memcpy_dtoh", dtoh)
    monkeypatch.setattr(driver, "EventPair", Timer)
    monkeypatch.setattr(api, "prepare", prepare)
    monkeypatch.setattr(bench, "check_output", lambda q, k, v, out, layout: {
        "rel_l2": 1e-3, "max_abs": 1e-2, "pass": out == "out" and layout == "bshd"})

    t = T.record(12, batch=1, heads=2, seq_len=512, layout="bshd")
    assert log == [("alloc", T.BUFFER_BYTES),
                   ("prepare", 12, {"PTXATTN_TRACE": "1"}, ((0xBEEF00, ctypes.c_void_p),)),
                   "zero", "launch", "zero", "start", "launch", "stop", "copy", "free"]
    assert t.label == "stage12" and t.threads == 384 and t.shape == (1, 2, 512, 512, 128)
    assert t.layout == "bshd" and t.gpu == "Fake H200" and t.kernel_ms == 0.25
    assert t.check["pass"] and t.truncated == ()
    assert t.warps() == [0, 4, 8]
    assert t.events == T.parse(buffer(events))


def test_record_of_the_production_kernel_at_d64_says_its_512_threads(monkeypatch):
    """The D = 64 production build runs three consumers (512 threads, warps 0, 4, 8 and 12
    record): the Trace says the CTA of the build that ran, not the unspecialized Stage's 384."""
    from ptxattn import api, stages
    from ptxattn.tools import bench

    events = {0: producer_records(), 4: consumer_records(100), 8: consumer_records(400),
              12: consumer_records(700)}
    seen = {}

    class Buf:
        ptr = 0xBEEF00

        def __init__(self, n):
            pass

        def close(self):
            pass

    class Prepared:
        stream = 7

        def __init__(self, stage):
            self.stage = stage

        def launch(self):
            pass

    def prepare(q, k, v, **kw):
        seen["head_dim"] = q.shape[-1]
        return Prepared(kw["stage"].specialize(q.shape[-1]))

    def dtoh(dst, src, stream=None):
        dst[...] = np.frombuffer(buffer(events), np.uint8)

    class Timer:
        def start(self, stream=None):
            pass

        stop = start

        def elapsed_ms(self):
            return 0.5

    monkeypatch.setattr(driver, "device_info",
                        lambda: {"name": "Fake H200", "clock_khz": 1_980_000})
    monkeypatch.setattr(driver, "DeviceBuffer", Buf)
    monkeypatch.setattr(driver, "memset_u8", lambda *a, **kw: None)
    monkeypatch.setattr(driver, "memcpy_dtoh", dtoh)
    monkeypatch.setattr(driver, "EventPair", Timer)
    monkeypatch.setattr(api, "prepare", prepare)
    monkeypatch.setattr(bench, "check_output", lambda *a: {"pass": True})

    t = T.record("production", batch=1, heads=2, seq_len=384, head_dim=64, check=False)
    assert seen["head_dim"] == 64 and t.shape[-1] == 64
    assert t.threads == stages.PRODUCTION.specialize(64).threads == 512
    assert t.warps() == list(T.traced_warps(t.threads)) == [0, 4, 8, 12]
    t128 = T.record("production", batch=1, heads=2, seq_len=256, head_dim=128, check=False)
    assert t128.threads == 384


def test_record_refuses_untraced_stages_and_bad_shapes_before_the_driver(no_driver, untraced):
    with pytest.raises(ValueError, match="no trace points"):
        T.record(untraced)
    with pytest.raises(ValueError, match="query length 100"):
        T.record(1, seq_len=100)


# --------------------------------------------------------------------------- CLI

def test_cli_names_the_traced_stages_for_an_untraced_one(no_driver, tmp_path, untraced):
    result = cli("trace", untraced.label, "--out", tmp_path / "t.svg")
    err = one_clean_error(result, untraced.label, "no trace points", "stage01 (baseline)")
    for s in TRACED:
        assert s.label in err
    assert not (tmp_path / "t.svg").exists()


def test_cli_without_gpu_says_so(monkeypatch, tmp_path):
    def fail():
        raise NoGpuError("ptxattn: no CUDA GPU available (test)")
    monkeypatch.setattr(driver, "device_info", fail)
    result = cli("trace", 1, "-b", 1, "-H", 2, "-L", 256, "--out", tmp_path / "t.svg")
    one_clean_error(result, "no CUDA GPU")


def test_cli_checks_the_shape_and_the_arguments(no_driver, tmp_path):
    one_clean_error(cli("trace", 1, "-L", 100, "--out", tmp_path / "t.svg"), "query length 100")
    one_clean_error(cli("trace", "--out", tmp_path / "t.svg"), "missing STAGE")
    assert cli("trace", 1).exit_code != 0                          # --out is required


def test_cli_draws_a_saved_trace_without_gpu(no_driver, warp_specialized, tmp_path):
    saved = warp_specialized.write_json(tmp_path / "in.json")
    result = cli("trace", "--from-json", saved, "--out", tmp_path / "t.svg",
                 "--json", tmp_path / "again.json")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "t.svg").read_text() == T.render_svg(warp_specialized)
    assert "consumer 0 (warpgroup 1)" in result.output and "span" in result.output
    assert json.loads((tmp_path / "again.json").read_text())["events"] == \
        json.loads(saved.read_text())["events"]
    # a STAGE picks from the file; one that is not in it is named, with what the file has
    assert cli("trace", 12, "--from-json", saved, "--out", tmp_path / "u.svg").exit_code == 0
    one_clean_error(cli("trace", 5, "--from-json", saved, "--out", tmp_path / "t.svg"),
                    "no trace of stage05", "stage12")
    one_clean_error(cli("trace", "--from-json", saved, "-L", 512, "--out", tmp_path / "t.svg"),
                    "give no shape")


def retimed(trace, number, name, stretch):
    """The same events as another stage, `stretch` times slower (a second stage to compare)."""
    events = [T.Event(e.warp, int(e.clock * stretch), int(e.globaltimer * stretch), e.code)
              for e in trace.events]
    return T.Trace(number, name, trace.threads, trace.shape, trace.layout, events,
                   gpu=trace.gpu, kernel_ms=trace.kernel_ms)


def test_collection_round_trip_keeps_every_trace_and_the_failures(warp_specialized, tmp_path):
    slow = retimed(warp_specialized, 7, "compute_pipeline", 2.0)
    col = T.Collection({12: warp_specialized, 7: slow}, {3: "CudaError: boom"},
                       {"shape": "1x2x512x128"})
    path = col.write_json(tmp_path / "all.json")
    text = path.read_text()
    assert len(text.splitlines()) == 4                 # head, one line per trace, end
    back = T.Collection.read_json(path)
    assert sorted(back.traces) == [7, 12] and back.errors == {3: "CudaError: boom"}
    assert back.meta["shape"] == "1x2x512x128"
    assert back.get(12).events == warp_specialized.events
    assert back.get("compute_pipeline").span_cycles == slow.span_cycles
    with pytest.raises(ValueError, match=r"no trace of stage03.*it failed: CudaError: boom"):
        back.get(3)
    # a single-trace file reads as a collection of one
    one = T.Collection.read_json(warp_specialized.write_json(tmp_path / "one.json"))
    assert list(one.traces) == [12]
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="ptxattn-traces/1"):
        T.Collection.read_json(tmp_path / "bad.json")


def test_record_all_keeps_going_past_a_failing_stage(monkeypatch, warp_specialized):
    def fake(stage, **shape):
        st = stages.get_stage(stage)
        assert shape == {"batch": 1, "heads": 2}
        if st.number == 2:
            raise RuntimeError("JIT failed\nlong log")
        return retimed(warp_specialized, st.number, st.name, 1.0)
    monkeypatch.setattr(T, "record", fake)
    said = []
    col = T.record_all([1, 2, 3], progress=said.append, batch=1, heads=2)
    assert sorted(col.traces) == [1, 3] and col.errors == {2: "RuntimeError: JIT failed"}
    assert len(said) == 3 and "stage02: FAILED" in said[1]
    assert col.meta["shape_args"] == {"batch": 1, "heads": 2}


def test_compare_draws_two_stages_on_one_axis(warp_specialized, tmp_path):
    slow = retimed(warp_specialized, 7, "compute_pipeline", 2.0)
    svg = T.render_compare_svg([slow, warp_specialized], tmp_path / "c.svg")
    root = ET.fromstring(svg.encode())
    texts = [t.text or "" for t in root.iter(f"{SVG}text")]
    assert any(t.startswith("stage07 compute_pipeline") for t in texts)
    assert any(t.startswith("stage12 tma_store_epilogue") for t in texts)
    assert any(t.startswith("stage07: consumer 0") for t in texts)
    assert any(t.startswith("stage12: producer") for t in texts)
    # one axis: its last tick covers the longer trace, and the shorter one's bars end halfway
    bars = [r for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    right = max(float(r.get("x")) + float(r.get("width")) for r in bars)
    assert right == pytest.approx(1200 - 30, abs=1.0)
    half = [float(r.get("x")) + float(r.get("width")) for r in bars
            if r.find(f"{SVG}title").text.startswith("epilogue")]
    # epilogue ends: stage 12's two consumers, then stage 07's; stage 12's last event is the
    # end of its second consumer's epilogue
    assert len(half) == 4
    assert sorted(half)[1] == pytest.approx(250 + (1200 - 30 - 250) / 2, abs=1.0)
    with pytest.raises(ValueError, match="at least two"):
        T.render_compare_svg([slow])
    other = T.Trace(7, "x", 384, (1, 2, 1024, 1024, 128), "bhld", slow.events)
    with pytest.raises(ValueError, match="same shape"):
        T.render_compare_svg([other, warp_specialized])


def test_cli_compares_two_saved_stages(no_driver, warp_specialized, tmp_path):
    slow = retimed(warp_specialized, 7, "compute_pipeline", 2.0)
    saved = T.Collection({12: warp_specialized, 7: slow}).write_json(tmp_path / "all.json")
    result = cli("trace", 7, 12, "--from-json", saved, "--out", tmp_path / "c.svg")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "c.svg").read_text() == T.render_compare_svg([slow, warp_specialized])
    result = cli("trace", 12, "--compare", "--from-json", saved, "--out", tmp_path / "c.svg")
    one_clean_error(result, "--compare needs two")
    one_clean_error(cli("trace", "--from-json", saved, "--out", tmp_path / "c.svg"),
                    "several traces", "stage07, stage12")
    one_clean_error(cli("trace", 1, 2, 3, "--out", tmp_path / "c.svg"), "two to compare")

"""bench/experiments/variants.py on the pretend GPU (tests/fake_gpu.py): its bookkeeping, not
its timing (the lead runs it on the H200 through bench/device_run.sh's VARIANTS hook); and
ncu_bind.py's --profile mode on canned ncu output."""

from __future__ import annotations

import importlib.util
import json
import types
from pathlib import Path

import pytest

import fake_gpu
from ptxattn import driver, stages
from ptxattn.tools import bench

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "experiments" / "variants.py"


@pytest.fixture
def variants(monkeypatch):
    """The script on the pretend GPU: stage 14 takes 2 ms, production 1 ms; stage 1's output is
    wrong. Its prepare() resolves kernel names and drops build defines (the fake has none)."""
    fake_gpu.install(monkeypatch, {14: 2.0, 0: 1.0, 1: 1.0, (0, "causal"): 1.0}, wrong={1})
    spec = importlib.util.spec_from_file_location("experiments_variants", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from ptxattn import api
    fake_prepare = api.prepare

    def prepare(q, k, v, *, stage, defines=None, walk_rule="l2-walk", **kwargs):
        module.prepared_extras.append((defines, walk_rule))
        return fake_prepare(q, k, v, stage=stages.get_stage(stage), **kwargs)
    module.prepared_extras = []

    monkeypatch.setattr(module, "prepare", prepare)
    monkeypatch.setattr(driver, "context", lambda: type("Ctx", (), {"name": "Fake GPU"})())
    monkeypatch.setattr(bench, "source_id", lambda: "test")
    return module


def run(module, tmp_path, *argv):
    out = tmp_path / "v.jsonl"
    rc = module.main([*argv, "--rounds", "2", "--reps", "2", "--out", str(out)])
    return rc, json.loads(out.read_text().splitlines()[-1])


def test_causal_flops_are_credited_as_ptxattn_bench_credits_them(variants, tmp_path):
    """A causal Lq != Lk shape: bench halves the dense FLOPs (the convention); the script
    used the exact pair count, 1.875x more here, so its TFLOP/s were not bench's."""
    rc, result = run(variants, tmp_path, "a=production", "--shape", "1x2x128x512x64", "--causal")
    assert rc == 0
    case = bench.Case(name="x", batch=1, heads=2, seq_q=128, seq_k=512, head_dim=64,
                      causal=True)
    assert result["variants"]["a"]["tflops"] == pytest.approx(case.flops / 1.0 / 1e9)
    assert result["flops"] == case.flops == 4 * 2 * 128 * 512 * 64 // 2
    assert "halved" in result["flops_rule"]


def test_window_flops_are_the_exact_pairs(variants, tmp_path):
    rc, result = run(variants, tmp_path, "a=production", "--shape", "1x1x256x64",
                     "--window", "16,0")
    assert rc == 0
    assert result["flops"] == 4 * 64 * bench.unmasked_pairs(256, 256, window=(16, 0))
    assert result["mask"] == {"causal": False, "window": [16, 0]}


def test_every_variant_failing_is_reported_not_a_crash(variants, tmp_path, capsys):
    rc, result = run(variants, tmp_path, "bad=stage1", "--shape", "1x1x128x128")
    assert rc == 1
    assert list(result["failed"]) == ["bad"] and result["variants"] == {}
    assert "every variant failed" in capsys.readouterr().out


def test_ratios_are_against_the_first_variant(variants, tmp_path):
    rc, result = run(variants, tmp_path, "base=stage14", "prod=production",
                     "--shape", "1x1x256x128")
    assert rc == 0
    assert result["variants"]["prod"]["ratio_to_first"] == pytest.approx(2.0)


@pytest.mark.parametrize("argv, message", [
    (["a=production", "a=stage14"], "each LABEL once"),
    (["a=production:PTXATTN_X"], "expected LABEL=KERNEL"),
    (["a=production", "--window", "3"], "--window '3': expected LEFT,RIGHT"),
    (["a=production:PTXATTN_L2_WALK=1"], "PTXATTN_L2_WALK is no build knob any more"),
    (["a=production:PTXATTN_HEAD_MAJOR=1"], "PTXATTN_HEAD_MAJOR is no build knob any more"),
    (["a=production:walk=snake"], "walk=snake: walk_rule: expected one of today, head-major, "
                                   "l2-walk, l2-band or section:N"),
    (["a=production:walk=section:0"], "walk=section:0: walk_rule: expected"),
])
def test_bad_arguments_are_named(variants, argv, message):
    with pytest.raises(SystemExit, match=message):
        variants.main([*argv, "--shape", "1x1x128x128"])


def test_gqa_flops_and_the_walk_rule(variants, tmp_path):
    """--heads-kv: K/V with fewer heads, FLOPs as bench credits a GQA case (by query heads);
    each variant's walk=RULE reaches prepare() as its walk_rule (the host's l2-walk by
    default), not as a define, and the result says which walk each variant ran."""
    rc, result = run(variants, tmp_path, "a=production", "b=production:walk=today",
                     "c=production:SW_EXP2_PER_8=1,walk=head-major", "--shape", "1x4x256x128",
                     "--heads-kv", "2", "--causal")
    assert rc == 0 and result["heads_kv"] == 2
    assert result["flops"] == 4 * 4 * 256 * 256 * 128 // 2
    assert variants.prepared_extras == [(None, "l2-walk"), (None, "today"),
                                        ({"SW_EXP2_PER_8": "1"}, "head-major")]
    assert [result["variants"][x]["walk"] for x in "abc"] == ["l2-walk", "today", "head-major"]
    with pytest.raises(SystemExit, match="--heads-kv 3"):
        variants.main(["a=production", "--shape", "1x4x256x128", "--heads-kv", "3"])


def test_sustained_windows_per_variant(variants, tmp_path, monkeypatch):
    """--sustained: every variant gets a window (here on a pretend clock and sampler, with the
    burst median as its launch time) and its sustained speed in % of the first's."""
    from ptxattn.tools import sustained
    from test_sustained import FakeEvents, FakeSampler, Timeline
    tl = {"x": Timeline(ms=1.0, enqueue_ms=0.5)}
    monkeypatch.setattr(sustained, "make_sampler",
                        lambda *a, **k: FakeSampler(lambda: tl["x"].host))
    monkeypatch.setattr(sustained, "pci_bus_id", lambda: None)
    monkeypatch.setattr(sustained, "Events", lambda stream: FakeEvents(tl["x"]))
    monkeypatch.setattr(sustained, "_now", lambda: tl["x"].host)
    monkeypatch.setattr(sustained, "_sleep", lambda dt: setattr(tl["x"], "host",
                                                                tl["x"].host + dt))
    orig = sustained.measure

    def measure(launch, events, sampler, cfg, **kw):
        # the pretend GPU's launches (each real one would compute the reference on the CPU)
        return orig(tl["x"].launch, events, sampler, cfg, **kw)
    monkeypatch.setattr(sustained, "measure", measure)
    rc, result = run(variants, tmp_path, "base=stage14", "prod=production", "--shape",
                     "1x1x128x128", "--sustained", "--sustained-seconds", "0.05",
                     "--cooldown", "0")
    assert rc == 0
    for lab in ("base", "prod"):
        s = result["variants"][lab]["sustained"]
        assert s["tflops"] > 0 and s["sm_mhz_median"] == 1400.0, s
    assert result["variants"]["base"]["sustained"]["pct_of_first"] == pytest.approx(100.0)


# ---- bench/experiments/ncu_bind.py --profile ------------------------------------------------

NCU_SCRIPT = SCRIPT.parent / "ncu_bind.py"

RAW = '''==PROF== Connected to process 1408 (/usr/bin/python3.12)
production 2x16x16384x128 causal=True: {'rel_l2': 0.0023}
==PROF== Disconnected from process 1408
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","lts__t_sector_hit_rate.pct","sm__cycles_elapsed.avg.per_second","sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active","smsp__issue_active.avg.pct_of_peak_sustained_active","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum"
"","","","","","","","%","hertz","%","%","byte","byte","nsecond"
"0","1408","python3.12","127.0.0.1","ptxattn_fwd","1","7","42.10","1,450,000,000","85.3","33.4","10,240,000,000","268,435,456","3,350,000"
'''


@pytest.fixture
def ncu_bind():
    spec = importlib.util.spec_from_file_location("experiments_ncu_bind", NCU_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ncu_raw_csv_gives_the_figures(ncu_bind):
    (launch,) = ncu_bind.parse_raw_csv(RAW)
    f = ncu_bind.figures(launch)
    assert f["l2_hit_pct"] == 42.1 and f["sm_mhz"] == 1450.0
    assert f["tensor_pipe_pct"] == 85.3                 # the Shared pipe (no gmma metric here)
    assert f["source"]["tensor_pipe_pct"].startswith("sm__pipe_shared")
    assert f["issue_active_pct"] == 33.4 and f["dram_read_bytes"] == 10.24e9
    assert f["duration_ns"] == 3.35e6 and f["instructions"] is None
    assert ncu_bind.parse_raw_csv("no csv here\n") == []
    text = ncu_bind.format_table([{"kernel": "production", "clocks": "natural", **f}])
    assert "42.1" in text and "1450" in text and "10.24" in text


def test_ncu_commands_and_unknown_metrics(ncu_bind):
    known = {m.split(".")[0] for m in ncu_bind.METRICS} - {"sm__pipe_tensor_op_gmma_cycles_active"}
    keep, unknown = ncu_bind.wanted_metrics(known)
    assert unknown == ["sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"]
    cmd = ncu_bind.ncu_command("ncu", "natural", keep, ["production", "--causal"], "production")
    assert cmd[:3] == ["ncu", "--clock-control", "none"] and "-k" in cmd
    assert cmd[-2:] == ["production", "--causal"]
    locked = ncu_bind.ncu_command("ncu", "locked", keep, ["cudnn"], "cudnn")
    assert locked[2] == "base" and "--nvtx-include" in locked and "-k" not in locked


def test_ncu_profile_runs_both_clocks_and_writes_json(ncu_bind, tmp_path, capsys):
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        if cmd[1] == "--query-metrics":
            names = "\n".join(m.split(".")[0] + " Counter x" for m in ncu_bind.METRICS)
            return types.SimpleNamespace(returncode=0, stdout=names, stderr="")
        return types.SimpleNamespace(returncode=0, stdout=RAW, stderr="")
    args = ncu_bind.argparse.Namespace(kernel="production", shape="2x16x16384x128", causal=True,
                                       heads_kv=0, define=[], walk="l2-walk",
                                       layout="bshd", window="256,0",
                                       clocks="natural,locked",
                                       out=str(tmp_path / "n.jsonl"), timeout=10)
    rc = ncu_bind.profile(args, ["production"], run=run, which=lambda name: "/usr/bin/ncu")
    assert rc == 0 and [c[2] for c in calls[1:]] == ["none", "base"]
    entry = json.loads((tmp_path / "n.jsonl").read_text())
    assert [r["clocks"] for r in entry["rows"]] == ["natural", "locked"]
    assert entry["rows"][0]["l2_hit_pct"] == 42.1 and entry["unknown_metrics"] == []
    assert (entry["layout"], entry["window"]) == ("bshd", "256,0")
    assert "L2 hit %" in capsys.readouterr().out
    def failing(cmd, **kw):
        return types.SimpleNamespace(returncode=1, stdout="", stderr="boom")
    assert ncu_bind.profile(args, ["production"], run=failing, which=lambda n: "ncu") == 1
    # an ncu that refuses the full metric list: the run is retried with the safe ones
    retried = []

    def picky(cmd, **kw):
        retried.append(cmd)
        if cmd[1] == "--query-metrics":
            return types.SimpleNamespace(returncode=1, stdout="", stderr="")
        full = ",".join(ncu_bind.METRICS) in cmd
        return types.SimpleNamespace(returncode=1 if full else 0, stdout="" if full else RAW,
                                     stderr="unknown metric" if full else "")
    assert ncu_bind.profile(args, ["production"], run=picky, which=lambda n: "ncu") == 0
    assert len(retried) == 5                       # query, then per clock: full list, safe list
    with pytest.raises(SystemExit, match="ncu"):
        ncu_bind.profile(args, [], run=run, which=lambda n: None)


def test_ncu_target_argv_carries_layout_and_window(ncu_bind, monkeypatch):
    seen = {}
    monkeypatch.setattr(ncu_bind, "profile", lambda args, argv: seen.setdefault("argv", argv) and 0)
    ncu_bind.main(["production", "--shape", "1x12x32760x128", "--layout", "bshd",
                   "--window", "1024,0", "--profile"])
    argv = seen["argv"]
    assert argv[argv.index("--layout") + 1] == "bshd" and argv[argv.index("--window") + 1] == "1024,0"
    assert ncu_bind._window("1024,0") == (1024, 0) and ncu_bind._window(None) is None
    with pytest.raises(SystemExit, match="BHLD without a window"):
        ncu_bind.target(ncu_bind.arg_parser().parse_args(
            ["cudnn", "--shape", "1x1x128x128", "--layout", "bshd"]))


def test_cudnn_variant_needs_torch_and_no_window(variants):
    with pytest.raises(SystemExit, match="needs PyTorch"):
        variants.main(["a=production", "c=cudnn", "--shape", "1x1x128x128"])


@pytest.mark.gpu
def test_variants_with_cudnn_and_sustained_on_the_gpu(tmp_path):
    """The device plan's form, small: the default walk, the walk that was the default
    (walk=today) and cuDNN, burst rounds then a short sustained window each (~6 s of device
    time). Every variant passes its check and gets sustained figures."""
    spec = importlib.util.spec_from_file_location("experiments_variants_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "v.jsonl"
    rc = module.main(["a=production", "w=production:walk=today", "c=cudnn", "--shape",
                      "1x4x2048x128", "--causal", "--rounds", "2", "--reps", "2", "--sustained",
                      "--sustained-seconds", "0.5", "--cooldown", "0.2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and not result["failed"], result["failed"]
    for lab in ("a", "w", "c"):
        s = result["variants"][lab]["sustained"]
        assert s.get("tflops"), (lab, s)


def test_the_issue_23_plans_parse(variants, ncu_bind):
    """Every line of the device plans is a valid command of its script (a typo would cost a
    device run)."""
    import shlex
    plans = SCRIPT.parent
    lines = [x for x in (plans / "2026-12-02-sustained-walk.txt").read_text().splitlines()
             if x.strip() and not x.startswith("#")]
    assert len(lines) == 7
    for line in lines:
        args = variants.arg_parser().parse_args(shlex.split(line))
        assert args.sustained and args.rounds >= 10
        labels = [variants.parse_variant(v)[0] for v in args.variants]
        assert labels[0] == "def" and "walk" in labels and "cudnn" in labels
    lines = [x for x in (plans / "2026-12-02-ncu-l2.txt").read_text().splitlines()
             if x.strip() and not x.startswith("#")]
    for line in lines:
        ncu_bind.arg_parser().parse_args(["--profile", *shlex.split(line)])


def test_the_session_10_walk_plans_parse(variants, ncu_bind):
    """The band walk's device plan: every ncu line parses with its walk rule, and the device
    script's variants.py calls name valid walk rules (l2-band, section:N)."""
    import re
    import shlex
    plans = SCRIPT.parent
    lines = [x for x in (plans / "2026-12-02-ncu-l2-walk-s10.txt").read_text().splitlines()
             if x.strip() and not x.startswith("#")]
    walks = [ncu_bind.arg_parser().parse_args(["--profile", *shlex.split(x)]).walk
             for x in lines]
    assert walks == ["l2-walk", "l2-band", "section:30", "l2-walk", "section:12"]
    script = (plans.parent / "device" / "session10_walk.sh").read_text()
    calls = re.findall(r"variants\.py (.*?)>>", script.replace("\\\n", " "), re.S)
    assert len(calls) == 2
    for call in calls:
        args = variants.arg_parser().parse_args(shlex.split(call.replace('"$OUT', '"/tmp')))
        assert args.sustained
        rules = [variants.parse_variant(v)[3] for v in args.variants]
        assert rules[0] in ("l2-walk", "l2-band") and len(set(rules)) == len(rules)


# ---- bench/experiments/ncu_paged.py --profile (issue 25: paged decode at small pages) ----------

NCU_PAGED = SCRIPT.parent / "ncu_paged.py"
_PAGED_HEAD = ('"ID","Kernel Name","gpu__time_duration.sum","sm__cycles_elapsed.avg.per_second",'
               '"dram__bytes_read.sum","dram__throughput.avg.pct_of_peak_sustained_elapsed",'
               '"lts__t_sector_hit_rate.pct","smsp__pcsamp_warps_issue_stalled_long_scoreboard",'
               '"smsp__pcsamp_warps_issue_stalled_barrier"')
PAGED_RAW = "\n".join([
    "==PROF== Connected to process 7", "contiguous: max |paged - contiguous| 0",
    "page16:today: max |paged - contiguous| 0", _PAGED_HEAD,
    '"","","nsecond","hertz","byte","%","%","",""',
    '"0","ptxattn_decode","500,000","1,700,000,000","2,147,483,648","90.1","20.0","10","5"',
    '"1","ptxattn_decode","735,000","1,710,000,000","2,147,483,648","61.0","21.0","400","9"',
    '"2","ptxattn_decode","520,000","1,700,000,000","2,147,483,648","87.0","20.5","30","6"',
    ""])
PAGED_SOURCE = "\n".join([
    '"Address","Source","Warp Stall Sampling (All Samples)","stall_long_sb",'
    '"Instructions Executed"',
    '"0x10","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ","500","0","64"',
    '"0x20","EXIT","0","0","1"',
    '"0x30","LDG.E.CONSTANT R4, desc[UR58][R4.64]","40","38","8"',
    '"0x40","R2UR UR8, R4","90","80","8"',
    '"0x50","UTMALDG.5D [UR8], [UR4]","60","0","16"',
    '"0x60","@P0 BRA.U.ANY `(.L_x_47)","20","0","16"',
    '"0x70","EXIT","0","0","1"',
    '"0x80","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R4","300","0","4"', ""])


@pytest.fixture
def ncu_paged():
    spec = importlib.util.spec_from_file_location("experiments_ncu_paged", NCU_PAGED)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ncu_paged_reads_three_launches_and_the_producer(ncu_paged):
    launches = ncu_paged.ncu_bind.parse_raw_csv(PAGED_RAW)
    rows = [ncu_paged.figures(x) for x in launches]
    assert [round(r["ms"], 3) for r in rows] == [0.5, 0.735, 0.52]
    assert round(rows[1]["dram_read_gbs"]) == round(2.147483648 / 0.735e-3)
    assert rows[1]["stalls_top"][0] == ("long_scoreboard", 400.0)
    assert rows[0]["tma_read_gb"] is None              # not collected: shown as "-"
    text = ncu_paged.format_rows([{"launch": "contiguous", "clocks": "natural", **rows[0]}])
    assert "90.1" in text and "long_scoreboard 10" in text
    head, srows = ncu_paged.source_table(PAGED_SOURCE)
    s = ncu_paged.producer_summary(head, srows)
    # the producer: from the consumer's EXIT before the first UTMALDG to the next EXIT
    assert s["producer_instructions"] == 5 and s["producer_samples"] == 210
    assert s["kernel_samples"] == 1010
    assert s["by_opcode"]["R2UR"] == 90 and s["by_opcode"]["BRA"] == 20
    assert s["by_reason"] == {"stall_long_sb": 118.0}
    assert s["producer_executed"] == 49 and s["executed_by_opcode"]["UTMALDG"] == 16
    assert s["top"][0][1].startswith("R2UR")
    assert "error" in ncu_paged.producer_summary(["Address", "Source"], srows)


def test_ncu_paged_profile_runs_each_clock_and_the_source_pages(ncu_paged, tmp_path, capsys):
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        if cmd[1] == "--query-metrics":
            return types.SimpleNamespace(returncode=1, stdout="", stderr="")
        if "-i" in cmd:
            return types.SimpleNamespace(returncode=0, stdout=PAGED_SOURCE, stderr="")
        if "-o" in cmd:
            return types.SimpleNamespace(returncode=0, stdout="", stderr="")
        return types.SimpleNamespace(returncode=0, stdout=PAGED_RAW, stderr="")
    out = tmp_path / "p.jsonl"
    args = ncu_paged.arg_parser().parse_args(["--profile", "--out", str(out)])
    assert ncu_paged.profile(args, run=run, which=lambda n: "/usr/bin/ncu") == 0
    profiled = [c for c in calls if "--csv" in c and "raw" in c]
    assert [c[2] for c in profiled] == ["none", "base"]
    assert all("--launch-count" in c and c[c.index("--launch-count") + 1] == "3"
               for c in profiled)
    skips = [c[c.index("--launch-skip") + 1] for c in calls if "-o" in c]
    assert skips == ["1", "2"]                          # today's launch, then the variant's
    entry = json.loads(out.read_text())
    assert [r["launch"] for r in entry["rows"]][:3] == [
        "contiguous", "page16:today", "page16:rowgroup_warp_ahead"]
    assert entry["producer"]["page16:today"]["producer_samples"] == 210
    printed = capsys.readouterr().out
    assert "by opcode" in printed and "DRAM GB/s" in printed

    def short(cmd, **kw):                               # two launches instead of three
        if cmd[1] == "--query-metrics":
            return types.SimpleNamespace(returncode=1, stdout="", stderr="")
        return types.SimpleNamespace(returncode=0, stdout="\n".join(
            PAGED_RAW.splitlines()[:-2]), stderr="")
    args = ncu_paged.arg_parser().parse_args(["--profile", "--no-source", "--clocks",
                                              "natural"])
    assert ncu_paged.profile(args, run=short, which=lambda n: "ncu") == 1
    with pytest.raises(SystemExit, match="ncu"):
        ncu_paged.profile(args, run=short, which=lambda n: None)
    with pytest.raises(SystemExit, match="--variant"):
        ncu_paged.main(["--variant", "fastest"])


# ---- session 12's bf16 d256n80 plan and device script ------------------------------------------

N80_PLAN = SCRIPT.parent / "2026-12-04-session12-n80.txt"


def test_the_n80_plan_times_the_variant_beside_the_default_and_cudnn(variants):
    """Each line of the plan parses as variants.py's arguments: base (today's D = 256 row), n80
    (-D BF16_BLOCK_N=80: builds.BF16_VARIANTS' d256n80) and cuDNN at D = 256, dense; the first
    line also sustained."""
    from ptxattn import builds
    lines = [x.split() for x in N80_PLAN.read_text().splitlines() if x and not x.startswith("#")]
    assert lines and "--sustained" in lines[0]
    for argv in lines:
        args = variants.arg_parser().parse_args(argv)
        parsed = {label: (kernel, defines) for label, kernel, defines, _ in
                  map(variants.parse_variant, args.variants)}
        assert parsed == {"base": ("production", {}),
                          "n80": ("production", builds.bf16_variant_defines("d256n80")),
                          "cudnn": ("cudnn", {})}
        assert args.shape.endswith("x256") and not args.causal and args.window is None
    assert lines[0][lines[0].index("--shape") + 1] == "2x8x16384x256"


def test_the_n80_device_script_runs_the_gpu_tests_and_the_plan(tmp_path):
    from bench_modules import run_with_stub_python
    proc, calls = run_with_stub_python("bench/device/session12_n80.sh", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert any("pytest" in c and "tests/test_gpu_bf16_variants.py" in c for c in calls)
    runs = [c for c in calls if "bench/experiments/variants.py" in c]
    plan = [x for x in N80_PLAN.read_text().splitlines() if x and not x.startswith("#")]
    assert len(runs) == len(plan) and all("n80=production:BF16_BLOCK_N=80" in c for c in runs)

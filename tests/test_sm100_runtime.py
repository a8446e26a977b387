"""The Blackwell (sm_100a) lineage's runtime and tooling, on the CPU (issue 15, parts 2-4).

No B200 is lent to this project, so the device is faked: a context of compute capability 10.0
(test_prepare's recorded driver calls) for the dispatch and the launch, and tests/fake_gpu.py
(a "launch" writes the NumPy reference, or something wrong) for the self-check's figures. The
sm100 rows are made here and patched into stages.SM100_STAGES, so these tests do not
depend on the PTX stages that another branch writes.
"""

from __future__ import annotations

import dataclasses

import fake_gpu
import numpy as np
import pytest
from cli_helpers import cli, one_clean_error
from test_prepare import dev, gpu, launched, maps     # noqa: F401 - gpu is a fixture

from ptxattn import api as attn
from ptxattn import choice, driver, selfcheck, stages, stages_sm100
from ptxattn.launch import PERSISTENT_CTAS_ENV
from ptxattn.tools import sass
from ptxattn.selfcheck import SelfCheckError

H100, B200 = (9, 0), (10, 0)
D = 128


def fake_ptx(tmp_path, name: str) -> str:
    """A PTX file for a made-up stage (its JIT is faked; `ptxattn ptx` shows its text)."""
    path = tmp_path / f"{name}.ptx"
    path.write_text(f"// a made-up sm_100a stage for tests\n.version 8.8\n.target sm_100a\n"
                    f".address_size 64\n.visible .entry made_up_{name[3:]}()\n{{\n    ret;\n}}\n")
    return str(path)


@pytest.fixture
def sm100(tmp_path, monkeypatch):
    """Two made-up Blackwell stages in the registry: 1 takes 128-row tiles, 14 (persistent,
    two Q tiles) multiples of 256 query rows, so a shape can be taken by one and not the other.
    Every self-check verdict of earlier tests is forgotten."""
    one = stages.Stage(number=1, name="baseline", idea="made-up sm100 stage one",
                       arch=stages.BLACKWELL, file=fake_ptx(tmp_path, "01_baseline"),
                       threads=128, block_m=128, block_n=128, smem_bytes=100_000,
                       swizzle=stages.SWIZZLE_128B)
    last = stages.Stage(number=14, name="persistent", idea="made-up sm100 stage fourteen",
                        arch=stages.BLACKWELL, file=fake_ptx(tmp_path, "14_persistent"),
                        threads=384, block_m=256, block_n=128, smem_bytes=200_000,
                        swizzle=stages.SWIZZLE_128B, persistent=True)
    monkeypatch.setattr(stages, "SM100_STAGES", (one, last))
    monkeypatch.setattr(selfcheck, "_RESULTS", {})
    monkeypatch.setattr(selfcheck, "_METRICS", {})
    return one, last


def passing(stage, seed=None):
    b, h, seq, d = selfcheck.shape(stage)
    return {"rel_l2": 2.3e-3, "max_abs": 1e-3, "ref_max_abs": 1.0, "nan_count": 0,
            "pass": True, "seed": 7, "shape": (b, h, seq, d)}


def failing(stage, seed=None):
    return {**passing(stage), "rel_l2": 0.1, "max_abs": 0.5, "pass": False}


# --------------------------------------------------------------------------- registry

def test_plain_keys_stay_hoppers_and_the_arch_picks_the_other_lineage(sm100):
    one, last = sm100
    assert stages.get_stage(1) is stages.STAGES[0] and stages.get_stage(1).label == "stage01"
    assert stages.all_stages() is stages.STAGES and stages.all_kernels()[0] is stages.PRODUCTION
    for key in (1, "01", "stage1", "baseline", "01_baseline"):
        assert stages.get_stage(key, arch="sm_100a") is one, key
    for key in ("sm100_stage14", "sm100:14", "sm_100a/persistent", "SM100_Stage14"):
        assert stages.get_stage(key) is last, key
    assert stages.get_stage("sm90_stage14") is stages.get_stage(14)
    assert last.label == "sm100_stage14" and last.title == "sm100_stage14 (persistent)"
    assert stages.get_stage(last.label) is last                       # labels read back
    assert stages.get_stage(last, arch="blackwell") is last
    assert stages.all_stages("sm_100a") == (one, last) == stages.all_kernels("sm100")


def test_lineage_lookups_refuse_what_does_not_exist(sm100):
    with pytest.raises(ValueError, match=r"^arch: expected sm_90a .* or sm_100a .*'sm_89'"):
        stages.get_stage(1, arch="sm_89")
    with pytest.raises(ValueError, match="no production kernel for sm_100a"):
        stages.get_stage("production", arch="sm_100a")
    with pytest.raises(ValueError, match=r"unknown sm_100a stage 5;.*sm100_stage01 \(baseline\)"
                                         r" to sm100_stage14 \(persistent\)"):
        stages.get_stage(5, arch="sm_100a")
    with pytest.raises(ValueError, match="names a sm_90a stage, but arch sm_100a"):
        stages.get_stage("sm90_stage01", arch="sm_100a")
    with pytest.raises(ValueError, match="stage01 .* is a sm_90a kernel, not sm_100a"):
        stages.get_stage(stages.STAGES[0], arch="sm_100a")


def test_an_empty_blackwell_registry_says_so(monkeypatch):
    monkeypatch.setattr(stages, "SM100_STAGES", ())
    with pytest.raises(ValueError, match="no sm_100a stage is registered yet"):
        stages.get_stage(1, arch="sm_100a")


def test_blackwell_speed_order_is_by_falling_number_unless_predicted(sm100, monkeypatch):
    one, last = sm100
    assert stages.by_speed("sm_100a") == (last, one)
    assert stages.by_speed() == stages.by_speed("sm_90a")          # Hopper's: unchanged
    assert [s.number for s in stages.by_speed()][:1] == [stages.FASTEST_FIRST[0]]
    monkeypatch.setattr(stages_sm100, "FASTEST_FIRST", (1, 14), raising=False)
    assert stages.by_speed("sm_100a") == (one, last)


def test_compute_capability_names_a_lineage():
    assert stages.lineage_for(H100) == "sm_90a" and stages.lineage_for(B200) == "sm_100a"
    # sm_100a code runs on 10.0 only (arch-specific features are not forward compatible)
    assert stages.lineage_for((10, 3)) is None and stages.lineage_for((8, 0)) is None
    assert choice.arch_ok("sm_100a", B200) and not choice.arch_ok("sm_100a", (10, 3))
    assert not choice.arch_ok("sm_100a", H100) and not choice.arch_ok("sm_90a", B200)


# --------------------------------------------------------------------------- dispatch

def test_the_dispatch_picks_by_the_devices_lineage(sm100):
    one, last = sm100
    assert choice.pick_stage(None, D, 512, 512, H100) is stages.PRODUCTION
    assert choice.pick_stage(None, D, 512, 512, B200) is last           # the fastest that takes it
    assert choice.pick_stage(None, D, 128, 512, B200) is one           # 128 rows: not 14's tiles
    assert choice.pick_stage(None, D, 512, 512, None) is stages.PRODUCTION   # device unknown yet


@pytest.mark.parametrize("what, kwargs, shape", [
    ("GQA", dict(gqa=True), (512, 512)),
    ("LSE", dict(lse=True), (512, 512)),
    ("masks", dict(masked=True), (512, 512)),
    ("a tail", {}, (500, 512)),
])
def test_shapes_that_need_a_production_kernel_say_there_is_none_on_sm100(sm100, what, kwargs,
                                                                         shape):
    with pytest.raises(ValueError, match="no production kernel for sm_100a") as info:
        choice.pick_stage(None, D, *shape, B200, **kwargs)
    assert "no registered stage takes this shape" in str(info.value), what
    # the same call on Hopper goes to the production kernel
    assert choice.pick_stage(None, D, *shape, H100, **kwargs) is stages.PRODUCTION


def test_a_stage_of_the_other_lineage_is_refused_clearly(sm100):
    one, last = sm100
    with pytest.raises(ValueError, match=r"stage: stage01 \(baseline\) is built for sm_90a, "
                                         r"which this GPU \(compute capability 10.0\) cannot run"
                       ) as info:
        choice.pick_stage(1, D, 512, 512, B200)
    assert "sm100_stage01" in str(info.value) and "arch='sm_100a'" in str(info.value)
    assert "sm100_stage14 (persistent)" in str(info.value)           # what would take it
    with pytest.raises(ValueError, match=r"stage: stage05 \(two_q_tiles\) is built for sm_90a") \
            as info:
        choice.pick_stage(5, D, 512, 512, B200)
    assert "sm100_stage05" not in str(info.value)         # no Blackwell stage 5 to point to
    with pytest.raises(ValueError, match="production is built for sm_90a.*no production kernel "
                                         "for sm_100a"):
        choice.pick_stage("production", D, 512, 512, B200)
    with pytest.raises(ValueError, match=r"sm100_stage14 \(persistent\) is built for sm_100a, "
                                         r"which this GPU \(compute capability 9.0\) cannot run.*"
                                         r"compute capability 10.0 .*never been run"):
        choice.pick_stage("sm100_stage14", D, 512, 512, H100)
    assert choice.pick_stage("sm100_stage14", D, 512, 512, B200) is last
    assert choice.pick_stage(last, D, 512, 512, None) is last         # validation: no device yet


def test_no_blackwell_stage_registered_is_said_on_a_b200(monkeypatch):
    monkeypatch.setattr(stages, "SM100_STAGES", ())
    with pytest.raises(ValueError, match=r"no registered stage runs on compute capability 10.0 "
                                         r"\(no sm_100a stage is registered\)"):
        choice.pick_stage(None, D, 512, 512, B200)


# --------------------------------------------------------------------------- the launch path

def qkv(L=512, H=2):
    return [dev((1, H, L, D), i) for i in range(3)]


def test_prepare_on_a_b200_self_checks_then_launches_the_sm100_stage(gpu, sm100, monkeypatch):
    one, last = sm100
    gpu["ctx"].compute_capability = B200
    checked = []
    monkeypatch.setattr(selfcheck, "run", lambda stage, seed=None: checked.append(stage)
                        or passing(stage))
    p = attn.prepare(*qkv())
    assert p.stage is last and checked == [last]
    assert p.block == (384, 1, 1) and p.smem_bytes == last.smem_bytes
    assert p.grid == (min(gpu["ctx"].sm_count, 2 * 1 * (512 // 256)), 1, 1)   # persistent
    p.launch()
    config, _ = launched(gpu)
    assert config.blockDimX == 384 and config.sharedMemBytes == last.smem_bytes
    # later calls (and another stage's first) do not check the one already checked again
    attn.prepare(*qkv()).launch()
    attn.prepare(*qkv(L=128))                       # 128 rows: stage 1's first call
    assert checked == [last, one] and len(gpu["cuLaunchKernelEx"]) == 2


def test_calls_that_need_the_production_kernel_are_refused_on_a_b200(gpu, sm100, monkeypatch):
    gpu["ctx"].compute_capability = B200
    monkeypatch.setattr(selfcheck, "run", passing)
    q = dev((1, 4, 512, D), 0)
    k, v = dev((1, 2, 512, D), 1), dev((1, 2, 512, D), 2)
    with pytest.raises(ValueError, match=r"^k: no registered stage takes this shape.*GQA.*"
                                         r"no production kernel for sm_100a"):
        attn.prepare(q, k, v)                                    # GQA
    with pytest.raises(ValueError, match=r"^causal: .*no production kernel for sm_100a"):
        attn.prepare(*qkv(), causal=True)
    with pytest.raises(ValueError, match=r"^return_lse: .*no production kernel for sm_100a"):
        attn.prepare(*qkv(), return_lse=True)
    with pytest.raises(ValueError, match=r"^q: .*query length 500.*no production kernel"):
        attn.prepare(*[dev((1, 2, 500, D), i) for i in range(3)])    # a tail
    assert not gpu["cuModuleLoadDataEx"] and not gpu["cuLaunchKernelEx"]


def test_a_failed_self_check_refuses_the_stage_now_and_later_without_rerunning(gpu, sm100,
                                                                             monkeypatch):
    one, last = sm100
    gpu["ctx"].compute_capability = B200
    checked = []
    monkeypatch.setattr(selfcheck, "run", lambda stage, seed=None: checked.append(stage)
                        or failing(stage))
    for _ in range(2):
        with pytest.raises(SelfCheckError, match=r"sm100_stage14 \(persistent\) \(sm_100a\) "
                                                 r"failed its first-launch self-check.*rel_l2 "
                                                 r"1.00e-01.*refused"):
            attn.attention(*qkv())
    assert checked == [last] and not gpu["cuLaunchKernelEx"]
    # another stage is judged on its own
    monkeypatch.setattr(selfcheck, "run", lambda stage, seed=None: checked.append(stage)
                        or passing(stage))
    attn.attention(*qkv(L=128))
    assert checked == [last, one] and len(gpu["cuLaunchKernelEx"]) == 1


def test_hopper_never_self_checks(gpu, sm100, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a self-check ran on Hopper")
    monkeypatch.setattr(selfcheck, "ensure", refuse)
    monkeypatch.setattr(selfcheck, "run", refuse)
    for stage in (None, 14, 1):
        attn.prepare(*qkv(), stage=stage).launch()
    assert len(gpu["cuLaunchKernelEx"]) == 3


def test_device_arrays_are_checked_against_the_stage_the_b200_runs(gpu, sm100, monkeypatch):
    one, last = sm100
    gpu["ctx"].compute_capability = B200
    monkeypatch.setattr(selfcheck, "run", passing)
    seen = []
    real = attn.check_device_geometry
    monkeypatch.setattr(attn, "check_device_geometry", lambda name, arr, plan, seq, rows:
                        seen.append((name, plan.stage, rows)) or real(name, arr, plan, seq, rows))
    attn.prepare(*qkv())
    # validation (no device yet) checked against production; the launch against stage 14
    assert [x for x in seen if x[1] is last] == [("q", last, last.q_box_rows),
                                                  ("k", last, last.block_n),
                                                  ("v", last, last.block_n)]


# --------------------------------------------------------------------------- the self-check

@pytest.fixture
def fake_launch(monkeypatch):
    """fake_gpu's pretend GPU: a launch writes the reference into the (poisoned) output, or
    10% off it for stage numbers in `wrong`; returns the launch counts by stage number."""
    def install(**kwargs):
        return fake_gpu.install(monkeypatch, {}, **kwargs)
    return install


def test_self_check_passes_a_correct_kernel_once(sm100, fake_launch):
    one, last = sm100
    launches = fake_launch()
    selfcheck.ensure(last)
    selfcheck.ensure(last)
    assert launches == {14: 1}
    (figures,) = selfcheck.results().values()
    assert figures["pass"] and figures["nan_count"] == 0 and figures["rel_l2"] < 4e-3
    assert figures["shape"] == selfcheck.shape(last) == (2, 2, 512, 128)   # 2 x 256-row tiles


def test_self_check_refuses_a_wrong_kernel_and_remembers(sm100, fake_launch):
    one, last = sm100
    launches = fake_launch(wrong={14})
    for _ in range(3):
        with pytest.raises(SelfCheckError) as info:
            selfcheck.ensure(last)
        message = str(info.value)
        assert "sm100_stage14 (persistent)" in message and "rel_l2" in message
        assert "B=2 H=2 L=512 D=128" in message and "refused" in message
    assert launches == {14: 1}                  # checked once, refused three times
    selfcheck.ensure(one)                       # stage 1 is not wrong: it passes
    assert launches == {14: 1, 1: 1}


def test_self_check_sees_the_poison_of_a_kernel_that_writes_nothing(sm100, monkeypatch):
    one, last = sm100
    fake_gpu.install(monkeypatch, {})

    class Silent:
        stream = 0

        def launch(self):
            pass
    poisoned = []
    real_empty = fake_gpu.tensors.empty

    def empty(shape, **kw):
        out = real_empty(shape, **kw)
        poisoned.append(out)
        return out
    monkeypatch.setattr(fake_gpu.tensors, "empty", empty)
    monkeypatch.setattr(selfcheck, "_prepare", lambda *a, **kw: Silent())
    with pytest.raises(SelfCheckError, match=r"\d+ NaN/Inf"):
        selfcheck.ensure(one)
    assert np.isnan(poisoned[0].array.astype(np.float32)).all()     # NaN before the launch


def test_self_check_that_cannot_run_refuses_and_remembers(sm100, fake_launch):
    one, last = sm100
    fake_launch(fail={1})
    for _ in range(2):
        with pytest.raises(SelfCheckError, match=r"sm100_stage01 \(baseline\) \(sm_100a\) could "
                                                 r"not run its first-launch self-check: "
                                                 r"RuntimeError: fake JIT failure"):
            selfcheck.ensure(one)


def test_threads_asking_at_once_share_one_self_check(sm100, monkeypatch):
    import threading
    import time

    from fakes import at_once
    one, last = sm100
    runs, inside = [], threading.Lock()

    def run(stage, seed=None):
        assert inside.acquire(blocking=False), "two self-checks at once"
        runs.append(stage)
        time.sleep(0.05)                    # the others arrive while this one runs
        inside.release()
        return passing(stage)
    monkeypatch.setattr(selfcheck, "run", run)
    assert at_once(lambda i: selfcheck.ensure(last)) == []
    assert runs == [last]


def test_the_self_checks_own_launch_does_not_check_again(sm100, monkeypatch):
    one, last = sm100
    inner = []

    def run(stage, seed=None):              # the check's launch comes back through ensure()
        selfcheck.ensure(stage)
        inner.append(stage)
        return passing(stage)
    monkeypatch.setattr(selfcheck, "run", run)
    selfcheck.ensure(last)
    assert inner == [last]


def test_self_check_inputs_are_fresh_each_run(sm100, fake_launch):
    one, last = sm100
    fake_launch()
    seeds = {selfcheck.run(one)["seed"] for _ in range(3)}
    assert len(seeds) == 3


def test_self_check_shape_fits_both_tiles():
    # the smallest length that is a multiple of both tiles, >= 256, two tiles of each
    for bm, bn, want in ((64, 64, 256), (128, 128, 256), (256, 128, 512), (192, 128, 384),
                         (128, 512, 1024)):
        stage = dataclasses.replace(stages.STAGES[0], block_m=bm, block_n=bn)
        b, h, seq, d = selfcheck.shape(stage)
        assert (b, h, seq, d) == (2, 2, want, 128), (bm, bn)
        assert stage.unsupported(d, seq, seq) is None


# --------------------------------------------------------------------------- SASS classes

FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures"


def tiny_sm100a():
    return sass.summarize((FIXTURES / "tiny_sm100a.nvdisasm.sass").read_text(),
                          (FIXTURES / "tiny_sm100a.log").read_text())


@pytest.mark.parametrize("opcode, cls", [
    ("UTCHMMA", "UTCMMA"), ("UTCHMMA.WS", "UTCMMA"), ("UTCQMMA", "UTCMMA"),
    ("UTCIMMA", "UTCMMA"), ("UTCBAR", "UTCBAR"), ("LDTM.x4", "LDTM"), ("STTM.x16", "STTM"),
    ("UTCCP.T.S", "UTC other"), ("UTCSHIFT.DOWN", "UTC other"),
    ("UTCATOMSWS.FIND_AND_SET.ALIGN", "UTC other"), ("UTMALDG.2D", "TMA"),
    ("UTMASTG.2D", "TMA"), ("SYNCS.PHASECHK.TRANS64.TRYWAIT", "SYNCS"),
    ("HGMMA.64x64x16.F32.BF16", "HGMMA"), ("LDS.128", "LDS"), ("LDSM.16.M88.4", "LDSM"),
])
def test_blackwell_opcodes_are_classified(opcode, cls):
    assert sass.classify(opcode) == cls


def test_a_blackwell_summary_counts_tcgen05_and_tmem():
    # real ptxas 13.0 -v and nvdisasm output of tests/fixtures/tiny_sm100a.ptx
    s = tiny_sm100a()
    assert s.arch == "sm_100a" and s.function == "tiny_sm100a"
    c = s.classes
    assert (c["UTCMMA"], c["UTCBAR"], c["LDTM"], c["STTM"]) == (2, 1, 1, 1)
    assert c["UTC other"] == 5          # tcgen05.cp, .shift, 2 x alloc loop, dealloc
    assert c["TMA"] == 3 and c["SYNCS"] >= 3 and c["HGMMA"] == 0
    assert list(c) == list(sass.CLASS_NAMES)
    text = sass.format_summary(s)
    assert "UTCMMA" in text and "LDTM" in text and "HGMMA" not in text


def test_a_hopper_summary_lists_the_classes_it_always_did():
    s = sass.summarize((FIXTURES / "tiny_sm90a.nvdisasm.sass").read_text(),
                       (FIXTURES / "tiny_sm90a.log").read_text())
    assert list(s.classes) == list(sass.HOPPER_CLASS_NAMES)
    assert not set(s.classes) & sass.BLACKWELL_CLASSES
    assert sass.class_names("sm_90a") == sass.class_names(None) == sass.HOPPER_CLASS_NAMES
    assert sass.class_names("sm_100a") == sass.CLASS_NAMES


@pytest.mark.skipif(sass.locate("ptxas") is None or
                    not (sass.locate("nvdisasm") or sass.locate("cuobjdump")),
                    reason="no ptxas/nvdisasm (pip install 'ptxattn[tools]')")
def test_the_blackwell_fixture_still_assembles_to_the_same_classes():
    asm = sass.assemble_ptx((FIXTURES / "tiny_sm100a.ptx").read_text(), "sm_100a",
                            name="tiny_sm100a")
    live = sass.summarize(sass.disassemble(asm.cubin), asm.log)
    fixture = tiny_sm100a()
    for name in sass.BLACKWELL_CLASSES | {"TMA"}:
        assert live.classes[name] == fixture.classes[name], name
    assert live.spill_bytes == 0


# --------------------------------------------------------------------------- CLI

def test_list_shows_both_lineages_and_says_the_blackwell_one_never_ran(sm100):
    one, last = sm100
    result = cli("list")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    heading = next(i for i, line in enumerate(lines) if line.startswith("Blackwell lineage"))
    assert "assembled and SASS-checked only; never run here (no B200 lent)" in lines[heading]
    for s in stages.all_stages():                                     # Hopper's, above it
        assert any(line.split()[:3] == [str(s.number), s.name, s.arch]
                   for line in lines[:heading])
    below = [line.split()[:3] for line in lines[heading + 1:] if line.split()[0].isdigit()]
    assert below == [["1", "baseline", "sm_100a"], ["14", "persistent", "sm_100a"]]


def test_list_with_no_blackwell_stage_yet(monkeypatch):
    monkeypatch.setattr(stages, "SM100_STAGES", ())
    result = cli("list")
    assert result.exit_code == 0 and "(no stage registered yet)" in result.output


def test_ptx_and_diff_take_the_lineage(sm100):
    one, last = sm100
    shown = cli("ptx", "14", "--arch", "sm_100a")
    assert shown.exit_code == 0 and ".entry made_up_persistent()" in shown.output
    assert cli("ptx", "sm100_stage01").output == cli("ptx", "1", "--arch", "sm100").output
    assert "made-up" not in cli("ptx", "1").output                   # plain: Hopper's
    diff = cli("diff", "1", "14", "--arch", "sm_100a")
    assert diff.exit_code == 0, diff.output
    assert "sm100_stage01" in diff.output and "sm100_stage14" in diff.output
    one_clean_error(cli("ptx", "1", "--arch", "sm_89"), "arch: expected sm_90a")


def test_sass_arch_names_the_lineage_or_only_the_target(sm100, monkeypatch):
    from ptxattn.tools import cli as cli_module
    one, last = sm100
    assert cli_module._resolve("14", "sm_100a") == (last, "sm_100a")
    assert cli_module._resolve("14", "blackwell") == (last, "sm_100a")
    assert cli_module._resolve("14", None) == (stages.get_stage(14), None)
    assert cli_module._resolve("14", "sm_120a") == (stages.get_stage(14), "sm_120a")
    assert cli_module._resolve("sm100_stage14", None) == (last, None)
    seen = []
    monkeypatch.setattr(sass, "inspect_stage", lambda st, arch=None, defines=None:
                        seen.append((st, arch)) or (_ for _ in ()).throw(RuntimeError("stop")))
    cli("sass", "14", "--arch", "sm_100a", "--summary")
    assert seen == [(last, "sm_100a")]


def b200_info():
    return {"name": "Fake B200", "compute_capability": B200, "arch": "sm_100a", "sm_count": 148,
            "driver_version": 13000, "driver_version_str": "13.0", "total_memory": 180 << 30}


def test_run_on_a_b200_takes_a_plain_number_as_the_blackwell_stage(sm100, monkeypatch):
    one, last = sm100
    launches = fake_gpu.install(monkeypatch, {14: 1.0, 1: 1.0})
    monkeypatch.setattr(driver, "device_info", b200_info)
    result = cli("run", "14", "--shape", "1x2x512x128", "--reps", "2")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("sm100_stage14 persistent on Fake B200")
    assert "PASS" in result.output
    assert set(launches) == {14}         # the made-up stage 14 ran, not Hopper's (a fake GPU)
    # the Blackwell stage's own constraints are checked (stage 14 takes multiples of 256)
    one_clean_error(cli("run", "14", "--shape", "1x2x128x128"), "sm100_stage14",
                    "query length 128")


def test_run_arch_is_checked_before_the_gpu(sm100, monkeypatch):
    def touched():
        raise AssertionError("the GPU was asked for")
    monkeypatch.setattr(driver, "device_info", touched)
    bad = cli("run", "1", "--arch", "sm_89")
    assert bad.exit_code == 2 and "--arch" in bad.output and "sm_89" in bad.output
    one_clean_error(cli("run", "5", "--arch", "sm_100a"), "unknown sm_100a stage '5'")


# --------------------------------------------------------------------------- on the H200

# The self-check's own device path (copies in, NaN poison, launch, copy out, reference) cannot
# run on a B200 here; on Hopper it runs with a Hopper stage, which ensure() does not mind.
@pytest.fixture
def no_verdicts(monkeypatch):
    monkeypatch.setattr(selfcheck, "_RESULTS", {})
    monkeypatch.setattr(selfcheck, "_METRICS", {})


@pytest.mark.gpu
def test_gpu_the_self_check_passes_a_correct_kernel(no_verdicts):
    stage = stages.get_stage(14)
    figures = selfcheck.run(stage)
    assert figures["pass"], figures
    assert figures["nan_count"] == 0 and figures["shape"] == (2, 2, 256, 128)
    assert figures["rel_l2"] < 4e-3
    selfcheck.ensure(stage)                                   # a real pass is remembered
    assert [m["pass"] for m in selfcheck.results().values()] == [True]


@pytest.mark.gpu
def test_gpu_the_self_check_refuses_a_wrong_result(no_verdicts, monkeypatch):
    stage = stages.get_stage(14)
    real = selfcheck._prepare
    # twice the softmax scale: the kernel runs as it should, on the wrong question
    monkeypatch.setattr(selfcheck, "_prepare",
                        lambda *a, **kw: real(*a, scale=2.0 / D ** 0.5, **kw))
    with pytest.raises(SelfCheckError, match=r"stage14 \(persistent\) \(sm_90a\) failed its "
                                             r"first-launch self-check"):
        selfcheck.ensure(stage)

    def rerun(*args, **kwargs):
        raise AssertionError("the self-check ran again")
    monkeypatch.setattr(selfcheck, "run", rerun)
    with pytest.raises(SelfCheckError, match="refused for the rest of this process"):
        selfcheck.ensure(stage)


@pytest.mark.gpu
def test_gpu_hopper_runs_without_self_checks_and_refuses_sm100_stages(sm100, monkeypatch):
    one, last = sm100

    def refuse(*args, **kwargs):
        raise AssertionError("a self-check ran on Hopper")
    monkeypatch.setattr(selfcheck, "ensure", refuse)
    from ptxattn.reference import random_qkv
    q, k, v = random_qkv(1, 2, 256, 256, D, "bhld", seed=3)
    out = attn.attention(q, k, v)                            # the production kernel, as ever
    assert out.shape == q.shape and np.isfinite(out.astype(np.float32)).all()
    with pytest.raises(ValueError, match=r"sm100_stage14 \(persistent\) is built for sm_100a, "
                                         r"which this GPU \(compute capability 9.0\) cannot run"):
        attn.attention(q, k, v, stage=last)


# --------------------------------------------------------------------------- the minor steps

def test_list_arch_shows_one_lineage(sm100):
    one, last = sm100
    result = cli("list", "--arch", "sm_100a")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    heading = next(i for i, line in enumerate(lines) if line.startswith("Blackwell lineage"))
    assert "never run here" in lines[heading]
    assert [line.split()[:3] for line in lines[heading + 1:] if line.split()[0].isdigit()] == [
        ["1", "baseline", "sm_100a"], ["14", "persistent", "sm_100a"]]
    assert not any("sm_90a" in line for line in lines)              # no Hopper row, no production
    hopper = cli("list", "--arch", "hopper")
    assert hopper.exit_code == 0 and "Blackwell" not in hopper.output
    assert "sm_100a" not in hopper.output and "production" in hopper.output
    one_clean_error(cli("list", "--arch", "sm_89"), "--arch", "sm_89")


def test_list_shows_the_minor_steps_as_never_run():
    """The registry's own rows (no made-up stages): 15 and 16 are listed under the heading that
    says the lineage never ran."""
    result = cli("list", "--arch", "sm_100a")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    heading = next(i for i, line in enumerate(lines) if line.startswith("Blackwell lineage"))
    assert "never run here" in lines[heading]
    rows = [line.split()[:3] for line in lines[heading + 1:]]
    assert ["15", "dynamic_scheduler", "sm_100a"] in rows
    assert ["16", "tma_store_epilogue", "sm_100a"] in rows


def test_a_b200_tries_the_predicted_order_then_falling_numbers():
    order = [s.number for s in stages.by_speed("sm_100a")]
    assert order[:3] == [16, 14, 15]                    # the static scheduler before the dynamic
    assert order[3:] == sorted(order[3:], reverse=True)
    assert sorted(order) == [s.number for s in stages.SM100_STAGES]


def _launch_on_a_b200(gpu, monkeypatch, number):
    gpu["ctx"].compute_capability = B200
    monkeypatch.setattr(selfcheck, "_RESULTS", {})
    monkeypatch.setattr(selfcheck, "_METRICS", {})
    monkeypatch.setattr(selfcheck, "run", passing)
    stage = stages.get_stage(number, arch="sm_100a")
    p = attn.prepare(*qkv(L=512, H=2), stage=stage)
    p.launch()
    config, (values, types) = launched(gpu)
    return stage, p, config, values, types


def test_the_dynamic_scheduler_gets_a_zeroed_tile_counter_last(gpu, monkeypatch):
    stage, p, config, values, types = _launch_on_a_b200(gpu, monkeypatch, 15)
    assert stage.dynamic_tiles and p.grid == (min(gpu["ctx"].sm_count, 2 * (512 // 256)), 1, 1)
    assert len(values) == len(types) == 14                     # the ABI's 13, then tile_counter
    assert types[-1] == driver.PTR and type(values[-1]) is int
    # the two u32 counters are set to zero on the launch's stream before the kernel runs
    zeroed = [a for name in ("cuMemsetD8", "cuMemsetD8Async") for a in gpu[name]]
    assert any(int(a[0]) == values[-1] and int(a[1]) == 0 and int(a[2]) == 8 for a in zeroed), zeroed
    assert config.sharedMemBytes == stage.smem_bytes and config.blockDimX == 512


def test_the_tma_store_stage_gets_the_abi_and_an_o_map_of_its_staging_tile(gpu, monkeypatch):
    stage, p, config, values, types = _launch_on_a_b200(gpu, monkeypatch, 16)
    assert len(values) == 13 and not stage.dynamic_tiles
    mo = maps(gpu)[3]
    assert mo[0] == p.out.ptr
    # the box the kernel stages: (64, 128, 2) over (d_inner, row, d_outer), 128-byte swizzle
    assert mo[3] == (64, 128, 2, 1, 1)
    assert mo[4] == driver.cu().CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B
    assert config.sharedMemBytes == stage.smem_bytes == 227 * 1024


# --------------------------------------------------------------------------- on a B200 only

def _on_a_b200():
    """Skip unless the GPU runs the sm_100a lineage (compute capability 10.0): on the H200s
    lent to this project these tests never run; they are for whoever runs the lineage first."""
    if driver.context().compute_capability != B200:
        pytest.skip("needs a GPU of compute capability 10.0 (B200) for sm_100a code")


@pytest.mark.gpu
@pytest.mark.parametrize("stage", stages.SM100_STAGES, ids=lambda s: s.label)
@pytest.mark.parametrize("layout", ["bhld", "bshd"])
def test_gpu_b200_stage_matches_the_reference(stage, layout, no_verdicts):
    from gpu_checks import assert_passes, check_rows

    from ptxattn import tensors
    from ptxattn.reference import random_qkv
    _on_a_b200()
    for B, H, Lq, Lk in ((2, 3, 512, 512), (1, 2, 256, 1024)):
        q, k, v = random_qkv(B, H, Lq, Lk, D, layout, seed=5)
        out = tensors.empty(q.shape)
        out.fill_u16(0xFFFF)                                  # NaN: rows never written show
        got = attn.attention(*(tensors.from_numpy(x) for x in (q, k, v)), stage=stage,
                             layout=layout, out=out).to_numpy()
        assert_passes(check_rows(q, k, v, got, layout), f"{stage.label} {layout} {Lq}x{Lk}:")


@pytest.mark.gpu
def test_gpu_b200_the_dynamic_scheduler_leaves_its_counter_zero(no_verdicts, monkeypatch):
    """Two CTAs take all 12 tiles from the counter; the last CTA out resets it, so every
    launch of one prepared call finds zeros and computes the same right answer."""
    from gpu_checks import assert_passes, check_rows

    from ptxattn import tensors
    from ptxattn.reference import random_qkv
    _on_a_b200()
    monkeypatch.setenv(PERSISTENT_CTAS_ENV, "2")
    stage = stages.get_stage(15, arch="sm_100a")
    q, k, v = random_qkv(2, 3, 512, 512, D, "bhld", seed=6)     # 2 x 3 x 2 = 12 tiles
    prepared = attn.prepare(*(tensors.from_numpy(x) for x in (q, k, v)), stage=stage)
    assert prepared.grid == (2, 1, 1)
    first = None
    for launch in range(3):
        prepared.out.fill_u16(0xFFFF)
        prepared.launch()
        got = prepared.out.to_numpy()
        assert_passes(check_rows(q, k, v, got, "bhld"), f"launch {launch}:")
        if first is None:
            first = got.view(np.uint16).copy()
        np.testing.assert_array_equal(got.view(np.uint16), first)

"""python -m ptxattn.tools.emulate: a stage on the emulator from the command line, with its
error against the reference and the emulator's findings; the exit status says which."""

from __future__ import annotations

from ptxattn.tools import emulate
from ptxattn.tools.emulator import fake_driver


def run(capsys, *argv) -> tuple[int, str]:
    try:
        rc = emulate.main(list(argv))
    finally:
        fake_driver.clear_runtime_caches()
    return rc, capsys.readouterr().out


def test_a_stage_that_meets_the_bar_exits_0(capsys, monkeypatch):
    monkeypatch.setattr("ptxattn.driver._cu_module", None)     # restored after the test
    rc, out = run(capsys, "1", "--shape", "1x1x64x128", "--layout", "bshd")
    assert rc == 0, out
    assert "-> pass" in out and "warp-instr/s" in out and "0 hazard(s)" in out


def test_a_planted_kernel_file_reports_its_hazard_and_exits_1(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("ptxattn.driver._cu_module", None)
    from ptxattn.stages import ptx_root
    text = (ptx_root() / "sm90" / "01_baseline.ptx").read_text()
    planted = tmp_path / "stage1_no_fence.ptx"
    planted.write_text(text.replace("fence.proxy.async.shared::cta;", ""))
    rc, out = run(capsys, "1", "--shape", "1x1x64x128", "--ptx", str(planted))
    assert rc == 1, out
    assert "[unfenced-async-read] wgmma" in out and "st.shared" in out


def test_a_deadlock_exits_2_with_the_report(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("ptxattn.driver._cu_module", None)
    from ptxattn.stages import ptx_root
    text = (ptx_root() / "sm90" / "04_warp_specialization.ptx").read_text()
    planted = tmp_path / "stage4_empty_256.ptx"
    planted.write_text(text.replace("[%bar_empty], 128;", "[%bar_empty], 256;"))
    assert planted.read_text() != text
    rc, out = run(capsys, "4", "--shape", "1x1x128x128", "--ptx", str(planted))
    assert rc == 2, out
    assert "Deadlock" in out and "waits on mbarrier at shared" in out
    assert "of 256 arrivals pending" in out          # the EMPTY barrier that never completes

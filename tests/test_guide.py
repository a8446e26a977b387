"""The lineage guide (ptxattn.tools.guide): the committed pages are what regenerating gives, pages work
before timelines exist and take them in once a traces JSON is committed. CPU only, no ptxas."""

from __future__ import annotations

import shutil

import pytest

from ptxattn import stages
from ptxattn.tools import guide
from ptxattn.tools import trace as T


def test_committed_guide_is_current():
    bad = guide.stale()
    assert not bad, (f"docs/lineage is stale ({', '.join(bad)}): run `python -m ptxattn.tools.guide` "
                     f"and commit the result")


def test_every_stage_has_a_page_with_its_idea_and_real_diff():
    files = guide.build()
    for st in stages.all_stages():
        page = files[guide.page_name(st)]
        assert f"# Stage {st.number}: {st.name}" in page and st.idea in page
        if st.number > 1:
            # the excerpt is the real diff: every '+' line of it is a line of the stage's file
            # (trace points are left out: TRACE_PARAM leaves the line it ends)
            source = (stages.ptx_root() / st.file).read_text().replace(" TRACE_PARAM", "")
            source = source.splitlines()
            body = page.split("```diff\n", 1)[1].split("\n```", 1)[0].splitlines()
            added = [l[1:] for l in body if l.startswith("+") and not l.startswith("+++")]
            assert added, st.label
            assert all(a in source for a in added), st.label
            assert not any("TRACE(" in l for l in body)
    assert "[baseline](01_baseline.md)" in files["README.md"]


def test_one_change_comes_from_the_file_header():
    st = stages.get_stage(2)
    text = guide.one_change(st)
    assert text.startswith("The one change against stage 1")
    assert "CTA:" not in text


def _fake_traces(path, numbers, broken=()):
    raw_events = [T.Event(w, c, 1_000_000 + c // 2, T.CODES[n]) for w, c, n in (
        (0, 0, "TMA_ISSUE"), (0, 50, "TMA_ISSUE"),
        (4, 10, "KV_WAIT"), (4, 400, "KV_READY"), (4, 410, "QK_ISSUE"), (4, 900, "QK_DONE"),
        (4, 905, "SOFTMAX_BEGIN"), (4, 2400, "SOFTMAX_END"), (4, 2410, "PV_ISSUE"),
        (4, 2900, "PV_DONE"), (4, 2910, "EPILOGUE_BEGIN"), (4, 4000, "EPILOGUE_END"))]
    col = T.Collection({}, {n: "CudaError: fake" for n in broken})
    for n in numbers:
        st = stages.get_stage(n)
        stretch = 1 + n / 10
        ev = [T.Event(e.warp, int(e.clock * stretch), int(e.globaltimer), e.code)
              for e in raw_events]
        col.traces[n] = T.Trace(n, st.name, 256, (1, 16, 2048, 2048, 128), "bhld", ev,
                                gpu="NVIDIA H200", clock_khz=1_980_000, kernel_ms=0.2)
    return col.write_json(path)


def test_pages_say_timeline_pending_without_traces(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    files = guide.build(out=tmp_path / "docs", results=results)
    for st in stages.all_stages():
        page = files[guide.page_name(st)]
        assert "Timeline pending" in page and "![timeline]" not in page
        assert "No benchmark results committed yet" in page
    assert not any(k.startswith("img/") for k in files)


def test_pages_take_the_timelines_in_once_the_traces_are_committed(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for p in guide.bench_runs():
        shutil.copy(p, results / p.name)
    _fake_traces(results / "traces-2026-12-01-h200.json", [1, 2, 3], broken=[4])
    out = tmp_path / "docs"
    files = guide.build(out=out, results=results)
    assert "![timeline](img/trace-01.svg)" in files["01_baseline.md"]
    assert "![timeline](img/compare-02-03.svg)" in files["03_swizzle.md"]
    assert files["img/compare-02-03.svg"].startswith("<?xml")
    assert "stage02" in files["img/compare-02-03.svg"] and "stage03" in files["img/compare-02-03.svg"]
    page = files["03_swizzle.md"]
    assert "CTA (0, 0, 0) of stage03 ran" in page and "(in stage02:" in page
    assert "Timeline pending (CudaError: fake)" in files["04_warp_specialization.md"]
    assert "Timeline pending (not in the traces file)" in files["05_two_q_tiles.md"]
    assert "| 4k |" in page                       # speed from the copied results
    # written to disk, the files are current; a hand edit makes them stale
    guide.write(out=out, results=results)
    assert guide.stale(out=out, results=results) == []
    (out / "03_swizzle.md").write_text("edited\n")
    assert guide.stale(out=out, results=results) == ["03_swizzle.md"]


def test_busy_fractions_count_overlapping_gemms_once():
    ev = [T.Event(4, c, 0, T.CODES[n]) for c, n in (
        (0, "QK_ISSUE"), (0, "PV_ISSUE"), (50, "PV_DONE"), (100, "QK_DONE"),
        (100, "KV_WAIT"), (200, "KV_READY"))]
    tr = T.Trace(7, "compute_pipeline", 384, (1, 1, 128, 128, 128), "bhld", ev, clock_khz=1_000_000)
    busy = guide._busy(tr)
    assert busy["mma"] == pytest.approx(50.0) and busy["wait"] == pytest.approx(50.0)
    assert busy["softmax"] == 0.0


def test_help_says_what_it_writes_and_check_refuses_sass(capsys):
    # a newcomer reads --help first: it must name the folder it writes and what each mode needs
    with pytest.raises(SystemExit) as e:
        guide.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "docs/lineage/" in text and "needs ptxas" in text
    # --check writes nothing, so a --sass beside it would be silently ignored: refused instead
    with pytest.raises(SystemExit) as e:
        guide.main(["--check", "--sass"])
    assert e.value.code == 2
    assert "--check and --sass" in capsys.readouterr().err

"""The lineage as a guide: one Markdown page per stage, written from the repository's own files.

    python -m ptxattn.tools.guide            # rewrite docs/lineage/ from committed files (no GPU, no ptxas)
    python -m ptxattn.tools.guide --sass     # first refresh docs/lineage/sass.json (needs ptxas)
    python -m ptxattn.tools.guide --check    # exit 1 when a page is not what regenerating gives

Every page is built from committed inputs only, so that regenerating gives the same bytes
anywhere (tests/test_guide.py checks it):
  - the idea: the stage registry's one line and the `// The one change` paragraph of the .ptx,
  - the heart of the diff: a unified diff of the two hand-written .ptx files (trace points and
    the header comment left out; `ptxattn diff A B` shows the expanded PTX in full),
  - SASS deltas: docs/lineage/sass.json, written by --sass from `ptxas` (as `ptxattn diff A B
    --sass` shows them),
  - speed: bench/results/*.json benchmark runs (ranges over the runs when there are two or more),
  - timelines: the newest bench/results/traces-*.json (bench/trace_all.sh on the GPU); the SVGs
    are drawn from it into docs/lineage/img/. Without it a page says "timeline pending".
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

from .. import stages
from . import bench, trace

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "lineage"
RESULTS = ROOT / "bench" / "results"
SASS_CACHE = "sass.json"
MAX_DIFF_LINES = 160          # the excerpt of the diff on a page; the rest is one command away
_TRACE_LINE = re.compile(r"^\s*(TRACE(_REGS|_SETUP\w*)?\b|#include \"trace\.ptxh\")")


def page_name(stage) -> str:
    return f"{stage.number:02d}_{stage.name}.md"


# --------------------------------------------------------------------------- from the .ptx files

def _source(stage) -> list[str]:
    return (stages.ptx_root() / stage.file).read_text().splitlines()


def header(stage) -> list[str]:
    """The comment block that opens a stage file, without the `// `."""
    out = []
    for line in _source(stage):
        if not line.startswith("//"):
            break
        out.append(line[3:] if line.startswith("// ") else line[2:])
    return out


def one_change(stage) -> str:
    """The `The one change ...` paragraph of the header, joined into one text."""
    lines, taking = [], False
    for line in header(stage):
        if line.startswith("The one change"):
            taking = True
        elif taking and (not line.strip() or re.match(r"^[A-Z][\w ]*:\s", line)):
            break
        if taking:
            lines.append(line.strip())
    return " ".join(lines)


def _body(stage) -> list[str]:
    """The file without its header comment and without trace instrumentation; TRACE_PARAM
    is dropped from the parameter line it sits on."""
    lines = _source(stage)
    start = next((i for i, l in enumerate(lines) if not l.startswith("//")), len(lines))
    return [l.replace(" TRACE_PARAM", "") for l in lines[start:] if not _TRACE_LINE.match(l)]


def diff_excerpt(prev, stage, limit: int = MAX_DIFF_LINES) -> tuple[list[str], int]:
    """(the first `limit` lines of the unified diff of the two sources, lines left out)."""
    diff = list(difflib.unified_diff(_body(prev), _body(stage), prev.file, stage.file,
                                     n=2, lineterm=""))
    return diff[:limit], max(len(diff) - limit, 0)


# --------------------------------------------------------------------------- SASS (cached)

_SASS_FIELDS = ("function", "arch", "registers", "barriers", "stack_frame", "spill_stores",
                "spill_loads", "static_smem", "dynamic_smem", "instructions", "classes")


def refresh_sass(out: Path = DOCS) -> Path:
    """Assemble every stage with ptxas and keep the summaries that pages show."""
    from . import sass
    data = {}
    for st in stages.all_stages():
        s = sass.inspect_stage(st).summary.to_dict()
        data[st.label] = {k: s[k] for k in _SASS_FIELDS}
    tool = sass.find_tool("ptxas")
    doc = {"about": "SASS summaries of each stage (python -m ptxattn.tools.guide --sass)",
           "ptxas": sass.tool_version(tool), "stages": data}
    out.mkdir(parents=True, exist_ok=True)
    path = out / SASS_CACHE
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return path


def _sass_table(cache: dict | None, prev, stage) -> list[str]:
    from . import sass
    if not cache or prev.label not in cache["stages"] or stage.label not in cache["stages"]:
        return ["SASS summaries pending (`python -m ptxattn.tools.guide --sass` needs ptxas)."]
    a, b = (sass.SassSummary(**cache["stages"][s.label]) for s in (prev, stage))
    rows = [r for r in sass.diff_summaries(a, b) if r.a != r.b]
    if not rows:
        return ["The SASS summary is the same as the predecessor's (registers, shared memory, "
                "instruction classes)."]
    out = [f"What changed in the SASS (`ptxattn diff {prev.number} {stage.number} --sass`, "
           f"ptxas {cache.get('ptxas') or '?'}; rows that did not change are left out):", "",
           "```text", sass.format_diff(rows, prev.label, stage.label), "```"]
    return out


# --------------------------------------------------------------------------- speed

def bench_runs(results: Path = RESULTS) -> list[Path]:
    """The committed lineage benchmark runs under the current protocol (schema >= 2, the
    `lineage` set): ranges are taken over runs of one protocol and one set only (the
    production set times stage 14 in other rounds, and schema 1 timed cuDNN last)."""
    out = []
    for p in sorted(results.glob("*.json")):
        try:
            d = json.loads(p.read_text())
        except ValueError:
            continue
        if (isinstance(d, dict) and isinstance(d.get("results"), list) and "shapes" in d
                and d.get("schema", 1) >= 2 and d.get("set", "lineage") == "lineage"):
            out.append(p)
    return out


def speed_rows(runs: list[Path]) -> dict:
    """{(label, shape): row} with pct_range / tflops_range / peer_tflops_range, over the runs."""
    if not runs:
        return {}
    if len(runs) >= 2:
        combined = bench.combine_results([str(p) for p in runs], [p.name for p in runs])
        return {(r["stage"], r["shape"]): r for r in combined["rows"]}
    res = bench.load_results(str(runs[0]))
    peers = {p["shape"]: p for p in res.get("peer", [])}
    rows = {}
    for r in res["results"]:
        ok = r.get("status") == "ok" and r.get("ms")
        pct = r.get("pct_of_peer")
        peer = peers.get(r["shape"], {}).get("tflops")
        rows[(r["stage"], r["shape"])] = {
            "status": r.get("status"), "pct_range": [pct, pct] if ok and pct is not None else None,
            "tflops_range": [r["tflops"], r["tflops"]] if ok else None,
            "peer_tflops_range": [peer, peer] if peer else None}
    return rows


def _speed_table(rows: dict, runs: list[Path], prev, stage) -> list[str]:
    if not runs:
        return ["No benchmark results committed yet (bench/results/*.json)."]
    shapes = []
    for (_, shape) in rows:
        if shape not in shapes:
            shapes.append(shape)
    fmt = bench.format_range
    lines = ["| shape | " + (f"{prev.label} | " if prev else "") + f"{stage.label} | "
             "TFLOP/s | cuDNN TFLOP/s |", "|---|" + ("---|" if prev else "") + "---|---|---|"]
    for shape in shapes:
        me = rows.get((stage.label, shape))
        if me is None:
            continue
        before = rows.get((prev.label, shape)) if prev else None

        def pct(r):
            if r is None:
                return "-"
            return fmt(r["pct_range"], "%", ".0f") if r.get("pct_range") else str(r["status"])
        lines.append(f"| {shape} | " + (f"{pct(before)} | " if prev else "") + f"{pct(me)} | "
                     f"{fmt(me.get('tflops_range'), '', '.0f')} | "
                     f"{fmt(me.get('peer_tflops_range'), '', '.0f')} |")
    names = ", ".join(f"[{i}](../../bench/results/{p.name})" for i, p in enumerate(runs, 1))
    kind = "range over the runs" if len(runs) >= 2 else "one run"
    return [f"Percent of cuDNN measured in the same run ({kind}: {names}); "
            f"shapes as in [bench/README.md](../../bench/README.md). Each figure is the median "
            f"over rounds of the round's cuDNN time / ours, so it does not follow from the "
            f"TFLOP/s columns.", ""] + lines


# --------------------------------------------------------------------------- timelines

def newest_traces(results: Path = RESULTS) -> Path | None:
    found = sorted(results.glob("traces-*.json"))
    return found[-1] if found else None


def _busy(tr: trace.Trace) -> dict:
    """Per consumer lane, in % of the lane's span: waiting (K/V, turn), softmax, a GEMM in flight."""
    ivs = tr.intervals()
    out = {"span_us": tr.span_us}
    stage = stages.get_stage(tr.stage)
    lanes = [w for w in tr.warps() if stage.threads <= 128 or w >= 4]
    span = max(tr.span_cycles, 1)
    for key, kinds in (("wait", ("kv_wait", "turn_wait")), ("softmax", ("softmax",)),
                       ("mma", ("qk", "pv"))):
        per_lane = []
        for w in lanes:
            # union of the intervals, so overlapping QK and PV are not counted twice
            spans = sorted((i.start, i.end) for i in ivs if i.warp == w and i.kind in kinds)
            total, end = 0, None
            for a, b in spans:
                if end is None or a > end:
                    total += b - a
                    end = b
                elif b > end:
                    total += b - end
                    end = b
            per_lane.append(100.0 * total / span)
        out[key] = sum(per_lane) / len(per_lane) if per_lane else 0.0
    return out


def tiles_of(tr: trace.Trace) -> int:
    """How many Q tiles CTA (0, 0, 0) computed in the trace: the epilogues of its busiest lane
    (a persistent stage's CTA 0 runs several, so its span is not one tile's time)."""
    counts: dict[int, int] = {}
    for i in tr.intervals():
        if i.kind == "epilogue":
            counts[i.warp] = counts.get(i.warp, 0) + 1
    return max(counts.values(), default=1)


def _tiles_text(tr) -> str:
    n = tiles_of(tr)
    return f"{n} Q tiles" if n != 1 else "one Q tile"


def _timeline_sentence(prev_tr, tr) -> str:
    b = _busy(tr)
    me = (f"CTA (0, 0, 0) of {tr.label} ran {_tiles_text(tr)} in {b['span_us']:.1f} µs; its "
          f"consumer lanes spent "
          f"{b['wait']:.0f}% of that waiting (K/V or the pingpong turn), {b['softmax']:.0f}% in "
          f"the softmax and had a GEMM in flight {b['mma']:.0f}% of the time")
    if prev_tr is None:
        return me + "."
    a = _busy(prev_tr)
    return (me + f" (in {prev_tr.label}: {_tiles_text(prev_tr)} in {a['span_us']:.1f} µs, "
            f"{a['wait']:.0f}% waiting, "
            f"{a['softmax']:.0f}% softmax, GEMM in flight {a['mma']:.0f}%).")


def _timeline(col, prev, stage, img: Path, written: dict) -> list[str]:
    if col is None or stage.number not in col.traces:
        why = "" if col is None else f" ({col.errors.get(stage.number, 'not in the traces file')})"
        return [f"Timeline pending{why}: `bash bench/trace_all.sh` on the GPU records every "
                f"stage; commit its JSON as bench/results/traces-<date>-h200.json and rerun "
                f"`python -m ptxattn.tools.guide`."]
    tr = col.traces[stage.number]
    prev_tr = col.traces.get(prev.number) if prev else None
    if prev_tr is not None and (prev_tr.shape, prev_tr.layout) == (tr.shape, tr.layout):
        name = f"compare-{prev.number:02d}-{stage.number:02d}.svg"
        written[name] = trace.render_compare_svg([prev_tr, tr])
        what = f"{prev.label} above, {stage.label} below, on one time axis"
    else:
        prev_tr = None
        name = f"trace-{stage.number:02d}.svg"
        written[name] = trace.render_svg(tr)
        what = f"{stage.label}"
    b, h, lq, _, d = tr.shape
    return [f"One CTA's measured timeline ({what}; B={b} H={h} L={lq} D={d}, "
            f"{tr.gpu or 'GPU'}):", "", f"![timeline]({img.name}/{name})", "",
            _timeline_sentence(prev_tr, tr)]


# --------------------------------------------------------------------------- pages

def _page(stage, prev, nxt, speed, runs, cache, col, img, written) -> str:
    title = f"Stage {stage.number}: {stage.name}"
    nav = ["[lineage](README.md)"]
    if prev:
        nav.insert(0, f"[← {prev.number:02d} {prev.name}]({page_name(prev)})")
    if nxt:
        nav.append(f"[{nxt.number:02d} {nxt.name} →]({page_name(nxt)})")
    out = [f"<!-- written by `python -m ptxattn.tools.guide` from committed files: do not edit -->",
           f"# {title}", "", " · ".join(nav), "", f"**The idea:** {stage.idea}.", ""]
    change = one_change(stage)
    if change:
        out += [f"> {change}", ""]
    out += [f"Source: [ptx/{stage.file}](../../ptx/{stage.file}). The file's header:", "",
            "```text", *header(stage), "```", ""]
    if prev:
        lines, left = diff_excerpt(prev, stage)
        out += ["## The diff", "",
                f"The hand-written sources of {prev.label} and {stage.label}, without trace "
                f"points and header comments"
                + (f" (the first {len(lines)} lines; {left} more: `ptxattn diff {prev.number} "
                   f"{stage.number}`)" if left else "") + ":", "",
                "```diff", *lines, "```", "", "## SASS", "", *_sass_table(cache, prev, stage), ""]
    out += ["## Speed", "", *_speed_table(speed, runs, prev, stage), "",
            "## Timeline", "", *_timeline(col, prev, stage, img, written), ""]
    return "\n".join(out)


def _index(all_st, speed, runs) -> str:
    out = ["<!-- written by `python -m ptxattn.tools.guide` from committed files: do not edit -->",
           "# The Hopper lineage, stage by stage", "",
           "One page per stage: the idea, the heart of its diff against the previous stage, what "
           "it did to the SASS, its measured speed, and one CTA's measured timeline beside its "
           "predecessor's. Regenerate with `ptxattn guide`.", "",
           "New to the terms (wgmma, TMA, mbarrier, warpgroup, setmaxnreg)? Read "
           "[the primer](primer.md) first. What `attention()` runs, grown from stage 14: "
           "[the production kernel](production.md).", "",
           "| # | stage | idea |", "|---|---|---|"]
    for st in all_st:
        out.append(f"| {st.number} | [{st.name}]({page_name(st)}) | {st.idea} |")
    return "\n".join(out) + "\n"


# The project's own bookkeeping (its issue and session numbers) that stage headers cite beside
# a source: readers of the guide have no use for it, so prose outside code blocks drops it.
_BOOKKEEPING = re.compile(r",\s*(?:issues?|session)\s+\d+(?:,?\s*(?:items?|run)\s+\d+)?"
                          r"|\s*\((?:issues?|session)\s+\d+(?:,?\s*(?:items?|run)\s+\d+)?\)"
                          r"|\b(?:session)\s+\d+(?:\s+run\s+\d+)?,\s*")


def public_prose(text: str) -> str:
    """`text` with ", issue 13" / "(session 4)" left out of every line but a diff's (a diff
    shows the source as it is)."""
    out, fence = [], None
    for line in text.split("\n"):
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
            out.append(line)
            continue
        out.append(line if fence == "diff" else _BOOKKEEPING.sub("", line))
    return "\n".join(out)


def build(out: Path = DOCS, results: Path = RESULTS) -> dict[str, str]:
    """{relative path: text} of every file of the guide (pages, index, SVGs); writes nothing."""
    all_st = list(stages.all_stages())
    runs = bench_runs(results)
    speed = speed_rows(runs)
    cache_path = out / SASS_CACHE
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else None
    tpath = newest_traces(results)
    col = trace.Collection.read_json(tpath) if tpath else None
    img = Path("img")
    files: dict[str, str] = {"README.md": _index(all_st, speed, runs)}
    from .guide_pages import pages
    files.update(pages())
    by_number = {st.number: st for st in all_st}
    for i, st in enumerate(all_st):
        # the page diffs a stage against the one it changes (16 and 17 change 14, not 15 or 16)
        prev = by_number.get(st.predecessor)
        nxt = all_st[i + 1] if i + 1 < len(all_st) else None
        written: dict[str, str] = {}
        files[page_name(st)] = _page(st, prev, nxt, speed, runs, cache, col, img, written)
        for name, svg in written.items():
            files[f"img/{name}"] = svg
    return {rel: public_prose(text) if rel.endswith(".md") else text
            for rel, text in files.items()}


def write(out: Path = DOCS, results: Path = RESULTS) -> list[Path]:
    files = build(out, results)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for rel, text in files.items():
        p = out / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
        written.append(p)
    # pages or images of a former build that this one does not write
    keep = {out / rel for rel in files} | {out / SASS_CACHE}
    for p in list(out.glob("*.md")) + list(out.glob("img/*.svg")):
        if p not in keep:
            p.unlink()
    return written


def stale(out: Path = DOCS, results: Path = RESULTS) -> list[str]:
    """Files whose committed text differs from what regenerating gives (or that are missing)."""
    files = build(out, results)
    bad = [rel for rel, text in files.items()
           if not (out / rel).is_file() or (out / rel).read_text(encoding="utf-8") != text]
    extra = [str(p.relative_to(out)) for p in list(out.glob("*.md")) + list(out.glob("img/*.svg"))
             if str(p.relative_to(out)) not in files]
    return sorted(bad + extra)


def main(argv=None) -> int:
    # the docstring's first paragraph (what it writes, what each mode needs) is the help text
    ap = argparse.ArgumentParser(prog="python -m ptxattn.tools.guide",
                                 description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sass", action="store_true",
                    help=f"first refresh docs/lineage/{SASS_CACHE} (the SASS deltas) with ptxas, then write")
    ap.add_argument("--check", action="store_true",
                    help=f"write nothing: list the files under docs/lineage/ that regenerating would "
                         "change, exit 1 when there are any")
    args = ap.parse_args(argv)
    if args.check and args.sass:
        # --check compares against the committed sass.json; refreshing it first would be a write
        ap.error("--check and --sass contradict each other (--check writes nothing)")
    if args.check:
        bad = stale()
        print("\n".join(bad) if bad else "the guide is current")
        return 1 if bad else 0
    if args.sass:
        print(f"wrote {refresh_sass()}")
    paths = write()
    print(f"wrote {len(paths)} files under {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

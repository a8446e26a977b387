"""The backward lineage as a guide: one Markdown page per stage under docs/lineage/backward/.

    python -m ptxattn.tools.guide_bwd            # rewrite the pages from committed files (no GPU)
    python -m ptxattn.tools.guide_bwd --sass     # first refresh docs/lineage/backward/sass.json (ptxas)
    python -m ptxattn.tools.guide_bwd --check    # exit 1 when a page is not what regenerating gives

Built like the forward's guide (ptxattn/guide.py, whose header/diff helpers it uses) from
committed inputs only: the registry's idea (STAGES in ptxattn/bwd_builds.py), each file's header,
the diff of the hand-written sources against the stage before, the SASS summaries in
sass.json, and the newest bench/results/*-backward.json run (bench/backward_bench.py). The
backward kernels have no trace points yet, so the pages have no timelines.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import bwd_builds
from . import guide

DOCS = guide.DOCS / "backward"
RESULTS = guide.RESULTS
SASS_CACHE = "sass.json"


def page_name(stage) -> str:
    return f"b{stage.number}_{stage.name}.md"


def refresh_sass(out: Path = DOCS) -> Path:
    """Assemble every backward stage with ptxas and keep the summaries the pages show."""
    from .. import backward
    from . import sass
    data = {}
    for st in bwd_builds.STAGES:
        text = backward.source(st.file).text
        a = sass.assemble_ptx(text, "sm_90a", st.label)
        s = sass.summarize(sass.disassemble(a.cubin), a.log, function=backward.ENTRY).to_dict()
        data[st.label] = {k: s[k] for k in guide._SASS_FIELDS if k in s}
    doc = {"about": "SASS summaries of each backward stage (python -m ptxattn.tools.guide_bwd --sass)",
           "ptxas": sass.tool_version(sass.find_tool("ptxas")), "stages": data}
    out.mkdir(parents=True, exist_ok=True)
    path = out / SASS_CACHE
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return path


def _sass_lines(cache, prev, stage) -> list[str]:
    from . import sass
    if not cache or stage.label not in cache["stages"]:
        return ["SASS summary pending (`python -m ptxattn.tools.guide_bwd --sass` needs ptxas)."]
    me = sass.SassSummary(**cache["stages"][stage.label])
    if prev is None or prev.label not in cache["stages"]:
        return [f"ptxas {cache.get('ptxas') or '?'}:", "", "```text",
                sass.format_summary(me, stage.label), "```"]
    before = sass.SassSummary(**cache["stages"][prev.label])
    rows = [r for r in sass.diff_summaries(before, me) if r.a != r.b]
    return [f"What changed in the SASS (ptxas {cache.get('ptxas') or '?'}; rows that did not "
            "change are left out):", "", "```text",
            sass.format_diff(rows, prev.label, stage.label), "```"]


def newest_run(results: Path = RESULTS) -> tuple[Path | None, dict | None]:
    runs = sorted(p for p in results.glob("*-backward*.json")
                  if not p.name.endswith("-variants.json"))     # (the build-table A/B runs)
    if not runs:
        return None, None
    return runs[-1], json.loads(runs[-1].read_text())


def _speed_lines(stage, run_path, run) -> list[str]:
    if run is None:
        return ["Not measured yet: `python bench/backward_bench.py --stages "
                f"{stage.label},production` on the H200 writes the run these pages read."]
    rows = [r for r in run["rows"] if r.get("stage") == stage.label and "tflops" in r]
    if not rows:
        return [f"Not in the newest run ({run_path.name})."]
    out = [f"From [{run_path.name}](../../../bench/results/{run_path.name}) (same run as cuDNN "
           f"through SDPA; backward FLOPs = 2.5 x the forward's):", "",
           "| case | TFLOP/s | cuDNN TFLOP/s | ratio (95% interval) |", "|---|---:|---:|---|"]
    for r in rows:
        lo, hi = r["ratio_ci"]
        out.append(f"| {r['case']} | {r['tflops']:.0f} | {r['cudnn_tflops']:.0f} | "
                   f"{r['ratio']:.3f} ({lo:.3f}-{hi:.3f}) |")
    return out


def _page(stage, prev, nxt, cache, run_path, run) -> str:
    nav = ["[backward lineage](README.md)", "[forward lineage](../README.md)"]
    if prev:
        nav.insert(0, f"[← b{prev.number} {prev.name}]({page_name(prev)})")
    if nxt:
        nav.append(f"[b{nxt.number} {nxt.name} →]({page_name(nxt)})")
    out = ["<!-- written by `python -m ptxattn.tools.guide_bwd` from committed files: do not edit -->",
           f"# Backward stage b{stage.number}: {stage.name}", "", " · ".join(nav), "",
           f"**The idea:** {stage.idea}.", ""]
    change = guide.one_change(stage)
    if change:
        out += [f"> {change}", ""]
    out += [f"Source: [ptx/{stage.file}](../../../ptx/{stage.file}). The file's header:", "",
            "```text", *guide.header(stage), "```", ""]
    if prev:
        lines, left = guide.diff_excerpt(prev, stage)
        out += ["## The diff", "",
                f"The hand-written sources of {prev.label} and {stage.label}, without header "
                "comments" + (f" (the first {len(lines)} lines; {left} more)" if left else "")
                + ":", "", "```diff", *lines, "```", ""]
    out += ["## SASS", "", *_sass_lines(cache, prev, stage), "",
            "## Speed", "", *_speed_lines(stage, run_path, run), "",
            "## Timeline", "", "No trace points in the backward kernels yet.", ""]
    return "\n".join(out)


def _index() -> str:
    out = ["<!-- written by `python -m ptxattn.tools.guide_bwd` from committed files: do not edit -->",
           "# The backward lineage, stage by stage", "",
           "Three stages from a readable baseline to the production kernel's structure, each one "
           "idea; the production backward (ptx/sm90/production/bwd.ptx) is the last grown to "
           "every forward feature. Regenerate with `python -m ptxattn.tools.guide_bwd`.", "",
           "| stage | idea |", "|---|---|"]
    for st in bwd_builds.STAGES:
        out.append(f"| [b{st.number} {st.name}]({page_name(st)}) | {st.idea} |")
    return "\n".join(out) + "\n"


def build(out: Path = DOCS, results: Path = RESULTS) -> dict[str, str]:
    cache_path = out / SASS_CACHE
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else None
    run_path, run = newest_run(results)
    all_st = list(bwd_builds.STAGES)
    files = {"README.md": _index()}
    by_number = {st.number: st for st in all_st}
    for i, st in enumerate(all_st):
        prev = by_number.get(st.predecessor)
        nxt = all_st[i + 1] if i + 1 < len(all_st) else None
        files[page_name(st)] = _page(st, prev, nxt, cache, run_path, run)
    return files


def write(out: Path = DOCS, results: Path = RESULTS) -> list[Path]:
    files = build(out, results)
    out.mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        (out / rel).write_text(text, encoding="utf-8")
    for p in out.glob("*.md"):
        if p.name not in files:
            p.unlink()
    return [out / rel for rel in files]


def stale(out: Path = DOCS, results: Path = RESULTS) -> list[str]:
    files = build(out, results)
    bad = [rel for rel, text in files.items()
           if not (out / rel).is_file() or (out / rel).read_text(encoding="utf-8") != text]
    return sorted(bad + [p.name for p in out.glob("*.md") if p.name not in files])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ptxattn.tools.guide_bwd",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--sass", action="store_true", help="first refresh sass.json with ptxas")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when stale")
    args = ap.parse_args(argv)
    if args.check and args.sass:
        ap.error("--check and --sass contradict each other (--check writes nothing)")
    if args.check:
        bad = stale()
        print("\n".join(bad) if bad else "the backward guide is current")
        return 1 if bad else 0
    if args.sass:
        print(f"wrote {refresh_sass()}")
    print(f"wrote {len(write())} files under {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

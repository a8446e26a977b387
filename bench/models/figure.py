"""The capstone figure: time per step of each model, torch's fastest SDPA backend against
ptxattn, each bar split into its attention share and the rest of the step.

    python bench/models/figure.py [--results bench/results/models] [--out bench/models/capstone.svg]
                                  [--table]     (and the README's results table, markdown)

Reads every capstone JSON (capstone.py's records) in --results, keeps the newest per model
(by its "date"; --tiny records, the CPU plumbing runs, are left out), and writes a
hand-written SVG: no matplotlib, the same records always give the same file. Each model has
its own scale (a video step and an 8k prefill differ tenfold); the numbers are printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from xml.sax.saxutils import escape

HERE = Path(__file__).resolve().parent
DEFAULT_RESULTS = HERE.parents[0] / "results" / "models"
DEFAULT_OUT = HERE / "capstone.svg"
MODEL_ORDER = ("ltx-2", "ltx-video", "wan", "llama")

WIDTH, LEFT, BAR_W, BAR_H = 920, 170, 520, 22
ATTN, REST = "#c2410c", "#fdba74"          # attention, the rest of the step (baseline)
ATTN_US, REST_US = "#1d4ed8", "#93c5fd"    # the same for ptxattn
ATTN_FP8, REST_FP8 = "#15803d", "#86efac"  # and for its opt-in FP8 path (capstone.py --fp8)
COLORS = ((ATTN, REST), (ATTN_US, REST_US), (ATTN_FP8, REST_FP8))


def load_reports(results_dir: Path, include_tiny: bool = False) -> list[dict]:
    """The newest capstone record per model in `results_dir`, ordered by model name."""
    newest: dict[str, dict] = {}
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a readable JSON file ({e})") from e
        if not isinstance(report, dict) or "model" not in report or "results" not in report:
            continue                            # another kind of result file
        if report.get("tiny") and not include_tiny:
            continue
        report["_file"] = path.name
        old = newest.get(report["model"])
        if old is None or str(report.get("date", "")) >= str(old.get("date", "")):
            newest[report["model"]] = report
    return sorted(newest.values(), key=lambda r: (_order(r["model"]), r["model"]))


def _order(model: str) -> int:
    """Video models first, in the order of issue 12, then the LLM; unknown names last."""
    for i, prefix in enumerate(MODEL_ORDER):
        if model.startswith(prefix):
            return i
    return len(MODEL_ORDER)


def row(report: dict) -> dict:
    """What one model's block shows: baseline and ptxattn (step ms, attention share), or why
    there is no comparison."""
    results = {r["backend"]: r for r in report["results"]}
    comparison = report.get("comparison") or {}
    base = results.get(comparison.get("baseline", ""))
    ours = results.get("ptxattn")
    out = {"model": report["model"], "note": report.get("note", ""),
           "layers": report.get("layers") or _depth(report), "gpu": report.get("gpu", ""),
           "weights": report.get("weights", ""), "layers_reduced": report.get("layers_reduced")}
    if base is None or ours is None or "error" in ours:
        errors = {b: r["error"] for b, r in results.items() if "error" in r}
        out["missing"] = ("no comparison: " + "; ".join(f"{b}: {e[:60]}" for b, e in errors.items())
                          if errors else "no comparison")
        return out
    out["bars"] = [(f"{base['backend']} (fastest SDPA)", base), ("ptxattn", ours)]
    out["speedup"] = comparison.get("speedup_step")
    out["by_round"] = comparison.get("speedup_by_round")
    out["diff"] = comparison.get("ptxattn_vs_baseline_rel_l2")
    out["yardstick"] = comparison.get("yardstick_rel_l2")
    if out["yardstick"] is None:
        torch_diffs = list((comparison.get("torch_backends_vs_baseline_rel_l2") or {}).values())
        out["yardstick"] = max(torch_diffs) if torch_diffs else None
    out["fallbacks"] = ours.get("fallbacks") or {}
    fp8 = results.get("ptxattn_fp8")
    if fp8 is not None and "error" not in fp8:
        out["bars"].append(("ptxattn FP8", fp8))
        out["fp8"] = comparison.get("fp8") or {}
    return out


def _block_h(r: dict) -> int:
    if "bars" not in r:
        return 2 * BAR_H + 62
    return len(r["bars"]) * (BAR_H + 4) + 54 + (14 if r.get("fp8") else 0)


def _depth(report: dict):
    config = report.get("config", {})
    return config.get("num_layers", config.get("num_hidden_layers"))


def _fmt_ms(ms: float) -> str:
    return f"{ms:,.1f} ms" if ms < 1000 else f"{ms / 1000:,.2f} s"


def render(reports: list[dict]) -> str:
    """The SVG text for these records."""
    rows = [row(r) for r in reports]
    height = 96 + sum(_block_h(r) for r in rows) + (0 if rows else 2 * BAR_H + 62) + 30
    gpus = sorted({r["gpu"] for r in rows if r["gpu"]})
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
             f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">',
             f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
             '<text x="20" y="28" font-size="16" font-weight="bold">ptxattn in real models: '
             'one step, torch\'s fastest SDPA backend against ptxattn</text>',
             f'<text x="20" y="48" fill="#444">{escape(", ".join(gpus) or "no GPU recorded")}; '
             'bf16; each model on its own scale; bar = time per step, dark part = attention '
             '(CUDA events, warm pass)</text>']
    lx = 20
    legend = [(ATTN, "attention (SDPA)"), (REST, "rest of the step (SDPA)"),
              (ATTN_US, "attention (ptxattn)"), (REST_US, "rest of the step (ptxattn)")]
    if any("fp8" in r for r in rows):
        legend.append((ATTN_FP8, "ptxattn FP8 (same split)"))
    for color, label in legend:
        parts.append(f'<rect x="{lx}" y="60" width="12" height="12" fill="{color}"/>'
                     f'<text x="{lx + 16}" y="70">{escape(label)}</text>')
        lx += 200 if len(legend) == 4 else 178
    if not rows:
        parts.append('<text x="20" y="110">no capstone results found</text>')
    y = 96
    for r in rows:
        depth = f"{r['layers']} layers" + (" (reduced)" if r.get("layers_reduced") else "")
        head = f"{r['model']}: {depth}, {r['weights']} weights"
        if r.get("speedup"):
            head += f"; step speedup with ptxattn {r['speedup']:.3f}x"
            if r.get("by_round"):
                head += (f" (per round {r['by_round']['min']:.3f}-{r['by_round']['max']:.3f}, "
                         f"{r['by_round']['rounds']} rounds)")
        parts.append(f'<text x="20" y="{y + 14}" font-weight="bold">{escape(head)}</text>')
        parts.append(f'<text x="20" y="{y + 30}" fill="#444">{escape(r["note"][:130])}</text>')
        if "missing" in r:
            parts.append(f'<text x="{LEFT}" y="{y + 54}" fill="#b91c1c">'
                         f'{escape(r["missing"][:110])}</text>')
            y += _block_h(r)
            continue
        scale = BAR_W / max(b["step_ms_median"] for _, b in r["bars"])
        for i, (label, b) in enumerate(r["bars"]):
            by = y + 38 + i * (BAR_H + 4)
            step = b["step_ms_median"]
            share = b.get("attention_share") or 0.0
            attn_w = min(max(share, 0.0), 1.0) * step * scale
            dark, light = COLORS[min(i, len(COLORS) - 1)]
            parts.append(f'<text x="{LEFT - 8}" y="{by + 15}" text-anchor="end">'
                         f'{escape(label)}</text>')
            parts.append(f'<rect x="{LEFT}" y="{by}" width="{step * scale:.1f}" '
                         f'height="{BAR_H}" fill="{light}"/>')
            parts.append(f'<rect x="{LEFT}" y="{by}" width="{attn_w:.1f}" height="{BAR_H}" '
                         f'fill="{dark}"/>')
            parts.append(f'<text x="{LEFT + step * scale + 6:.1f}" y="{by + 15}">'
                         f'{escape(_fmt_ms(step))}, attention {100 * share:.0f}%</text>')
        tail = []
        if r.get("diff") is not None:
            tail.append(f"output rel. diff vs baseline: ptxattn {r['diff']:.2e}")
        if r.get("yardstick") is not None:
            tail.append(f"torch's own backends {r['yardstick']:.2e}")
        if r.get("fallbacks"):
            tail.append("fallbacks per step " + ", ".join(f"{k} {v}" for k, v in
                                                         sorted(r["fallbacks"].items())))
        lines = ["; ".join(tail)]
        fp8 = r.get("fp8") or {}
        if fp8.get("speedup_vs_baseline"):
            lines.append(f"FP8: {fp8['speedup_vs_baseline']:.3f}x the baseline, "
                         f"{fp8.get('speedup_vs_ptxattn_bf16') or 0:.3f}x ptxattn bf16; its "
                         f"output rel. diff vs baseline {fp8['vs_baseline_rel_l2']:.2e}")
        for j, line in enumerate(lines):
            parts.append(f'<text x="{LEFT}" y="{y + 38 + len(r["bars"]) * (BAR_H + 4) + 12 + 14 * j}" '
                         f'fill="#444">{escape(line)}</text>')
        y += _block_h(r)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


TABLE_HEAD = ("| model (layers) | fastest SDPA, ms/step | ptxattn, ms/step | step speedup | "
              "attention share (SDPA → ptxattn) | output rel. diff: ptxattn / torch's backends |\n"
              "|---|---:|---:|---:|---:|---:|")


def table(reports: list[dict]) -> str:
    """The README's results table (markdown) for these records."""
    lines = [TABLE_HEAD]
    for r in map(row, reports):
        name = f"{r['model']} ({r['layers']}{', reduced' if r.get('layers_reduced') else ''})"
        if "missing" in r:
            lines.append(f"| {name} | {r['missing'][:80]} | | | | |")
            continue
        (base_label, base), (_, ours) = r["bars"][:2]
        speedup = f"{r['speedup']:.3f}x"
        if r.get("by_round"):
            speedup += f" ({r['by_round']['min']:.3f}-{r['by_round']['max']:.3f})"
        diff = f"{r['diff']:.2e}" if r.get("diff") is not None else "-"
        yard = f"{r['yardstick']:.2e}" if r.get("yardstick") is not None else "-"
        lines.append(f"| {name} | {base['backend']} {base['step_ms_median']:.1f} | "
                     f"{ours['step_ms_median']:.1f} | {speedup} | "
                     f"{100 * base['attention_share']:.0f}% → {100 * ours['attention_share']:.0f}% | "
                     f"{diff} / {yard} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(DEFAULT_RESULTS), help="folder of capstone JSON")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="the SVG to write")
    ap.add_argument("--include-tiny", action="store_true", help="draw --tiny records too")
    ap.add_argument("--table", action="store_true",
                    help="also print the README's results table (markdown) for the records")
    args = ap.parse_args(argv)
    results = Path(args.results)
    if not results.is_dir():
        ap.error(f"--results: {results} is not a folder")
    reports = load_reports(results, args.include_tiny)
    Path(args.out).write_text(render(reports))
    print(f"wrote {args.out}: {len(reports)} model(s): "
          + ", ".join(f"{r['model']} ({r['_file']})" for r in reports))
    if args.table:
        print(table(reports), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

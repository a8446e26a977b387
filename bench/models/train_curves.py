"""The training check's arithmetic and figure, free of torch (train_check.py runs the models).

A run is a list of per-step losses. The check (issue 26): the curve of a run with ptxattn
and the curve of a run with torch's SDPA, same init and same data order, agree within the
spread of two SDPA runs that differ only in their data order. Curves are compared after a
moving average (single steps are noisy by nature: batches differ), from `skip` steps on
(the first steps' losses fall too fast for a difference to mean anything):

    spread = max_t |smooth(sdpa)_t - smooth(sdpa_other_order)_t|
    gap    = max_t |smooth(ptxattn)_t - smooth(sdpa)_t|
    pass   = gap <= spread

The figure is a hand-written SVG (no plotting library: the same records give the same file).
"""

from __future__ import annotations

import math


def smooth(values, window: int) -> list[float]:
    """Trailing moving average over `window` steps (shorter at the start)."""
    if window < 1:
        raise ValueError(f"window: expected >= 1, got {window}")
    out, total = [], 0.0
    for i, x in enumerate(values):
        total += x
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def max_gap(a, b, window: int, skip: int) -> tuple[float, int]:
    """(max |smooth(a) - smooth(b)| from step `skip` on, the step where it is)."""
    if len(a) != len(b):
        raise ValueError(f"curves: expected equal lengths, got {len(a)} and {len(b)}")
    sa, sb = smooth(a, window), smooth(b, window)
    gaps = [(abs(x - y), t) for t, (x, y) in enumerate(zip(sa, sb)) if t >= skip]
    if not gaps:
        raise ValueError(f"skip: {skip} leaves no step of {len(a)} to compare")
    return max(gaps)


def verdict(runs: dict, window: int = 20, skip: int = 20) -> dict:
    """The check on runs {"ptxattn": [...], "sdpa": [...], "sdpa_other_order": [...]}."""
    for name in ("ptxattn", "sdpa", "sdpa_other_order"):
        if name not in runs:
            raise ValueError(f"runs: missing {name!r} (have {sorted(runs)})")
        bad = [t for t, x in enumerate(runs[name]) if not math.isfinite(x)]
        if bad:
            return {"pass": False, "why": f"{name}: non-finite loss at steps {bad[:5]}"}
    spread, spread_at = max_gap(runs["sdpa"], runs["sdpa_other_order"], window, skip)
    gap, gap_at = max_gap(runs["ptxattn"], runs["sdpa"], window, skip)
    final = {n: smooth(v, window)[-1] for n, v in runs.items()}
    return {"pass": gap <= spread, "gap": gap, "gap_step": gap_at, "spread": spread,
            "spread_step": spread_at, "window": window, "skip": skip, "final_smoothed": final,
            "why": (f"max smoothed gap ptxattn-sdpa {gap:.4f} (step {gap_at}) "
                    f"{'<=' if gap <= spread else '>'} spread of two SDPA data orders "
                    f"{spread:.4f} (step {spread_at})")}


COLOURS = {"ptxattn": "#d62728", "sdpa": "#1f77b4", "sdpa_other_order": "#7f7f7f"}


def svg(runs: dict, title: str, window: int = 20, width: int = 720, height: int = 420) -> str:
    """Smoothed loss curves of every run (raw losses faint beneath), one SVG document."""
    left, right, top, bottom = 60, 170, 40, 50
    steps = max(len(v) for v in runs.values())
    finite = [x for v in runs.values() for x in v if math.isfinite(x)]
    lo, hi = min(finite), max(finite)
    hi = hi if hi > lo else lo + 1.0
    pw, ph = width - left - right, height - top - bottom

    def xy(t, y):
        x = left + pw * (t / max(1, steps - 1))
        return x, top + ph * (1 - (y - lo) / (hi - lo))

    def line(values, colour, opacity, stroke):
        pts = " ".join("%.1f,%.1f" % xy(t, y) for t, y in enumerate(values) if math.isfinite(y))
        return (f'<polyline fill="none" stroke="{colour}" stroke-opacity="{opacity}" '
                f'stroke-width="{stroke}" points="{pts}"/>')

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{left}" y="22" font-size="14">{_escape(title)}</text>',
             f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" '
             f'stroke="#444"/>']
    for i in range(5):                                   # y ticks
        y = lo + (hi - lo) * i / 4
        _, py = xy(0, y)
        parts.append(f'<text x="{left - 6}" y="{py + 4:.1f}" text-anchor="end">{y:.2f}</text>')
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{py:.1f}" y2="{py:.1f}" '
                     f'stroke="#ddd"/>')
    for i in range(6):                                   # x ticks
        t = round((steps - 1) * i / 5)
        px, _ = xy(t, lo)
        parts.append(f'<text x="{px:.1f}" y="{top + ph + 18}" text-anchor="middle">{t}</text>')
    parts.append(f'<text x="{left + pw / 2}" y="{height - 10}" text-anchor="middle">step'
                 f'</text>')
    parts.append(f'<text x="16" y="{top + ph / 2}" transform="rotate(-90 16 {top + ph / 2})" '
                 f'text-anchor="middle">loss</text>')
    for n, (name, values) in enumerate(sorted(runs.items())):
        colour = COLOURS.get(name, "#2ca02c")
        parts.append(line(values, colour, 0.2, 1))
        parts.append(line(smooth(values, window), colour, 1.0, 2))
        ly = top + 16 + 18 * n
        parts.append(f'<line x1="{left + pw + 12}" x2="{left + pw + 32}" y1="{ly - 4}" '
                     f'y2="{ly - 4}" stroke="{colour}" stroke-width="2"/>')
        parts.append(f'<text x="{left + pw + 38}" y="{ly}">{_escape(name)}</text>')
    parts.append(f'<text x="{left + pw + 12}" y="{top + 16 + 18 * len(runs) + 6}" '
                 f'fill="#666">moving average: {window} steps</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

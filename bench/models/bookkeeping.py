"""The capstone's bookkeeping, free of torch: attention FLOPs from call shapes, the per-step
summary of attention calls, the JSON record's required fields.

capstone.py (torch) records one entry per attention call:
    {"path": "torch" | "ptxattn", "role": "attn1", "q": [..], "k": [..], "layout": "bhld",
     "causal": False}
and hands the list to summarize_calls(). figure.py and the CPU tests read the same fields.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

LAYOUTS = ("bhld", "bshd")

# Fields every capstone JSON has (the CPU test checks a real record against them).
REPORT_FIELDS = ("model", "note", "config", "layers_reduced", "weights", "device", "args",
                 "results", "comparison", "torch", "gpu", "commit", "date")
# Fields of each backend's result that ran (one that failed has "backend" and "error").
RESULT_FIELDS = ("backend", "step_ms_median", "step_ms", "attention_ms_in_hooked_pass",
                 "attention_share", "attention_tflops", "calls", "fallbacks")
CALLS_FIELDS = ("calls", "by_role", "by_path", "by_shape", "flops")


def dims(shape, layout: str) -> tuple[int, int, int, int]:
    """(batch, heads, length, head_dim) of a rank-4 shape in `layout`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    if len(shape) != 4:
        raise ValueError(f"shape: expected 4 dims, got {list(shape)}")
    b, x, y, d = (int(s) for s in shape)
    return (b, x, y, d) if layout == "bhld" else (b, y, x, d)


def causal_pairs(lq: int, lk: int) -> int:
    """Query-key pairs a top-left causal mask keeps (PyTorch's is_causal: query i sees keys
    0..i): sum over i < lq of min(i + 1, lk)."""
    if lq < 0 or lk < 0:
        raise ValueError(f"lq, lk: expected lengths >= 0, got {lq}, {lk}")
    full = min(lq, lk)                       # rows 0..full-1 see i+1 keys
    return full * (full + 1) // 2 + (lq - full) * lk


def attention_flops(q_shape, k_shape, layout: str = "bhld", causal: bool = False) -> int:
    """FLOPs of one attention call, 4·B·H·pairs·D (the benchmark protocol: QKᵀ and PV, two
    FLOPs a multiply-add); pairs = Lq·Lk, or the unmasked pairs when causal."""
    b, h, lq, d = dims(q_shape, layout)
    _, _, lk, _ = dims(k_shape, layout)
    pairs = causal_pairs(lq, lk) if causal else lq * lk
    return 4 * b * h * pairs * d


def role_of(module_name: str | None) -> str:
    """The attention module's name without its block index and parents: the same role in
    every block ("transformer_blocks.7.audio_attn1" -> "audio_attn1",
    "model.layers.0.self_attn" -> "self_attn"); calls outside a named module: "other"."""
    if not module_name:
        return "other"
    parts = [p for p in module_name.split(".") if not re.fullmatch(r"\d+", p)]
    return parts[-1] if parts else "other"


def shape_key(entry: dict) -> str:
    mask = " causal" if entry.get("causal") else ""
    return (f"{entry['path']} {entry.get('role', 'other')} q={list(entry['q'])} "
            f"k={list(entry['k'])} {entry['layout']}{mask}")


def summarize_calls(record: list[dict]) -> dict:
    """Calls of one step: how many, per role, per path (torch / ptxattn), per shape, and
    their FLOPs in all."""
    by_role: dict[str, int] = {}
    by_path: dict[str, int] = {}
    by_shape: dict[str, int] = {}
    flops = 0
    for e in record:
        role = e.get("role", "other")
        by_role[role] = by_role.get(role, 0) + 1
        by_path[e["path"]] = by_path.get(e["path"], 0) + 1
        key = shape_key(e)
        by_shape[key] = by_shape.get(key, 0) + 1
        flops += attention_flops(e["q"], e["k"], e["layout"], bool(e.get("causal")))
    return {"calls": len(record), "by_role": by_role, "by_path": by_path,
            "by_shape": by_shape, "flops": flops}


def missing_fields(report: dict) -> list[str]:
    """The fields a capstone JSON lacks ("results[2].attention_share", ...); [] when whole."""
    missing = [f for f in REPORT_FIELDS if f not in report]
    for i, r in enumerate(report.get("results", [])):
        if "error" in r:
            missing += [f"results[{i}].{f}" for f in ("backend",) if f not in r]
            continue
        missing += [f"results[{i}].{f}" for f in RESULT_FIELDS if f not in r]
        calls = r.get("calls", {})
        missing += [f"results[{i}].calls.{f}" for f in CALLS_FIELDS if f not in calls]
    comparison = report.get("comparison", {})
    if comparison:
        missing += [f"comparison.{f}" for f in
                    ("baseline", "torch_backends_vs_baseline_rel_l2",
                     "ptxattn_vs_baseline_rel_l2", "speedup_step", "speedup_by_round")
                    if f not in comparison]
    return missing


def commit() -> str:
    """The checkout's HEAD commit ("" without git), for the scripts' JSON records."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return ""

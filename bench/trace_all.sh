#!/usr/bin/env bash
# Timelines of every traced stage on the H200, in ONE device call, from the repository root:
#
#   bash bench/trace_all.sh            (the run tool sets $OUT; carry .whl with the pcpp wheel)
#
# Records CTA (0, 0, 0) of every stage with trace points (ptxattn.tools.trace.record_all) on one
# shape and writes, into $OUT (at most 5 files, well under the 8-file limit):
#   traces-<date>-h200.json   ALL the traces in one JSON (ptxattn-traces/1, one trace a line):
#                             commit it as bench/results/traces-<date>-h200.json; the guide
#                             (python -m ptxattn.tools.guide) draws every page's SVGs from it on the CPU
#   trace_all.txt             per stage: the summary, the traced build's check, balance of the
#                             begin/end pairs; then the GPU trace tests (unless SKIP_TESTS=1)
#   trace-stage01.svg, trace-compare-06-07.svg, trace-stage14.svg   a first look
#
# Switches (environment): STAGES=1,7,14 (default: every traced stage)  TRACE_SHAPE=1x16x2048x128
#   LAYOUT=bhld  SEED=0  SKIP_TESTS=1
set -uo pipefail

OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
TRACE_SHAPE=${TRACE_SHAPE:-1x16x2048x128}
STAGES=${STAGES:-}
LAYOUT=${LAYOUT:-bhld}
SEED=${SEED:-0}
DATE=$(date +%F)
JSON="$OUT/traces-$DATE-h200.json"
LOG="$OUT/trace_all.txt"

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1

{
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv || true
    python3 - "$JSON" "$TRACE_SHAPE" "$STAGES" "$LAYOUT" "$SEED" <<'EOF'
import sys
from ptxattn.tools import trace as T

path, shape, stage_arg, layout, seed = sys.argv[1:6]
b, h, l, d = (int(x) for x in shape.split("x"))
chosen = [int(s) for s in stage_arg.split(",") if s.strip()] or None
col = T.record_all(chosen, progress=print, batch=b, heads=h, seq_len=l, head_dim=d,
                   layout=layout, seed=int(seed))
col.meta["shape"] = shape
col.write_json(path)
print(f"\nwrote {path}: {len(col.traces)} traces, {len(col.errors)} failed")
bad = 0
for n, tr in sorted(col.traces.items()):
    c = tr.check or {}
    try:
        T.intervals(tr.events, strict=True)
        pairs = "balanced"
    except T.UnbalancedTraceError as exc:
        pairs, bad = f"UNBALANCED: {exc}", bad + 1
    print(f"{tr.label}: span {tr.span_us or 0:.1f} us, kernel {tr.kernel_ms or 0:.3f} ms, "
          f"check {'PASS' if c.get('pass') else 'FAIL'} rel_l2 {c.get('rel_l2', float('nan')):.2e}, "
          f"truncated {list(tr.truncated)}, {pairs}")
    bad += (not c.get("pass")) + bool(tr.truncated)
for n, err in sorted(col.errors.items()):
    print(f"stage{n:02d}: FAILED {err}")
out = path.rsplit("/", 1)[0]
for n in (1, 14):
    if n in col.traces:
        T.render_svg(col.traces[n], f"{out}/trace-stage{n:02d}.svg")
if 6 in col.traces and 7 in col.traces:
    T.render_compare_svg([col.traces[6], col.traces[7]], f"{out}/trace-compare-06-07.svg")
sys.exit(1 if bad or col.errors else 0)
EOF
    echo "record_all exit $?"
    if [[ -z ${SKIP_TESTS:-} ]]; then
        PTXATTN_REQUIRE_GPU=1 python3 -m pytest -q -rs tests/test_trace_gpu.py 2>&1 | tail -25
    fi
} 2>&1 | tee "$LOG"

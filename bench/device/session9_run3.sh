#!/usr/bin/env bash
# Device call C (session 9): generate() at batch 8 after session 8's graph-break fix (both
# caches; the static one compiled), then the backward's default-path GPU suite.
set -uo pipefail
source bench/device/call_setup.sh call-c.log
part "generate_bench batch 8"
timeout ${GB_S:-300} python3 bench/models/generate_bench.py --batches 8 --budget-s 270 \
    --out "$OUT" >> "$LOG" 2>&1; echo "generate rc $?" | tee -a "$LOG"
part "GPU tests: backward"
left=$(( ${END_S:-540} - (SECONDS - t0) ))
timeout $left python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu_backward.py \
    >> "$LOG" 2>&1; echo "tests rc $?" | tee -a "$LOG"
part "end"
grep -E "=====|rc |passed|failed|FAILED|summary|decode_|b8 " "$LOG" | cut -c1-260 | tail -50

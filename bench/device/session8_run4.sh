#!/usr/bin/env bash
# Device call D (session 8): the 80-row backward variant (bench/device/session8_bwd_m80.sh:
# its GPU tests and its benchmark against st_ahead), the default-path GPU suites of the
# backward, decode and serving, the generate() tests after the probe's fix, then as many of
# the production set's ncu L2 lines as time leaves (natural clocks).
set -uo pipefail
source bench/device/call_setup.sh call-d.log
part "m80"
T_S=70 BW_S=110 bash bench/device/session8_bwd_m80.sh > /dev/null 2>&1
cat "$OUT/m80.log" >> "$LOG"; rm -f "$OUT/m80.log"
part "GPU tests: backward, decode, serving, generate"
timeout ${TS_S:-150} python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu_backward.py \
    tests/test_gpu_decode.py tests/test_gpu_serving.py tests/test_gpu_generate.py \
    >> "$LOG" 2>&1; echo "tests rc $?" | tee -a "$LOG"
part "ncu L2, production lines"
ncu_lines bench/experiments/2026-12-02-ncu-l2-production.txt "$OUT/ncu-l2-production.jsonl"
part "end"
grep -vE "^\s*$" "$LOG" | grep -E "=====|rc |vs st_ahead|passed|failed|FAILED|natural|production [0-9]|skipped \(time" \
    | cut -c1-220 | tail -70

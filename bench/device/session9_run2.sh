#!/usr/bin/env bash
# Device call B (session 9): PrefillPlan.run's parts alone (bench/experiments/host_parts.py),
# the plans' host time with a caller's out= (serving_bench --parts host), the GPU tests of the
# serving path after out= took the fast path, then the production set's four ncu L2 lines
# session 8 left (GQA causal, window, LTX, Llama prefill; natural clocks).
set -uo pipefail
source bench/device/call_setup.sh call-b.log
part "host parts"
timeout 90 python3 bench/experiments/host_parts.py --out "$OUT/host-parts.json" >> "$LOG" 2>&1
echo "host parts rc $?" | tee -a "$LOG"
part "serving host"
timeout 90 python3 bench/serving_bench.py --out "$OUT" --parts host --repeats 9 >> "$LOG" 2>&1
echo "serving host rc $?" | tee -a "$LOG"
part "GPU tests of the serving path"
timeout 150 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu_serving.py \
    tests/test_gpu_transformers_paged.py >> "$LOG" 2>&1; echo "tests rc $?" | tee -a "$LOG"
part "ncu L2, remaining production lines"
END_S=${END_S:-420} ncu_lines bench/experiments/2026-12-02-ncu-l2-remaining.txt "$OUT/ncu-l2-production.jsonl"
part "end"
grep -E "=====|host_parts|host  |rc |passed|failed|FAILED|natural|production [0-9]|skipped \(time" \
    "$LOG" | cut -c1-220 | tail -60

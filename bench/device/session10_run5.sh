#!/usr/bin/env bash
# Session 10, call 5: generate()'s GPU tests after the promotion fix, and generate() dynamic at
# batch 1 and a second batch-8 sample (the README's rows).
set -uo pipefail
source bench/device/call_setup.sh run5.log
part "GPU tests: generate"
timeout 150 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu_generate.py \
    >> "$LOG" 2>&1; echo "generate tests rc $?" | tee -a "$LOG"
for b in 1 8; do
    part "generate profile, batch $b (dynamic)"
    timeout 100 python3 bench/experiments/generate_profile.py --batch $b --no-static --tokens 24 \
        >> "$LOG" 2>&1; echo "gen b$b rc $?" | tee -a "$LOG"
done
part "end"
grep -E "=====|rc |passed|failed|FAILED|== |steps: " "$LOG" | cut -c1-300 | tail -30

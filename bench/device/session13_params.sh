#!/usr/bin/env bash
# Session 13, call 4: bench/experiments/launch_params.py twice (call 3's run failed on a
# property read as a call). Files: $OUT/params.log, $OUT/launch_params-{1,2}.json
set -uo pipefail
source bench/device/call_setup.sh params.log
for round in 1 2; do
    part "launch_params $round"
    timeout 60 taskset -c 9 python3 bench/experiments/launch_params.py \
        --out "$OUT/launch_params-$round.json" >> "$LOG" 2>&1
    echo "launch_params rc $?" | tee -a "$LOG"
done
grep -E "=====|rc |launch_params |Error" "$LOG" | cut -c1-200

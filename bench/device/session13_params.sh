#!/usr/bin/env bash
# Session 13, calls 4 and 5: bench/experiments/launch_params.py twice (call 4's forward row
# failed: the experiment let the plan, whose tile table the frozen launch reads, be collected;
# call 5 adds the forward as a CUDA graph of one and two nodes), then host_rounds of this tree
# twice more. Files: $OUT/params.log, $OUT/launch_params-{1,2}.json, $OUT/new-{1,2}.json
set -uo pipefail
source bench/device/call_setup.sh params.log
for round in 1 2; do
    part "launch_params $round"
    timeout 60 taskset -c 9 python3 bench/experiments/launch_params.py \
        --out "$OUT/launch_params-$round.json" >> "$LOG" 2>&1
    echo "launch_params rc $?" | tee -a "$LOG"
done
for round in 1 2; do
    part "host_rounds new $round"
    timeout 50 taskset -c 9 python3 bench/experiments/host_rounds.py \
        --out "$OUT/new-$round.json" >> "$LOG" 2>&1
    echo "host_rounds rc $?" | tee -a "$LOG"
done
grep -E "=====|rc |launch_params |host_rounds |Error" "$LOG" | cut -c1-200

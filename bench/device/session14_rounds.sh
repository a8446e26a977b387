#!/usr/bin/env bash
# Session 14: issue 25's run() <= 10 µs a layer, the measurement session 13 asked for: graphs
# and launches of each plan path interleaved repeat by repeat with the calibration loops
# (host_rounds --interleave), five processes pinned to one core, so that each ratio and each
# figure is read against the host speed of its own repeat. Files: $OUT/rounds.log,
# $OUT/rounds-{1..5}.json
set -uo pipefail
source bench/device/call_setup.sh rounds.log
for round in 1 2 3 4 5; do
    part "host_rounds $round"
    timeout 70 taskset -c 9 python3 bench/experiments/host_rounds.py --graphs both --interleave \
        --repeats 15 --out "$OUT/rounds-$round.json" >> "$LOG" 2>&1
    echo "host_rounds rc $?" | tee -a "$LOG"
done
grep -E "=====|rc |prefill_plan_run_out|decode_plan_run_out|calib|Error" "$LOG" | cut -c1-200

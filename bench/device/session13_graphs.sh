#!/usr/bin/env bash
# Session 13, call 6: graph replays of the plans' frozen launches (replay.py). The GPU tests of
# the plans' paths (bit for bit the unplanned calls, through graphs, and under torch's capture),
# then run()'s host time with graphs and without in the same process (host_rounds --graphs
# both), three processes. Files: $OUT/graphs.log, $OUT/rounds-{1,2,3}.json
set -uo pipefail
source bench/device/call_setup.sh graphs.log
part "GPU tests"
timeout ${TEST_S:-220} python3 -m pytest -q -rfs -p no:cacheprovider --durations=5 \
    tests/test_gpu_frozen_launch.py tests/test_gpu_fastlaunch.py tests/test_gpu_serving.py \
    tests/test_gpu_transformers_paged.py tests/test_gpu_decode.py >> "$LOG" 2>&1
echo "tests rc $?" | tee -a "$LOG"
for round in 1 2 3; do
    part "host_rounds $round"
    timeout 60 taskset -c 9 python3 bench/experiments/host_rounds.py --graphs both \
        --out "$OUT/rounds-$round.json" >> "$LOG" 2>&1
    echo "host_rounds rc $?" | tee -a "$LOG"
done
grep -E "=====|rc |passed|failed|FAILED|host_rounds |Error" "$LOG" | cut -c1-200

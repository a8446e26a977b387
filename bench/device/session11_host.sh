#!/usr/bin/env bash
# Session 11, frozen launches (issue 25's run() <= 10 us): the GPU tests of the plans' paths
# (test_gpu_frozen_launch: every frozen run bit for bit the unplanned call's; fastlaunch,
# serving, the transformers integration, decode), then host time of the tree before
# (build/old: git archive of the session's start, carried) and after, interleaved in one call
# on one host: bench/experiments/host_parts.py (PrefillPlan.run and its parts, DecodePlan.run)
# and serving_bench.py --parts host,integration, decode_bench's host figures (b8_32k, b1_8k).
# Files (7): $OUT/host.log, $OUT/parts-{old,new}.json, $OUT/{old,new}/*{serving,decode}*.json
set -uo pipefail
source bench/device/call_setup.sh host.log
ROOT=$PWD
part "GPU tests"
timeout ${TEST_S:-200} python3 -m pytest -q -rfs -p no:cacheprovider --durations=5 \
    tests/test_gpu_frozen_launch.py tests/test_gpu_fastlaunch.py tests/test_gpu_serving.py \
    tests/test_gpu_transformers_paged.py tests/test_gpu_decode.py >> "$LOG" 2>&1
echo "tests rc $?" | tee -a "$LOG"
tree_of() { [ "$1" = old ] && echo "$ROOT/build/old" || echo "$ROOT"; }
for round in 1 2; do
    for tree in old new; do
        part "host_parts $tree (round $round)"
        (cd "$(tree_of $tree)" && PYTHONPATH=/tmp/site:$PWD timeout ${PARTS_S:-45} \
            python3 bench/experiments/host_parts.py \
            $([ $round = 1 ] && echo --out "$OUT/parts-$tree.json")) >> "$LOG" 2>&1
        echo "host_parts $tree $round rc $?" | tee -a "$LOG"
    done
done
for tree in old new; do
    part "serving_bench host $tree"
    mkdir -p "$OUT/$tree"
    (cd "$(tree_of $tree)" && PYTHONPATH=/tmp/site:$PWD timeout ${HOST_S:-60} \
        python3 bench/serving_bench.py --out "$OUT/$tree" --parts integration,host \
        --repeats 7) >> "$LOG" 2>&1
    echo "serving_bench $tree rc $?" | tee -a "$LOG"
done
for tree in old new; do
    part "decode_bench host $tree"
    mkdir -p "$OUT/$tree"
    (cd "$(tree_of $tree)" && PYTHONPATH=/tmp/site:$PWD timeout ${DEC_S:-100} \
        python3 bench/decode_bench.py --out "$OUT/$tree" --cases b8_32k,b1_8k --rounds 3 \
        --reps 5) >> "$LOG" 2>&1
    echo "decode_bench $tree rc $?" | tee -a "$LOG"
done
for tree in old new; do
    part "decode host us per call (dechost_cpu --gpu) $tree"
    (cd "$(tree_of $tree)" && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 \
        bench/experiments/dechost_cpu.py --gpu) >> "$LOG" 2>&1
    echo "dechost $tree rc $?" | tee -a "$LOG"
done
part "end"
grep -E "=====|rc |passed|failed|FAILED|host_parts |integration |host  |host us|us_per_call" "$LOG" | cut -c1-200 \
    | tail -80

#!/usr/bin/env bash
# Session 13, steady torch runs (issue 25's run() <= 10 µs): the GPU tests of the plans' paths
# (test_gpu_frozen_launch: every planned run bit for bit the unplanned call's; fastlaunch,
# serving, the transformers integration, decode), then host time of the tree before
# (build/old: git archive of the session's start, carried) and after, interleaved in one call
# on one host: bench/experiments/host_parts.py (PrefillPlan.run and its parts, DecodePlan.run),
# serving_bench.py --parts host (PrefillPlan.run(out=), DecodePlan.run with and without the
# append), and bench/experiments/launch_api.py (the driver's enqueue: cuLaunchKernelEx against
# cuLaunchKernel and a ctypes call that enqueues nothing).
# Files: $OUT/host.log, $OUT/parts-{old,new}-{1,2}.json, $OUT/{old,new}/serving-host*.json,
# $OUT/launch_api.json
set -uo pipefail
source bench/device/call_setup.sh host.log
ROOT=$PWD
part "GPU tests"
timeout ${TEST_S:-240} python3 -m pytest -q -rfs -p no:cacheprovider --durations=5 \
    tests/test_gpu_frozen_launch.py tests/test_gpu_fastlaunch.py tests/test_gpu_serving.py \
    tests/test_gpu_transformers_paged.py tests/test_gpu_decode.py >> "$LOG" 2>&1
echo "tests rc $?" | tee -a "$LOG"
tree_of() { [ "$1" = old ] && echo "$ROOT/build/old" || echo "$ROOT"; }
for round in 1 2; do
    for tree in old new; do
        part "host_parts $tree (round $round)"
        (cd "$(tree_of $tree)" && PYTHONPATH=/tmp/site:$PWD timeout ${PARTS_S:-45} \
            python3 bench/experiments/host_parts.py --out "$OUT/parts-$tree-$round.json") \
            >> "$LOG" 2>&1
        echo "host_parts $tree $round rc $?" | tee -a "$LOG"
    done
done
for round in 1 2; do
    for tree in old new; do
        part "serving_bench host $tree (round $round)"
        mkdir -p "$OUT/$tree/$round"
        (cd "$(tree_of $tree)" && PYTHONPATH=/tmp/site:$PWD timeout ${HOST_S:-50} \
            python3 bench/serving_bench.py --out "$OUT/$tree/$round" --parts host \
            --repeats 7) >> "$LOG" 2>&1
        echo "serving_bench $tree $round rc $?" | tee -a "$LOG"
    done
done
part "launch_api"
timeout 40 python3 bench/experiments/launch_api.py --out "$OUT/launch_api.json" >> "$LOG" 2>&1
echo "launch_api rc $?" | tee -a "$LOG"
part "end"
grep -E "=====|rc |passed|failed|FAILED|host_parts |host  |launch_api " "$LOG" | cut -c1-200 \
    | tail -100

#!/usr/bin/env bash
# Host time per layer call of the transformers integration ("paged|ptxattn"), before and after
# the per-forward plans: bench/serving_bench.py --parts integration,host (the integration's
# cases of bench/serving_integration.py, and the plans' run() / the plain calls), twice
# interleaved, on this tree and on the tree unpacked in .before/ with this tree's bench
# scripts (ROUNDS=2: a second interleaved round). Make .before/ in the checkout before the
# call (left untracked, it travels):
#   mkdir -p .before && git archive b9e9c1b ptxattn ptx pyproject.toml \
#       $(git ls-tree --name-only b9e9c1b bench/ | grep '\.py$') | tar -x -C .before
# Without .before/ only this tree is timed. GPU_TESTS=1 then runs the GPU tests of the path
# (tests/test_gpu_serving.py, tests/test_gpu_transformers_paged.py: ~2-3 min more).
# FAKE=1: the pretend driver and CPU tensors (a plumbing check on a machine without a GPU).
# Files: $OUT/{before,after}{1,2}/*serving*.json and $OUT/host.log.
set -uo pipefail
source bench/device/call_setup.sh host.log     # each run below sets its own PYTHONPATH
ROOT=$PWD
if [ -d .before/ptxattn ]; then
    mkdir -p .before/bench
    cp bench/serving_bench.py bench/serving_integration.py bench/callpath.py .before/bench/
fi
for round in $(seq 1 ${ROUNDS:-1}); do
    if [ -d .before/ptxattn ]; then
        part "before, round $round"
        (cd .before && PYTHONPATH=/tmp/site timeout ${HOST_S:-120} python3 bench/serving_bench.py \
            --out "$OUT/before$round" --parts integration,host --repeats 9 ${FAKE:+--fake}) \
            >> "$LOG" 2>&1
        echo "before rc $?" | tee -a "$LOG"
    fi
    part "after, round $round"
    PYTHONPATH=/tmp/site timeout ${HOST_S:-120} python3 bench/serving_bench.py \
        --out "$OUT/after$round" --parts integration,host --repeats 9 ${FAKE:+--fake} \
        >> "$LOG" 2>&1
    echo "after rc $?" | tee -a "$LOG"
done
if [ "${GPU_TESTS:-0}" = 1 ]; then
    part "GPU tests of the path"
    PYTHONPATH=/tmp/site:$ROOT timeout ${TEST_S:-300} python3 -m pytest -q -rfs -p no:cacheprovider \
        tests/test_gpu_serving.py tests/test_gpu_transformers_paged.py >> "$LOG" 2>&1
    echo "gpu tests rc $?" | tee -a "$LOG"
fi
part "end"
grep -E "=====|integration |host  |rc |passed|failed|FAILED|Error" "$LOG" | cut -c1-200 | tail -60

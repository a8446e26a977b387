#!/usr/bin/env bash
# Session 6, device run 3: the fixed tests again, the backward, serving and sustained-walk
# benchmarks (issues 26, 25, 23).
set -uo pipefail
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PTXATTN_REQUIRE_GPU=1
timeout 90 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu_serving.py \
    tests/test_gpu_backward.py -k "serving or gqa" > "$OUT/pytest-retest.txt" 2>&1
echo "retest rc $?"; tail -3 "$OUT/pytest-retest.txt" | cut -c1-250
timeout ${BWD_S:-170} python3 bench/backward_bench.py --out "$OUT" --rounds 10 --reps 5 \
    > "$OUT/bench-backward.txt" 2>&1; echo "backward rc $?"; tail -12 "$OUT/bench-backward.txt" | cut -c1-250
timeout ${SERVING_S:-130} python3 bench/serving_bench.py --out "$OUT" --parts paged,varlen \
    --rounds 10 --reps 10 > "$OUT/bench-serving.txt" 2>&1; echo "serving rc $?"
tail -14 "$OUT/bench-serving.txt" | cut -c1-250
: > "$OUT/variants.txt"
while read -r line; do
    [[ -z $line || $line == \#* ]] && continue
    echo "+ variants.py $line" >> "$OUT/variants.txt"
    timeout 60 python3 bench/experiments/variants.py $line --out "$OUT/variants.jsonl" < /dev/null \
        >> "$OUT/variants.txt" 2>&1
done < "${VARIANTS:-bench/experiments/2026-12-02-sustained-walk.txt}"
grep -v "^ *$" "$OUT/variants.txt" | grep -i -E "^\+|sustain|tflop|MHz" | cut -c1-220 | tail -40

#!/usr/bin/env bash
# Session 16 (issue 25, flash_attn_varlen_func(..., block_table=)): one device call, from the
# repository root, carrying .whl (pcpp):
#   1. the serving GPU tests (the emulator's paged-varlen cases on the H200, then serving sizes:
#      lengths 0..4097, pages 16/64/256, D 64/128/256, 37 sequences) and the other varlen users
#   2. compute-sanitizer (memcheck, racecheck, synccheck, initcheck) on the varlen and paged
#      varlen rows (a planted bad table entry: nothing read outside the caches)
#   3. serving_bench.py: paged varlen against the packed-key call (same run, same data) at
#      pages 16/64/256, and the varlen prefill row (its tile kernel gained a parameter)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PTXATTN_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv
timeout 200 python3 -m pytest -q -rf -p no:cacheprovider --durations=8 \
    tests/test_gpu_serving.py tests/test_gpu_frozen_launch.py tests/test_gpu_transformers_paged.py \
    > "$OUT/pytest-serving.txt" 2>&1
echo "serving tests rc $?"
tail -25 "$OUT/pytest-serving.txt" | cut -c1-400
STAGES=varlen,paged_varlen JOBS=12 timeout 150 bash bench/sanitize.sh > "$OUT/sanitize.txt" 2>&1
echo "sanitize rc $?"
tail -22 "$OUT/sanitize.txt" | cut -c1-300
timeout 200 python3 bench/serving_bench.py --out "$OUT" --parts paged_varlen,varlen \
    > "$OUT/serving-bench.txt" 2>&1
echo "bench rc $?"
grep -v "^\s*$" "$OUT/serving-bench.txt" | tail -12 | cut -c1-400

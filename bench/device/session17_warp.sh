#!/usr/bin/env bash
# Session 17 (issue 25): the paged varlen build's producer is now its first warp
# (PTXATTN_PAGED_WARP=1 by default, kv_paged.ptxh). One device call from the repository root,
# carrying .whl (pcpp):
#   1. the producer variants, same run, same data: session 16's single thread ("thread"), the
#      warp ("warp", today's default) and the warp with the table read a tile ahead, against
#      the packed-key call at pages 16/64/256 (paged_varlen_probe.py; bitwise equal first)
#   2. the serving GPU tests (paged varlen at serving sizes, 37 sequences, the emulator's cases;
#      only the paged varlen build changed)
#   3. compute-sanitizer on the paged varlen rows
#   4. serving_bench.py's paged_varlen part (the result JSON)
#   5. Nsight Compute at natural clocks, page 16: thread against warp
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PTXATTN_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv
timeout 100 python3 bench/experiments/paged_varlen_probe.py --pages 16,64,256 \
    --variants thread,warp,warp_ahead --out "$OUT/probe.jsonl" 2>&1 | tee "$OUT/probe.txt"
timeout 150 python3 -m pytest -q -rf -p no:cacheprovider --durations=8 \
    tests/test_gpu_serving.py > "$OUT/pytest-serving.txt" 2>&1
echo "serving tests rc $?"
tail -15 "$OUT/pytest-serving.txt" | cut -c1-400
# ONLY_TESTS=1: stop here (a session with little device time left)
[[ "${ONLY_TESTS:-0}" == 1 ]] && exit 0
STAGES=paged_varlen JOBS=12 timeout 60 bash bench/sanitize.sh > "$OUT/sanitize.txt" 2>&1
echo "sanitize rc $?"
tail -12 "$OUT/sanitize.txt" | cut -c1-300
timeout 150 python3 bench/serving_bench.py --out "$OUT" --parts paged_varlen \
    > "$OUT/serving-bench.txt" 2>&1
echo "bench rc $?"
grep -v "^\s*$" "$OUT/serving-bench.txt" | tail -12 | cut -c1-400
timeout 100 python3 bench/experiments/paged_varlen_probe.py --ncu --page 16 \
    --variants thread,warp --out "$OUT/probe-ncu.jsonl" 2>&1 | tee "$OUT/probe-ncu.txt"

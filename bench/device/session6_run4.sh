#!/usr/bin/env bash
# Session 6, device run 4 (the last): the production forward with the sectioned walk as its
# default, the per-call counters, FP8 (its first run), the fuzzer's 2,000 cases, and the
# production set with sustained windows on the walk's cases.
set -uo pipefail
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PTXATTN_REQUIRE_GPU=1
T() { timeout "$1" python3 -m pytest -v -rfs -p no:cacheprovider "${@:3}" > "$OUT/$2.txt" 2>&1
      echo "$2 rc $?"; grep -E "(FAILED|ERROR)|passed|failed" "$OUT/$2.txt" | grep -v PASSED \
      | cut -c1-240 | head -${SHOW:-14}; }
T ${FWD_S:-170} pytest-forward tests/test_gpu_production.py tests/test_gpu_api.py \
    tests/test_gpu_callpath.py tests/test_tile_walk.py tests/test_gpu_per_call_state.py \
    tests/test_trace_gpu.py tests/test_torch_gpu.py tests/test_flash_api.py -m gpu
T ${FP8_S:-100} pytest-fp8 tests/test_gpu_fp8.py tests/test_gpu_torch_fp8.py -m gpu
timeout ${FP8B_S:-40} python3 bench/fp8_bench.py --rounds 10 --reps 5 --out "$OUT" \
    > "$OUT/bench-fp8.txt" 2>&1; echo "fp8 bench rc $?"; tail -8 "$OUT/bench-fp8.txt" | cut -c1-220
timeout ${FUZZ_S:-100} python3 bench/fuzz.py --cases 2000 --seconds 85 --out "$OUT" \
    > "$OUT/fuzz.txt" 2>&1; echo "fuzz rc $?"; tail -6 "$OUT/fuzz.txt" | cut -c1-220
timeout ${BENCH_S:-60} python3 -m ptxattn bench --set production --shapes \
    ${CASES:-causal-16k} --rounds 10 --reps 5 --sustained --cooldown 0.5 --out "$OUT" \
    > "$OUT/bench-production.txt" 2>&1; echo "bench rc $?"; tail -12 "$OUT/bench-production.txt" | cut -c1-220

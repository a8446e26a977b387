#!/usr/bin/env bash
# Device call C (session 8): the FP8 GPU tests with D=128's new exponential split, the
# transformers generate() tests after the compiled decode step lost its graph break; then
# generate() at batch 1 (static and dynamic caches, the end-to-end figure), the decode
# kernel with transformers' dynamic-cache memory order, and the FP8 benchmark's three shapes.
set -uo pipefail
source bench/device/call_setup.sh call-c.log
part "GPU tests: fp8, torch fp8, generate"
timeout ${TS_S:-150} python3 -m pytest -q -rf -p no:cacheprovider --durations=5 \
    tests/test_gpu_fp8.py tests/test_gpu_torch_fp8.py tests/test_gpu_generate.py \
    >> "$LOG" 2>&1; echo "tests rc $?" | tee -a "$LOG"
part "generate_bench batch 1"
timeout ${GB_S:-220} python3 bench/models/generate_bench.py --batches 1 --budget-s 190 \
    --out "$OUT" >> "$LOG" 2>&1; echo "generate rc $?" | tee -a "$LOG"
part "decode_bench 32k, both memory orders"
timeout ${DB_S:-60} python3 bench/decode_bench.py --cases b8_32k,b8_32k_hf,b1_32k_hf \
    --out "$OUT" >> "$LOG" 2>&1; echo "decode rc $?" | tee -a "$LOG"
left=$(( 555 - (SECONDS - t0) ))
if (( left > 40 )); then
    part "fp8_bench, three shapes"
    timeout $(( left < 100 ? left : 100 )) python3 bench/fp8_bench.py --rounds 10 --reps 5 \
        --out "$OUT" >> "$LOG" 2>&1; echo "fp8 rc $?" | tee -a "$LOG"
fi
left=$(( 560 - (SECONDS - t0) ))
if (( left > 35 )); then
    part "fp8_bench 16k-d256 SW_EXP2_PER_8=1"
    timeout $left python3 bench/fp8_bench.py --shapes 16k-d256 --rounds 10 --reps 5 \
        --define SW_EXP2_PER_8=1 >> "$LOG" 2>&1; echo "fp8 d256 rc $?" | tee -a "$LOG"
fi
part "end"
grep -E "=====|passed|failed|FAILED|rc [0-9]|decode [0-9]|tok/s|x cuDNN|TB/s|fp8 forward|fp8 \+|bf16 production|prefill:|decode_" "$LOG" | cut -c1-300 | tail -60

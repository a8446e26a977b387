#!/usr/bin/env bash
# Device call A (session 8): the GPU suites of the paths whose defaults changed last session
# (backward st_ahead/qsplit, paged warp_ahead) and of decode/serving; where generate()'s decode
# steps lose time (bench/experiments/generate_profile.py, batch 1 with the compiled static
# cache, batch 8 dynamic); the FP8 forward's softmax knobs (exponentials on the FMA pipe, the
# lazy rebase) against today's FP8 build. One log: $OUT/call-a.log, besides the JSON records.
set -uo pipefail
source bench/device/call_setup.sh call-a.log
part "GPU tests: backward, decode, serving, paged variants"
timeout ${TS_S:-170} python3 -m pytest -q -rf -p no:cacheprovider --durations=5 \
    tests/test_gpu_backward.py tests/test_gpu_decode.py tests/test_gpu_serving.py \
    tests/test_gpu_paged_variants.py >> "$LOG" 2>&1; echo "tests rc $?" | tee -a "$LOG"
part "generate profile, batch 1 (dynamic and static)"
timeout ${G1_S:-150} python3 bench/experiments/generate_profile.py --batch 1 >> "$LOG" 2>&1
echo "gen b1 rc $?" | tee -a "$LOG"
part "generate profile, batch 8 (dynamic)"
timeout ${G8_S:-110} python3 bench/experiments/generate_profile.py --batch 8 --no-static \
    --tokens 12 >> "$LOG" 2>&1; echo "gen b8 rc $?" | tee -a "$LOG"
for knob in "" SW_EXP2_PER_8=1 SW_EXP2_PER_8=2 "P_SHIFT_LOG2=4 REBASE_LOG2_FP8=4"; do
    left=$(( 560 - (SECONDS - t0) ))
    (( left < 30 )) && { part "fp8 $knob: skipped (time)"; continue; }
    part "fp8_bench 16k-d128 [$knob]"
    defs=(); for d in $knob; do defs+=(--define "$d"); done
    timeout $(( left < 60 ? left : 60 )) python3 bench/fp8_bench.py --shapes 16k-d128 \
        --rounds 10 --reps 5 "${defs[@]}" >> "$LOG" 2>&1; echo "fp8 rc $?" | tee -a "$LOG"
done
part "end"
grep -E "=====|passed|failed|FAILED|rc [0-9]|== |steps:|gpu:|dynamo|fallbacks|fp8 forward|bf16 production|TFLOP" "$LOG" | cut -c1-400 | tail -70

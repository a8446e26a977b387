#!/usr/bin/env bash
# Session 10, the ctypes launch (ptxattn/fastlaunch.py): its GPU tests and the serving path's
# (test_gpu_fastlaunch: ctypes against the binding, kernel and plans bit for bit, the TMA
# encoder's bytes; test_gpu_serving, test_gpu_transformers_paged, test_gpu_decode), then the
# host time with launches through cuda.bindings (PTXATTN_LAUNCH=binding) and through ctypes,
# interleaved in one call on one host: bench/experiments/host_parts.py (PrefillPlan.run and its
# parts) and serving_bench.py --parts integration,host (the plans' run(), the plain calls, the
# transformers integration's layer calls).
# Files: $OUT/launch.log, $OUT/parts-{binding,ctypes}.json, $OUT/{binding,ctypes}/*serving*.json
set -uo pipefail
source bench/device/call_setup.sh launch.log
part "GPU tests"
timeout ${TEST_S:-240} python3 -m pytest -q -rfs -p no:cacheprovider --durations=5 \
    tests/test_gpu_fastlaunch.py tests/test_gpu_serving.py tests/test_gpu_transformers_paged.py \
    tests/test_gpu_decode.py >> "$LOG" 2>&1; echo "tests rc $?" | tee -a "$LOG"
for mode in binding ctypes; do
    part "host_parts, launches: $mode"
    PTXATTN_LAUNCH=$([ $mode = binding ] && echo binding) timeout ${PARTS_S:-40} \
        python3 bench/experiments/host_parts.py --out "$OUT/parts-$mode.json" >> "$LOG" 2>&1
    echo "host_parts $mode rc $?" | tee -a "$LOG"
done
for mode in binding ctypes; do
    part "serving_bench host, launches: $mode"
    PTXATTN_LAUNCH=$([ $mode = binding ] && echo binding) timeout ${HOST_S:-60} \
        python3 bench/serving_bench.py --out "$OUT/$mode" --parts integration,host \
        --repeats 7 >> "$LOG" 2>&1
    echo "serving_bench $mode rc $?" | tee -a "$LOG"
done
for mode in binding ctypes; do
    part "decode host us per call (dechost_cpu --gpu), launches: $mode"
    PTXATTN_LAUNCH=$([ $mode = binding ] && echo binding) timeout 60 python3 \
        bench/experiments/dechost_cpu.py --gpu --out "$OUT/dechost-$mode.json" >> "$LOG" 2>&1
    echo "dechost $mode rc $?" | tee -a "$LOG"
done
part "generate profile, batch 8 (dynamic)"
timeout 120 python3 bench/experiments/generate_profile.py --batch 8 --no-static --tokens 24 \
    >> "$LOG" 2>&1; echo "gen b8 rc $?" | tee -a "$LOG"
part "end"
grep -E "=====|rc |passed|failed|FAILED|host_parts |integration |host  |us_per_call|== |steps: " "$LOG" | cut -c1-200 \
    | tail -70

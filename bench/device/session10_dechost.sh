#!/usr/bin/env bash
# Session 10, decode host path (issue 24/25): transformers' DynamicCache calls take the second
# level of decode's remembered calls (one Launcher of the geometry rebound to each step's
# caches) instead of validate() + a new Launcher every layer of every step.
# 1. GPU tests of the path: decode (incl. the DynamicCache rebind test), generate (dynamic
#    and static caches through generate()) and the paged variants (the first-level path with
#    Launcher.run's binding; session 9: these three, 140 tests in ~125 s);
# 2. host µs per decode call at generate()'s batch-8 shape, dynamic and static pattern
#    (bench/experiments/dechost_cpu.py --gpu); with .before/ in the checkout also on that tree
#    (make it before the call, left untracked so it travels:
#      mkdir -p .before && git archive 9bd053c ptxattn ptx pyproject.toml | tar -x -C .before)
# 3. generate() batch 8, dynamic cache, ptxattn and flash: ms/step (generate_profile.py).
# Expected: ~4 min (tests ~2 min, host ~40 s, generate ~40-60 s). Files: $OUT/dechost.log,
# $OUT/dechost_gpu.json, $OUT/dechost_gpu_before.json.
set -uo pipefail
source bench/device/call_setup.sh dechost.log
ROOT=$PWD
part "GPU tests: decode, generate, paged variants"
timeout ${TS_S:-180} python3 -m pytest -q -rf -p no:cacheprovider --durations=5 \
    tests/test_gpu_decode.py tests/test_gpu_generate.py tests/test_gpu_paged_variants.py \
    >> "$LOG" 2>&1; echo "tests rc $?" | tee -a "$LOG"
if [ -d .before/ptxattn ]; then
    part "decode host µs per call, before (9bd053c)"
    mkdir -p .before/bench/experiments          # this tree's scripts on the old package
    cp bench/callpath.py .before/bench/ && cp bench/experiments/dechost_cpu.py \
        .before/bench/experiments/
    (cd .before && PYTHONPATH=/tmp/site timeout ${HOST_S:-60} python3 \
        bench/experiments/dechost_cpu.py --gpu --out "$OUT/dechost_gpu_before.json") \
        >> "$LOG" 2>&1; echo "host before rc $?" | tee -a "$LOG"
fi
part "decode host µs per call, after"
timeout ${HOST_S:-60} python3 bench/experiments/dechost_cpu.py --gpu \
    --out "$OUT/dechost_gpu.json" >> "$LOG" 2>&1; echo "host rc $?" | tee -a "$LOG"
part "generate profile, batch 8 (dynamic)"
timeout ${G8_S:-120} python3 bench/experiments/generate_profile.py --batch 8 --no-static \
    --tokens 12 >> "$LOG" 2>&1; echo "gen b8 rc $?" | tee -a "$LOG"
part "end"
grep -E "=====|rc |passed|failed|FAILED|us_per_call|== |steps: " "$LOG" | cut -c1-260 | tail -50

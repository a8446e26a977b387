#!/usr/bin/env bash
# Device call (session 12, issue 27): the FP8 measurement variant m3n96 (builds.FP8_VARIANTS):
# three consumer warpgroups (192-row Q tiles, 512 threads, 160 registers a consumer) at
# D = 128 with 96-key tiles (-D FP8_BLOCK_N=96 -D FP8_CONSUMERS=3), against today's build
# (two consumers, 128 x 128) in the same rounds. Today's builds are untouched (golden).
#   1. GPU tests of the variants (tests/test_gpu_fp8_variants.py -k m3n96)
#   2. the JIT's register report of m3n96 and today's D = 128 build (a fresh compile)
#   3. fp8_bench --variants default,m3n96 at 16k-d128 (burst, then --sustained)
#   4. while END_S leaves time: m3n96 with -D SW_EXP2_PER_8=0 (all exponentials on MUFU: the
#      three-consumer D = 64 builds measured 0 of 8 +2% over 1 of 8), then ncu of m3n96 and
#      of the default at natural clocks
# bench/notes.md "Session 12, FP8 with three consumers" has the prediction this measures.
# Expected: ~5 minutes. Files in $OUT: fp8m3.log, d128-/sw0-<date>-h200-fp8-variants.json,
# ncu-<build>.txt.
set -uo pipefail
source bench/device/call_setup.sh fp8m3.log
bench_variants() {   # <tag> <timeout s> <fp8_bench arguments...>
    local tag=$1 limit=$2; shift 2
    mkdir -p "$OUT/$tag"
    timeout "$limit" python3 bench/fp8_bench.py --rounds 10 --reps 5 --out "$OUT/$tag" "$@" \
        >> "$LOG" 2>&1
    echo "bench $tag rc $?" | tee -a "$LOG"
}
part "GPU tests: m3n96"
timeout ${T_S:-120} python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu_fp8_variants.py \
    -k "m3n96 or default" >> "$LOG" 2>&1; echo "tests m3n96 rc $?" | tee -a "$LOG"
part "JIT register report (CUDA_CACHE_DISABLE=1: a fresh compile)"
CUDA_CACHE_DISABLE=1 timeout 60 python3 -c "
from ptxattn import driver, fp8_forward
for name in ('default', 'm3n96'):
    m = driver.load_module(fp8_forward.forward_source(128, False, fp8_forward.variant_defines(name)), name)
    print('jit', name, ' | '.join(l.strip() for l in m.jit_log.splitlines() if 'regist' in l or 'spill' in l or 'stack' in l))
" >> "$LOG" 2>&1; echo "jit rc $?" | tee -a "$LOG"
part "fp8_bench --variants default,m3n96: 16k-d128 (burst + sustained)"
bench_variants d128 ${B1_S:-150} --variants default,m3n96 --shapes 16k-d128 --sustained
part "fp8_bench --variants default,m3n96 -D SW_EXP2_PER_8=0: 16k-d128 (burst)"
left=$(( ${END_S:-420} - (SECONDS - t0) ))
if (( left >= 120 )); then
    bench_variants sw0 90 --variants default,m3n96 --shapes 16k-d128 --define SW_EXP2_PER_8=0
else
    echo "skipped (time): SW_EXP2_PER_8=0" | tee -a "$LOG"
fi
part "ncu natural clocks: m3n96, then the default"
for build in m3n96 default; do
    left=$(( ${END_S:-420} - (SECONDS - t0) ))
    (( left < 45 )) && { echo "skipped (time): ncu $build" | tee -a "$LOG"; continue; }
    timeout $left ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section WarpStateStats --metrics sm__cycles_elapsed.avg.per_second \
        -k regex:ptxattn_fwd_fp8 --launch-skip 2 --launch-count 1 \
        python3 bench/experiments/fp8_variant_ncu.py --variant "$build" \
        > "$OUT/ncu-$build.txt" 2>&1 < /dev/null
    echo "ncu $build rc $?" | tee -a "$LOG"
    grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|Stall|cycles_elapsed|Pipe" \
        "$OUT/ncu-$build.txt" | head -24 >> "$LOG"
done
for sub in d128 sw0; do                  # one JSON each (the same file name): flattened
    for f in "$OUT/$sub"/*.json; do [[ -e $f ]] && mv "$f" "$OUT/$sub-$(basename "$f")"; done
    rmdir "$OUT/$sub" 2>/dev/null
done
part "end"
grep -E "=====|rc |jit |passed|failed|FAILED|check |fp8 default|fp8 m3n96|fp8 forward|bf16 production|cuDNN bf16|sustained|skipped \(time|Duration|SM Frequency|Issue Slots" \
    "$LOG" | cut -c1-240 | tail -60

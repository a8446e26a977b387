#!/usr/bin/env bash
# Device call (session 11, issue 27): the FP8 measurement variants (builds.FP8_VARIANTS):
# n192 / n224 = 128 x 192 / 128 x 224 tiles at D = 128 (224: FlashAttention-3's FP8 tile),
# n192s3 = n192 with a 3-deep K/V ring, d256n128 = 128 x 128 tiles at D = 256 (one Q buffer).
# Today's default builds are untouched (golden fingerprints); the variants are selected only
# by their defines (fp8_forward.variant_defines, fp8_bench --variants).
#   1. GPU tests: the variants against the FP8 model (tests/test_gpu_fp8_variants.py)
#   2. fp8_bench --variants at 16k-d128 with --sustained (burst 10 x 5, then a sustained
#      window per FP8 build, our bf16 and cuDNN), at 16k-d256 (default vs d256n128, burst)
#      and at the Wan shape (burst)
#   3. only while END_S leaves time: the FP8 path's own GPU tests (tests/test_gpu_fp8.py: the
#      default builds, whose launcher changed around them), 16k-d128 again with
#      -D SW_EXP2_PER_8=2 (the exp2 split at wider N), then ncu at natural clocks of the
#      fastest D = 128 variant, then the default
# Expected: ~6 minutes (parts 1-2 ~5; part 3 only within END_S=450 s). Files in $OUT:
# fp8n.log, d128-/d256-/wan-/sw2-<date>-h200-fp8-variants.json, ncu-<build>.txt (0-2).
set -uo pipefail
source bench/device/call_setup.sh fp8n.log
D128=default,n192,n224,n192s3
bench_variants() {   # <tag> <timeout s> <fp8_bench arguments...>
    local tag=$1 limit=$2; shift 2
    mkdir -p "$OUT/$tag"
    timeout "$limit" python3 bench/fp8_bench.py --rounds 10 --reps 5 --out "$OUT/$tag" "$@" \
        >> "$LOG" 2>&1
    echo "bench $tag rc $?" | tee -a "$LOG"
}
part "GPU tests: FP8 variants"
timeout ${T_S:-120} python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu_fp8_variants.py \
    >> "$LOG" 2>&1; echo "tests variants rc $?" | tee -a "$LOG"
part "JIT register report of each FP8 build (CUDA_CACHE_DISABLE=1: a fresh compile)"
CUDA_CACHE_DISABLE=1 timeout 60 python3 -c "
from ptxattn import builds, driver, fp8_forward
for name, d in [('default', 128), ('default', 256)] + [(n, b.head_dim) for n, b in builds.FP8_VARIANTS.items()]:
    m = driver.load_module(fp8_forward.forward_source(d, False, fp8_forward.variant_defines(name)), name)
    print('jit', name, d, ' | '.join(l.strip() for l in m.jit_log.splitlines() if 'regist' in l or 'spill' in l or 'stack' in l))
" >> "$LOG" 2>&1; echo "jit rc $?" | tee -a "$LOG"
part "fp8_bench --variants $D128: 16k-d128 (burst + sustained)"
bench_variants d128 ${B1_S:-160} --variants $D128 --shapes 16k-d128 --sustained
part "fp8_bench --variants default,d256n128: 16k-d256 (burst)"
bench_variants d256 ${B2_S:-70} --variants default,d256n128 --shapes 16k-d256
part "fp8_bench --variants $D128: wan (burst)"
bench_variants wan ${B3_S:-90} --variants $D128 --shapes wan
part "GPU tests: the FP8 path (the default builds)"
left=$(( ${END_S:-450} - (SECONDS - t0) ))
if (( left >= 150 )); then
    timeout 90 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu_fp8.py >> "$LOG" 2>&1
    echo "tests fp8 rc $?" | tee -a "$LOG"
else
    echo "skipped (time): tests/test_gpu_fp8.py" | tee -a "$LOG"
fi
part "fp8_bench --variants $D128 -D SW_EXP2_PER_8=2: 16k-d128 (burst)"
left=$(( ${END_S:-450} - (SECONDS - t0) ))
if (( left >= 120 )); then
    bench_variants sw2 90 --variants $D128 --shapes 16k-d128 --define SW_EXP2_PER_8=2
else
    echo "skipped (time): SW_EXP2_PER_8=2" | tee -a "$LOG"
fi
part "ncu natural clocks: the fastest D = 128 variant, then the default"
best=$(python3 - "$OUT/d128" <<'PY' 2>/dev/null
import json, sys, pathlib
files = sorted(pathlib.Path(sys.argv[1]).glob("*.json"))
rows = json.loads(files[-1].read_text())["shapes"]["16k-d128"]["rows"] if files else {}
best = max(((r.get("tflops") or 0, lab[4:]) for lab, r in rows.items()
            if lab.startswith("fp8 ") and lab[4:] not in ("forward", "default")), default=None)
print(best[1] if best else "n224")
PY
)
echo "best variant: ${best:-n224}" | tee -a "$LOG"
for build in "${best:-n224}" default; do
    left=$(( ${END_S:-450} - (SECONDS - t0) ))
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
for sub in d128 d256 wan sw2; do         # one JSON each (the same file name): flattened
    for f in "$OUT/$sub"/*.json; do [[ -e $f ]] && mv "$f" "$OUT/$sub-$(basename "$f")"; done
    rmdir "$OUT/$sub" 2>/dev/null
done
part "end"
grep -E "=====|rc |jit |passed|failed|FAILED|check |fp8 default|fp8 n1|fp8 n2|fp8 d2|fp8 forward|bf16 production|cuDNN bf16|sustained|best variant|skipped \(time|Duration|SM Frequency|Issue Slots" \
    "$LOG" | cut -c1-240 | tail -80

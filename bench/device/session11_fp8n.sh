#!/usr/bin/env bash
# Device call (session 11, issue 27): the FP8 D = 128 measurement variants with wider key tiles
# (builds.FP8_VARIANTS: n192 = 128 x 192, n224 = 128 x 224, FlashAttention-3's FP8 tile).
#   1. GPU tests: the variants against the FP8 model (tests/test_gpu_fp8_variants.py), and
#      the FP8 path's own GPU tests (tests/test_gpu_fp8.py: the default build, whose launcher
#      changed around it)
#   2. fp8_bench --variants default,n192,n224 at 16k-d128 with --sustained (burst 10 x 5 and a
#      sustained window per FP8 build, our bf16 and cuDNN), then at the Wan shape (burst)
#   3. only while END_S leaves time: the same at 16k-d128 with -D SW_EXP2_PER_8=2 (is 1 of 8
#      exponentials on the FMA pipe still right at wider N?), then ncu at natural clocks of the
#      fastest variant at 16k-d128, then of the default
# Expected: ~5 minutes (at most ~7.5 if every part runs to its timeout). Files in $OUT:
# fp8n.log, up to three fp8_bench JSONs (d128-, wan-, sw2-...json), ncu-<build>.txt (0-2).
set -uo pipefail
source bench/device/call_setup.sh fp8n.log
part "GPU tests: FP8 variants, FP8 path"
timeout ${T_S:-150} python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu_fp8_variants.py \
    tests/test_gpu_fp8.py >> "$LOG" 2>&1; echo "tests rc $?" | tee -a "$LOG"
part "fp8_bench --variants: 16k-d128 (burst + sustained)"
mkdir -p "$OUT/d128" "$OUT/wan"
timeout ${B1_S:-170} python3 bench/fp8_bench.py --variants default,n192,n224 --shapes 16k-d128 \
    --rounds 10 --reps 5 --sustained --out "$OUT/d128" >> "$LOG" 2>&1; echo "bench d128 rc $?" | tee -a "$LOG"
part "fp8_bench --variants: wan (burst)"
timeout ${B2_S:-110} python3 bench/fp8_bench.py --variants default,n192,n224 --shapes wan \
    --rounds 10 --reps 5 --out "$OUT/wan" >> "$LOG" 2>&1; echo "bench wan rc $?" | tee -a "$LOG"
part "fp8_bench --variants -D SW_EXP2_PER_8=2: 16k-d128 (burst; the exp2 split at wider N)"
left=$(( ${END_S:-440} - (SECONDS - t0) ))
if (( left >= 150 )); then
    mkdir -p "$OUT/sw2"
    timeout 100 python3 bench/fp8_bench.py --variants default,n192,n224 --shapes 16k-d128 \
        --define SW_EXP2_PER_8=2 --rounds 10 --reps 5 --out "$OUT/sw2" >> "$LOG" 2>&1
    echo "bench sw2 rc $?" | tee -a "$LOG"
else
    echo "skipped (time): SW_EXP2_PER_8=2" | tee -a "$LOG"
fi
part "ncu natural clocks: the fastest variant, then the default"
best=$(python3 - "$OUT/d128" <<'PY' 2>/dev/null
import json, sys, pathlib
files = sorted(pathlib.Path(sys.argv[1]).glob("*.json"))
rows = json.loads(files[-1].read_text())["shapes"]["16k-d128"]["rows"] if files else {}
best = max((r.get("tflops") or 0, lab[4:]) for lab, r in rows.items()
           if lab.startswith("fp8 ") and lab[4:] not in ("forward", "default")) if rows else None
print(best[1] if best else "n224")
PY
)
echo "best variant: ${best:-n224}" | tee -a "$LOG"
for build in "${best:-n224}" default; do
    left=$(( ${END_S:-440} - (SECONDS - t0) ))
    (( left < 40 )) && { echo "skipped (time): ncu $build" | tee -a "$LOG"; continue; }
    timeout $left ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section WarpStateStats --metrics sm__cycles_elapsed.avg.per_second \
        -k regex:ptxattn_fwd_fp8 --launch-skip 2 --launch-count 1 \
        python3 bench/experiments/fp8_variant_ncu.py --variant "$build" \
        > "$OUT/ncu-$build.txt" 2>&1 < /dev/null
    echo "ncu $build rc $?" | tee -a "$LOG"
    grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|Stall|cycles_elapsed|Pipe" \
        "$OUT/ncu-$build.txt" | head -24 >> "$LOG"
done
for sub in d128 wan sw2; do              # one JSON each (the same file name): flattened
    for f in "$OUT/$sub"/*.json; do [[ -e $f ]] && mv "$f" "$OUT/$sub-$(basename "$f")"; done
    rmdir "$OUT/$sub" 2>/dev/null
done
part "end"
grep -E "=====|rc |passed|failed|FAILED|check fp8|fp8 default|fp8 n1|fp8 n2|fp8 forward|bf16 production|cuDNN bf16|sustained|best variant|skipped \(time|Duration|SM Frequency|Issue Slots" \
    "$LOG" | cut -c1-240 | tail -70

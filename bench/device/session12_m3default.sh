#!/usr/bin/env bash
# Device call (session 12, issue 27): attention(precision="fp8") now runs m3n96 (three
# consumers, 96-key tiles) for pre-quantized dense D = 128 calls (builds.FP8_PREQUANTIZED_DENSE,
# fp8_forward.chosen_defines), and m3n96 puts every exponential on MUFU (SW_EXP2_PER_8 0, was 1).
#   1. GPU tests: the FP8 path (tests/test_gpu_fp8.py: its pre-quantized dense D = 128 cases now
#      run m3n96), the m3n96 variant tests, the torch FP8 op
#   2. fp8_bench --variants default,m3n96,m3n96:SW_EXP2_PER_8=1 at 16k-d128 (burst + sustained)
#      and wan (burst): m3n96 at 0 of 8 against 1 of 8 in the same rounds
# Expected ~5 minutes. Files in $OUT: m3d.log, d128-/wan-<date>-h200-fp8-variants.json.
set -uo pipefail
source bench/device/call_setup.sh m3d.log
part "GPU tests: FP8 path, m3n96, torch FP8"
timeout ${T_S:-200} python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu_fp8.py \
    tests/test_gpu_torch_fp8.py "tests/test_gpu_fp8_variants.py" -k "not (n192 or n224 or d256n64)" \
    >> "$LOG" 2>&1
echo "tests rc $?" | tee -a "$LOG"
V=default,m3n96,m3n96:SW_EXP2_PER_8=1
for spec in "d128 16k-d128 --sustained" "wan wan"; do
    set -- $spec
    tag=$1 shape=$2; shift 2
    part "fp8_bench --variants $V: $shape $*"
    mkdir -p "$OUT/$tag"
    timeout ${B_S:-170} python3 bench/fp8_bench.py --rounds 10 --reps 5 --variants $V \
        --shapes "$shape" "$@" --out "$OUT/$tag" >> "$LOG" 2>&1
    echo "bench $tag rc $?" | tee -a "$LOG"
    for f in "$OUT/$tag"/*.json; do [[ -e $f ]] && mv "$f" "$OUT/$tag-$(basename "$f")"; done
    rmdir "$OUT/$tag" 2>/dev/null
done
part "end"
grep -E "=====|rc |passed|failed|FAILED|check |fp8 default|fp8 m3n96|fp8 forward|bf16 production|cuDNN bf16|sustained|skipped" \
    "$LOG" | cut -c1-240 | tail -60

#!/usr/bin/env bash
# Device call (session 12, issue 27): the FP8 D = 256 row is now FlashAttention-3's 128 x 128
# tile (session 11's variant d256n128, measured 1.159x the 128 x 64 tile in burst); the former
# row is the measurement variant d256n64. Golden: the new row's PTX is byte for byte the old
# variant's (dense and masked), the new variant's the old row's.
#   1. GPU tests: the FP8 path (tests/test_gpu_fp8.py: every default build, masked included,
#      so the 128 x 128 tile's causal/window/GQA/LSE/BSHD cases), the variants (d256n64 dense
#      and causal among them), the torch op's FP8 tests
#   2. fp8_bench at 16k-d256 with --sustained (the README's row: FP8, FP8 + quantize, our
#      bf16, cuDNN; burst and sustained)
#   3. fp8_bench --variants default,d256n64 at 16k-d256 and causal-16k-d256 (burst, same
#      rounds: the new row against the old)
#   4. while END_S leaves time: ncu at natural clocks of the new row
# Expected ~6-7 minutes. Files in $OUT: d256.log, base-/var-<date>-h200-fp8*.json, ncu-d256.txt.
set -uo pipefail
source bench/device/call_setup.sh d256.log
part "GPU tests: FP8 path, FP8 variants, torch FP8"
timeout ${T_S:-200} python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu_fp8.py \
    tests/test_gpu_fp8_variants.py tests/test_gpu_torch_fp8.py >> "$LOG" 2>&1
echo "tests fp8 rc $?" | tee -a "$LOG"
part "JIT register report of the D = 256 FP8 builds (a fresh compile)"
CUDA_CACHE_DISABLE=1 timeout 60 python3 -c "
from ptxattn import driver, fp8_forward
for name in ('default', 'd256n64'):
    for masked in (False, True):
        m = driver.load_module(fp8_forward.forward_source(256, masked, fp8_forward.variant_defines(name)), name)
        print('jit', name, 'masked' if masked else 'dense', ' | '.join(l.strip() for l in m.jit_log.splitlines() if 'regist' in l or 'spill' in l or 'stack' in l))
" >> "$LOG" 2>&1; echo "jit rc $?" | tee -a "$LOG"
part "fp8_bench 16k-d256 --sustained (the README row)"
mkdir -p "$OUT/base"
timeout ${B1_S:-150} python3 bench/fp8_bench.py --rounds 10 --reps 5 --shapes 16k-d256 \
    --sustained --out "$OUT/base" >> "$LOG" 2>&1; echo "bench base rc $?" | tee -a "$LOG"
part "fp8_bench --variants default,d256n64: 16k-d256, causal-16k-d256 (burst)"
mkdir -p "$OUT/var"
timeout ${B2_S:-150} python3 bench/fp8_bench.py --rounds 10 --reps 5 --variants default,d256n64 \
    --shapes 16k-d256,causal-16k-d256 --out "$OUT/var" >> "$LOG" 2>&1
echo "bench var rc $?" | tee -a "$LOG"
part "ncu natural clocks: the new D = 256 row"
left=$(( ${END_S:-470} - (SECONDS - t0) ))
if (( left >= 45 )); then
    timeout $left ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section WarpStateStats --section MemoryWorkloadAnalysis \
        --metrics sm__cycles_elapsed.avg.per_second,lts__t_sector_hit_rate.pct \
        -k regex:ptxattn_fwd_fp8 --launch-skip 2 --launch-count 1 \
        python3 bench/experiments/fp8_variant_ncu.py --variant default --shape 16k-d256 \
        > "$OUT/ncu-d256.txt" 2>&1 < /dev/null
    echo "ncu rc $?" | tee -a "$LOG"
    grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Issue Slots Busy|Executed Ipc A|hit_rate|L2 Hit|cycles_elapsed" \
        "$OUT/ncu-d256.txt" | head -16 >> "$LOG"
else
    echo "skipped (time): ncu" | tee -a "$LOG"
fi
for sub in base var; do                  # one JSON each: flattened (the device returns files)
    for f in "$OUT/$sub"/*.json; do [[ -e $f ]] && mv "$f" "$OUT/$sub-$(basename "$f")"; done
    rmdir "$OUT/$sub" 2>/dev/null
done
part "end"
grep -E "=====|rc |jit |passed|failed|FAILED|check |fp8 default|fp8 d256|fp8 forward|fp8 \+ quant|bf16 production|cuDNN bf16|sustained|skipped \(time|Duration|SM Frequency|Issue Slots|Hit" \
    "$LOG" | cut -c1-240 | tail -70

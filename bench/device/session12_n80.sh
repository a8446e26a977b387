#!/usr/bin/env bash
# Device call (session 12, issue 23): the bf16 D = 256 measurement variant d256n80
# (FlashAttention-3's 128 x 80 tile at hdim 256, -D BF16_BLOCK_N=80, builds.BF16_VARIANTS;
# dense only, never chosen by attention()) against today's D = 256 row (128 x 64) and cuDNN.
#   1. GPU tests: tests/test_gpu_bf16_variants.py (the variant against float64 under the bf16
#      bar, poisoned outputs: one key, ragged tails, whole tiles, GQA, BSHD, a persistent grid,
#      16k keys; its error beside the default build's; deterministic)
#   2. the JIT's register report of the variant and of today's row (a fresh compile)
#   3. variants.py, bench/experiments/2026-12-04-session12-n80.txt: (2, 8, 16384, 256) dense,
#      burst + --sustained (base, n80, cuDNN), the burst again, and (4, 8, 8192, 256) burst
# Expected ~2.5-3 minutes. Files in $OUT: n80.log, variants.jsonl.
set -uo pipefail
source bench/device/call_setup.sh n80.log
part "GPU tests: the bf16 variants"
timeout ${T_S:-90} python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu_bf16_variants.py \
    >> "$LOG" 2>&1
echo "tests bf16 variants rc $?" | tee -a "$LOG"
part "JIT register report: D = 256 default and d256n80 (a fresh compile)"
CUDA_CACHE_DISABLE=1 timeout 40 python3 -c "
from ptxattn import builds, driver, ptx, stages
st = stages.PRODUCTION.specialize(256)
for name in ('default', 'd256n80'):
    d = builds.bf16_variant_defines(name)
    m = driver.load_module(ptx.source(st, {**dict(st.defines), **d}), name)
    print('jit', name, ' | '.join(l.strip() for l in m.jit_log.splitlines() if 'regist' in l or 'spill' in l or 'stack' in l))
" >> "$LOG" 2>&1; echo "jit rc $?" | tee -a "$LOG"
part "variants.py: base / n80 / cuDNN at D = 256 (burst, sustained)"
left=$(( ${END_S:-180} - (SECONDS - t0) ))
while read -r line; do
    [[ -z $line || $line == \#* ]] && continue
    left=$(( ${END_S:-180} - (SECONDS - t0) ))
    (( left < 20 )) && { echo "skipped (time): $line" | tee -a "$LOG"; continue; }
    echo "+ variants.py $line" | tee -a "$LOG"
    # shellcheck disable=SC2086  (the line is a list of arguments)
    timeout $left python3 bench/experiments/variants.py $line --out "$OUT/variants.jsonl" \
        < /dev/null >> "$LOG" 2>&1
    echo "variants rc $?" | tee -a "$LOG"
done < bench/experiments/2026-12-04-session12-n80.txt
part "end"
grep -E "=====|rc |jit |passed|failed|FAILED|shape |base|n80|cudnn|sustained|skipped \(time" \
    "$LOG" | cut -c1-240 | tail -60

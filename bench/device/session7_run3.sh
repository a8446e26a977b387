#!/usr/bin/env bash
# Device call C: transformers on the device's own 5.17 (only pcpp is installed from .whl):
# continuous batching (paged|ptxattn GPU tests, then cb_bench against paged|sdpa), generate()
# end to end (its GPU tests and generate_bench), and decode_bench at b1_128k (the split rule).
# One log, $OUT/call-c.log, besides the JSON records (the device returns at most 8 files).
set -uo pipefail
source bench/device/call_setup.sh call-c.log
python3 -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)" | tee -a "$LOG"
part "decode_bench b1_128k,b1_8k"
timeout ${DEC_S:-60} python3 bench/decode_bench.py --out "$OUT" --cases b1_128k,b1_8k --rounds 6 \
    --splits 14 >> "$LOG" 2>&1; echo "decode bench rc $?"
part "pytest paged|ptxattn"
timeout ${CBT_S:-100} python3 -m pytest -q -rfs -p no:cacheprovider tests/test_gpu_transformers_paged.py \
    >> "$LOG" 2>&1; echo "cb tests rc $?"
part "cb_bench"
timeout ${CBB_S:-170} python3 bench/models/cb_bench.py --out "$OUT" >> "$LOG" 2>&1; echo "cb bench rc $?"
part "generate"
left=$(( 585 - (SECONDS - t0) ))
BUDGET=$(( left - 90 )) timeout $left bash bench/generate_device.sh >> "$LOG" 2>&1
echo "generate rc $?"
part "end"
grep -E "=====|passed|failed|FAILED|ERROR|TB/s|tok/s|tokens/s|speedup|ratio|summary|first differ" "$LOG" | cut -c1-200 | tail -70

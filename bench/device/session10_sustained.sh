#!/usr/bin/env bash
# Device call (session 10): sustained figures beside the burst ones (issues 23, 26, 27): the
# backward against cuDNN at (4,16,8192,128) dense and causal, and the FP8 forward against our
# bf16 and cuDNN bf16 at (2,16,16384,128) and (2,8,16384,256), each with --sustained (a 3 s
# window per kernel after a cool-down; NVML, else nvidia-smi). Then the sustained CPU tests
# and the sampler's GPU tests. Results: two JSON files and one log under $OUT (~3 minutes).
set -uo pipefail
source bench/device/call_setup.sh sustained.log
python3 -c "import pynvml" 2>/dev/null || echo "no pynvml: the nvidia-smi sampler" | tee -a "$LOG"
part "backward_bench --sustained: dense, causal"
timeout ${BWD_S:-120} python3 bench/backward_bench.py --cases dense,causal --rounds 10 \
    --reps 10 --sustained --out "$OUT" >> "$LOG" 2>&1; echo "backward rc $?" | tee -a "$LOG"
part "fp8_bench --sustained: 16k-d128, 16k-d256"
timeout ${FP8_S:-150} python3 bench/fp8_bench.py --shapes 16k-d128,16k-d256 --rounds 10 \
    --reps 10 --sustained --out "$OUT" >> "$LOG" 2>&1; echo "fp8 rc $?" | tee -a "$LOG"
part "tests: sustained (CPU and GPU)"
left=$(( ${END_S:-330} - (SECONDS - t0) ))
(( left < 20 )) && left=20
timeout $left python3 -m pytest -q -rf -p no:cacheprovider tests/test_sustained.py \
    tests/test_sustained_scripts.py >> "$LOG" 2>&1; echo "tests rc $?" | tee -a "$LOG"
part "end"
grep -E "=====|rc |sustained|ratio|passed|failed|FAILED|Error" "$LOG" | cut -c1-240 | tail -60

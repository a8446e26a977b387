#!/usr/bin/env bash
# Device call B (session 8): the whole production set, burst and sustained (seconds back to
# back at the power cap, ours and cuDNN alternating), with today's defaults: the sustained-speed
# issue's table. Then, if time is left, the FP8 softmax knobs (bench/fp8_bench.py --define).
set -uo pipefail
source bench/device/call_setup.sh call-b.log
part "production set, burst + sustained (${CASES:-all cases})"
nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit,temperature.gpu --format=csv >> "$LOG"
timeout ${PB_S:-470} python3 -m ptxattn bench --set production --sustained --reps ${REPS:-5} \
    ${CASES:+--shapes $CASES} --out "$OUT" >> "$LOG" 2>&1; echo "bench rc $?" | tee -a "$LOG"
for knob in ${FP8_KNOBS:-"" SW_EXP2_PER_8=1 SW_EXP2_PER_8=2}; do
    left=$(( 560 - (SECONDS - t0) ))
    (( left < 40 )) && { part "fp8 [$knob]: skipped (time)"; continue; }
    part "fp8_bench 16k-d128 [$knob]"
    defs=(); [[ $knob == *=* ]] && defs=(--define "$knob")
    timeout $(( left < 70 ? left : 70 )) python3 bench/fp8_bench.py --shapes 16k-d128 \
        --rounds 10 --reps 5 "${defs[@]}" >> "$LOG" 2>&1; echo "fp8 rc $?" | tee -a "$LOG"
done
part "end"
cat "$OUT"/bench-production.txt 2>/dev/null | cut -c1-230
grep -E "=====|rc [0-9]|fp8 forward|bf16 production" "$LOG" | cut -c1-300 | tail -30

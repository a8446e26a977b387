#!/usr/bin/env bash
# Session 10, the band-sized walk (issue 23 item 3; bench/notes.md "## Session 10, L2-local walk
# for windows and causal 4k"): the walk's GPU tests (windows and causal, the new rule's
# sections forced and chosen), ncu at natural clocks on the window and causal 4k cases under
# the old and new sections (bench/experiments/2026-12-02-ncu-l2-walk-s10.txt), then same-run
# burst + sustained before/after (variants.py, walk=RULE: l2-walk is the default rule, l2-band the band rule,
# section:N a forced section). Target ~4-5 min; every part has its own timeout.
set -uo pipefail
source bench/device/call_setup.sh walk.log
part "GPU tests: the walk"
timeout 75 python3 -m pytest -q -rf -p no:cacheprovider -m gpu tests/test_tile_walk.py \
    >> "$LOG" 2>&1; echo "walk tests rc $?" | tee -a "$LOG"
timeout 60 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu_production.py -k \
    "sliding_window or causal_square or causal_cross or causal_gqa or many_tiles or masked or head_dim_window or head_dim_causal" \
    >> "$LOG" 2>&1; echo "production mask tests rc $?" | tee -a "$LOG"
part "ncu L2: window and causal 4k, old and new sections"
END_S=${END_S:-260} ncu_lines bench/experiments/2026-12-02-ncu-l2-walk-s10.txt "$OUT/ncu-l2-walk.jsonl"
part "sustained: window 1024 (2, 16, 16384)"
timeout 60 python3 bench/experiments/variants.py old=production new=production:walk=l2-band \
    s30=production:walk=section:30 --shape 2x16x16384x128 --window 1024,0 --rounds 10 --reps 5 \
    --sustained --cooldown 0.5 --out "$OUT/variants-walk.jsonl" >> "$LOG" 2>&1
echo "variants window rc $?" | tee -a "$LOG"
part "sustained: causal (8, 16, 4096)"
timeout 50 python3 bench/experiments/variants.py s8=production s12=production:walk=section:12 \
    --shape 8x16x4096x128 --causal --rounds 10 --reps 5 --sustained --cooldown 0.5 \
    --out "$OUT/variants-walk.jsonl" >> "$LOG" 2>&1
echo "variants causal rc $?" | tee -a "$LOG"
part "end"
grep -E "=====|rc |passed|failed|FAILED|natural|production [0-9]|skipped \(time|TFLOP|sustained|old|new|s30|s8 |s12" \
    "$LOG" | cut -c1-240 | tail -60

#!/usr/bin/env bash
# Device call D: the paged decode producer variants against contiguous (pages 16/32/64, each
# checked bit for bit against today's build first), the backward variants against today's
# builds and cuDNN, and the host-synchronization probe of a transformers decode step.
# One log, $OUT/call-d.log, besides the JSON records.
set -uo pipefail
source bench/device/call_setup.sh call-d.log
part "serving_bench --variants all"
timeout ${PG_S:-150} python3 bench/serving_bench.py --out "$OUT" --parts paged --variants all \
    >> "$LOG" 2>&1; echo "paged variants rc $?"
part "backward_bench --variants all"
timeout ${BW_S:-170} python3 bench/backward_bench.py --variants all --rounds 8 --reps 5 \
    --out "$OUT" >> "$LOG" 2>&1; echo "bwd variants rc $?"
part "sync probe"
timeout ${SY_S:-70} python3 bench/experiments/sync_probe.py >> "$LOG" 2>&1; echo "sync probe rc $?"
left=$(( 440 - (SECONDS - t0) ))
if (( left > 40 )); then
    part "backward variant GPU tests (${left}s)"
    timeout $left python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_backward_variants.py \
        >> "$LOG" 2>&1; echo "bwd variant tests rc $?"
fi
part "end"
grep -vE "^\s*$" "$LOG" | grep -E "=====|variant|ratio|page|x cuDNN|vs|passed|failed|FAILED|synchroniz|  +[0-9]+ x" | cut -c1-200 | tail -80

#!/usr/bin/env bash
# Device call B: the backward's sanitizer control (now visible to racecheck), the FP8 backend
# in the Wan 2.1 and LTX-Video capstones (against cuDNN bf16 and bf16 ptxattn), the Llama-8B
# training step, then the 300-step training check. ~9 minutes; each part under its own timeout.
# Every log goes into one file, $OUT/call-b.log (the device returns at most 8 files).
set -uo pipefail
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
LOG=$OUT/call-b.log
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PTXATTN_REQUIRE_GPU=1
t0=$SECONDS
part() { echo "===== $* (at $((SECONDS - t0))s)" >> "$LOG"; }
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
part "racecheck: the backward's planted control"
timeout 60 "$SAN" --tool racecheck --racecheck-report analysis --error-exitcode 86 \
    python3 bench/sanitize_bwd_case.py b1_hazard >> "$LOG" 2>&1
echo "bwd control rc $? (86: flagged) at $((SECONDS - t0))s"
for m in wan ltx; do
    part "capstone $m --fp8"
    timeout ${CAP_S:-110} python3 bench/models/capstone.py $m --fp8 --reps ${REPS:-8} \
        --backends cudnn,flash --out "$OUT" >> "$LOG" 2>&1
    echo "capstone $m fp8 rc $? at $((SECONDS - t0))s"
done
part "train step"
timeout ${STEP_S:-150} python3 bench/models/train_step_bench.py --rounds ${ROUNDS:-8} \
    --backends cudnn,flash --out "$OUT" >> "$LOG" 2>&1
echo "train step rc $? at $((SECONDS - t0))s"
part "train check"
timeout $(( 575 - (SECONDS - t0) )) python3 bench/models/train_check.py --steps ${STEPS:-300} \
    --out "$OUT" >> "$LOG" 2>&1
echo "train check rc $? at $((SECONDS - t0))s"
grep -vE "^\s*$|Warning|warn\(|^  return" "$LOG" | grep -E "=====|RACECHECK SUMMARY|^case |ms/step|speedup|rel_l2|no_speedup|verdict|loss|step|Error|error" | cut -c1-180 | tail -60

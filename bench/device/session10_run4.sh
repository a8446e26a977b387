#!/usr/bin/env bash
# Session 10, call 4: the K/V multicast build's re-test after the descriptor fix (rank bits of
# cluster shared addresses masked out of wgmma descriptors: session10_mcast.sh), then the decode
# path after the promotion fix (_PROMOTE_WITHIN): its GPU tests and generate() b8 dynamic.
set -uo pipefail
bash bench/device/session10_mcast.sh
source bench/device/call_setup.sh run4.log
part "GPU tests: decode"
timeout 120 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu_decode.py \
    >> "$LOG" 2>&1; echo "decode tests rc $?" | tee -a "$LOG"
part "generate profile, batch 8 (dynamic)"
timeout 120 python3 bench/experiments/generate_profile.py --batch 8 --no-static --tokens 24 \
    >> "$LOG" 2>&1; echo "gen b8 rc $?" | tee -a "$LOG"
part "end"
grep -E "=====|rc |passed|failed|FAILED|== |steps: |gpu: " "$LOG" | cut -c1-300 | tail -30

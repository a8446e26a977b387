#!/usr/bin/env bash
# Session 6, device run 2: the whole GPU suite of main after the evidence, serving and torchint
# merges, the backward's error beside PyTorch's backends, then the decode benchmark (short).
set -uo pipefail
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PTXATTN_REQUIRE_GPU=1
git log --oneline -1 2>/dev/null | tee "$OUT/commit.txt"
timeout ${SUITE_S:-330} python3 -m pytest -v -rfs -p no:cacheprovider -m gpu --durations=15 \
    ${PYTEST_ARGS:-} > "$OUT/pytest-gpu.txt" 2>&1; echo "suite rc $?"
grep -E "(FAILED|ERROR)|passed|failed" "$OUT/pytest-gpu.txt" | grep -v "PASSED" | cut -c1-250 | head -40
timeout 60 python3 bench/bwd_error_peers.py 2>&1 | tee "$OUT/bwd-error-peers.txt" | tail -20
timeout ${DECODE_S:-150} python3 bench/decode_bench.py --out "$OUT" --rounds 6 --reps 10 \
    --cases ${DECODE_CASES:-b64_8k,b8_32k,b1_128k,b1_8k,spec_b16_8k} > "$OUT/bench-decode.txt" 2>&1
echo "decode rc $?"; tail -25 "$OUT/bench-decode.txt" | cut -c1-220

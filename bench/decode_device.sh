#!/usr/bin/env bash
# The decode branch's device session (issue 24), in one call from the repository root:
#
#   bash bench/decode_device.sh        (the run tool sets $OUT; carry .whl with the pcpp wheel)
#
# 1. GPU tests of flash_attn_with_kvcache (tests/test_gpu_decode.py, ~1-2 minutes) ->
#    $OUT/pytest-decode.txt; a failure's message names the rows, heads and sizes.
# 2. The decode benchmark (bench/decode_bench.py, ~2-4 minutes) -> $OUT/<date>-h200-decode.json
#    and $OUT/bench-decode.txt. SWEEP=8,24,32 also times those split counts.
# 3. compute-sanitizer memcheck on one decode call with out-of-range device lengths (~1 minute)
#    -> $OUT/memcheck-decode.txt (SKIP_SANITIZER=1 skips it).
# Switches: SKIP_TESTS=1 SKIP_BENCH=1 CASES=b1_8k,b64_8k ROUNDS=10 PYTEST_ARGS=--maxfail=5
set -uo pipefail
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PTXATTN_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
status=0
if [[ -z "${SKIP_TESTS:-}" ]]; then
    python3 -m pytest -q -rs ${PYTEST_ARGS:-} tests/test_gpu_decode.py > "$OUT/pytest-decode.txt" 2>&1
    rc=$?; echo "pytest exit $rc"; (( rc )) && status=1
    grep -E "passed|failed|error" "$OUT/pytest-decode.txt" | tail -3
    grep -E "^(FAILED|ERROR)" "$OUT/pytest-decode.txt" | head -30
fi
if [[ -z "${SKIP_BENCH:-}" ]]; then
    python3 bench/decode_bench.py --out "$OUT" --rounds "${ROUNDS:-10}" \
        ${CASES:+--cases "$CASES"} ${SWEEP:+--splits "$SWEEP"} 2>&1 | tee "$OUT/bench-decode.txt"
    (( PIPESTATUS[0] )) && status=1
fi
if [[ -z "${SKIP_SANITIZER:-}" ]]; then
    SAN=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
    if [[ -x "$SAN" ]]; then
        "$SAN" --tool memcheck --leak-check full --error-exitcode 86 \
            python3 bench/sanitize_case.py --stage decode:128 -b 3 -H 8 -L 600 \
            > "$OUT/memcheck-decode.txt" 2>&1
        rc=$?; echo "memcheck exit $rc"; (( rc )) && status=1
        grep -E "ERROR SUMMARY|case decode" "$OUT/memcheck-decode.txt"
    else
        echo "no compute-sanitizer found (COMPUTE_SANITIZER=...)"
    fi
fi
exit $status

#!/usr/bin/env bash
# A short device session: GPU tests (all, or PYTEST_TARGETS) then `ptxattn run` on the shapes in
# RUNS ("KERNEL|ARGS;KERNEL|ARGS;..."), medians only. For smoke checks between protocol runs
# (bench/device_run.sh); its figures are not headline figures.
set -uo pipefail
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PTXATTN_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -m pytest -q -m gpu -rs ${PYTEST_ARGS:-} ${PYTEST_TARGETS:-} > "$OUT/pytest-gpu.txt" 2>&1
echo "pytest exit $?"; grep -E "passed|failed|error" "$OUT/pytest-gpu.txt" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/pytest-gpu.txt" | head -20
IFS=';' read -ra runs <<< "${RUNS:-}"
for r in "${runs[@]}"; do
    kernel=${r%%|*}; args=${r#*|}
    echo "== run $kernel $args"
    # shellcheck disable=SC2086
    python3 -m ptxattn run "$kernel" $args 2>&1 | grep -E "time|check|PASS|FAIL|Error" 
done | tee "$OUT/runs.txt"

#!/usr/bin/env bash
# transformers generate() through ptxattn, end to end, on the H200 in one call from the
# repository root:
#
#   bash bench/generate_device.sh       (the run tool sets $OUT; carry .whl with the pcpp wheel)
#
# 1. tests/test_gpu_generate.py (~1 minute: the profiler sees the decode kernel in plain calls
#    and graph replays; decode logits and greedy tokens against "sdpa" on a tiny Llama, dynamic,
#    static eager and static compiled; the benchmark itself at 2 layers) and the static-cache
#    routing tests of tests/test_gpu_torch_autograd.py -> $OUT/pytest-generate.txt.
# 2. bench/models/generate_bench.py: the Llama-3.1-8B architecture, 32k context, 128 new
#    tokens, batch 8 and 1, dynamic and static cache, ptxattn against SDPA's backends
#    (~4 minutes at BUDGET=240, which skips the static-cache runs that would end later: the
#    batch-1 pair at the full depth, most likely; BUDGET=420 runs everything, ~5-6 minutes)
#    -> $OUT/generate-<date>.json and $OUT/generate.txt (the phases, the runs, the summary).
# Switches: SKIP_TESTS=1 SKIP_BENCH=1 BATCHES=8,1 CACHES=dynamic,static LAYERS= BUDGET=240
#   STATIC_SDPA=best|all EXTRA="..." (more generate_bench.py arguments) PYTEST_ARGS=--maxfail=5
set -uo pipefail
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PTXATTN_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used --format=csv
status=0
if [[ -z "${SKIP_TESTS:-}" ]]; then
    python3 -m pytest -q -rs ${PYTEST_ARGS:-} tests/test_gpu_generate.py \
        tests/test_gpu_torch_autograd.py -k "generate or static_cache" \
        > "$OUT/pytest-generate.txt" 2>&1
    rc=$?; echo "pytest exit $rc"; (( rc )) && status=1
    grep -E "passed|failed|error" "$OUT/pytest-generate.txt" | tail -3
    grep -E "^(FAILED|ERROR)" "$OUT/pytest-generate.txt" | head -30
fi
if [[ -z "${SKIP_BENCH:-}" ]]; then
    python3 bench/models/generate_bench.py --out "$OUT" --budget-s "${BUDGET:-240}" \
        ${BATCHES:+--batches "$BATCHES"} ${CACHES:+--caches "$CACHES"} \
        ${LAYERS:+--layers "$LAYERS"} ${STATIC_SDPA:+--static-sdpa "$STATIC_SDPA"} \
        ${EXTRA:-} 2>&1 | tee "$OUT/generate.txt"
    (( PIPESTATUS[0] )) && status=1
fi
exit $status

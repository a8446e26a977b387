#!/usr/bin/env bash
# Device call A (session 9): what session 8 merged without a device run. The integration's host
# time before/after (session8_host.sh, one round, with its GPU tests: serving and the
# transformers paged path, CUDA-graph capture included), then the default-path GPU suites of
# decode, paged variants and generate() that session 8 never finished in one call.
set -uo pipefail
source bench/device/call_setup.sh call-a.log
part "host before/after + GPU tests of the path"
GPU_TESTS=1 HOST_S=${HOST_S:-100} TEST_S=${TEST_S:-200} bash bench/device/session8_host.sh > /dev/null 2>&1
cat "$OUT/host.log" >> "$LOG"; rm -f "$OUT/host.log"
part "GPU suites: decode, paged variants, generate"
left=$(( ${END_S:-560} - (SECONDS - t0) ))
timeout $left python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu_decode.py \
    tests/test_gpu_paged_variants.py tests/test_gpu_generate.py >> "$LOG" 2>&1
echo "suites rc $?" | tee -a "$LOG"
part "end"
grep -E "=====|integration |host  |rc |passed|failed|FAILED|Error" "$LOG" | cut -c1-220 | tail -70

#!/usr/bin/env bash
# Nsight Compute on the H200 for "what binds" (issue 13): each line of KERNELS is the arguments
# of bench/experiments/ncu_bind.py. One profiled launch per kernel; the report goes to
# $OUT/ncu.txt. Run after device_run.sh (needs the same PYTHONPATH).
#
# L2=1 (issue 23): instead, per line, ncu_bind.py --profile: the L2 hit rate, the SM clock the
# kernel got, tensor pipe, issue slots and DRAM bytes at natural clocks (--clock-control none)
# and at locked clocks, a table in $OUT/ncu-l2.txt and one JSON line per kernel in
# $OUT/ncu-l2.jsonl. A line's kernel may be `cudnn` (PyTorch SDPA, cuDNN backend).
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
# KERNELS_FILE=path: the lines of a file instead (comment lines skipped)
if [[ -n ${KERNELS_FILE:-} ]]; then KERNELS=$(grep -v '^#' "$KERNELS_FILE"); fi
KERNELS=${KERNELS:-"stage14 --shape 4x16x8192x128
stage16 --shape 4x16x8192x128
production --shape 2x16x16384x128 --causal"}
if [[ -n ${L2:-} ]]; then
    : > "$OUT/ncu-l2.txt"
    while read -r line; do
        [[ -z $line || $line == \#* ]] && continue
        echo "===== ncu L2: $line" | tee -a "$OUT/ncu-l2.txt"
        # shellcheck disable=SC2086
        python3 bench/experiments/ncu_bind.py --profile $line --out "$OUT/ncu-l2.jsonl" \
            < /dev/null 2>&1 | tee -a "$OUT/ncu-l2.txt"
    done <<< "$KERNELS"
    exit 0
fi
: > "$OUT/ncu.txt"
while read -r line; do
    [[ -z $line ]] && continue
    echo "===== ncu: $line" | tee -a "$OUT/ncu.txt"
    # shellcheck disable=SC2086
    timeout 240 ncu --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        -k ptxattn_fwd --launch-skip 1 --launch-count 1 \
        python3 bench/experiments/ncu_bind.py $line < /dev/null >> "$OUT/ncu.txt" 2>&1
    echo "ncu exit $?" | tee -a "$OUT/ncu.txt"
done <<< "$KERNELS"

#!/usr/bin/env bash
# compute-sanitizer on the backward kernels: memcheck, racecheck, synccheck on every case of
# bench/sanitize_bwd_case.py (one case, one call per invocation), and the negative control
# (b1 with its dS^T barrier dropped) under racecheck, which must flag it.
#
#   bash bench/sanitize_bwd.sh         (on the GPU machine, from the repository root; $OUT set)
#
# $OUT/sanitizer-backward-<date>.txt: each invocation's command, its summary lines and case
# line, and the first lines of the log of any invocation that is not clean; the table last.
# Exit 0 when every real case is clean and the control is flagged, 1 otherwise.
# Switches: TOOLS="memcheck synccheck" (racecheck is the slow one), CASES="b1 b3 d128".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
PYTHON=${PYTHON:-python3}
SAN=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
TOOLS=${TOOLS:-memcheck racecheck synccheck}
CASES=${CASES:-}            # e.g. CASES="b1 b3 d128": a subset (default: every case)
mkdir -p "$OUT"
LOG="$OUT/sanitizer-backward-$(date +%Y-%m-%d).txt"
: > "$LOG"
export CUDA_CACHE_DISABLE=0 PYTHONUNBUFFERED=1
status=0
table=()
for tool in $TOOLS; do
  for case in ${CASES:-$($PYTHON bench/sanitize_bwd_case.py --list)}; do
    extra=(); [ "$tool" = memcheck ] && extra=(--leak-check full)
    [ "$tool" = racecheck ] && extra=(--racecheck-report analysis)
    cmd=("$SAN" --tool "$tool" "${extra[@]}" --error-exitcode 86 "$PYTHON" bench/sanitize_bwd_case.py "$case")
    out=$(timeout 600 "${cmd[@]}" 2>&1); rc=$?
    echo "== ${cmd[*]} (rc $rc)" >> "$LOG"
    echo "$out" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^case " >> "$LOG"
    if [ $rc -ne 0 ]; then status=1; echo "$out" | head -40 >> "$LOG"; fi
    table+=("$(printf '%-10s %-24s %s' "$tool" "$case" "$([ $rc -eq 0 ] && echo clean || echo "NOT CLEAN (rc $rc)")")")
  done
done
for case in $($PYTHON bench/sanitize_bwd_case.py --controls); do
  cmd=("$SAN" --tool racecheck --racecheck-report analysis --error-exitcode 86 "$PYTHON" bench/sanitize_bwd_case.py "$case")
  out=$(timeout 600 "${cmd[@]}" 2>&1); rc=$?
  echo "== ${cmd[*]} (rc $rc: must be 86, flagged)" >> "$LOG"
  echo "$out" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^case |hazard" | head -10 >> "$LOG"
  [ $rc -eq 86 ] || status=1
  table+=("$(printf '%-10s %-24s %s' racecheck "$case" "$([ $rc -eq 86 ] && echo "flagged (as it must)" || echo "NOT FLAGGED (rc $rc)")")")
done
{ echo; echo "tool       case                     result"; printf '%s\n' "${table[@]}"; } | tee -a "$LOG"
exit $status

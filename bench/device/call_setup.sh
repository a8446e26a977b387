# Sourced by the device-call scripts of bench/device/ (bash): `source bench/device/call_setup.sh
# <log name>`. Sets OUT (the run tool's, else ./device-out) and LOG ($OUT/<log name>: the device
# returns at most 8 files, so a call keeps one log), installs pcpp from .whl when it is carried
# (the device's own torch and transformers stay), exports what the GPU tests and benchmarks
# need, and defines part() (a heading in the log with the seconds since the call began) and
# ncu_lines (below).
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
LOG=$OUT/${1:?call_setup.sh: a log name}
if ls .whl/pcpp*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/pcpp*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PTXATTN_REQUIRE_GPU=1
t0=$SECONDS
part() { echo "===== $* (at $((SECONDS - t0))s)" | tee -a "$LOG"; }
# ncu_lines FILE OUT_JSONL: each line of FILE (ncu_bind.py --profile's arguments; blank lines
# and # comments skipped) while END_S (default 440) seconds since the call began leave >= 15 s;
# the lines left over are written to the log as skipped.
ncu_lines() {
    local line left
    while read -r line; do
        [[ -z $line || $line == \#* ]] && continue
        left=$(( ${END_S:-440} - (SECONDS - t0) ))
        (( left < 15 )) && { echo "skipped (time): $line" >> "$LOG"; continue; }
        # shellcheck disable=SC2086
        timeout $left python3 bench/experiments/ncu_bind.py --profile $line --timeout $left \
            --out "$2" >> "$LOG" 2>&1 < /dev/null
    done < "$1"
}

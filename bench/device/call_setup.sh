# Sourced by the device-call scripts of bench/device/ (bash): `source bench/device/call_setup.sh
# <log name>`. Sets OUT (the run tool's, else ./device-out) and LOG ($OUT/<log name>: the device
# returns at most 8 files, so a call keeps one log), installs pcpp from .whl when it is carried
# (the device's own torch and transformers stay), exports what the GPU tests and benchmarks
# need, and defines part(): a heading in the log with the seconds since the call began.
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
LOG=$OUT/${1:?call_setup.sh: a log name}
if ls .whl/pcpp*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/pcpp*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PTXATTN_REQUIRE_GPU=1
t0=$SECONDS
part() { echo "===== $* (at $((SECONDS - t0))s)" | tee -a "$LOG"; }

#!/usr/bin/env bash
# Device call A: the sanitizers on the kernels that had none (decode re-checked after its
# workspace fix, paged, varlen, FP8 with its quantizer; the backward), the first-call JIT
# time, and ncu's L2 hit rate and clock on the default sectioned walk. ~7 minutes.
set -uo pipefail
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PTXATTN_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
t0=$SECONDS
# the two sanitizer runners side by side (the forward's parallel, the backward's serial)
STAGES=decode,paged,varlen,fp8 JOBS=10 bash bench/sanitize.sh > "$OUT/sanitize-new.txt" 2>&1 &
a=$!
bash bench/sanitize_bwd.sh > "$OUT/sanitize-bwd.txt" 2>&1 &
b=$!
wait $a; echo "sanitize new kernels rc $? at $((SECONDS - t0))s"
tail -${SAN_TAIL:-24} "$OUT/sanitize-new.txt" | cut -c1-160
wait $b; echo "sanitize backward rc $? at $((SECONDS - t0))s"
tail -16 "$OUT/sanitize-bwd.txt" | cut -c1-160
timeout ${JIT_S:-150} python3 bench/jit_time.py > "$OUT/jit-time.jsonl" 2> "$OUT/jit-time.err"
echo "jit rc $? at $((SECONDS - t0))s"; cut -c1-160 "$OUT/jit-time.jsonl"
L2=1 KERNELS_FILE=bench/experiments/2026-12-02-ncu-l2.txt timeout ${NCU_S:-150} \
    bash bench/experiments/ncu_bind.sh > "$OUT/ncu-run.txt" 2>&1
echo "ncu rc $? at $((SECONDS - t0))s"; grep -vE "^==PROF==|^\s*$" "$OUT/ncu-l2.txt" | tail -30 | cut -c1-200

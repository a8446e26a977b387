#!/usr/bin/env bash
# Session 16: the paged varlen build's warp producer (PTXATTN_PAGED_WARP: the producer's first
# warp, values warp-uniform, one elected lane issuing) against today's batched single thread,
# same run, pages 16/64/256; then Nsight Compute at page 16.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 240 python3 bench/experiments/paged_varlen_probe.py --pages 16,64,256 \
    --variants today,warp,warp_ahead --out "$OUT/probe2.jsonl" 2>&1 | tee "$OUT/probe2.txt"
timeout 150 python3 bench/experiments/paged_varlen_probe.py --ncu --page 16 \
    --variants today,warp_ahead --out "$OUT/probe2-ncu.jsonl" 2>&1 | tee -a "$OUT/probe2-ncu.txt"

#!/usr/bin/env bash
# Session 16: where the paged varlen build loses against packed keys (bench/experiments/
# paged_varlen_probe.py): same-run timing of today's producer and the table-ahead variant at
# pages 16/64/256, then Nsight Compute (natural clocks) at pages 256 and 16.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 200 python3 bench/experiments/paged_varlen_probe.py --pages 16,64,256 \
    --variants today,ahead --out "$OUT/probe.jsonl" 2>&1 | tee "$OUT/probe.txt"
for page in 256 16; do
    timeout 150 python3 bench/experiments/paged_varlen_probe.py --ncu --page $page \
        --variants today,ahead --out "$OUT/probe-ncu.jsonl" 2>&1 | tee -a "$OUT/probe-ncu.txt"
done

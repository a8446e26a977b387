#!/usr/bin/env bash
# What session 17 could not run (its device time went on machines that would not start, and
# the one call that ran got an H100): for the next session, from the repository root,
# carrying .whl (pcpp), on the H200:
#   1. the vLLM backend's GPU tests (mixed and decode-only steps, a CUDA-graph replay)
#   2. the serving GPU tests with the warp producer on the H200 (run on an H100 in session 17)
#   3. the paged varlen probe on the H200: thread, warp, warp + table ahead; then the warp
#      over pages in the sequences' order (what the build costs apart from the scattering)
#   4. sustained at the power cap: the packed call, the thread and the warp, page 16 and 256
#      (3 s windows after a cool-down, power and clock sampled; about 40 s)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PTXATTN_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv
timeout 150 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu_vllm_backend.py \
    tests/test_gpu_serving.py > "$OUT/pytest-vllm-serving.txt" 2>&1
echo "tests rc $?"
tail -15 "$OUT/pytest-vllm-serving.txt" | cut -c1-400
timeout 100 python3 bench/experiments/paged_varlen_probe.py --pages 16,64,256 \
    --variants thread,warp,warp_ahead --out "$OUT/probe.jsonl" 2>&1 | tee "$OUT/probe.txt"
timeout 60 python3 bench/experiments/paged_varlen_probe.py --pages 16,64,256 --in-order \
    --variants warp --out "$OUT/probe-in-order.jsonl" 2>&1 | tee "$OUT/probe-in-order.txt"
timeout 120 python3 bench/experiments/paged_varlen_probe.py --pages 16,256 --sustained \
    --variants thread,warp --out "$OUT/probe-sustained.jsonl" 2>&1 | tee "$OUT/probe-sustained.txt"

#!/usr/bin/env bash
# The capstone on the H200 in one device call (estimated 4-5 minutes; the call's limit is 10),
# from the repository root, with .whl/ carried (the wheels of bench/models/wheels.txt and pcpp):
#
#   bash bench/models/run_all.sh
#
# One process per model, each at its pipeline's default shape and its published depth, random
# weights, bf16; each writes <model>-<date>.json and capstone-<model>.log into $OUT; then the
# figure $OUT/capstone.svg from those JSON files and the README's table rows. Per backend
# (cuDNN, flash, efficient, ptxattn) a model runs 2 warm-up steps, REPS rounds of one timed
# step (all backends in each round) and one hooked step: 4 x (3 + REPS) steps.
# Estimates per model on the H200 (from the 2026-12-01 run at 4 layers and the FLOPs of the
# full depth; the whole process: imports, random init on the GPU, JIT, 52 steps at REPS=10):
#   wan    Wan 2.1 T2V 1.3B, 480x832x81 = 32,760 tokens, 30 layers   ~0.5 s/step  ~50 s
#   ltx2   LTX-2 19B, 768x512x121 = 6,144 video + 126 audio tokens,
#          1,024 text tokens, 48 layers (76 GB fp32 init, 38 GB bf16) ~0.35 s/step ~60 s
#   llama  Llama-3.1-8B architecture, 8,192-token prefill, 32 layers ~0.25 s/step ~40 s
#          (efficient refuses GQA at once: 3 backends)
#   ltx    LTX-Video 0.9, 704x480x161 = 6,930 tokens, 28 layers       ~0.1 s/step  ~30 s
# plus ~20 s for the wheels: about 3.5 minutes if the estimates hold, and DEADLINE below
# guards the call's 10 minutes if they do not.
#
# Switches (environment): MODELS="wan ltx2 llama ltx" (the order they run in)
#   WAN_LAYERS= LTX2_LAYERS= LLAMA_LAYERS= LTX_LAYERS= (default: the published depth; set
#   e.g. LTX2_LAYERS=12 to cut a model's depth, which its JSON then records)
#   REPS=10  BACKENDS=cudnn,flash,efficient  DEADLINE=540 (seconds for the whole script: a
#   model that would start with less than 30 s left is skipped, and each runs under `timeout`
#   with what is left, so the figure and the summary always come back)
#   EXTRA="..." (more arguments for capstone.py)  PYTHON=python3  SKIP_INSTALL=1 (no wheels)
# A dry run of the whole script without a GPU (tiny configs on the CPU):
#   SKIP_INSTALL=1 PYTHON=/path/to/python-with-torch BACKENDS=math,flash REPS=1 \
#       EXTRA="--tiny --device cpu" OUT=/tmp/capstone-dry bash bench/models/run_all.sh
set -uo pipefail

start=$SECONDS
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
MODELS=${MODELS:-wan ltx2 llama ltx}
REPS=${REPS:-10}
BACKENDS=${BACKENDS:-cudnn,flash,efficient}
DEADLINE=${DEADLINE:-540}

PYTHON=${PYTHON:-python3}
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"
if [[ -n ${SKIP_INSTALL:-} ]]; then
    echo "run_all.sh: SKIP_INSTALL set: using the packages $PYTHON has"
elif compgen -G ".whl/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
else
    echo "run_all.sh: no .whl/*.whl here (carry .whl: bench/models/fetch_wheels.sh fills it)"
fi
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1

section() { printf '\n===== %s =====\n' "$*"; }
status=0
declare -A LAYERS=([wan]=${WAN_LAYERS:-0} [ltx2]=${LTX2_LAYERS:-0} [llama]=${LLAMA_LAYERS:-0}
                   [ltx]=${LTX_LAYERS:-0})

section "GPU"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
"$PYTHON" -c 'import torch, diffusers, transformers; print("torch", torch.__version__,
"diffusers", diffusers.__version__, "transformers", transformers.__version__)' || status=1

for model in $MODELS; do
    left=$(( DEADLINE - (SECONDS - start) ))
    if (( left < 30 )); then
        section "$model: skipped, ${left}s left of DEADLINE=$DEADLINE"
        status=1
        continue
    fi
    args=("$model" --reps "$REPS" --backends "$BACKENDS" --out "$OUT" "${EXTRA_ARGS[@]}")
    layers=${LAYERS[$model]:-0}
    (( layers > 0 )) && args+=(--layers "$layers")
    section "capstone $model (limit ${left}s): $PYTHON bench/models/capstone.py ${args[*]}"
    t0=$SECONDS
    timeout --signal=TERM --kill-after=10 "$left" \
        "$PYTHON" bench/models/capstone.py "${args[@]}" > "$OUT/capstone-$model.log" 2>&1
    rc=$?
    # the warnings torch prints for every backend that declines a call are noise here
    grep -v -e 'UserWarning' -e 'out = fn' -e 'experimental feature' "$OUT/capstone-$model.log" \
        | tail -n 40
    echo "capstone $model: exit status $rc after $(( SECONDS - t0 ))s"
    (( rc == 0 )) || status=$rc
done

section "figure"
fig_args=(--results "$OUT" --out "$OUT/capstone.svg" --table)
[[ " ${EXTRA:-} " == *" --tiny "* ]] && fig_args+=(--include-tiny)    # the dry run's records
"$PYTHON" bench/models/figure.py "${fig_args[@]}" || status=1

section "files in \$OUT"
ls -la "$OUT"
echo "run_all.sh: exit status $status after $(( SECONDS - start ))s"
exit "$status"

#!/usr/bin/env bash
# The one script the lead runs on the remote H200, in one call, from the repository root:
#
#   bash bench/device_run.sh            (the run tool sets $OUT; carry .whl with the pcpp wheel)
#
# The device has Python 3.12, torch, cuda-bindings, numpy, ml_dtypes, click, pytest, ptxas,
# nvdisasm, cuobjdump, but not pcpp (a wheel in .whl/) and not ptxattn (used from $PWD).
#
# Switches (environment): SETS=lineage,production (the benchmark's case sets, default both)
#   STAGES=1,2,5 (default all; lineage set and SASS)  SHAPES=4k,8k,16k,1k (lineage set)
#   CASES=8k,causal-8k (production set; default all, `ptxattn bench --set production --estimate`
#   lists them)  LAYOUT=bhld (lineage set)  REPS= ROUNDS= (default: each set's, lineage 20 x 10,
#   production 10 x 10)  SKIP_SASS=1 SKIP_TESTS=1 SKIP_RUN=1 SKIP_BENCH=1  PLOT=1 (matplotlib)
#   TRACE=1,14 (timelines of those stages: trace-stageNN.svg/.json and trace.txt in $OUT)
#   TRACE_SHAPE=1x16x2048x128  PYTEST_ARGS="--maxfail=10" (default -x)
#   SUSTAINED=1 (every set also runs each kernel and cuDNN back to back at the power cap:
#   `ptxattn bench --sustained`; SUSTAINED_SECONDS=3 sets the window)
#   VARIANTS=bench/experiments/<plan>.txt (same-run build comparisons: each non-comment line is
#   the arguments of one bench/experiments/variants.py run; results in $OUT/variants.jsonl/.txt)
#
# $OUT gets files, no folders: device.txt, sass.txt, pytest-gpu.txt, run-stage1.txt, and per set
# <date>-h200-<set>.json and bench-<set>.txt (and progression.png with PLOT=1, of the lineage set;
# trace.txt and trace-stageNN.svg/.json with TRACE=...). The short tables print LAST.
set -euo pipefail

OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
SETS=${SETS:-lineage,production}
SHAPES=${SHAPES:-4k,8k,16k,1k}
STAGES=${STAGES:-}
CASES=${CASES:-}
LAYOUT=${LAYOUT:-bhld}
REPS=${REPS:-}
ROUNDS=${ROUNDS:-}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
# GPU tests fail (not skip) when the GPU or a framework they need (torch, CuPy, JAX) is
# missing: a device run cannot come back green without having run (tests/conftest.py).
export PTXATTN_REQUIRE_GPU=${PTXATTN_REQUIRE_GPU:-1}

section() { printf '\n===== %s =====\n' "$*"; }
status=0   # the worst exit code of the steps that must not stop the script

section "GPU and toolkit"
{
    nvidia-smi || true
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit \
        --format=csv || true
    python3 -m ptxattn info
} 2>&1 | tee "$OUT/device.txt"

if [[ -z ${SKIP_SASS:-} ]]; then
    section "SASS summaries (offline ptxas)"
    stage_numbers=${STAGES//,/ }
    if [[ -z $stage_numbers ]]; then
        stage_numbers=$(python3 -c \
            'from ptxattn.stages import all_stages; print(*(s.number for s in all_stages()))')
    fi
    : > "$OUT/sass.txt"
    for s in $stage_numbers; do
        python3 -m ptxattn sass "$s" --summary 2>&1 | tee -a "$OUT/sass.txt" || status=1
        echo | tee -a "$OUT/sass.txt"
    done
fi

if [[ -z ${SKIP_TESTS:-} ]]; then
    section "GPU tests"
    set +e
    python3 -m pytest -q -m gpu -rs ${PYTEST_ARGS:--x} 2>&1 | tee "$OUT/pytest-gpu.txt"
    rc=${PIPESTATUS[0]}
    set -e
    echo "pytest -m gpu exit code: $rc" | tee -a "$OUT/pytest-gpu.txt"
    (( rc == 0 )) || status=$rc
fi

if [[ -z ${SKIP_RUN:-} ]]; then
    section "ptxattn run stage1 --shape 4k"
    set +e
    python3 -m ptxattn run stage1 --shape 4k --layout "$LAYOUT" 2>&1 | tee "$OUT/run-stage1.txt"
    rc=${PIPESTATUS[0]}
    set -e
    (( rc == 0 )) || status=$rc
fi

if [[ -z ${SKIP_BENCH:-} ]]; then
    for name in ${SETS//,/ }; do
        args=(--set "$name" --out "$OUT")
        case $name in
            lineage)
                args+=(--shapes "$SHAPES" --layout "$LAYOUT")
                [[ -n $STAGES ]] && args+=(--stages "$STAGES")
                [[ -n ${PLOT:-} ]] && args+=(--plot "$OUT/progression.png") ;;
            production)
                [[ -n $CASES ]] && args+=(--shapes "$CASES") ;;
            *)
                echo "device_run.sh: SETS: unknown set '$name' (lineage, production)"; status=2
                continue ;;
        esac
        [[ -n $REPS ]] && args+=(--reps "$REPS")
        [[ -n $ROUNDS ]] && args+=(--rounds "$ROUNDS")
        [[ -n ${SUSTAINED:-} ]] && args+=(--sustained)
        [[ -n ${SUSTAINED_SECONDS:-} ]] && args+=(--sustained-seconds "$SUSTAINED_SECONDS")
        section "benchmark: set $name"
        python3 -m ptxattn bench "${args[@]}" --estimate | tail -n 1 || true   # errors: below
        set +e
        python3 -m ptxattn bench "${args[@]}" > /dev/null   # the table is in $OUT/bench-$name.txt
        rc=$?
        set -e
        (( rc == 0 )) || status=$rc
    done
fi

if [[ -n ${VARIANTS:-} ]]; then
    section "same-run build comparisons: $VARIANTS"
    : > "$OUT/variants.txt"
    while read -r line; do
        [[ -z $line || $line == \#* ]] && continue
        echo "+ variants.py $line" | tee -a "$OUT/variants.txt"
        # shellcheck disable=SC2086  (the line is a list of arguments)
        python3 bench/experiments/variants.py $line --out "$OUT/variants.jsonl" < /dev/null 2>&1 \
            | tee -a "$OUT/variants.txt" || status=1
    done < "$VARIANTS"
fi

if [[ -n ${TRACE:-} ]]; then
    section "timelines of one CTA: stages $TRACE"
    : > "$OUT/trace.txt"
    for s in ${TRACE//,/ }; do
        label=$(printf 'stage%02d' "$s")
        python3 -m ptxattn trace "$s" --shape "${TRACE_SHAPE:-1x16x2048x128}" --layout "$LAYOUT" \
            --out "$OUT/trace-$label.svg" --json "$OUT/trace-$label.json" 2>&1 \
            | tee -a "$OUT/trace.txt" || status=1
    done
fi

section "files in \$OUT"
ls -la "$OUT"
for table in "$OUT"/bench-*.txt; do
    [[ -f $table ]] || continue
    section "benchmark $(basename "$table" .txt) (same-run % of cuDNN)"
    cat "$table"
done
echo "device_run.sh: exit status $status"
exit "$status"

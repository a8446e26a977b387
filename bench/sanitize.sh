#!/usr/bin/env bash
# compute-sanitizer on every registered stage: memcheck, racecheck, synccheck and initcheck.
#
#   bash bench/sanitize.sh              (on the GPU machine, from the repository root; carry .whl
#                                        for pcpp; the run tool sets $OUT)
#
# Each sanitizer invocation runs ONE kernel ONCE on a small case through bench/sanitize_case.py
# (random inputs, NaN-poisoned output and LSE, one launch, a check against the float64
# reference, every buffer freed and the context released). The cases are the one table of
# bench/sanitize_case.py (`python3 bench/sanitize_case.py --list`: NAME, CTAS and its arguments,
# tab-separated): every lineage stage at B=1 H=2 L=256 in BHLD and BSHD; stages with BLOCK_M
# 128 also at L=512 (several K/V tiles: the K/V ring wraps); persistent stages also at B=2 H=2
# L=512 with PTXATTN_PERSISTENT_CTAS=2 in both layouts, so each of the 2 CTAs walks 8 tiles (at
# these shapes a grid of 132 CTAs would give each CTA one tile at most). The production kernel:
# every head dim's build (production:64/128/256) small and persistent in both layouts, its
# masked build (causal), a sliding and a two-sided window, a masked persistent walk, GQA, MQA,
# ragged tails (Lq, Lk not tile multiples, Lq < Lk and Lq > Lk), the top-left diagonal, and the
# LSE written. Decode (flash_attn_with_kvcache: three splits and the combine, with device
# lengths out of range) once per head dim; paged decode at pages 16, 64 and 256 (shuffled pages,
# a planted bad table entry); varlen prefill over sequences of 0..300 tokens (causal, a window,
# GQA/MQA, the LSE); the FP8 forward with its quantizer (checked against the FP8 model). The
# backward has its own runner (bench/sanitize_bwd.sh).
#
# Device time (H200, compute-sanitizer 2025.3, 16 cores): one invocation takes 3-8 s (racecheck
# the slowest); at JOBS=14 about 2 invocations finish a second. The full run (89 cases x 4
# tools + 4 controls = 360 invocations, plus 89 plain runs) takes about 3 minutes; the script
# prints its own estimate first. TOOLS="memcheck synccheck" / "racecheck initcheck" halves it.
#
# Negative controls (`sanitize_case.py --controls`), run under racecheck and synccheck: stage 1
# built with -D PTXATTN_PLANT_HAZARD=1 (the bar.sync between the P stores and the PV wgmma
# dropped, plus an ordinary ld.shared of a P word another warp stored: a hazard racecheck
# tracks, so it MUST be flagged, or the clean results above mean nothing) and =2 (the barrier
# dropped only; the unordered reader is wgmma, through the async proxy: recorded, not required).
# What the tools do not see (async-proxy accesses: TMA writes, wgmma operand reads) is covered
# by the GPU tests instead: NaN-poisoned outputs, the reference check on sampled rows, and
# bitwise-identical repeats across calls, streams and grid caps (a race moves the error).
#
# Tools and options:
#   memcheck   --leak-check full              out-of-bounds/misaligned accesses, leaks
#   racecheck  --racecheck-report analysis    shared-memory hazards (slow: smallest shapes)
#   synccheck                                 invalid barrier use (bar.sync, named barriers)
#   initcheck                                 reads of uninitialised global memory. Run on every
#              stage: the inputs are copied in and the output is memset (NaN) before the launch,
#              so whether or not the tool tracks TMA (bulk tensor) stores as writes, the host's
#              copy of O back cannot be flagged; an unwritten tile shows as NaN in the check.
#
# Switches (environment): TOOLS="memcheck racecheck synccheck initcheck"  STAGES=1,5,14,production
#   CONTROL_TOOLS="racecheck synccheck" (the negative controls; "" skips them)
#   JOBS=nproc-2 (sanitizer processes at once; they share the GPU)  CASE_TIMEOUT=300 (seconds per
#   invocation)  DRY_RUN=1 (print the commands, run nothing)  COMPUTE_SANITIZER=/path/to/it
#   PYTHON=python3  CUDA_CACHE_DISABLE=0 (default: the plain warm-up run fills the driver's JIT
#   cache, so each sanitizer invocation loads its stage from the cache)
#
# $OUT gets one file, sanitizer-<date>.txt: the exact commands, tool and driver versions, each
# invocation's result lines (ERROR SUMMARY / RACECHECK SUMMARY / the case line) and, for any
# invocation that is not clean, the first lines of its log. The summary table prints LAST.
# Exit status: 0 when every invocation is clean, 1 otherwise, 3 when the sanitizer cannot run.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-$PWD/device-out}
PYTHON=${PYTHON:-python3}
TOOLS=${TOOLS:-memcheck racecheck synccheck initcheck}
CONTROL_TOOLS=${CONTROL_TOOLS-racecheck synccheck}
STAGES=${STAGES:-}
JOBS=${JOBS:-$(( $(nproc) > 2 ? $(nproc) - 2 : 1 ))}
SECONDS_PER_INVOCATION=6     # measured on the H200 (2026-12-01): 3-8 s, JOBS of them at once
CASE_TIMEOUT=${CASE_TIMEOUT:-300}
DRY_RUN=${DRY_RUN:-}
export CUDA_CACHE_DISABLE=${CUDA_CACHE_DISABLE:-0}
export PYTHONUNBUFFERED=1
ERROR_EXIT=86

if [[ -z $DRY_RUN ]] && ! "$PYTHON" -c 'import pcpp' 2>/dev/null; then
    if compgen -G '.whl/*.whl' > /dev/null; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || exit 3
    fi
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}

find_sanitizer() {
    local c
    for c in "${COMPUTE_SANITIZER:-}" "$(command -v compute-sanitizer 2>/dev/null)" \
             "${CUDA_HOME:+$CUDA_HOME/bin/compute-sanitizer}" \
             /usr/local/cuda/bin/compute-sanitizer \
             /usr/local/cuda/compute-sanitizer/compute-sanitizer \
             $(ls -d /usr/local/cuda-*/bin/compute-sanitizer 2>/dev/null | sort -V -r); do
        if [[ -n $c && -x $c ]]; then echo "$c"; return 0; fi
    done
    return 1
}
SAN=$(find_sanitizer) || SAN=""
if [[ -z $SAN ]]; then
    if [[ -z $DRY_RUN ]]; then
        echo "sanitize.sh: compute-sanitizer not found (PATH, \$CUDA_HOME, /usr/local/cuda*);" \
             "set COMPUTE_SANITIZER=/path/to/compute-sanitizer" >&2
        exit 3
    fi
    SAN=compute-sanitizer
fi

tool_options() {
    case $1 in
        memcheck)  echo "--tool memcheck --leak-check full" ;;
        racecheck) echo "--tool racecheck --racecheck-report analysis" ;;
        synccheck) echo "--tool synccheck" ;;
        initcheck) echo "--tool initcheck" ;;
        *) echo "sanitize.sh: unknown tool '$1' (memcheck, racecheck, synccheck, initcheck)" >&2
           return 1 ;;
    esac
}

# ---- the cases and the commands ------------------------------------------------------------
mapfile -t CASES < <("$PYTHON" bench/sanitize_case.py --list --stages "$STAGES") || exit 3
(( ${#CASES[@]} )) || { echo "sanitize.sh: no cases (STAGES=$STAGES)" >&2; exit 3; }
CONTROLS=()
if [[ -n $CONTROL_TOOLS ]]; then
    mapfile -t CONTROLS < <("$PYTHON" bench/sanitize_case.py --controls) || exit 3
fi

# each line of --list / --controls: NAME <tab> CTAS <tab> the arguments of sanitize_case.py;
# split once into NAME/RUN (cases) and CNAME/CRUN (controls): RUN is the plain command, the
# environment a case needs (the persistent grid cap) in front of sanitize_case.py
split_cases() {   # PREFIX LINES...: PREFIX_NAME[i], PREFIX_RUN[i]
    local prefix=$1 line name ctas args env; shift
    local -n names=${prefix}NAME runs=${prefix}RUN
    names=() runs=()
    for line in "$@"; do
        IFS=$'\t' read -r name ctas args <<< "$line"
        env="CUDA_CACHE_DISABLE=$CUDA_CACHE_DISABLE"
        if (( ctas )); then env+=" PTXATTN_PERSISTENT_CTAS=$ctas"; fi
        names+=("$name")
        runs+=("$env|bench/sanitize_case.py $args")
    done
}
split_cases "" "${CASES[@]}"
split_cases C "${CONTROLS[@]}"
with() {   # RUN [SANITIZER OPTIONS...]: the command line
    local run=$1; shift
    echo "env ${run%%|*} ${*:+$* }$PYTHON ${run#*|}"
}

CMDS=() CMD_CASE=() CMD_TOOL=()
for tool in $TOOLS; do
    opts=$(tool_options "$tool") || exit 2
    for i in "${!CASES[@]}"; do
        run=${RUN[$i]}
        CMDS+=("env ${run%%|*} $SAN $opts --error-exitcode $ERROR_EXIT --print-limit 20 $PYTHON ${run#*|}")
        CMD_CASE+=("$i")
        CMD_TOOL+=("$tool")
    done
done
# the negative controls: CMD_CASE "cN" for control N
for tool in $CONTROL_TOOLS; do
    opts=$(tool_options "$tool") || exit 2
    for i in "${!CONTROLS[@]}"; do
        run=${CRUN[$i]}
        CMDS+=("env ${run%%|*} $SAN $opts --error-exitcode $ERROR_EXIT --print-limit 20 $PYTHON ${run#*|}")
        CMD_CASE+=("c$i")
        CMD_TOOL+=("$tool")
    done
done
estimate=$(( (${#CMDS[@]} + ${#CASES[@]} / 2 + JOBS - 1) / JOBS * SECONDS_PER_INVOCATION ))

if [[ -n $DRY_RUN ]]; then
    for i in "${!CASES[@]}"; do
        with "${RUN[$i]}"
    done
    printf '%s\n' "${CMDS[@]}"
    echo "estimate: ${#CMDS[@]} sanitizer invocations + ${#CASES[@]} plain runs, $JOBS at a time: about ${estimate}s" >&2
    exit 0
fi

mkdir -p "$OUT"
REPORT=$OUT/sanitizer-$(date -u +%Y-%m-%d).txt
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
started=$SECONDS

SOURCE=$("$PYTHON" -c 'from ptxattn.tools.bench import source_id; s = source_id()
if s.get("declared_commit"): print("commit:", s["declared_commit"], "(declared by the runner: PTXATTN_SOURCE_COMMIT)")
print(("git HEAD here:" if s.get("declared_commit") else "commit:"), (s["commit"] or "? (no git here)") + (" (with local changes in ptx/ or ptxattn/)" if s["dirty"] else ""))
print("source: sha256 of ptx/ and ptxattn/", s["tree_sha256"])' 2>&1)
{
    echo "ptxattn compute-sanitizer report, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    # the code that ran: the commit when git can tell, and always a hash of ptx/ and ptxattn/
    # (the device gets a copy of the tree, often without .git)
    # (the device gets a copy of the tree, often without .git, or with a stale one: the runner
    # declares the commit it copied in PTXATTN_SOURCE_COMMIT, and the tree hash checks it)
    echo "$SOURCE"
    echo "GPU: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo '?')"
    echo "compute-sanitizer: $SAN"
    "$SAN" --version 2>&1 | sed 's/^/    /'
    echo "python: $("$PYTHON" -c 'import sys; print(sys.version.split()[0])')," \
         "cuda-bindings $("$PYTHON" -c 'from importlib.metadata import version as v; print(v("cuda-bindings"))' 2>/dev/null || echo '?')"
    echo "settings: TOOLS='$TOOLS' STAGES='${STAGES:-all}' JOBS=$JOBS CASE_TIMEOUT=$CASE_TIMEOUT" \
         "CUDA_CACHE_DISABLE=$CUDA_CACHE_DISABLE"
    echo "cases: ${#CASES[@]} (bench/sanitize_case.py --list):"
    printf '    %s\n' "${NAME[@]}"
    echo "negative controls: ${#CONTROLS[@]} under '$CONTROL_TOOLS':"
    if (( ${#CONTROLS[@]} )); then printf '    %s\n' "${CNAME[@]}"; fi
    echo "estimate: ${#CMDS[@]} sanitizer invocations + ${#CASES[@]} plain runs, $JOBS at a time: about ${estimate}s"
    echo
} > "$REPORT"
cat "$REPORT"

run_logged() {   # INDEX-NAME COMMAND...: run with a timeout, log, exit code and seconds in $LOGS
    local key=$1; shift
    local t0=$SECONDS
    timeout -k 15 "$CASE_TIMEOUT" "$@" > "$LOGS/$key.log" 2>&1
    echo $? > "$LOGS/$key.rc"
    echo $((SECONDS - t0)) > "$LOGS/$key.s"
}

throttle() { while (( $(jobs -rp | wc -l) >= JOBS )); do wait -n; done; }

# ---- 1. plain runs: the JIT cache is filled and every case is checked without a sanitizer ----
echo "== plain runs (no sanitizer) ==" | tee -a "$REPORT"
for i in "${!CASES[@]}"; do
    throttle
    # shellcheck disable=SC2046
    run_logged "plain-$i" $(with "${RUN[$i]}") &
done
wait
worst=0
PLAIN=()
for i in "${!CASES[@]}"; do
    line=$(grep -m1 '^case ' "$LOGS/plain-$i.log" || tail -n 1 "$LOGS/plain-$i.log")
    echo "  [exit $(cat "$LOGS/plain-$i.rc")] $line" | tee -a "$REPORT"
    if grep -q '^case .* PASS$' "$LOGS/plain-$i.log"; then PLAIN+=(PASS); else PLAIN+=(FAIL); worst=1; fi
done

# ---- 2. can the sanitizer run here at all? (gVisor machines answer "Device not supported") ----
probe=$("$SAN" --tool memcheck --error-exitcode $ERROR_EXIT "$PYTHON" -c \
    'from ptxattn import tensors; tensors.empty((64,)).fill_u16(0)' 2>&1)
probe_rc=$?
if (( probe_rc != 0 )) || grep -q "Device not supported" <<< "$probe"; then
    {
        echo
        echo "compute-sanitizer cannot run on this machine (exit $probe_rc):"
        sed 's/^/    /' <<< "$probe" | head -n 20
    } | tee -a "$REPORT"
    exit 3
fi

# ---- 3. every tool on every case ----------------------------------------------------------
echo | tee -a "$REPORT"
echo "== ${#CMDS[@]} sanitizer invocations, $JOBS at a time ==" | tee -a "$REPORT"
for k in "${!CMDS[@]}"; do
    throttle
    # shellcheck disable=SC2086
    run_logged "san-$k" ${CMDS[$k]} &
done
wait

declare -A CELL
for k in "${!CMDS[@]}"; do
    log=$LOGS/san-$k.log
    rc=$(cat "$LOGS/san-$k.rc")
    secs=$(cat "$LOGS/san-$k.s")
    summary=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^case ' "$log")
    errors=$(grep -oE 'ERROR SUMMARY: [0-9]+' "$log" | grep -oE '[0-9]+$' | tail -n 1)
    warnings=$(grep -oE '\(([0-9]+) errors?, ([0-9]+) warnings?\)' "$log" | grep -oE '[0-9]+ warn' \
               | grep -oE '[0-9]+' | tail -n 1)
    hazards=$(grep -oE 'RACECHECK SUMMARY: [0-9]+' "$log" | grep -oE '[0-9]+$' | tail -n 1)
    if [[ ${CMD_CASE[$k]} == c* ]]; then
        # a negative control: the question is whether the tool flagged the planted hazard
        check=$(grep -oE '(PASS|FAIL)$' <<< "$(grep '^case ' "$log")" | tail -n 1)
        if (( rc == 124 || rc == 137 )); then
            cell="TIMEOUT"
        elif (( rc == ERROR_EXIT )) || [[ -n $errors && $errors != 0 ]] \
             || [[ -n $warnings && $warnings != 0 ]] || [[ -n $hazards && $hazards != 0 ]]; then
            cell="FLAGGED (${errors:-0} err, ${warnings:-0} warn)"
        else
            cell="not flagged"
        fi
        cell+=", output ${check:-?}"
        control=${CNAME[${CMD_CASE[$k]#c}]}
        if [[ ${CMD_TOOL[$k]} == racecheck && $control == *HAZARD=1* && $cell != FLAGGED* ]]; then
            worst=1            # the visible hazard went unseen: clean results prove nothing
        fi
        CELL["${CMD_CASE[$k]},${CMD_TOOL[$k]}"]=$cell
        {
            echo
            echo "\$ ${CMDS[$k]}"
            echo "exit $rc after ${secs}s: negative control $cell"
            sed 's/^/    /' <<< "$summary"
            echo "    --- first lines of the log ---"
            grep -v '^========= *$' "$log" | head -n 40 | sed 's/^/    | /'
        } >> "$REPORT"
        continue
    fi
    if (( rc == 124 || rc == 137 )); then
        cell="TIMEOUT"
    elif grep -q '^case .* FAIL$' "$log"; then
        cell="WRONG"
    elif (( rc == ERROR_EXIT )) || [[ -n $errors && $errors != 0 ]]; then
        cell="${errors:-?} err"
    elif (( rc != 0 )); then
        cell="FAIL rc=$rc"
    elif ! grep -q '^case .* PASS$' "$log"; then
        cell="NO CASE"
    else
        cell="ok"
        [[ -n $warnings && $warnings != 0 ]] && cell="ok, $warnings warn"
    fi
    [[ $cell == ok* ]] || worst=1
    CELL["${CMD_CASE[$k]},${CMD_TOOL[$k]}"]=$cell
    {
        echo
        echo "\$ ${CMDS[$k]}"
        echo "exit $rc after ${secs}s: $cell"
        sed 's/^/    /' <<< "$summary"
        if [[ $cell != ok* ]]; then
            echo "    --- first lines of the log ---"
            grep -v '^========= *$' "$log" | head -n 60 | sed 's/^/    | /'
        fi
    } >> "$REPORT"
done

# ---- 4. the table, last ------------------------------------------------------------------
table() {
    printf '\n%-56s %-8s' "case" "plain"
    for tool in $TOOLS; do printf ' %-14s' "$tool"; done
    printf '\n'
    for i in "${!CASES[@]}"; do
        printf '%-56s %-8s' "${NAME[$i]}" "${PLAIN[$i]}"
        for tool in $TOOLS; do printf ' %-14s' "${CELL[$i,$tool]}"; done
        printf '\n'
    done
    if (( ${#CONTROLS[@]} )); then
        printf '\nnegative controls (planted hazards; =1 must be FLAGGED by racecheck):\n'
        for i in "${!CONTROLS[@]}"; do
            for tool in $CONTROL_TOOLS; do
                printf '  %-52s %-10s %s\n' "${CNAME[$i]}" "$tool" \
                    "${CELL[c$i,$tool]}"
            done
        done
        cat <<'EOF_NOTE'
  What racecheck tracks: ordinary shared-memory accesses (ld/st.shared, stmatrix/ldmatrix) by
  different threads not ordered by a barrier. What it is not relied on to see: async-proxy
  accesses (TMA writes into shared memory, wgmma operand reads, TMA stores from shared memory),
  i.e. a dropped mbarrier wait or wgmma wait; control =2 records whether it saw a wgmma read.
  Those hazards are caught by the GPU tests instead: outputs poisoned with NaN before every
  launch, the float64 reference on rows sampled over every tile position, and bitwise-identical
  repeats across calls, streams and persistent grid caps (a race moves the error between runs).
EOF_NOTE
    fi
    printf '\n%s\n' "$SOURCE"
    printf '%d invocations in %ds (estimated %ds); report: %s\n' "${#CMDS[@]}" \
        $((SECONDS - started)) "$estimate" "$REPORT"
    echo "sanitize.sh: $( ((worst)) && echo 'NOT CLEAN' || echo 'all clean')"
}
table | tee -a "$REPORT"
exit "$worst"

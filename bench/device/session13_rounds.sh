#!/usr/bin/env bash
# Session 13, call 2: run()'s host time, the tree before (build/old: git archive of the
# session's start with today's bench scripts, carried) and after, alternately for five rounds,
# each process pinned to one core (taskset), with the process's own calibration loops
# (bench/experiments/host_rounds.py): call 1's figures moved by up to 1.6x between processes.
# Files: $OUT/rounds.log, $OUT/{old,new}-<round>.json
set -uo pipefail
source bench/device/call_setup.sh rounds.log
ROOT=$PWD
CORE=${CORE:-3}
{ lscpu | grep -E "Model name|^CPU\(s\)|MHz|NUMA node"; nproc; uptime; } >> "$LOG" 2>&1
tree_of() { [ "$1" = old ] && echo "$ROOT/build/old" || echo "$ROOT"; }
for round in 1 2 3 4 5; do
    for tree in old new; do
        part "host_rounds $tree (round $round, core $CORE)"
        (cd "$(tree_of $tree)" && PYTHONPATH=/tmp/site:$PWD timeout ${ROUND_S:-50} \
            taskset -c "$CORE" python3 bench/experiments/host_rounds.py \
            --out "$OUT/$tree-$round.json") >> "$LOG" 2>&1
        echo "host_rounds $tree $round rc $?" | tee -a "$LOG"
    done
done
part "end"
grep -E "=====|rc |host_rounds " "$LOG" | cut -c1-200 | tail -120

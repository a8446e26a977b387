#!/usr/bin/env bash
# Session 13, call 3: what sets the driver's enqueue (bench/experiments/launch_params.py:
# empty kernels of 8, 96 and 608 parameter bytes against the forward's frozen launch), then
# run()'s host time again, pinned to another core than call 2's, new tree three rounds and
# the old two, with the host's load beside them (call 2's calibration loops moved 2x).
# Files (7): $OUT/launch.log, $OUT/launch_params.json, $OUT/{new-1,new-2,new-3,old-1,old-2}.json
set -uo pipefail
source bench/device/call_setup.sh launch.log
ROOT=$PWD
CORE=${CORE:-9}
{ lscpu | grep -E "Model name|^CPU\(s\)|Thread|MHz|NUMA node"; nproc; cat /proc/loadavg;
  echo "core $CORE siblings: $(cat /sys/devices/system/cpu/cpu$CORE/topology/thread_siblings_list)";
  cat /sys/devices/system/cpu/cpu$CORE/cpufreq/scaling_governor 2>/dev/null;
  top -bn1 | head -20; } >> "$LOG" 2>&1
part "launch_params"
timeout 60 taskset -c "$CORE" python3 bench/experiments/launch_params.py \
    --out "$OUT/launch_params.json" >> "$LOG" 2>&1
echo "launch_params rc $?" | tee -a "$LOG"
tree_of() { [ "$1" = old ] && echo "$ROOT/build/old" || echo "$ROOT"; }
for round in 1 2 3; do
    for tree in new old; do
        [ "$tree" = old ] && [ "$round" = 3 ] && continue
        part "host_rounds $tree (round $round, core $CORE) load $(cut -d' ' -f1 /proc/loadavg)"
        (cd "$(tree_of $tree)" && PYTHONPATH=/tmp/site:$PWD timeout ${ROUND_S:-50} \
            taskset -c "$CORE" python3 bench/experiments/host_rounds.py \
            --out "$OUT/$tree-$round.json") >> "$LOG" 2>&1
        echo "host_rounds $tree $round rc $?" | tee -a "$LOG"
    done
done
part "end"
cat /proc/loadavg >> "$LOG"
grep -E "=====|rc |host_rounds |launch_params |siblings|Model|MHz|load" "$LOG" | cut -c1-200 | tail -90

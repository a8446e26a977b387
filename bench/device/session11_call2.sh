#!/usr/bin/env bash
# Session 11, call 2: the backward variant m80_edv (session11_bwd.sh), then the plans' host
# time after the torch_ptrs change (host_parts twice, serving_bench host once; new tree only:
# session11_host.sh's call 1 has the before/after in one call). Files: bwd.log and its JSON
# records, host2.log.
set -uo pipefail
bash bench/device/session11_bwd.sh
source bench/device/call_setup.sh host2.log
for round in 1 2; do
    part "host_parts (round $round)"
    timeout 45 python3 bench/experiments/host_parts.py >> "$LOG" 2>&1
    echo "host_parts $round rc $?" | tee -a "$LOG"
done
part "serving_bench host"
mkdir -p /tmp/sb && timeout 60 python3 bench/serving_bench.py --out /tmp/sb --parts host \
    --repeats 7 >> "$LOG" 2>&1; echo "serving_bench rc $?" | tee -a "$LOG"
part "end"
grep -E "=====|rc |host_parts run|host_parts frozen|host_parts decode|host_parts torch_ptr|host  " "$LOG"

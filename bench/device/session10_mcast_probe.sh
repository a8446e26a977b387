#!/usr/bin/env bash
# Session 10, K/V multicast probe (<= 90 s): pins the multicast build's wrong results down on
# small shapes. bench/device/session10_mcast_probe.py runs three builds (fixed: the masked wgmma
# descriptors; old: the failing build, PTXATTN_MCAST_DEBUG_NO_DESC_MASK=1; self: ctaMask = own
# CTA) against the float64 reference and the unicast build, per rank and per half of D.
# Expected: fixed and self all ~1e-3 and every block half the same bits as unicast; old wrong
# only in rank 1's columns 64..127 (1.0 at Lk = 1). ~30-60 s (JIT of 4 builds, 4 small shapes).
# Files in $OUT: mcast_probe.log.
set -uo pipefail
source bench/device/call_setup.sh mcast_probe.log
part "probe: per rank, per half of D"
timeout ${P_S:-80} python3 bench/device/session10_mcast_probe.py >> "$LOG" 2>&1
echo "probe rc $?" | tee -a "$LOG"
part "end"
cut -c1-200 "$LOG" | tail -20

#!/usr/bin/env bash
# The D 128 backward on 80-row query blocks (bwd_builds VARIANTS "m80") on the H200: first its
# GPU tests (every build writes every element, the ragged / GQA / mask / window matrix, against
# today's build on the same inputs, deterministic bit for bit), then the benchmark against
# st_ahead (today's measured default) and today's rows with cuDNN in the same rounds, dense,
# causal, GQA 32:4 and deterministic. Prediction: bench/notes.md, "Session 8".
# One log, $OUT/m80.log, beside the JSON record. Expected wall time ~2.5 min.
set -uo pipefail
source bench/device/call_setup.sh m80.log
part "m80 GPU tests"
timeout ${T_S:-120} python3 -m pytest -q -p no:cacheprovider tests/test_gpu_backward_variants.py \
    -k m80 >> "$LOG" 2>&1; echo "m80 tests rc $?" | tee -a "$LOG"
part "backward_bench --variants m80,st_ahead"
timeout ${BW_S:-200} python3 bench/backward_bench.py --variants m80,st_ahead \
    --cases dense,causal,gqa,deterministic --rounds 10 --reps 5 --out "$OUT" >> "$LOG" 2>&1
echo "bwd bench rc $?" | tee -a "$LOG"
part "m80 against st_ahead, same rounds"
python3 - "$OUT" >> "$LOG" 2>&1 <<'PY'
import glob, json, sys
import numpy as np
path = sorted(glob.glob(f"{sys.argv[1]}/*-h200-backward-variants.json"))[-1]
rows = json.load(open(path))["rows"]
for case in dict.fromkeys(r["case"] for r in rows):
    by = {r["variant"]: r for r in rows if r["case"] == case and "ms_rounds" in r}
    if "m80" in by and "st_ahead" in by:
        per = np.array(by["st_ahead"]["ms_rounds"]) / np.array(by["m80"]["ms_rounds"])
        print(f"{case:<14} m80 {by['m80']['tflops']:6.1f} TFLOP/s  x cuDNN {by['m80']['ratio']:.3f}"
              f"  st_ahead {by['st_ahead']['tflops']:6.1f}  x cuDNN {by['st_ahead']['ratio']:.3f}"
              f"  m80 vs st_ahead {np.median(per):.3f} (rounds {per.min():.3f}..{per.max():.3f})")
PY
part "end"
grep -vE "^\s*$" "$LOG" | grep -E "=====|rc |ratio|vs st_ahead|passed|failed|FAILED|Error" \
    | cut -c1-200 | tail -60

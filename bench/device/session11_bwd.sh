#!/usr/bin/env bash
# The D 128 backward's m80 with early dV (bwd_builds VARIANTS "m80_edv": dS^T from the packed
# P^T, dV issued before dP^T is waited on) on the H200: its GPU tests (every build writes every
# element, the ragged / GQA / MQA / mask / window / scale matrix, against today's build on the
# same inputs, deterministic bit for bit over ten runs), then backward_bench against m80 (the
# measured default) and today's rows, cuDNN in the same rounds, dense / causal / GQA 32:4, and
# the same-round m80_edv / m80 ratio per case. Then, if the time is left, the sustained
# windows (3 s at the power cap) of dense and causal. Prediction: bench/notes.md, "Session 11,
# backward: early dV at 80 rows". One log, $OUT/bwd.log, beside the JSON records. ~3-4.5 min.
set -uo pipefail
source bench/device/call_setup.sh bwd.log
part "m80_edv GPU tests"
timeout ${T_S:-100} python3 -m pytest -q -p no:cacheprovider tests/test_gpu_backward_variants.py \
    -k "m80_edv" >> "$LOG" 2>&1; echo "m80_edv tests rc $?" | tee -a "$LOG"
part "backward_bench --variants m80_edv,m80 (burst)"
mkdir -p "$OUT/burst"
timeout ${BW_S:-120} python3 bench/backward_bench.py --variants m80_edv,m80 \
    --cases dense,causal,gqa --rounds 8 --reps 5 --out "$OUT/burst" >> "$LOG" 2>&1
echo "bwd bench rc $?" | tee -a "$LOG"
left=$(( ${END_S:-285} - (SECONDS - t0) ))
if (( left >= 70 )); then
    part "backward_bench --sustained dense,causal (${left}s left)"
    mkdir -p "$OUT/sustained"
    timeout $left python3 bench/backward_bench.py --variants m80_edv,m80 --cases dense,causal \
        --rounds 3 --reps 5 --sustained --out "$OUT/sustained" >> "$LOG" 2>&1
    echo "sustained rc $?" | tee -a "$LOG"
else
    echo "sustained skipped (time: ${left}s left)" | tee -a "$LOG"
fi
part "m80_edv against m80, same rounds"
python3 - "$OUT" >> "$LOG" 2>&1 <<'PY'
import glob, json, sys
import numpy as np
for kind in ("burst", "sustained"):
    paths = sorted(glob.glob(f"{sys.argv[1]}/{kind}/*-backward-variants.json"))
    if not paths:
        print(f"{kind}: no record"); continue
    rows = json.load(open(paths[-1]))["rows"]
    for case in dict.fromkeys(r["case"] for r in rows):
        by = {r["variant"]: r for r in rows if r["case"] == case and "ms_rounds" in r}
        if not ("m80_edv" in by and "m80" in by):
            continue
        e, m = by["m80_edv"], by["m80"]
        per = np.array(m["ms_rounds"]) / np.array(e["ms_rounds"])
        line = (f"{kind:<9} {case:<7} m80_edv {e['tflops']:6.1f} TFLOP/s x cuDNN {e['ratio']:.3f}"
                f" [{e['ratio_ci'][0]:.3f}, {e['ratio_ci'][1]:.3f}]  m80 {m['tflops']:6.1f} x cuDNN"
                f" {m['ratio']:.3f}  edv/m80 {np.median(per):.3f} ({per.min():.3f}..{per.max():.3f})")
        if kind == "sustained":
            line += (f"  sustained x cuDNN: edv {e.get('sustained_ratio') or float('nan'):.3f}"
                     f" m80 {m.get('sustained_ratio') or float('nan'):.3f}")
        print(line)
        l2 = lambda r: " ".join(f"{k} {x:.2e}" for k, x in r["check_vs_cudnn_rel_l2"].items())
        mhz = lambda r: (r.get("clocks") or {}).get("clocks_sm")
        print(f"{'':<17} rel L2 vs cuDNN: edv {l2(e)} | m80 {l2(m)} | SM MHz {mhz(e)}, {mhz(m)}")
PY
part "end"
grep -vE "^\s*$" "$LOG" | grep -E "=====|rc |edv/m80|rel L2|skipped|passed|failed|FAILED|Error" \
    | cut -c1-240 | tail -40

#!/usr/bin/env python3
"""One backward case, one call, small: what bench/sanitize_bwd.sh runs under compute-sanitizer.

    python3 bench/sanitize_bwd_case.py --list        the cases, one a line (NAME)
    python3 bench/sanitize_bwd_case.py --controls    the negative controls (NAME)
    python3 bench/sanitize_bwd_case.py NAME          run it: random bf16 inputs, our forward
        for out and lse, the backward's outputs and workspaces poisoned with NaN (memsets:
        initialised memory for initcheck, an unwritten tile shows as NaN), one launch of the
        three kernels, a check of each gradient against the float64 reference (relative L2
        <= 1e-2, no NaN), every buffer freed and the context released. Prints
        "case NAME: PASS|FAIL ..."; exit 0 PASS, 1 FAIL, 2 bad arguments.

Cases: each lineage stage and each production build (D 64/128/256, masked and not), ragged
lengths, GQA, the deterministic mode, and each build-table variant (bwd_builds.VARIANTS). Control: stage b1 built with -D PTXATTN_PLANT_HAZARD=1
(its dS^T barrier dropped plus a plain load of the other consumer's dS^T word): racecheck must
flag it.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

# name: (stage, B, H, Hkv, Lq, Lk, D, kwargs, defines)
CASES = {
    "b1": ("b1", 1, 2, 2, 128, 256, 128, {}, {}),
    "b2": ("b2", 1, 2, 2, 192, 256, 128, {}, {}),
    "b3": ("b3", 1, 2, 2, 192, 256, 128, {}, {}),
    "d64": (None, 1, 2, 1, 200, 300, 64, {}, {}),
    "d128": (None, 1, 4, 2, 130, 257, 128, {}, {}),
    "d256": (None, 1, 2, 2, 100, 129, 256, {}, {}),
    "d64_causal": (None, 1, 2, 2, 200, 150, 64, {"causal": True}, {}),
    "d128_window": (None, 1, 2, 1, 257, 300, 128, {"window": (40, 8)}, {}),
    "d256_causal_top_left": (None, 1, 2, 2, 90, 200, 256,
                             {"causal": True, "diagonal": "top_left"}, {}),
    "d128_deterministic": (None, 1, 2, 2, 200, 384, 128, {"deterministic": True}, {}),
    # the build table's variants (bwd_builds.VARIANTS): the shared P^T / dS^T tiles of the
    # query split, the next S^T issued ahead, dQ added from registers
    "d128_st_ahead_causal": (None, 1, 2, 1, 200, 257, 128,
                             {"variant": "st_ahead", "causal": True}, {}),
    "d64_st_ahead_deterministic": (None, 1, 2, 2, 300, 200, 64,
                                   {"variant": "st_ahead", "deterministic": True}, {}),
    "d256_qsplit_window": (None, 1, 2, 1, 150, 129, 256,
                           {"variant": "qsplit", "window": (40, 3)}, {}),
    "d256_qsplit_deterministic": (None, 1, 2, 2, 130, 200, 256,
                                  {"variant": "qsplit", "deterministic": True}, {}),
    "d256_qsplit_dqred": (None, 1, 3, 1, 150, 129, 256, {"variant": "qsplit_dqred"}, {}),
    "d128_dqred_gqa": (None, 1, 4, 2, 130, 257, 128, {"variant": "dqred"}, {}),
    # 80-row query blocks: the transposed dS^T and dQ^T, blocks counted by division
    "d128_m80_causal": (None, 1, 2, 1, 200, 257, 128, {"variant": "m80", "causal": True}, {}),
    "d128_m80_deterministic": (None, 1, 2, 2, 250, 300, 128,
                               {"variant": "m80", "deterministic": True}, {}),
}
CONTROLS = {"b1_hazard": ("b1", 1, 2, 2, 128, 256, 128, {}, {"PTXATTN_PLANT_HAZARD": "1"})}


def run(name: str) -> int:
    import numpy as np

    from bwd_checks import inputs, prepared, rel_l2
    from ptxattn import backward, driver
    from ptxattn.reference_backward import attention_backward_reference
    stage, B, H, Hkv, Lq, Lk, D, kw, defines = {**CASES, **CONTROLS}[name]
    mask = {k: v for k, v in kw.items() if k not in ("deterministic", "variant")}
    q, k, v, out, lse, dout = inputs(B, H, Hkv, Lq, Lk, D, seed=7, **mask)
    if defines:       # a build with its defines (the controls): swap in the kernel
        original = backward.kernel

        def kernel(file, entry, d=None, smem=0):
            return original(file, entry, {**(d or {}), **defines} if entry == backward.ENTRY
                            else d, smem)
        backward.kernel = kernel
    p, dev = prepared(q, k, v, out, lse, dout, stage=stage, **kw)
    p.launch()
    grads = [x.to_numpy() for x in (p.dq, p.dk, p.dv)]
    p.close()
    for x in dev:
        x.free()
    ref = attention_backward_reference(q, k, v, dout, **mask)
    errs = {n: rel_l2(np.nan_to_num(g.astype(np.float32)), r)
            for n, g, r in zip(("dq", "dk", "dv"), grads, ref)}
    nans = sum(int((~np.isfinite(g.astype(np.float32))).sum()) for g in grads)
    ok = nans == 0 and all(e <= 1e-2 for e in errs.values())
    del p, dev, grads
    gc.collect()
    driver.synchronize()
    try:
        from cuda.bindings import driver as cu
        cu.cuDevicePrimaryCtxRelease(0)
    except Exception:      # noqa: BLE001 - the leak check reads what is left; best effort
        pass
    print(f"case {name}: {'PASS' if ok else 'FAIL'} "
          + " ".join(f"{n} {e:.2e}" for n, e in errs.items()) + f" nan {nans}")
    return 0 if ok else 1


def main(argv) -> int:
    if argv[:1] == ["--list"]:
        print("\n".join(CASES))
        return 0
    if argv[:1] == ["--controls"]:
        print("\n".join(CONTROLS))
        return 0
    if len(argv) != 1 or argv[0] not in {**CASES, **CONTROLS}:
        print(f"usage: {sys.argv[0]} --list | --controls | NAME", file=sys.stderr)
        return 2
    return run(argv[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

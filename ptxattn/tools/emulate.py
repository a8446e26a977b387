"""Run a registered kernel on the CPU emulator and report its errors against the float64
reference, and any hazard, fault or deadlock the emulator found.

    python -m ptxattn.tools.emulate 14 --shape 1x2x256x128
    python -m ptxattn.tools.emulate production --shape 1x4x300x64 --lk 200 --hkv 2 --causal
    python -m ptxattn.tools.emulate production --shape 1x1x384x128 --ctas 1 --seed 7
    python -m ptxattn.tools.emulate 7 --shape 1x1x256x128 --ptx my_stage7.ptx   # a new text

--ptx replaces the PTX the stage loads with a file's (expanded with the stage's include
directory, as ptxattn.ptx does): a kernel written for a registered stage's ABI can be tried
before it is registered. Exit status: 0 when the output meets the bar with no hazard, 1 when it
does not, 2 when the emulator stopped (fault, deadlock, unsupported PTX).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


class _Patch:
    """monkeypatch.setattr for a script: undone at exit by process end."""

    def setattr(self, obj, name, value):
        setattr(obj, name, value)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ptxattn.tools.emulate",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", help="a stage number or name, or 'production'")
    ap.add_argument("--shape", default="1x1x128x128", help="BxHxLxD (L: query length)")
    ap.add_argument("--lk", type=int, help="key length (default: L)")
    ap.add_argument("--hkv", type=int, help="key/value heads (GQA; default: H)")
    ap.add_argument("--layout", default="bhld", choices=("bhld", "bshd"))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--diagonal", default="bottom_right", choices=("bottom_right", "top_left"))
    ap.add_argument("--window", help="LEFT,RIGHT (-1: unbounded)")
    ap.add_argument("--lse", action="store_true", help="also check the log-sum-exp")
    ap.add_argument("--ctas", type=int, help="cap a persistent grid (PTXATTN_PERSISTENT_CTAS)")
    ap.add_argument("--seed", type=int, help="random scheduling and asynchronous completion")
    ap.add_argument("--data-seed", type=int, default=0, help="seed of the random inputs")
    ap.add_argument("--strict", action="store_true", help="stop at the first hazard")
    ap.add_argument("--max-steps", type=int, default=5_000_000,
                    help="instruction steps before a run counts as a livelock")
    ap.add_argument("--ptx", help="a PTX file to load instead of the stage's own")
    ap.add_argument("-D", dest="defines", action="append", default=[],
                    help="a preprocessor define for the stage (NAME or NAME=VALUE)")
    args = ap.parse_args(argv)

    import ptxattn
    from ptxattn import reference
    from ptxattn.tools.emulator import EmulatorError, fake_driver

    b, h, lq, d = (int(x) for x in args.shape.lower().split("x"))
    lk = args.lk or lq
    hkv = args.hkv or h
    window = tuple(int(x) for x in args.window.split(",")) if args.window else None
    if args.ctas is not None:
        os.environ["PTXATTN_PERSISTENT_CTAS"] = str(args.ctas)
    stage = None if args.stage in ("production", "prod") else args.stage
    defines = {}
    for item in args.defines:
        name, _, value = item.partition("=")
        defines[name] = value or 1

    fake = fake_driver.install(_Patch(), seed=args.seed, strict=args.strict,
                               raise_hazards=False, max_instructions=args.max_steps)
    if args.ptx:
        fake.rewrite_ptx = _file_text(args.ptx, stage)

    rng = np.random.default_rng(args.data_seed)

    def make(heads, n):
        shape = (b, heads, n, d) if args.layout == "bhld" else (b, n, heads, d)
        return rng.standard_normal(shape).astype(np.float32)
    q, k, v = make(h, lq), make(hkv, lk), make(hkv, lk)
    case = (f"{args.stage} B={b} H={h} Hkv={hkv} Lq={lq} Lk={lk} D={d} {args.layout}"
            f"{' causal ' + args.diagonal if args.causal else ''}"
            f"{f' window {window}' if window else ''}{' lse' if args.lse else ''}"
            f"{f' ctas<={args.ctas}' if args.ctas else ''}"
            f"{f' seed {args.seed}' if args.seed is not None else ''}")
    print(case)
    t0 = time.perf_counter()
    try:
        prepared = ptxattn.prepare(q, k, v, stage=stage, layout=args.layout,
                                   causal=args.causal, window=window, diagonal=args.diagonal,
                                   return_lse=args.lse, defines=defines or None)
        prepared.launch()
        out = prepared.out.to_numpy()
        lse = prepared.lse.to_numpy() if args.lse else None
    except EmulatorError as e:
        print(f"emulator stopped: {type(e).__name__}: {e}")
        return 2
    except Exception as e:                              # the library's own errors
        print(f"{type(e).__name__}: {e}")
        return 2
    wall = time.perf_counter() - t0
    ref = reference.attention_reference(q, k, v, layout=args.layout, causal=args.causal,
                                        window=window, diagonal=args.diagonal,
                                        return_lse=args.lse)
    ref, ref_lse = ref if args.lse else (ref, None)
    metrics = reference.error_metrics(out, ref)
    ok = reference.passes(metrics)
    print(f"rel L2 {metrics['rel_l2']:.3e}  max |err| {metrics['max_abs']:.3e} "
          f"(bar {reference.PASS_MAX_ABS_FRACTION * metrics['ref_max_abs']:.3e})  "
          f"NaN/Inf {metrics['nan_count']}  -> {'pass' if ok else 'FAIL'}")
    if lse is not None:
        fin = np.isfinite(ref_lse)
        same = np.array_equal(np.isfinite(lse), fin)
        err = float(np.abs(lse[fin] - ref_lse[fin]).max()) if fin.any() else 0.0
        lse_ok = same and err <= 2e-3
        ok = ok and lse_ok
        print(f"LSE max |err| {err:.3e} (bar 2e-3){'' if same else ', finite where -inf'}"
              f" -> {'pass' if lse_ok else 'FAIL'}")
    hazards = 0
    for name, grid, block, smem, report in fake.launches:
        if report is None:
            continue
        print(f"launch {name} grid {grid} block {block} smem {smem}: {report.summary()}")
        for hz in report.hazards:
            print("  " + hz.describe().replace("\n", "\n  "))
        hazards += len(report.hazards)
    print(f"wall {wall:.2f} s (parse, compile and run)")
    return 0 if ok and not hazards else 1


def _file_text(path: str, stage):
    """text -> the file's expanded PTX (includes from the stage's include folder)."""
    from ptxattn import ptx, stages
    from ptxattn.stages import ptx_root
    st = stages.get_stage(stage if stage is not None else "production")
    include = (ptx_root() / st.file).parent / "include"
    expanded = ptx.expand_file(path, [include], dict(st.defines) or None).text
    return lambda text: expanded


if __name__ == "__main__":
    sys.exit(main())

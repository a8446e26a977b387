"""The first call's JIT time, per production build, with the driver's compute cache off and on.

    python bench/jit_time.py            # on the GPU machine; prints one line per build and mode

Each measurement runs in a fresh process (a process compiles a build once): the time of the
first ptxattn.attention call (JIT + launch + copies) and of the second (launch + copies), at a
small shape: with CUDA_CACHE_DISABLE=1 (a cold compile), then with the cache on twice ("fill"
may compile and store the build, "warm" then finds it). README "Troubleshooting" quotes the result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, time, ptxattn
d, causal = int(sys.argv[1]), sys.argv[2] == "1"
q, k, v = ptxattn.random_qkv(1, 2, 256, 256, d, "bhld", seed=0)
times = []
for _ in range(2):
    t = time.perf_counter()
    ptxattn.attention(q, k, v, causal=causal)
    times.append(time.perf_counter() - t)
print(json.dumps({"head_dim": d, "causal": causal, "first_s": times[0], "second_s": times[1]}))
"""


def main() -> int:
    for d in (64, 128, 256):
        for causal in (False, True):
            for cache in ("disabled", "fill", "warm"):
                env = dict(os.environ)
                if cache == "disabled":
                    env["CUDA_CACHE_DISABLE"] = "1"
                else:
                    env.pop("CUDA_CACHE_DISABLE", None)
                proc = subprocess.run([sys.executable, "-c", CHILD, str(d), "1" if causal else "0"],
                                      capture_output=True, text=True, env=env, timeout=600)
                if proc.returncode:
                    print(f"D={d} causal={causal} cache={cache}: failed: "
                          f"{proc.stderr.strip().splitlines()[-1:]}", flush=True)
                    return 1
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                row["cache"] = cache
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

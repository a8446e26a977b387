"""Host µs of a warm stage-15 call with its per-call tile counter (driver.zeroed_scratch: alloc,
zero, free on the call's stream) against the same call given one cached counter (the defect of
issue 28 item 1), beside the production call and the scratch calls alone. Pretend driver
(bench/callpath.py's fake_driver, CPU torch tensors passing for CUDA ones): the Python and
binding side only; the driver's own time comes on top on a GPU (bench/callpath.py's
stage15_out path measures it there).

    python bench/counter_bench.py
"""
import statistics, sys, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import callpath as cp
import ptxattn
from ptxattn import driver
import torch

def loop(fn, n=2000):
    c0 = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - c0) / n * 1e6

with cp.fake_driver(), cp.torch_pretends_cuda(torch):
    q, k, v, out = cp.make_torch_inputs(cp.SMALL, torch)
    call = lambda: ptxattn.attention(q, k, v, out=out, stage=15)
    prod = lambda: ptxattn.attention(q, k, v, out=out)
    call(); prod()
    real_z, real_f = driver.zeroed_scratch, driver.free_scratch
    ctx = driver.context()
    cached = real_z(ctx, 8, 0)
    res = {"per_call": [], "cached": [], "production": [], "scratch_only": []}
    for _ in range(15):
        driver.zeroed_scratch, driver.free_scratch = real_z, real_f
        res["per_call"].append(loop(call))
        driver.zeroed_scratch = lambda c, n, s: cached
        driver.free_scratch = lambda c, x: None
        res["cached"].append(loop(call))
        driver.zeroed_scratch, driver.free_scratch = real_z, real_f
        res["production"].append(loop(prod))
        res["scratch_only"].append(loop(lambda: real_f(ctx, real_z(ctx, 8, 0))))
    for k_, v_ in res.items():
        print(f"{k_:13s} median {statistics.median(v_):6.2f} µs  min {min(v_):6.2f}")

"""Host time of one attention call (issue 11): where it goes, and how far from a launch.

    python bench/callpath.py                 # GPU: host µs per call for each path, JSON out
    python bench/callpath.py --profile       # + cProfile top entries and driver calls per call
    python bench/callpath.py --fake --profile  # no GPU: the Python side with a pretend driver

Paths at the small shape (1, 2, 128, 128), BHLD, bf16:
  attention           ptxattn.attention(q, k, v)            (a fresh output per call)
  attention_out       ptxattn.attention(q, k, v, out=out)
  launch              p = prepare(...) once, then p.launch()
  stage15_out         ptxattn.attention(q, k, v, out=out, stage=15)  (+ a per-call tile counter)
  torch_op            ptxattn.torch.attention(q, k, v)      (the ptxattn::attention op, eager)
  torch_sdpa_wrapper  ptxattn.torch.scaled_dot_product_attention(q, k, v)
  sdpa                torch.nn.functional.scaled_dot_product_attention (default backend)
  sdpa_cudnn          the same inside sdpa_kernel(SDPBackend.CUDNN_ATTENTION)
The torch paths need torch (sdpa and sdpa_cudnn: torch with CUDA). With --fake, CPU torch
tensors stand in for CUDA ones (torch_pretends_cuda: is_cuda, get_device and torch's raw
current stream are patched for the run, which adds a Python call per is_cuda/get_device read
that the real C attributes do not cost) and the library paths run twice: on DLPack producers
(attention, attention_out) and on those torch tensors (torch_attention, torch_attention_out).
--profile also records the Python function calls per call (cProfile's count, C functions
included) of every path, the torch baselines too.
"Host time with the queue full": a long kernel is queued first (so the GPU is always busy and
no call waits for it), then N calls are timed on the host with perf_counter; the figure is the
median over repeats of (loop time / N). N stays far below the launch queue's depth (~1000).
End to end at 1k (8, 16, 1024, 128): N calls then a synchronize, wall time / N, for attention,
attention_out and launch; the issue's target is attention_out within 2% of launch.

Inputs are torch tensors when torch imports with CUDA (DLPack, as a model sends them), else
ptxattn DeviceArrays behind a minimal DLPack producer. With --fake nothing reaches libcuda:
every cu* function answers success (the CPU profile of the Python side; the real driver's
own cost, e.g. of cuTensorMapEncodeTiled or of packing kernel parameters, is not in it).
Writes callpath-<label>.json (and .txt with --profile) into $OUT or bench/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ptxattn  # noqa: E402
from ptxattn import driver, tensors, tma  # noqa: E402

try:                            # the runtime split by job: kernels in launch, calls in fastpath
    from ptxattn import api as attn  # noqa: E402
    from ptxattn import fastpath as _steady_home, launch as _kernel_home  # noqa: E402
except ImportError:             # a commit from before the split: one module, attention.py
    from ptxattn import attention as attn  # noqa: E402
    _steady_home = _kernel_home = attn

SMALL = (1, 2, 128, 128)
ONE_K = (8, 16, 1024, 128)
PATHS = ("attention", "attention_out", "launch", "torch_attention", "torch_attention_out",
         "torch_op", "torch_sdpa_wrapper", "sdpa", "sdpa_cudnn")


# --------------------------------------------------------------------------- driver counting

class DriverCounter:
    """Counts calls to every cu* function of cuda.bindings.driver while active.

    ptxattn looks each function up on the module at call time (driver.cu().cuX), so wrapping
    the module's attributes sees every call (LaunchSpec keeps cuLaunchKernelEx from its
    construction, which is inside the counted window)."""

    def __init__(self):
        self.counts: Counter = Counter()
        self._saved: dict = {}

    def __enter__(self):
        d = driver.cu()
        for name in dir(d):
            fn = getattr(d, name)
            if name.startswith("cu") and callable(fn) and not isinstance(fn, type):
                self._saved[name] = fn
                setattr(d, name, self._wrap(name, fn))
        return self

    def _wrap(self, name, fn):
        counts = self.counts

        def counted(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return counted

    def __exit__(self, *exc):
        d = driver.cu()
        for name, fn in self._saved.items():
            setattr(d, name, fn)
        self._saved.clear()


class _FakeContext:
    ordinal = 0
    sm_count = 132
    max_smem_optin = 227 * 1024
    compute_capability = (9, 0)
    alive = True
    memory_pools = True

    def make_current(self):
        pass


@contextlib.contextmanager
def fake_driver(binding_packing: bool = False):
    """Every cu* function answers CUDA_SUCCESS with a plausible value; nothing reaches libcuda.
    Addresses come from a bump allocator (cuMemAllocAsync hands a freed block back, as the
    driver's pool does for a same-size request in stream order).

    binding_packing: cuLaunchKernelEx also does what the real binding does with its
    kernelParams before calling the driver (cuda.bindings' _HelperKernelParams: the tuple
    form packed in C, ~6-9 us a launch on this machine's CPU; a void*[] address is read as
    it is), so that the CPU figures include that part of a launch's host cost."""
    d = driver.cu()
    ok = d.CUresult.CUDA_SUCCESS
    heap = {"next": 0x7E00_0000_0000, "free": []}

    def alloc(nbytes, *stream):
        if stream and heap["free"]:
            return ok, d.CUdeviceptr(heap["free"].pop())
        ptr = heap["next"]
        heap["next"] += (int(nbytes) + 255) // 256 * 256
        return ok, d.CUdeviceptr(ptr)

    def free_async(ptr, stream):
        heap["free"].append(int(ptr))
        return (ok,)

    answers = {
        "cuMemAlloc": alloc, "cuMemAllocAsync": alloc, "cuMemFreeAsync": free_async,
        "cuEventCreate": lambda *a: (ok, d.CUevent()),
        "cuModuleLoadDataEx": lambda *a: (ok, d.CUmodule()),
        "cuModuleGetFunction": lambda *a: (ok, d.CUfunction()),
        "cuPointerGetAttribute": lambda *a: (ok, 0),
        "cuTensorMapEncodeTiled": lambda *a: (ok, d.CUtensorMap()),
        "cuStreamIsCapturing": lambda *a: (ok, d.CUstreamCaptureStatus(0)),
        "cuMemGetInfo": lambda *a: (ok, 1 << 30, 1 << 31),
    }
    helper = getattr(d, "_HelperKernelParams", None)
    if binding_packing and helper is not None:
        def launch(config, function, params, extra):
            helper(params)                      # the binding's packing, then "the driver"
            return (ok,)
        answers["cuLaunchKernelEx"] = launch
    saved = {}
    for name in dir(d):
        fn = getattr(d, name)
        if name.startswith("cu") and callable(fn) and not isinstance(fn, type):
            saved[name] = fn
            setattr(d, name, answers.get(name, lambda *a, **k: (ok,)))
    # pretend functions, maps and launch configs must not outlive the pretence
    # (getattr: the script also profiles commits from before these caches existed)
    caches = tuple(c for c in (getattr(_kernel_home, "_KERNELS", None), getattr(tma, "_MAPS", None),
                               getattr(driver, "_CONFIGS", None),
                               getattr(_steady_home, "_STEADY", None))
                   if c is not None)
    saved_caches = [dict(c) for c in caches]
    saved_context = driver.context
    ctx = _FakeContext()
    driver.context = lambda: ctx
    for c in caches:
        c.clear()
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(d, name, fn)
        driver.context = saved_context
        for c, saved_c in zip(caches, saved_caches):
            c.clear()
            c.update(saved_c)


# --------------------------------------------------------------------------- inputs

class DLPackProducer:
    """The smallest honest DLPack producer over device memory (what a CuPy/JAX array is to
    ptxattn): a fresh capsule per __dlpack__ call, no stream work (its writes are in order)."""

    def __init__(self, array: tensors.DeviceArray):
        self.array = array

    def __dlpack_device__(self):
        return (tensors.kDLCUDA, self.array.device or 0)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        a = self.array
        return tensors.make_capsule(a.ptr, a.shape, a.strides, (tensors.kDLBfloat, 16, 1),
                                    self.__dlpack_device__(), self,
                                    versioned=max_version is not None)


def _torch(any_device: bool = False):
    """torch with CUDA (any_device: torch at all), else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if any_device or torch.cuda.is_available() else None


_MISSING = object()


@contextlib.contextmanager
def torch_pretends_cuda(torch):
    """CPU torch tensors pass for CUDA tensors on device 0 (for --fake): Tensor.is_cuda and
    get_device, torch's raw current stream (0, the default stream) and the device capability
    (9, 0) are patched, and restored after."""
    T = torch.Tensor
    saved = {name: T.__dict__.get(name, _MISSING) for name in ("is_cuda", "get_device")}
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", _MISSING)
    capability, current = torch.cuda.get_device_capability, torch.cuda.current_stream
    T.is_cuda = property(lambda self: True)
    T.get_device = lambda self: 0
    torch._C._cuda_getCurrentRawStream = lambda device: 0
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    default_stream = _PretendStream()
    torch.cuda.current_stream = lambda device=None: default_stream
    tensors._TORCH = None                       # the raw-stream getter is read afresh
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                delattr(T, name)
            else:
                setattr(T, name, value)
        if raw is _MISSING:
            del torch._C._cuda_getCurrentRawStream
        else:
            torch._C._cuda_getCurrentRawStream = raw
        torch.cuda.get_device_capability, torch.cuda.current_stream = capability, current
        tensors._TORCH = None


class _PretendStream:
    """torch.cuda.current_stream()'s answer under torch_pretends_cuda: the default stream."""
    cuda_stream = 0


def make_inputs(shape, torch, fake: bool, seed: int = 0):
    """q, k, v, out: torch tensors, or DLPack producers over ptxattn memory."""
    if torch is not None and not fake:
        g = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(3))
        return q, k, v, torch.empty_like(q)
    rng = np.random.default_rng(seed)
    arrays = [tensors.from_numpy(rng.standard_normal(shape, np.float32)) for _ in range(3)]
    arrays.append(tensors.empty(shape))
    return tuple(DLPackProducer(a) for a in arrays)


def make_torch_inputs(shape, torch, seed: int = 0):
    """CPU bf16 torch tensors (for --fake, under torch_pretends_cuda)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(3))
    return q, k, v, torch.empty_like(q)


def torch_paths(q, k, v, out, prefix: str = "torch_") -> dict:
    """The library on torch tensors, and ptxattn.torch's op and SDPA wrapper."""
    import ptxattn.torch as pt
    return {
        prefix + "attention": lambda: ptxattn.attention(q, k, v),
        prefix + "attention_out": lambda: ptxattn.attention(q, k, v, out=out),
        "torch_op": lambda: pt.attention(q, k, v),
        "torch_sdpa_wrapper": lambda: pt.scaled_dot_product_attention(q, k, v),
    }


def make_paths(q, k, v, out, torch, fake: bool) -> dict:
    prepared = attn.prepare(q, k, v, out=out)
    paths = {
        "attention": lambda: ptxattn.attention(q, k, v),
        "attention_out": lambda: ptxattn.attention(q, k, v, out=out),
        "launch": prepared.launch,
        # the lineage's dynamic scheduler: a fresh tile counter per call (issue 28, defect 1)
        "stage15_out": lambda: ptxattn.attention(q, k, v, out=out, stage=15),
    }
    if torch is not None and not fake:
        # on the GPU the library paths already take torch tensors: only the op and wrapper
        paths.update((name, fn) for name, fn in torch_paths(q, k, v, out).items()
                     if name in ("torch_op", "torch_sdpa_wrapper"))
        from torch.nn.attention import SDPBackend, sdpa_kernel
        sdpa = torch.nn.functional.scaled_dot_product_attention
        paths["sdpa"] = lambda: sdpa(q, k, v)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return sdpa(q, k, v)
        paths["sdpa_cudnn"] = cudnn
    return paths


# --------------------------------------------------------------------------- timing

def _synchronize(fake: bool):
    if not fake:
        driver.synchronize()


def _blocker(fake: bool, torch):
    """Something that keeps the GPU busy for longer than the timed loop (the queue stays full)."""
    if fake:
        return lambda: None
    q, k, v, out = make_inputs((2, 16, 16384, 128), torch, fake, seed=1)   # ~3 ms per launch
    p = attn.prepare(q, k, v, out=out)

    def block(launches: int = 20):
        for _ in range(launches):
            p.launch()
    return block


def host_us(fn, calls: int, repeats: int, block, fake: bool) -> dict:
    """Median host µs per call over `repeats` loops of `calls` calls, the GPU kept busy.
    Wall time (perf_counter: what the caller waits, driver waits included); beside it the
    process's CPU time (process_time: the same loop without the time the OS ran something
    else, the steadier figure on a shared machine, e.g. for --fake)."""
    fn()
    _synchronize(fake)
    per_call, cpu = [], []
    for _ in range(repeats):
        block()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(calls):
            fn()
        cpu.append((time.process_time() - c0) / calls * 1e6)
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
        _synchronize(fake)
    return {"median_us": statistics.median(per_call), "min_us": min(per_call),
            "max_us": max(per_call), "cpu_median_us": statistics.median(cpu),
            "cpu_min_us": min(cpu), "calls": calls, "repeats": repeats}


def host_table(fns: dict, calls: int, repeats: int, block, fake: bool, tag: str) -> dict:
    """host_us of each {label: fn} in order, each printed as it is measured ("<tag> <label>
    <median> µs/call (min, cpu)": the lines the device scripts grep); {label: figures}."""
    results = {}
    width = max((len(label) for label in fns), default=0)
    for label, fn in fns.items():
        h = results[label] = host_us(fn, calls, repeats, block, fake)
        print(f"{tag} {label:{width}s} {h['median_us']:7.2f} µs/call (min {h['min_us']:.2f}, "
              f"cpu {h['cpu_median_us']:.2f})", flush=True)
    return results


def end_to_end_us(fn, calls: int, repeats: int, fake: bool) -> dict:
    """Wall µs per call including the GPU: `calls` calls then a synchronize."""
    fn()
    _synchronize(fake)
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _synchronize(fake)
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    return {"median_us": statistics.median(per_call), "min_us": min(per_call),
            "max_us": max(per_call), "calls": calls, "repeats": repeats}


def profile_path(fn, calls: int, top: int) -> tuple[dict, float, str]:
    """Driver calls per call (exact counts / calls), Python function calls per call (cProfile's
    count: Python and C functions) and the cProfile top entries."""
    fn()                                   # JIT, first encodes: not what a steady call pays
    with DriverCounter() as counter:
        for _ in range(calls):
            fn()
    per_call = {name: n / calls for name, n in sorted(counter.counts.items())}
    prof = cProfile.Profile()
    loop = _profiled_loop(fn, calls)
    prof.enable()
    loop()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text).strip_dirs()
    # the loop's own frame and the disable() call are not the path's
    python_calls = (stats.total_calls - 2) / calls
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return per_call, python_calls, text.getvalue()


def _profiled_loop(fn, calls):
    def loop():
        for _ in range(calls):
            fn()
    return loop


# --------------------------------------------------------------------------- main

def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(args) -> dict:
    torch = None if args.fake else _torch()
    fake_torch = _torch(any_device=True) if args.fake and not args.no_torch else None
    record = {"label": args.label, "commit": _commit(), "fake_driver": args.fake,
              "inputs": "torch" if torch is not None else "DLPack producer over DeviceArray",
              "shape_small": SMALL, "shape_1k": ONE_K, "host": {}, "end_to_end_1k": {},
              "driver_calls_per_call": {}, "python_calls_per_call": {}}
    if fake_torch is not None:
        record["inputs"] += ("; torch_* paths: CPU torch tensors passing for CUDA "
                             f"(torch {fake_torch.__version__})")
    if not args.fake:
        record["device"] = driver.device_info()
    profiles = []
    q, k, v, out = make_inputs(SMALL, torch, args.fake)
    paths = make_paths(q, k, v, out, torch, args.fake)
    block = _blocker(args.fake, torch)
    with contextlib.ExitStack() as stack:
        if fake_torch is not None:
            stack.enter_context(torch_pretends_cuda(fake_torch))
            paths.update(torch_paths(*make_torch_inputs(SMALL, fake_torch)))
        for name, fn in paths.items():
            record["host"][name] = host_us(fn, args.calls, args.repeats, block, args.fake)
            h = record["host"][name]
            print(f"host  {name:19s} {h['median_us']:9.1f} µs/call (cpu {h['cpu_median_us']:.1f}, "
                  f"min {h['cpu_min_us']:.1f})", flush=True)
        if args.profile:
            for name, fn in paths.items():
                counts, python_calls, text = profile_path(fn, args.calls, args.top)
                record["driver_calls_per_call"][name] = counts
                record["python_calls_per_call"][name] = python_calls
                profiles.append(f"==== {name}: driver calls per call\n"
                                + "".join(f"  {k:28s} {v:g}\n" for k, v in counts.items())
                                + f"==== {name}: {python_calls:g} Python function calls per "
                                f"call; cProfile over {args.calls} calls\n{text}")
                print(f"calls {name:19s} python {python_calls:6.1f}  driver "
                      + ", ".join(f"{k}={v:g}" for k, v in counts.items()))
    if not args.fake and not args.skip_1k:
        q, k, v, out = make_inputs(ONE_K, torch, args.fake, seed=2)
        big = make_paths(q, k, v, out, torch, args.fake)
        for name in ("attention", "attention_out", "launch"):
            record["end_to_end_1k"][name] = end_to_end_us(big[name], args.e2e_calls,
                                                          args.repeats, args.fake)
            print(f"1k    {name:14s} {record['end_to_end_1k'][name]['median_us']:9.1f} µs/call")
        e2e = record["end_to_end_1k"]
        record["end_to_end_1k"]["attention_out_over_launch"] = (
            e2e["attention_out"]["median_us"] / e2e["launch"]["median_us"])
    out_dir = Path(args.out or os.environ.get("OUT") or ROOT / "bench" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"callpath-{args.label}.json").write_text(json.dumps(record, indent=1) + "\n")
    if profiles:
        (out_dir / f"callpath-{args.label}-profile.txt").write_text("\n".join(profiles))
    print(f"wrote {out_dir}/callpath-{args.label}.json")
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", action="store_true", help="cProfile and driver-call counts")
    ap.add_argument("--fake", action="store_true", help="no GPU: a pretend driver (CPU profile)")
    ap.add_argument("--calls", type=int, default=200, help="calls per timed loop")
    ap.add_argument("--e2e-calls", type=int, default=200, help="calls per end-to-end loop at 1k")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--top", type=int, default=25, help="cProfile entries per sort")
    ap.add_argument("--label", default="after", help="file name part: before / after / ...")
    ap.add_argument("--skip-1k", action="store_true")
    ap.add_argument("--no-torch", action="store_true",
                    help="with --fake: leave out the torch paths even where torch imports")
    ap.add_argument("--out", help="output folder (default: $OUT, else bench/results)")
    args = ap.parse_args(argv)
    if args.fake:
        with fake_driver():
            run(args)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

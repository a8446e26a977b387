"""attention(q, k, v): validate, pick a stage, build tensor maps, launch.

Everything about the arguments is checked before the first driver call, so
bad input gets a ValueError/TypeError naming the argument on any machine,
and nothing is ever written to the caller's `out` when an error is raised.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import threading
import types
from dataclasses import dataclass

import numpy as np

from . import driver, stages, tensors, tma
from .errors import CudaError, PtxattnError
from .stages import ENTRY, PRODUCTION, Stage, all_kernels, by_speed, get_stage
from .tensors import BF16, DeviceArray, as_device_array, to_bf16

from . import stages_sm100   # the Blackwell rows (issue 15): part of _pick_stage's cache key

LAYOUTS = ("bhld", "bshd")
_AXES = {"bhld": "(batch, heads, seq, head_dim)", "bshd": "(batch, seq, heads, head_dim)"}
# A testing knob: cap the grid of persistent stages (e.g. 2), so that each CTA walks several
# tiles even at a small shape (compute-sanitizer runs, bench/sanitize.sh). Read by prepare().
PERSISTENT_CTAS_ENV = "PTXATTN_PERSISTENT_CTAS"


@dataclass
class _Plan:
    """What validation learned: everything needed to launch, nothing on the GPU yet."""
    host: bool                       # NumPy in -> NumPy out
    q: object                        # np.ndarray (host) or DeviceArray
    k: object
    v: object
    out: object                      # None, np.ndarray (host) or DeviceArray
    layout: str
    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    stage: Stage                     # the requested stage, or the best one ignoring arch
    stage_requested: bool
    scale: float
    stream: int
    stream_object: object = None     # what the caller passed as `stream` (kept alive by outputs)
    heads_kv: int = 0                # heads of k and v (divides heads; 0: the same as heads)
    want_lse: bool = False           # also return the log-sum-exp of each query row
    window: tuple[int, int] = (-1, -1)   # keys seen by query i: [i + diag - left, i + diag + right]
    diag_offset: int = 0             # Lk - Lq (bottom-right diagonal) or 0 (top-left)

    @property
    def masked(self) -> bool:
        """Causal or a sliding window: some keys are hidden from some queries."""
        return self.window != (-1, -1)

    def __post_init__(self):
        if not self.heads_kv:
            self.heads_kv = self.heads

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        return tma.layout_shape(self.layout, self.batch, self.heads, self.seq_q, self.head_dim)

    @property
    def lse_shape(self) -> tuple[int, int, int]:
        return (self.batch, self.heads, self.seq_q)

    @property
    def empty(self) -> bool:
        """Nothing to compute (no query rows, heads or batches): no launch, no driver."""
        return self.seq_q == 0 or self.heads == 0 or self.batch == 0


# --------------------------------------------------------------------------- validation

def _classify(name: str, obj, stream: int):
    """(is_host, array): NumPy stays on the host, anything else is imported zero-copy."""
    if isinstance(obj, np.ndarray):
        if obj.dtype != BF16 and obj.dtype not in (np.float32, np.float64):
            raise TypeError(f"{name}: expected dtype bfloat16 (ml_dtypes.bfloat16; float32 and "
                            f"float64 are rounded to bfloat16), got {obj.dtype}")
        return True, obj
    if isinstance(obj, DeviceArray) or hasattr(obj, "__dlpack__") or \
            hasattr(obj, "__cuda_array_interface__"):
        return False, as_device_array(obj, name=name, stream=stream)
    raise TypeError(f"{name}: expected a NumPy array or a CUDA array (DLPack or "
                    f"__cuda_array_interface__), got {type(obj).__name__}")


def _bhld(name: str, shape, layout: str) -> tuple[int, int, int, int]:
    """(batch, heads, seq, head_dim) of an array in `layout`."""
    if len(shape) != 4:
        raise ValueError(f"{name}: expected a rank-4 array {_AXES[layout]} for layout "
                         f"{layout!r}, got rank {len(shape)} (shape {tuple(shape)})")
    b, x, y, d = (int(n) for n in shape)
    return (b, x, y, d) if layout == "bhld" else (b, y, x, d)


def _arch_ok(arch: str, cc: tuple[int, int]) -> bool:
    """sm_90a runs only on compute capability 9.0; plain sm_XY on XY and newer."""
    digits = arch.removeprefix("sm_").rstrip("af")
    want = (int(digits[:-1]), int(digits[-1]))
    return cc == want if arch[-1] in "af" else cc >= want


def _pick_stage(stage, head_dim: int, seq_q: int, seq_k: int, cc=None, *, gqa: bool = False,
                lse: bool = False, masked: bool = False) -> Stage:
    """_pick_uncached, remembered per arguments: the answer depends on them and on the
    registry alone, and a model asks the same question every call. The memory is dropped
    whenever the registry objects change (tests swap them); errors are never remembered."""
    registry = _registry()
    if any(a is not b for a, b in zip(registry, _PICKS_REGISTRY)):
        _PICKS.clear()
        _PICKS_REGISTRY[:] = registry
    key = (stage, head_dim, seq_q, seq_k, cc, gqa, lse, masked)
    try:
        hit = _PICKS.get(key)
    except TypeError:                   # an unhashable `stage` argument: answer it uncached
        return _pick_uncached(stage, head_dim, seq_q, seq_k, cc, gqa=gqa, lse=lse, masked=masked)
    if hit is None:
        hit = _pick_uncached(stage, head_dim, seq_q, seq_k, cc, gqa=gqa, lse=lse, masked=masked)
        if len(_PICKS) >= 512:
            _PICKS.clear()
        _PICKS[key] = hit
    return hit


_PICKS: dict[tuple, Stage] = {}
_PICKS_REGISTRY: list = [None, None, None, None, None]
_SM100_NAMES = vars(stages_sm100)   # its FASTEST_FIRST is optional: a dict lookup, no raise


def _registry() -> tuple:
    """Every registry object _pick_uncached reads, Blackwell's included (stages.by_speed reads
    stages_sm100.FASTEST_FIRST when it is defined). A remembered pick or steady call is stale
    when any of them is not the same object (tests swap them)."""
    return (PRODUCTION, stages.STAGES, stages.FASTEST_FIRST, stages_sm100.SM100_STAGES,
            _SM100_NAMES.get("FASTEST_FIRST"))


@functools.lru_cache(maxsize=256)
def _specialized(stage: Stage, head_dim: int, masked: bool) -> Stage:
    """stage.specialize(head_dim, masked), built once per triple (a dataclasses.replace per
    call is a measurable part of a small call's host time)."""
    return stage.specialize(head_dim, masked)


def _pick_uncached(stage, head_dim: int, seq_q: int, seq_k: int, cc=None, *, gqa: bool = False,
                   lse: bool = False, masked: bool = False) -> Stage:
    """The requested kernel, checked; or the production kernel when it takes the call, else
    the fastest lineage stage (stages.by_speed) that does (and, once the device is known,
    runs on its compute capability). gqa: k/v have fewer heads than q; lse: return_lse.
    On a compute capability 10.0 device the choice is among the Blackwell lineage's stages
    (stages_sm100), fastest first by stages.by_speed: it has no production kernel."""
    q_len = seq_q or None  # an empty query never launches: only head dim and keys matter
    blackwell = cc is not None and stages.lineage_for(cc) == stages.BLACKWELL
    pool = by_speed(stages.BLACKWELL) if blackwell else (PRODUCTION,) + by_speed()
    # What a shape that only the production kernel takes is told on a B200.
    no_production = ("; there is no production kernel for sm_100a: its lineage takes head dim "
                     "128, no GQA/MQA, LSE or masks, and lengths that are multiples of its "
                     "tiles" if blackwell else "")

    def why_not(s: Stage):
        if gqa and not s.gqa:
            return "k/v with fewer heads than q (GQA/MQA)"
        if lse and not s.lse:
            return "return_lse=True"
        if masked and not s.masks:
            return "causal or window masks"
        return s.unsupported(head_dim, q_len or s.block_m, seq_k)

    def argument(why: str) -> str:
        return {"k": "k", "r": "return_lse", "c": "causal"}.get(why[0], "q")

    def takers(exclude):
        # A few names, fastest first; past four, the fastest and a count (errors stay short).
        ok = [s for s in pool if s is not exclude and why_not(s) is None
              and (cc is None or _arch_ok(s.arch, cc))]
        if not ok:
            return "no registered stage takes this shape" + no_production
        if len(ok) > 4:
            return (f"{ok[0].title} and {len(ok) - 1} other stages would take it "
                    f"(see `ptxattn list`)")
        return ", ".join(s.title for s in ok) + " would take it"

    if stage is not None:
        chosen = get_stage(stage)
        why = why_not(chosen)
        if why:
            raise ValueError(f"{argument(why)}: {chosen.title} does not take "
                             f"{why}; {takers(chosen)}")
        if cc is not None and not _arch_ok(chosen.arch, cc):
            # The lineages' numbers collide: say how to name the one this GPU runs.
            hint = ""
            if blackwell and chosen.production:
                hint = "; there is no production kernel for sm_100a"
            elif blackwell and any(s.number == chosen.number for s in pool):
                hint = (f"; a plain number names a Hopper stage: name a Blackwell one as "
                        f"'sm100_stage{chosen.number:02d}' or "
                        f"stages.get_stage({chosen.number}, arch='sm_100a')")
            elif not blackwell and chosen.arch == stages.BLACKWELL:
                hint = ("; the sm_100a lineage runs on compute capability 10.0 (a B200) only, "
                        "and has never been run by this project")
            raise ValueError(f"stage: {chosen.title} is built for {chosen.arch}, "
                             f"which this GPU (compute capability {cc[0]}.{cc[1]}) cannot run; "
                             f"{takers(chosen)}{hint}")
        return chosen
    candidates = [s for s in pool if cc is None or _arch_ok(s.arch, cc)]
    for s in candidates:
        if why_not(s) is None:
            return s
    if not candidates:
        raise ValueError(f"stage: no registered stage runs on compute capability {cc[0]}.{cc[1]}"
                         f"{' (no sm_100a stage is registered)' if blackwell else ''}")
    grouped: dict[str, list[str]] = {}
    for s in candidates:
        grouped.setdefault(why_not(s), []).append(s.label)
    # Counts, not 15 names: "head dim 64 (takes 128) for every stage; see `ptxattn list`".
    reasons = "; ".join(
        f"{why} for {'every stage' if len(labels) == len(candidates) else len(labels)}"
        f"{'' if len(labels) in (1, len(candidates)) else ' stages'}"
        f"{' (' + labels[0] + ')' if len(labels) == 1 < len(candidates) else ''}"
        for why, labels in grouped.items())
    raise ValueError(f"{argument(why_not(candidates[0]))}: no registered stage takes this shape: "
                     f"{reasons}{no_production}; see `ptxattn list`")


def _first_use(plan: _Plan, stage: Stage, device: int) -> None:
    """Before a Blackwell stage's launch: validation checked the device arrays against the
    stage it picked without knowing the GPU (a Hopper one); check them against this one, then
    run (once per process) its self-check against the reference (selfcheck.ensure)."""
    import dataclasses

    from . import selfcheck
    if not plan.host and stage is not plan.stage:
        checked = dataclasses.replace(plan, stage=stage)
        for name, seq, rows in (("q", plan.seq_q, stage.q_box_rows),
                                ("k", plan.seq_k, stage.block_n), ("v", plan.seq_k, stage.block_n)):
            _check_device_geometry(name, getattr(plan, name), checked, seq, rows)
        if plan.out is not None:
            _check_device_geometry("out", plan.out, checked, plan.seq_q, stage.q_box_rows)
    selfcheck.ensure(stage, device)


def _overlaps(a: DeviceArray, b: DeviceArray) -> bool:
    (a0, a1), (b0, b1) = a.span(), b.span()
    return a0 < b1 and b0 < a1


@functools.lru_cache(maxsize=256)
def _self_overlapping(shape, strides) -> bool:
    """True when two different indices of the view share an element."""
    extent = 1
    for s, n in sorted((abs(s), n) for n, s in zip(shape, strides) if n > 1):
        if s < extent:
            return True
        extent = s * (n - 1) + extent
    return False


def _check_device_geometry(name: str, arr: DeviceArray, plan: _Plan, seq: int, rows: int) -> None:
    """Last-dim stride 1, positive strides, and what TMA needs (16-byte base and strides)."""
    tma.check_base(arr.ptr, name)
    heads = plan.heads_kv if name in ("k", "v") else plan.heads
    tma.map_geometry(plan.layout, plan.batch, heads, seq, plan.head_dim, rows,
                     plan.stage.tma_chunk, arr.strides, name)


def _check_out(plan: _Plan, out_obj):
    expected = plan.out_shape
    if plan.host:
        if not isinstance(out_obj, np.ndarray):
            raise ValueError(f"out: q, k, v are NumPy (host) arrays, so out must be a NumPy array "
                             f"too, got {type(out_obj).__name__}")
        out = out_obj
        if out.dtype != BF16:
            raise TypeError(f"out: expected dtype bfloat16 (ml_dtypes.bfloat16), got {out.dtype}")
    else:
        if isinstance(out_obj, np.ndarray):
            raise ValueError("out: q, k, v are device arrays, so out must be a device array "
                             "too, got a NumPy (host) array")
        _, out = _classify("out", out_obj, plan.stream)
    if tuple(out.shape) != expected:
        raise ValueError(f"out: expected shape {expected}, i.e. {_AXES[plan.layout]} for layout "
                         f"{plan.layout!r}, got {tuple(out.shape)}")
    for name in ("q", "k", "v"):
        x = getattr(plan, name)
        overlap = (np.may_share_memory(out, x) if plan.host else _overlaps(out, x))
        if overlap:
            raise ValueError(f"out: overlaps {name}; the output must not alias an input")
    if plan.host:
        if not out.flags.writeable:
            raise ValueError("out: the NumPy array is read-only")
        return out
    if out.readonly:
        raise ValueError("out: the device array is exported read-only")
    if out.device is not None and plan.q.device is not None and out.device != plan.q.device:
        raise ValueError(f"out: on CUDA device {out.device}, but q is on device {plan.q.device}")
    if _self_overlapping(out.shape, out.strides):
        raise ValueError(f"out: strides {out.strides} make elements overlap; the output needs "
                         "one element per index")
    if not plan.empty:
        _check_device_geometry("out", out, plan, plan.seq_q, plan.stage.q_box_rows)
    return out


def _framework_stream(obj):
    """The current stream object of the framework that made `obj`: PyTorch's
    torch.cuda.current_stream(device), CuPy's get_current_stream(); None otherwise.

    Read from the framework module the caller already imported (never imported
    here): ptxattn has no dependency on either.
    """
    package = type(obj).__module__.partition(".")[0]
    if package == "torch":
        torch = sys.modules.get("torch")
        if torch is not None and getattr(obj, "is_cuda", False):
            return torch.cuda.current_stream(obj.device)
    elif package == "cupy":
        cupy = sys.modules.get("cupy")
        if cupy is not None:
            return cupy.cuda.get_current_stream()
    return None


def _caller_stream(arrays):
    """stream=None: the current stream of the first torch/CuPy array among the
    arguments, else None (the legacy default stream)."""
    for obj in arrays:
        if obj is not None and not isinstance(obj, np.ndarray):
            current = _framework_stream(obj)
            if current is not None:
                return current
    return None


DIAGONALS = ("bottom_right", "top_left")
UNBOUNDED = 1 << 30              # an unbounded window side, as the kernel reads it


def _window(causal, window, diagonal) -> tuple[int, int]:
    """(left, right) from causal=/window= (FlashAttention's window_size: -1 is unbounded;
    causal is (-1, 0), or (left, 0) with a window)."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected True or False, got {type(causal).__name__}")
    if diagonal not in DIAGONALS:
        raise ValueError(f"diagonal: expected 'bottom_right' (FlashAttention: query i of Lq sees "
                         f"keys up to i + Lk - Lq) or 'top_left' (PyTorch's is_causal: up to i), "
                         f"got {diagonal!r}")
    left, right = -1, -1
    if window is not None:
        try:
            left, right = window
        except (TypeError, ValueError):
            raise TypeError(f"window: expected a pair (left, right) of ints >= -1, got "
                            f"{window!r}") from None
        for name, x in (("left", left), ("right", right)):
            if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < -1:
                raise ValueError(f"window: {name} must be an int >= -1 (-1: unbounded), got {x!r}")
        left, right = int(left), int(right)
    if causal:
        if right > 0:
            raise ValueError(f"window: causal=True hides every key past the diagonal, so the "
                             f"right edge must be 0 or -1, got {right}")
        right = 0
    return left, right


def _validate(q, k, v, *, stage, scale, layout, out, stream, return_lse=False, causal=False,
              window=None, diagonal="bottom_right") -> _Plan:
    stream_handle = driver.stream_handle
    if not isinstance(layout, str) or layout.lower() not in LAYOUTS:
        raise ValueError(f"layout: expected 'bhld' (batch, heads, seq, head_dim) or 'bshd' "
                         f"(batch, seq, heads, head_dim), got {layout!r}")
    layout = layout.lower()
    if stream is None:
        stream = _caller_stream((q, k, v, out))
    handle = stream_handle(stream)

    kinds = {}
    arrays = {}
    for name, obj in (("q", q), ("k", k), ("v", v)):
        kinds[name], arrays[name] = _classify(name, obj, handle)
    if len(set(kinds.values())) > 1:
        where = ", ".join(f"{n} is {'a NumPy (host) array' if h else 'a device array'}"
                          for n, h in kinds.items())
        raise ValueError(f"q, k, v: expected all NumPy (host) arrays or all device arrays; {where}")
    host = kinds["q"]

    dims = {n: _bhld(n, a.shape, layout) for n, a in arrays.items()}
    if dims["k"] != dims["v"]:
        raise ValueError(f"v: expected the same shape as k, {tuple(arrays['k'].shape)}, "
                         f"got {tuple(arrays['v'].shape)}")
    (b, h, lq, d), (bk, hk, lk, dk) = dims["q"], dims["k"]
    for label, mine, theirs in (("batch", bk, b), ("head dim", dk, d)):
        if mine != theirs:
            raise ValueError(f"k: {label} {mine} does not match q's {label} {theirs} "
                             f"(layout {layout!r}: {_AXES[layout]})")
    # GQA/MQA: each group of heads // heads_kv query heads shares one k/v head
    if hk != h and (hk == 0 or h % hk):
        raise ValueError(f"k: heads {hk} do not divide q's heads {h}; grouped-query attention "
                         f"needs k/v heads dividing q heads (layout {layout!r}: {_AXES[layout]})")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected True or False, got {type(return_lse).__name__}")
    left, right = _window(causal, window, diagonal)
    masked = (left, right) != (-1, -1)
    if lk == 0:
        raise ValueError("k: key length is 0; attention over no keys is undefined "
                         "(softmax of an empty row)")
    if not host:
        devices = {n: a.device for n, a in arrays.items() if a.device is not None}
        if len(set(devices.values())) > 1:
            raise ValueError("q, k, v: expected arrays on one device, got "
                             + ", ".join(f"{n} on CUDA device {dv}" for n, dv in devices.items()))

    empty = lq == 0 or h == 0 or b == 0
    try:
        chosen = _pick_stage(stage, d, 0 if empty else lq, lk, gqa=hk != h,
                             lse=return_lse, masked=masked)
    except ValueError as exc:
        # Say how the layout read the shape: a BHLD array passed as "bshd" shows up here as an
        # odd query length, and the reader should see why.
        name = str(exc).split(":", 1)[0]
        if name in ("q", "k"):
            bb, hh, ll, dd = dims[name]
            exc.args = (f"{exc}; layout {layout!r} reads {name}'s shape "
                        f"{tuple(arrays[name].shape)} as batch {bb}, heads {hh}, seq {ll}, "
                        f"head_dim {dd}",)
        raise
    if scale is None:
        scale_value = 1.0 / math.sqrt(d)
    else:
        try:
            if isinstance(scale, (str, bytes)):
                raise TypeError
            scale_value = float(scale)
        except (TypeError, ValueError):
            raise TypeError(f"scale: expected a real number, got {type(scale).__name__}") from None
        if not math.isfinite(scale_value) or scale_value <= 0:
            # the softmax subtracts the row max of the raw scores: that bounds the exponents
            # only for a positive scale (and -inf masks stay -inf only then)
            raise ValueError(f"scale: expected a positive finite number, got {scale_value}")

    plan = _Plan(host, arrays["q"], arrays["k"], arrays["v"], None, layout, b, h, lq, lk, d,
                 chosen, stage is not None, scale_value, handle, stream, heads_kv=hk,
                 want_lse=return_lse, window=(left, right),
                 diag_offset=lk - lq if diagonal == "bottom_right" else 0)
    if not host and not plan.empty:
        _check_device_geometry("q", plan.q, plan, lq, chosen.q_box_rows)
        _check_device_geometry("k", plan.k, plan, lk, chosen.block_n)
        _check_device_geometry("v", plan.v, plan, lk, chosen.block_n)
    if out is not None:
        plan.out = _check_out(plan, out)
    return plan


# --------------------------------------------------------------------------- launch

class PreparedAttention:
    """One attention call with device buffers, tensor maps and parameters built.

    `launch()` only enqueues cuLaunchKernelEx (what a benchmark times between
    events); `out` is the DeviceArray the kernel writes.
    """

    def __init__(self, plan: _Plan, stage: Stage, out: DeviceArray, spec=None, keep=(),
                 owned=(), lse: DeviceArray | None = None):
        self.plan = plan
        self.stage = stage
        self.out = out
        self.lse = lse                        # float32 (B, H, Lq) with return_lse, else None
        self.host = plan.host
        self.stream = plan.stream
        self._spec = spec
        self._keep = keep                     # inputs, staging copies, tensor maps
        self._owned = owned                   # arrays this object allocated (close() frees)
        self.grid = spec.grid if spec else (0, 1, 1)
        self.block = spec.block if spec else (stage.threads, 1, 1)
        self.cluster = spec.cluster if spec else stage.cluster
        self.smem_bytes = spec.smem_bytes if spec else stage.smem_bytes
        self.function = spec.function if spec else None
        self._thread = threading.get_ident()
        self._steady = None                   # set by _build: see _Steady

    def launch(self) -> None:
        if self._spec is not None:
            if threading.get_ident() != self._thread:
                # another thread than the one that prepared it: make the context current here
                from . import driver
                driver.context()
            self._spec()

    def close(self) -> None:
        """Free the device memory this object allocated (NumPy inputs' copies, an output it
        made, the tile counter) now rather than at garbage collection; the caller's own
        arrays are never touched. Synchronizes first: a queued launch may still use it."""
        from . import driver
        if self._spec is None:
            return
        driver.synchronize(self.stream)
        for item in self._keep:
            if isinstance(item, driver.DeviceBuffer):
                item.close()
        for array in self._owned:
            array.free()
        self._spec = None

    def __enter__(self) -> "PreparedAttention":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def flops(self) -> int:
        p = self.plan
        return 4 * p.batch * p.heads * p.seq_q * p.seq_k * p.head_dim


_KERNELS: dict[tuple[int, str], object] = {}
# Held while a kernel is looked up or JIT-compiled: threads asking for the same stage at once
# compile it once, and none sees a function before its shared-memory opt-in is done.
_KERNELS_LOCK = threading.RLock()


def kernel(stage: Stage, defines: dict | None = None):
    """The stage's ptxattn_fwd, JIT-compiled once per (device, defines), smem opt-in once.
    The build's own defines (stage.defines, a production variant) come first; `defines`
    (tools: PTXATTN_TRACE, knobs) are added to them."""
    from . import ptx
    ctx = driver.context()
    # A call's own build (no tool defines) is found by what names it, before any merging.
    build_key = (ctx.ordinal, stage.file, stage.defines, "build") if not defines else None
    function = _KERNELS.get(build_key) if build_key else None
    if function is not None:
        return function
    defines = {**dict(stage.defines), **(defines or {})} or None
    key = (ctx.ordinal, stage.file, tuple(sorted((defines or {}).items())))
    function = _KERNELS.get(key)
    if function is not None:
        if build_key:
            _KERNELS[build_key] = function
        return function
    with _KERNELS_LOCK:
        if key not in _KERNELS:
            label = stage.label + "".join(f" -D{k}={v}" for k, v in sorted((defines or {}).items()))
            module = driver.load_module(ptx.source(stage, defines), label, stage=stage,
                                        defines=defines)
            function = module.function(ENTRY)
            function.set_max_dynamic_smem(stage.smem_bytes)
            _KERNELS[key] = function
        if build_key:
            _KERNELS[build_key] = _KERNELS[key]
        return _KERNELS[key]


def persistent_ctas() -> int | None:
    """The PTXATTN_PERSISTENT_CTAS cap on a persistent stage's grid, or None (no cap)."""
    text = os.environ.get(PERSISTENT_CTAS_ENV, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{PERSISTENT_CTAS_ENV}: expected a positive number of CTAs (a testing "
                         f"knob that caps the persistent grid), got {text!r}")
    return value


@functools.lru_cache(maxsize=256)
def _bhl_strides(layout, shape, strides):
    return tma.bhl_strides(layout, shape, strides, "out")


def _build(plan: _Plan, defines=None, extra_params=()) -> PreparedAttention:
    if plan.empty:   # nothing to compute: an empty output, no launch, no driver
        device = None if plan.host else plan.q.device
        out = plan.out if isinstance(plan.out, DeviceArray) else DeviceArray(
            0, plan.out_shape, device=device)
        lse = DeviceArray(0, plan.lse_shape, device=device, dtype=np.float32) \
            if plan.want_lse else None
        return PreparedAttention(plan, plan.stage, out, lse=lse)

    cap = persistent_ctas()
    ctx = driver.context()
    stage = _pick_stage(plan.stage if plan.stage_requested else None, plan.head_dim,
                        plan.seq_q, plan.seq_k, ctx.compute_capability,
                        gqa=plan.heads_kv != plan.heads, lse=plan.want_lse, masked=plan.masked)
    stage = _specialized(stage, plan.head_dim, plan.masked)   # the production build for this call
    if stage.arch != stages.HOPPER:      # a never-run lineage: checked before its first launch
        _first_use(plan, stage, ctx.ordinal)
    if stage.smem_bytes > ctx.max_smem_optin:
        raise PtxattnError(f"{stage.label} needs {stage.smem_bytes} bytes of shared memory per "
                           f"CTA; this GPU allows {ctx.max_smem_optin}")
    # The JIT first: when it fails, nothing is allocated yet and no array is touched.
    function = kernel(stage, defines)
    stream = plan.stream

    if plan.host:
        q, k, v = (tensors.from_numpy(to_bf16(x), stream=stream) for x in (plan.q, plan.k, plan.v))
        out = tensors.empty(plan.out_shape, stream=stream)
        owned = (q, k, v, out)
    else:
        q, k, v = plan.q, plan.k, plan.v
        # A fresh output is stream-ordered memory (cuMemAllocAsync on the launch stream, freed
        # there when the array goes): no allocation or free ever waits for the GPU.
        out = plan.out if plan.out is not None else tensors.empty(
            plan.out_shape, stream=stream, stream_owner=plan.stream_object)
        owned = () if plan.out is not None else (out,)
        for name, arr in (("q", q), ("k", k), ("v", v), ("out", out)):
            if arr.device is None:              # __cuda_array_interface__ does not say
                arr.device = driver.pointer_device(arr.ptr)
            if arr.device != ctx.ordinal:
                raise ValueError(f"{name}: on CUDA device {arr.device}, but ptxattn runs on "
                                 f"device {ctx.ordinal} (set PTXATTN_DEVICE={arr.device})")
            # Pending writes on another stream: CAI v3 names the producer's stream, and
            # our own DeviceArrays remember the stream that last wrote them. (DLPack
            # producers already synchronised to our stream in __dlpack__.)
            pending = arr.producer_stream if arr.producer_stream is not None else arr.stream
            if pending is not None and pending != stream:
                driver.stream_wait(stream, pending)
            # our own stream-ordered memory used on this stream is not reused before the
            # launch is done (a no-op for other producers' memory and on its own stream)
            arr.used_on(stream)
    out.stream = stream
    # A stream object the caller passed (driver.Stream, cupy) must outlive the handle that
    # the output remembers for later readers (to_numpy, DLPack export).
    out.stream_owner = plan.stream_object

    B, H, Lq, Lk, D = plan.batch, plan.heads, plan.seq_q, plan.seq_k, plan.head_dim

    Hkv = plan.heads_kv

    def tmap(name, arr, heads, seq, rows):
        return tma.encode_qkvo_map(arr.ptr, plan.layout, B, heads, seq, D, rows, stage.swizzle,
                                   stage.tma_chunk, arr.strides, name=name)

    # Q and O boxes are one consumer warpgroup's rows (q_box_rows, 64), not the
    # CTA's block_m: stages with two consumers load Q (and store O) as 2 boxes.
    maps = (tmap("q", q, H, Lq, stage.q_box_rows), tmap("k", k, Hkv, Lk, stage.block_n),
            tmap("v", v, Hkv, Lk, stage.block_n), tmap("out", out, H, Lq, stage.q_box_rows))
    o_batch, o_head, o_row, _ = _bhl_strides(plan.layout, out.shape, out.strides)
    values = (*maps, out.ptr, o_row, o_head, o_batch, Lq, Lk, H, B, plan.scale)
    types = (driver.BY_VALUE,) * 4 + (driver.PTR, driver.U64, driver.U64, driver.U64,
                                      driver.U32, driver.U32, driver.U32, driver.U32, driver.F32)
    keep = [q, k, v, maps]
    lse = None
    if plan.want_lse:
        lse = tensors.empty(plan.lse_shape, stream=stream, dtype=np.float32,
                            stream_owner=plan.stream_object)
        lse.stream = stream
        owned += (lse,)
    if stage.production:
        # GQA group size, where the log-sum-exp goes (0: not wanted), the diagonal and the
        # window (read by the masked build only)
        # A side of 2^30 or more is unbounded too (no length reaches it): passed as is, a side
        # near 2^31 overflows the kernel's s32 key arithmetic, and one past it wraps in the
        # s32 parameter, and keys that rows must see are dropped without an error.
        left, right = (UNBOUNDED if x < 0 else min(x, UNBOUNDED) for x in plan.window)
        values += (H // Hkv, lse.ptr if lse is not None else 0, plan.diag_offset, left, right)
        types += (driver.U32, driver.U64, driver.S32, driver.S32, driver.S32)
    if stage.dynamic_tiles:
        # the dynamic tile scheduler's two u32 counters: zero before the first launch, and
        # the kernel's last CTA resets them, so every later launch of this object finds zeros
        counter = driver.DeviceBuffer(8)
        driver.memset_u8(counter.ptr, 0, 8, stream=stream)
        values += (counter.ptr,)
        types += (driver.PTR,)
        keep.append(counter)
    # Parameters a build variant adds after the ABI's (e.g. trace_buf with PTXATTN_TRACE).
    values += tuple(value for value, _ in extra_params)
    types += tuple(ctype for _, ctype in extra_params)
    grid = stage.grid(B, H, Lq, ctx.sm_count if cap is None else min(ctx.sm_count, cap))
    spec = driver.LaunchSpec(function, grid, (stage.threads, 1, 1), stage.smem_bytes,
                             (values, types), cluster=stage.cluster, stream=stream)
    prepared = PreparedAttention(plan, stage, out, spec, keep=tuple(keep), owned=owned, lse=lse)
    # What a steady call (the fast path of attention()) replaces per call: the O map and
    # pointer (slots 3 and 4, a fresh output each call) and the LSE pointer.
    prepared._steady = (ctx, (plan.layout, B, H, Lq, D, stage.q_box_rows, stage.swizzle,
                              stage.tma_chunk, out.strides, "out"),
                        _LSE_SLOT if stage.production and lse is not None else None)
    return prepared


_LSE_SLOT = 14      # the production ABI: 4 maps, O, 3 O strides, Lq, Lk, H, B, scale, group, lse


def prepare(q, k, v, *, stage=None, scale=None, layout: str = "bhld", out=None,
            stream=None, return_lse: bool = False, causal: bool = False, window=None,
            diagonal: str = "bottom_right", defines: dict | None = None,
            extra_params=()) -> PreparedAttention:
    """Validate, pick the stage, copy NumPy inputs in, build maps and parameters.

    Arguments as for `attention`. Call `.launch()` to enqueue the kernel (as
    often as wanted: it always reads the same inputs and writes `.out`).
    For build variants (tools, not users): `defines` go to the preprocessor
    (e.g. {"PTXATTN_TRACE": 1}) and `extra_params`, (value, ctypes type)
    pairs, follow the ABI's parameters (e.g. ((trace_ptr, ctypes.c_void_p),)).
    """
    return _build(_validate(q, k, v, stage=stage, scale=scale, layout=layout, out=out,
                            stream=stream, return_lse=return_lse, causal=causal, window=window,
                            diagonal=diagonal), defines, tuple(extra_params))


# --------------------------------------------------------------------------- the steady call
#
# A model asks the same question thousands of times: the same shapes, strides, dtypes and
# flags, often the same addresses. attention() first builds a key from everything the full
# path (validation, stage pick, maps, parameters, launch config) reads, and when an earlier
# call with that key went through the full path and launched, it replays that launch: a fresh
# output (stream-ordered, as on the full path), its O map and pointer (and the LSE pointer) in
# parameters packed once per address, the launch. Why this is exact:
# - The key holds, for q, k, v and a caller's out: address, shape, strides, device, dtype,
#   read-only flag; and stage, scale, layout, return_lse, causal, window, diagonal, the launch
#   stream's handle and the PTXATTN_PERSISTENT_CTAS text. Validation and _build are functions
#   of these (and of the context and the stage registry, checked on every hit), so a hit can
#   only happen for arguments that validated and launched before: errors always come from the
#   full path, with its messages, in its order.
# - Arguments whose meaning depends on their exact type (causal=1 is an error, True is not;
#   a list window, a NumPy scale) are keyed only when plain (bool, int, float, str, a tuple of
#   ints); anything else takes the full path. So do NumPy inputs (their time is the copies),
#   __cuda_array_interface__ objects (their device needs a driver call) and torch tensors
#   that DLPack must judge (subclasses, requires_grad, ...).
# - Per call, as on the full path: the stream handshake (torch's current stream, a
#   DeviceArray's pending writes, a DLPack producer's own __dlpack__), DeviceArray.used_on,
#   the output and LSE allocations, the context made current on this thread.
# - Nothing the caller owns is kept: an entry holds maps (host structs), packed parameters and
#   the launch config, never an array, so it pins no memory. A new tensor at a remembered
#   address with the same geometry reuses that address's maps, which describe it exactly.
# - Entries are never changed after they are stored; the per-address parameter packs are
#   added under a lock and read without one (as the map and config caches). Bounded.

_STEADY: dict[tuple, "_Steady"] = {}
_STEADY_MAX = 1024
_STEADY_LOCK = threading.Lock()
_PACKS_MAX = 64                  # per entry: output/LSE addresses the pool hands back in turn
_DEFAULT_STREAMS = (0, 1, 2)     # streams that outlive any buffer (see driver.DeviceBuffer)
# The environment as os.environ keeps it (POSIX: a dict of bytes), read with one lookup; the
# knob's text is part of the key, so changing it mid-process takes effect at the next call.
_ENVIRON = getattr(os.environ, "_data", None)
try:
    _KNOB = os.environ.encodekey(PERSISTENT_CTAS_ENV)
except AttributeError:           # pragma: no cover - not CPython's os.environ
    _KNOB, _ENVIRON = None, None


def clear_steady_cache() -> None:
    """Forget every remembered call (tests; a registry swap is noticed without this)."""
    with _STEADY_LOCK:
        _STEADY.clear()


class _Steady:
    """One validated, built and launched call, replayed for arguments with the same key."""

    __slots__ = ("ctx", "registry", "function", "config", "attrs", "values", "types",
                 "o_map", "lse_slot", "out_array", "lse_array", "keep", "packs", "_lock")

    def __init__(self, prepared: PreparedAttention):
        spec = prepared._spec
        ctx, o_map, lse_slot = prepared._steady
        self.ctx = ctx
        self.registry = _registry()
        self.function = spec.function.handle
        self.config, self.attrs = spec.config, spec._attrs
        values, self.types = spec.params
        self.values = list(values)
        self.o_map, self.lse_slot = o_map, lse_slot
        # (bytes, shape, strides, dtype) of a fresh output and LSE, as tensors.empty makes them
        self.out_array = _array_fields(prepared.plan.out_shape, BF16)
        self.lse_array = _array_fields(prepared.plan.lse_shape, np.dtype(np.float32))
        # the q/k/v maps and a dynamic scheduler's counter (never the caller's arrays)
        self.keep = tuple(x for x in prepared._keep if not isinstance(x, DeviceArray))
        self.packs: dict[tuple[int, int], tuple[int, tuple]] = {}
        self._lock = threading.Lock()

    def pack(self, out_ptr: int, lse_ptr: int) -> tuple[int, tuple]:
        """The void*[] of the parameters with this O (map and pointer) and LSE pointer: (its
        address, its holders). The caller keeps the tuple until its launch is queued: another
        thread may evict it from `packs` meanwhile, and the holders are the array itself."""
        values = list(self.values)
        values[3] = tma.encode_qkvo_map(out_ptr, *self.o_map)
        values[4] = out_ptr
        if self.lse_slot is not None:
            values[self.lse_slot] = lse_ptr
        packed = driver.pack_params((values, self.types))
        with self._lock:
            if len(self.packs) >= _PACKS_MAX:
                self.packs.pop(next(iter(self.packs)), None)
            self.packs[(out_ptr, lse_ptr)] = packed
        return packed


def _array_fields(shape, dtype) -> tuple:
    shape = tuple(int(n) for n in shape)
    return (math.prod(shape) * dtype.itemsize, shape, tma.contiguous_strides(shape), dtype)


def _remember(key: tuple, prepared: PreparedAttention) -> None:
    """Store a launched call under its key, when the key says what the full path saw."""
    plan = prepared.plan
    if prepared._spec is None or prepared._steady is None or plan.host:
        return
    seen = tuple(None if a is None else (a.ptr, a.shape, a.strides, a.device, a.readonly,
                                         a.dtype)
                 for a in (plan.q, plan.k, plan.v, plan.out))
    if seen != key[-4:] or plan.stream != key[7]:
        return       # a producer that exported something else the second time: never reuse
    values = prepared._spec.params[0]
    lse_slot = prepared._steady[2]
    if values[4] != prepared.out.ptr or (lse_slot is not None
                                         and values[lse_slot] != prepared.lse.ptr):
        return       # the ABI moved (O pointer, LSE slot): replaying would send stale slots
    entry = _Steady(prepared)
    with _STEADY_LOCK:
        if len(_STEADY) >= _STEADY_MAX:
            _STEADY.pop(next(iter(_STEADY)), None)      # oldest first
        _STEADY[key] = entry


def _steady_call(q, k, v, out, stage, scale, layout, stream, return_lse, causal, window,
                 diagonal, qkv_meta=None):
    """(result, None) when a remembered launch took the call; else (None, key or None), the
    key under which the full path's launch is to be remembered. Never raises for bad input:
    whatever it cannot key exactly goes to the full path, which raises its own errors.

    qkv_meta: tensors.torch_meta of q, k and v (and of out, a fourth) when the caller
    (ptxattn.torch) has read them already; each must be that function's answer for that
    exact torch.Tensor."""
    # plain argument types only (see the notes above)
    if (type(layout) is not str or type(diagonal) is not str or type(return_lse) is not bool
            or type(causal) is not bool
            or not (scale is None or type(scale) is float or type(scale) is int)
            or not (stage is None or type(stage) is int or type(stage) is str
                    or type(stage) is Stage)):
        return None, None
    if window is not None and (type(window) is not tuple or len(window) != 2
                               or type(window[0]) is not int or type(window[1]) is not int):
        return None, None
    torch_types = tensors._TORCH
    if torch_types is None or torch_types[0] is not sys.modules.get("torch"):
        torch_types = tensors._torch_types()
    tensor_type = torch_types[1] if torch_types is not None else None
    stream_object = stream
    torch_device = None                   # a device whose torch stream we must follow
    q_meta = qkv_meta[0] if qkv_meta is not None else None
    if stream is None:
        meta = q_meta = q_meta if q_meta is not None else (
            tensors.torch_meta(q) if type(q) is tensor_type else None)
        if meta is not None:
            # the caller's stream is torch's current one; its object is fetched only when an
            # allocation must hold it (a stream other than the default ones)
            handle = tensors.torch_current_stream(meta[3])
            stream_object = _CALLER_STREAM
        else:
            try:
                stream_object = _caller_stream((q, k, v, out))
                handle = driver.stream_handle(stream_object)
            except Exception:
                return None, None
    elif type(stream) is int and stream >= 0:
        handle = stream
    else:
        try:
            handle = driver.stream_handle(stream)
        except Exception:
            return None, None
    metas = []
    arrays = []                           # DeviceArrays: pending writes, used_on, per call
    imported = []                         # DLPack imports, alive until the launch is queued
    given = qkv_meta if qkv_meta is not None and len(qkv_meta) == 4 else (
        (*qkv_meta, None) if qkv_meta is not None else (q_meta, None, None, None))
    for i, (name, obj) in enumerate((("q", q), ("k", k), ("v", v), ("out", out))):
        kind = type(obj)
        if kind is tensor_type:
            meta = given[i] if given[i] is not None else tensors.torch_meta(obj)
            if meta is None:
                return None, None
            torch_device = meta[3]
            metas.append((*meta, False, BF16))
            continue
        if obj is None and name == "out":
            metas.append(None)
            continue
        if kind is not DeviceArray:
            if kind is np.ndarray or not hasattr(obj, "__dlpack__"):
                return None, None
            try:
                obj = as_device_array(obj, name=name, stream=handle)
            except Exception:
                return None, None
            imported.append(obj)
        elif obj.device is None:
            return None, None
        else:
            arrays.append(obj)
        metas.append((obj.ptr, obj.shape, obj.strides, obj.device, obj.readonly, obj.dtype))
    env = _ENVIRON.get(_KNOB) if _ENVIRON is not None else os.environ.get(PERSISTENT_CTAS_ENV)
    key = (layout, stage, scale, return_lse, causal, window, diagonal, handle, env, *metas)
    try:
        entry = _STEADY.get(key)
    except TypeError:                     # an unhashable Stage (a dict in its fields)
        return None, None
    if entry is None:
        return None, key
    ctx = driver.context()
    registry = entry.registry             # (_registry(), spelled out: this is the hot path)
    if (entry.ctx is not ctx or registry[0] is not PRODUCTION
            or registry[1] is not stages.STAGES or registry[2] is not stages.FASTEST_FIRST
            or registry[3] is not stages_sm100.SM100_STAGES
            or registry[4] is not _SM100_NAMES.get("FASTEST_FIRST")):
        return None, key                  # another context or registry: rebuilt, replaced

    # the stream handshake, as the full path's imports and _build do it
    if torch_device is not None and stream is not None:
        current = tensors.torch_current_stream(torch_device)
        if current != handle:
            driver.stream_wait(handle, current)
    for arr in arrays:
        pending = arr.producer_stream if arr.producer_stream is not None else arr.stream
        if pending is not None and pending != handle:
            driver.stream_wait(handle, pending)
        arr.used_on(handle)
    if stream_object is _CALLER_STREAM:
        stream_object = None if handle in _DEFAULT_STREAMS or (
            out is not None and not return_lse and type(out) is not DeviceArray) \
            else _caller_stream((q, k, v, out))
    if out is None:
        result = tensors.fresh(*entry.out_array, ctx.ordinal, handle, stream_object)
        out_ptr = result.ptr
    else:
        result = out
        out_ptr = metas[3][0]
    lse = None
    lse_ptr = 0
    if return_lse:
        lse = tensors.fresh(*entry.lse_array, ctx.ordinal, handle, stream_object)
        lse_ptr = lse.ptr
    # `packed` (the void*[] and what it points at) stays referenced here until the launch is
    # queued: another thread's pack() may evict it from entry.packs at any time
    packed = entry.packs.get((out_ptr, lse_ptr))
    if packed is None:
        packed = entry.pack(out_ptr, lse_ptr)
    err = int(driver._cu_module.cuLaunchKernelEx(entry.config, entry.function, packed[0], 0)[0])
    if err:
        raise CudaError(err, "cuLaunchKernelEx (a remembered attention call)")
    if type(result) is DeviceArray:
        result.stream = handle
        result.stream_owner = stream_object
    if lse is not None:
        lse.stream = handle
        return (result, lse), None
    return result, None


_CALLER_STREAM = object()     # "torch's current stream object, if an allocation needs it"


def attention(q, k, v, *, stage=None, scale=None, layout: str = "bhld", out=None, stream=None,
              return_lse: bool = False, causal: bool = False, window=None,
              diagonal: str = "bottom_right", precision: str = "bf16", **fp8_options):
    """softmax(scale * q k^T + mask) v, bf16 in and out, fp32 accumulation.

    precision="fp8" runs the FP8 (e4m3) forward instead (ptxattn/fp8.py: bf16 inputs quantized
    inside, or e4m3 inputs with fp8_options q_descale, k_descale, v_descale; smooth_k), which
    trades ~5% relative error for up to twice the tensor rate.

    q: (B, H, Lq, D), k and v: (B, Hkv, Lk, D) for layout "bhld"; (B, L, H, D) for "bshd".
    Any lengths Lq, Lk >= 1; Hkv divides H (grouped-query / multi-query attention: query
    head h reads k/v head h // (H // Hkv)). return_lse=True returns (out, lse), lse float32
    of shape (B, H, Lq): the natural log of sum_j exp(scale * q.k_j) per query row.

    Masks (FlashAttention's convention): causal=True hides keys past the diagonal;
    window=(left, right) keeps keys j with i + off - left <= j <= i + off + right for query i
    (-1: unbounded side; causal is (-1, 0)). off = Lk - Lq with diagonal="bottom_right" (a
    prefill against a KV cache), 0 with "top_left" (PyTorch's is_causal); the same when
    Lq == Lk. Masked K/V tiles are skipped, not computed. A query that sees no key at all
    gets output 0 and lse -inf.
    Inputs are either all NumPy arrays or all CUDA arrays:

    - NumPy in -> NumPy out (ml_dtypes.bfloat16): copied in and out, synchronised.
      float32 and float64 inputs are accepted and rounded to bfloat16 first
      (float64 through float32); other dtypes raise TypeError.
    - Any DLPack (torch, cupy, jax) or __cuda_array_interface__ object in ->
      zero-copy, launched asynchronously on `stream` (an int handle or an object
      with .cuda_stream/.handle/.ptr, e.g. torch.cuda.Stream, cupy.cuda.Stream,
      ptxattn.Stream). stream=None is the caller's stream: the current stream of
      PyTorch or CuPy when the inputs are theirs, else the legacy default stream.
      Producers make their pending writes visible on that stream (the DLPack
      `stream` argument). Out comes a DeviceArray, itself a DLPack producer whose
      consumers are ordered after the launch; or the caller's `out=`, returned
      (written in stream order on `stream`).
      The dtype must be bfloat16 (device arrays are never converted); the head
      dim must have stride 1 and the base address and other strides must be
      16-byte multiples (TMA).

    stage: None (default) runs the production kernel (stages.PRODUCTION); a lineage stage's
    number or name runs that stage (D=128, lengths multiple of its tiles, no GQA, no LSE).
    scale defaults to 1/sqrt(D).
    An empty output (Lq, H or B == 0) comes back without a launch; Lk == 0 is an
    error. Nothing is written to `out` when an error is raised. Thread-safe: see
    README, "Threading".
    """
    if precision != "bf16" or fp8_options:
        from . import fp8
        return fp8.attention(q, k, v, precision=precision, stage=stage, scale=scale,
                             layout=layout, out=out, stream=stream, return_lse=return_lse,
                             causal=causal, window=window, diagonal=diagonal, **fp8_options)
    result, key = _steady_call(q, k, v, out, stage, scale, layout, stream, return_lse, causal,
                               window, diagonal)
    if result is not None:
        return result
    prepared = prepare(q, k, v, stage=stage, scale=scale, layout=layout, out=out, stream=stream,
                       return_lse=return_lse, causal=causal, window=window, diagonal=diagonal)
    if prepared.host:
        try:
            prepared.launch()
            result = prepared.out.to_numpy()      # waits for the launch stream
            lse = prepared.lse.to_numpy() if return_lse else None
        except BaseException:
            # the device copies are ours: free them now, not when the traceback goes; a
            # failure to free (a broken context) must not hide the error that got us here
            try:
                prepared.close()
            except Exception:
                pass
            raise
        prepared.close()                          # the device copies are ours: free them now
        if out is not None:
            out[...] = result
            result = out
        return (result, lse) if return_lse else result
    prepared.launch()
    if key is not None:
        _remember(key, prepared)
    result = out if out is not None else prepared.out
    return (result, prepared.lse) if return_lse else result


# `ptxattn.attention` names both this module and the function. Whichever is
# imported first, a package attribute would end up shadowing the other (the
# import system rebinds the package attribute to the submodule). So the
# package exports the module itself, and the module is callable:
# ptxattn.attention(q, k, v) and ptxattn.attention.prepare(...) both work.
class _CallableModule(types.ModuleType):
    # the function itself (not a method that calls it): one Python frame less per call
    __call__ = staticmethod(attention)


sys.modules[__name__].__class__ = _CallableModule

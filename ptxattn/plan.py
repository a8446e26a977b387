"""Validation: the arguments of attention() and prepare() checked and read into a Plan.

Everything about the arguments is checked here, before the first driver call, so bad input
gets a ValueError/TypeError naming the argument on any machine, and nothing is ever written to
the caller's `out` when an error is raised. The plan holds what the launch needs (shapes,
layout, the mask, the scale, the stream, the kernel choice.pick_stage made without knowing the
device); launch.py builds from it.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

import numpy as np

from . import driver, tma
from .choice import pick_stage
from .stages import Stage
from .tensors import BF16, DeviceArray, as_device_array, refuse_masked

LAYOUTS = ("bhld", "bshd")
_AXES = {"bhld": "(batch, heads, seq, head_dim)", "bshd": "(batch, seq, heads, head_dim)"}


@dataclass
class Plan:
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
    lse_out: object = None           # the caller's float32 (B, H, Lq) array for the LSE, or None

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
        refuse_masked(name, obj)
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


def check_device_geometry(name: str, arr: DeviceArray, plan: Plan, seq: int, rows: int) -> None:
    """Last-dim stride 1, positive strides, and what TMA needs (16-byte base and strides)."""
    tma.check_base(arr.ptr, name)
    heads = plan.heads_kv if name in ("k", "v") else plan.heads
    tma.map_geometry(plan.layout, plan.batch, heads, seq, plan.head_dim, rows,
                     plan.stage.tma_chunk, arr.strides, name)


def _check_out(plan: Plan, out_obj):
    expected = plan.out_shape
    if plan.host:
        if not isinstance(out_obj, np.ndarray):
            raise ValueError(f"out: q, k, v are NumPy (host) arrays, so out must be a NumPy array "
                             f"too, got {type(out_obj).__name__}")
        refuse_masked("out", out_obj)
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
        check_device_geometry("out", out, plan, plan.seq_q, plan.stage.q_box_rows)
    return out


def _check_lse_out(plan: Plan, lse_obj):
    """The caller's LSE buffer: float32 of shape (B, H, Lq), contiguous (the kernel writes row
    b * H * Lq + h * Lq + i), on the host for NumPy inputs and on q's device otherwise,
    writeable and not overlapping q, k, v or out."""
    expected = plan.lse_shape
    if plan.host:
        if not isinstance(lse_obj, np.ndarray):
            raise ValueError(f"lse_out: q, k, v are NumPy (host) arrays, so lse_out must be a "
                             f"NumPy array too, got {type(lse_obj).__name__}")
        refuse_masked("lse_out", lse_obj)
        lse = lse_obj
        if lse.dtype != np.float32:
            raise TypeError(f"lse_out: expected dtype float32, got {lse.dtype}")
    else:
        if isinstance(lse_obj, np.ndarray):
            raise ValueError("lse_out: q, k, v are device arrays, so lse_out must be a device "
                             "array too, got a NumPy (host) array")
        if not (isinstance(lse_obj, DeviceArray) or hasattr(lse_obj, "__dlpack__")
                or hasattr(lse_obj, "__cuda_array_interface__")):
            raise TypeError(f"lse_out: expected a CUDA array (DLPack or "
                            f"__cuda_array_interface__), got {type(lse_obj).__name__}")
        lse = as_device_array(lse_obj, name="lse_out", stream=plan.stream, dtype=np.float32)
        if lse.dtype != np.float32:
            raise TypeError(f"lse_out: expected dtype float32, got {lse.dtype}")
    if tuple(lse.shape) != expected:
        raise ValueError(f"lse_out: expected shape (batch, heads, seq_q) = {expected}, got "
                         f"{tuple(lse.shape)}")
    if plan.host:
        if not lse.flags.writeable:
            raise ValueError("lse_out: the NumPy array is read-only")
        for name in ("q", "k", "v", "out"):
            x = getattr(plan, name)
            if x is not None and np.may_share_memory(lse, x):
                raise ValueError(f"lse_out: overlaps {name}; the LSE must not alias an input "
                                 "or the output")
        return lse
    if lse.readonly:
        raise ValueError("lse_out: the device array is exported read-only")
    if lse.device is not None and plan.q.device is not None and lse.device != plan.q.device:
        raise ValueError(f"lse_out: on CUDA device {lse.device}, but q is on device "
                         f"{plan.q.device}")
    if not lse.is_contiguous:
        raise ValueError(f"lse_out: expected a contiguous array (the kernel writes row "
                         f"(b * heads + h) * seq_q + i), got strides {lse.strides}")
    if lse.ptr % 4:
        raise ValueError(f"lse_out: base address 0x{lse.ptr:x} is not 4-byte aligned")
    for name in ("q", "k", "v", "out"):
        x = getattr(plan, name)
        if x is not None and _overlaps(lse, x):
            raise ValueError(f"lse_out: overlaps {name}; the LSE must not alias an input or "
                             "the output")
    return lse


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


def caller_stream(arrays):
    """stream=None: the current stream of the first torch/CuPy array among the
    arguments, else None (the legacy default stream)."""
    for obj in arrays:
        if obj is not None and not isinstance(obj, np.ndarray):
            current = _framework_stream(obj)
            if current is not None:
                return current
    return None


DIAGONALS = ("bottom_right", "top_left")


def _window(causal, window, diagonal, name: str = "window") -> tuple[int, int]:
    """(left, right) from causal=/window= (FlashAttention's window_size: -1 is unbounded;
    causal is (-1, 0), or (left, 0) with a window). `name`: the caller's name for the window
    (flash_attn_*'s window_size). A diagonal other than the default places a mask's diagonal,
    so it is refused without causal= or a window: it would change nothing."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected True or False, got {type(causal).__name__}")
    if diagonal not in DIAGONALS:
        raise ValueError(f"diagonal: expected 'bottom_right' (FlashAttention: query i of Lq sees "
                         f"keys up to i + Lk - Lq) or 'top_left' (PyTorch's is_causal: up to i), "
                         f"got {diagonal!r}")
    if diagonal != DIAGONALS[0] and not causal and window is None:
        raise ValueError(f"diagonal: {diagonal!r} places the diagonal of a causal or window "
                         "mask, and this call has neither (causal=False, window=None), so it "
                         "would change nothing; pass causal=True or a window, or leave "
                         "diagonal at its default")
    left, right = -1, -1
    if window is not None:
        # a sequence of two (tuple, list, a 1-d array): a set's order is arbitrary, a dict
        # unpacks its keys, an iterator is used up by reading it
        pair = isinstance(window, (tuple, list)) or (
            isinstance(window, np.ndarray) and window.ndim == 1)
        if not pair or len(window) != 2:
            raise TypeError(f"{name}: expected a pair (left, right) of ints >= -1 (a tuple or "
                            f"list), got {_describe(window)}")
        left, right = window
        for side, x in (("left", left), ("right", right)):
            if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < -1:
                raise ValueError(f"{name}: {side} must be an int >= -1 (-1: unbounded), got "
                                 f"{x!r}")
        left, right = int(left), int(right)
    if causal:
        if right > 0:
            raise ValueError(f"{name}: causal=True hides every key past the diagonal, so the "
                             f"right edge must be 0 or -1, got {right}")
        right = 0
    return left, right


def _describe(obj) -> str:
    """repr for short values, the type for the rest (a generator's repr says nothing)."""
    text = repr(obj)
    return text if len(text) <= 60 and not hasattr(obj, "__next__") else \
        f"a {type(obj).__name__}"


def qkv_dims(arrays: dict, layout: str) -> dict:
    """(batch, heads, seq, head_dim) of each array in `layout`, q, k and v checked against
    each other (shared with the backward, which adds its own arrays)."""
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
    if hk != h and (hk == 0 or hk > h or h % hk):
        raise ValueError(f"k: heads {hk} do not divide q's heads {h}; grouped-query attention "
                         f"needs k/v heads dividing q heads (layout {layout!r}: {_AXES[layout]})")
    return dims


FLOAT32_MAX = float(np.finfo(np.float32).max)


def scale_of(scale, head_dim: int, name: str = "scale") -> float:
    """`scale` as a float (None: 1/sqrt(D)), or the error naming it (shared with the backward,
    decode and varlen, whose `name` is softmax_scale). The kernels take it as a float32: a
    value past float32's range would become inf (or 0) there, so it is refused here."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a real number, got bool {scale!r} (True is not 1.0)")
    try:
        if isinstance(scale, (str, bytes)):
            raise TypeError
        value = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a real number, got {type(scale).__name__}") from None
    if not math.isfinite(value) or value <= 0:
        # the softmax subtracts the row max of the raw scores: that bounds the exponents
        # only for a positive scale (and -inf masks stay -inf only then)
        raise ValueError(f"{name}: expected a positive finite number, got {value}")
    if value > FLOAT32_MAX or float(np.float32(value)) == 0.0:
        raise ValueError(f"{name}: expected a positive number a float32 holds (the kernel's "
                         f"parameter; up to {FLOAT32_MAX:.7g}, above 0 once rounded), got "
                         f"{value!r}, which float32 makes "
                         f"{'inf' if value > FLOAT32_MAX else '0'}")
    return value


def validate(q, k, v, *, stage, scale, layout, out, stream, return_lse=False, causal=False,
              window=None, diagonal="bottom_right", lse_out=None) -> Plan:
    stream_handle = driver.stream_handle
    if not isinstance(layout, str) or layout.lower() not in LAYOUTS:
        raise ValueError(f"layout: expected 'bhld' (batch, heads, seq, head_dim) or 'bshd' "
                         f"(batch, seq, heads, head_dim), got {layout!r}")
    layout = layout.lower()
    if stream is None:
        stream = caller_stream((q, k, v, out))
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

    dims = qkv_dims(arrays, layout)
    (b, h, lq, d), (bk, hk, lk, dk) = dims["q"], dims["k"]
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected True or False, got {type(return_lse).__name__}")
    if lse_out is not None and not return_lse:
        raise ValueError("lse_out: given with return_lse=False (the buffer is where the "
                         "log-sum-exp goes: ask for it with return_lse=True)")
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
        chosen = pick_stage(stage, d, 0 if empty else lq, lk, gqa=hk != h,
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
    scale_value = scale_of(scale, d)

    plan = Plan(host, arrays["q"], arrays["k"], arrays["v"], None, layout, b, h, lq, lk, d,
                 chosen, stage is not None, scale_value, handle, stream, heads_kv=hk,
                 want_lse=return_lse, window=(left, right),
                 diag_offset=lk - lq if diagonal == "bottom_right" else 0)
    if not host and not plan.empty:
        check_device_geometry("q", plan.q, plan, lq, chosen.q_box_rows)
        check_device_geometry("k", plan.k, plan, lk, chosen.block_n)
        check_device_geometry("v", plan.v, plan, lk, chosen.block_n)
    if out is not None:
        plan.out = _check_out(plan, out)
    if lse_out is not None:
        plan.lse_out = _check_lse_out(plan, lse_out)
    return plan

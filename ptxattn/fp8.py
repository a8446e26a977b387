"""attention(q, k, v, precision="fp8"): the FP8 (e4m3) forward and its quantizer.

Two kinds of input, never mixed:
- bf16 q, k, v (NumPy or device, as for the bf16 path): quantized by the hand-written
  kernels of ptx/sm90/production/quantize_fp8.ptx (fp8_quantize.py; their time is part of
  the call's): Q per
  128 query rows, K per 128 keys (smooth_k=True first subtracts K's per-channel mean over the
  tokens of each head, which the softmax does not see), V per channel, stored as V^T with the
  keys of each group of 32 permuted (fp8_reference.PV_KEY_ORDER).
- e4m3 q, k, v (torch.float8_e4m3fn CUDA tensors, DeviceArrays of dtype float8_e4m3fn, or NumPy
  ml_dtypes.float8_e4m3fn arrays), taken as they are, with FlashAttention-3's descales:
  q_descale, k_descale, v_descale float32 of shape (batch, heads_kv) (None: 1), a dequantized
  value being the e4m3 value times its descale. V is transposed and permuted by
  ptxattn_fp8_transpose_v; Q and K are read in place.

What it trades (bench/notes.md, session 5): e4m3 keeps 3 mantissa bits, ~2.6% relative error
on each of Q, K, V and P; together ~5% relative L2 against the float64 reference on random
inputs (the bf16 path: 0.23%), more where scores spread widely (outlier channels of K).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import driver, fp8_forward, tensors, tma
from .plan import scale_of
from .tensors import BF16, E4M3, DeviceArray

PRECISIONS = ("bf16", "fp8")
HEAD_DIMS = fp8_forward.HEAD_DIMS
_F32 = np.dtype(np.float32)


# --------------------------------------------------------------------------- validation

@dataclass
class Plan:
    """What validation learned about an FP8 call (nothing on the GPU yet)."""
    quantized: bool               # e4m3 inputs with descales (else bf16, quantized here)
    host: bool
    q: object
    k: object
    v: object
    out: object
    layout: str
    batch: int
    heads: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int
    scale: float
    stream: int
    stream_object: object
    want_lse: bool
    window: tuple[int, int]
    diag_offset: int
    smooth_k: bool
    descales: dict                # name -> (array, (batch stride, head_kv stride)) or None

    @property
    def masked(self) -> bool:
        return self.window != (-1, -1)

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        return tma.layout_shape(self.layout, self.batch, self.heads, self.seq_q, self.head_dim)

    @property
    def empty(self) -> bool:
        return self.seq_q == 0 or self.heads == 0 or self.batch == 0


def _is_e4m3(obj) -> bool:
    """An FP8 input: e4m3 NumPy, an e4m3 DeviceArray, or a torch.float8_e4m3fn tensor."""
    if isinstance(obj, (np.ndarray, DeviceArray)):
        return obj.dtype == E4M3
    torch_types = tensors._torch_types()
    if torch_types is not None and isinstance(obj, torch_types[1]):
        return obj.dtype is getattr(torch_types[0], "float8_e4m3fn", None)
    return False


def _e4m3_array(name: str, obj, stream: int):
    """(is_host, array) of an e4m3 input: NumPy stays on the host; a DeviceArray as it is; a
    torch tensor viewed in place (its data_ptr, shape, strides), after the stream handshake
    (`stream` waits for the work torch's current stream has queued)."""
    if isinstance(obj, np.ndarray):
        return True, obj
    if isinstance(obj, DeviceArray):
        return False, obj
    if not obj.is_cuda:
        raise TypeError(f"{name}: expected a CUDA tensor or a NumPy array, got a torch tensor "
                        f"on {obj.device}")
    return False, _torch_view(obj, E4M3, stream)


def _torch_view(obj, dtype, stream: int) -> DeviceArray:
    """A CUDA torch tensor viewed in place as a DeviceArray of `dtype` (its data_ptr, shape,
    strides; the tensor kept alive as the owner), after the stream handshake: `stream` waits
    for the work torch's current stream has queued (what tensors._from_torch does for bf16)."""
    device = obj.get_device()
    current = tensors.torch_current_stream(device)
    if current != stream:
        driver.stream_wait(stream, current)
    return DeviceArray(obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()), device=device,
                       owner=obj, dtype=dtype)


def _descale(name: str, obj, batch: int, heads_kv: int, host: bool, stream: int):
    """A FlashAttention-3 descale: float32 (batch, heads_kv), on the inputs' side (NumPy with
    NumPy inputs, a device array with device inputs); (array, (batch stride, head stride))."""
    if obj is None:
        return None
    expected = (batch, heads_kv)
    if isinstance(obj, np.ndarray):
        if not host:
            raise ValueError(f"{name}: q, k, v are device arrays, so {name} must be a device "
                             "array too, got a NumPy array")
        arr = obj
    else:
        if host:
            raise ValueError(f"{name}: q, k, v are NumPy arrays, so {name} must be a NumPy "
                             f"array too, got {type(obj).__name__}")
        arr = _float32_device(name, obj, stream)
    if np.dtype(arr.dtype) != _F32:
        raise TypeError(f"{name}: expected dtype float32 (FlashAttention-3's descales), got "
                        f"{arr.dtype}")
    if tuple(arr.shape) != expected:
        raise ValueError(f"{name}: expected shape (batch, heads_kv) = {expected}, got "
                         f"{tuple(arr.shape)}")
    strides = (tuple(s // arr.itemsize for s in arr.strides) if isinstance(arr, np.ndarray)
               else tuple(arr.strides))
    if any(s < 0 for s in strides):
        raise ValueError(f"{name}: negative strides {strides} are not supported")
    return arr, tuple(0 if n == 1 else s for n, s in zip(arr.shape, strides))


def _float32_device(name: str, obj, stream: int):
    torch_types = tensors._torch_types()
    if torch_types is not None and isinstance(obj, torch_types[1]):
        if not obj.is_cuda:
            raise ValueError(f"{name}: expected a CUDA tensor, got one on {obj.device}")
        if obj.dtype is not torch_types[0].float32:
            raise TypeError(f"{name}: expected dtype float32 (FlashAttention-3's descales), "
                            f"got {obj.dtype}")
        return _torch_view(obj, _F32, stream)
    if isinstance(obj, DeviceArray):
        return obj
    raise TypeError(f"{name}: expected a float32 array (batch, heads_kv), got "
                    f"{type(obj).__name__}")


def _check_e4m3_geometry(name: str, arr: DeviceArray, layout: str) -> None:
    """What TMA needs of an e4m3 operand: 16-byte base, unit last stride, 16-byte strides."""
    tma.check_base(arr.ptr, name)
    s_batch, s_head, s_row, s_dim = tma.bhl_strides(layout, arr.shape, arr.strides, name)
    if s_dim != 1:
        raise ValueError(f"{name}: last (head) dim must have stride 1 for TMA, got {s_dim}")
    for label, s in (("row", s_row), ("head", s_head), ("batch", s_batch)):
        if s <= 0 or s % 16:
            raise ValueError(f"{name}: {label} stride of {s} e4m3 elements is not a positive "
                             "multiple of 16 bytes, which TMA requires")


def validate(q, k, v, *, precision="fp8", stage=None, scale=None, layout="bhld", out=None,
             stream=None, return_lse=False, causal=False, window=None,
             diagonal="bottom_right", q_descale=None, k_descale=None, v_descale=None,
             smooth_k=False) -> Plan:
    """Every check of an FP8 call, before any driver call; errors name the argument."""
    from . import plan as bf16_api             # its checks of the shared arguments
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected 'bf16' or 'fp8', got {precision!r}")
    options = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale,
               "smooth_k": smooth_k or None}
    if precision == "bf16":
        name = next((n for n, x in options.items() if x is not None), "smooth_k")
        raise ValueError(f"{name}: an option of precision='fp8', given with precision='bf16'")
    if stage is not None:
        raise ValueError("stage: precision='fp8' runs the FP8 build of the production kernel; "
                         f"it takes no stage=, got {stage!r}")
    if not isinstance(smooth_k, bool):
        raise TypeError(f"smooth_k: expected True or False, got {type(smooth_k).__name__}")
    kinds = {name: _is_e4m3(x) for name, x in (("q", q), ("k", k), ("v", v))}
    quantized = kinds["q"]
    if len(set(kinds.values())) > 1:
        raise TypeError("q, k, v: expected all bfloat16 (quantized here) or all "
                        "float8_e4m3fn (with q_descale/k_descale/v_descale); got "
                        + ", ".join(f"{n} {'float8_e4m3fn' if e else 'not e4m3'}"
                                    for n, e in kinds.items()))
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if not quantized:
        given = [n for n, x in descales.items() if x is not None]
        if given:
            raise ValueError(f"{given[0]}: descales go with float8_e4m3fn inputs; bfloat16 q, "
                             "k, v are quantized here with their own scales")
        if return_lse and smooth_k:
            raise ValueError("return_lse: not supported with smooth_k=True yet (the smoothed "
                             "scores' log-sum-exp lacks q . mean(k))")
        plan = bf16_api.validate(q, k, v, stage=None, scale=scale, layout=layout, out=out,
                                  stream=stream, return_lse=return_lse, causal=causal,
                                  window=window, diagonal=diagonal)
        if plan.head_dim not in HEAD_DIMS:      # (the bf16 kernel's head dims: a safeguard)
            raise ValueError(f"q: head dim {plan.head_dim} (precision='fp8' takes 64, 128, 256)")
        return Plan(False, plan.host, plan.q, plan.k, plan.v, plan.out, plan.layout,
                    plan.batch, plan.heads, plan.heads_kv, plan.seq_q, plan.seq_k,
                    plan.head_dim, plan.scale, plan.stream, plan.stream_object, return_lse,
                    plan.window, plan.diag_offset, smooth_k, {})
    if smooth_k:
        raise ValueError("smooth_k: only for bfloat16 inputs (quantized here); e4m3 K is "
                         "used as it is")
    if not isinstance(layout, str) or layout.lower() not in bf16_api.LAYOUTS:
        raise ValueError(f"layout: expected 'bhld' (batch, heads, seq, head_dim) or 'bshd' "
                         f"(batch, seq, heads, head_dim), got {layout!r}")
    layout = layout.lower()
    stream_object = stream if stream is not None else bf16_api.caller_stream((q, k, v, out))
    handle = driver.stream_handle(stream_object)
    arrays, hosts = {}, {}
    for name, obj in (("q", q), ("k", k), ("v", v)):
        hosts[name], arrays[name] = _e4m3_array(name, obj, handle)
    if len(set(hosts.values())) > 1:
        raise ValueError("q, k, v: expected all NumPy (host) arrays or all device arrays")
    host = hosts["q"]
    dims = {n: bf16_api._bhld(n, a.shape, layout) for n, a in arrays.items()}
    if dims["k"] != dims["v"]:
        raise ValueError(f"v: expected the same shape as k, {tuple(arrays['k'].shape)}, got "
                         f"{tuple(arrays['v'].shape)}")
    (b, h, lq, d), (bk, hk, lk, dk) = dims["q"], dims["k"]
    for label, mine, theirs in (("batch", bk, b), ("head dim", dk, d)):
        if mine != theirs:
            raise ValueError(f"k: {label} {mine} does not match q's {label} {theirs}")
    if hk == 0 or h % hk:
        raise ValueError(f"k: heads {hk} do not divide q's heads {h}")
    if d not in HEAD_DIMS:
        raise ValueError(f"q: head dim {d} (precision='fp8' takes 64, 128, 256)")
    if lk == 0:
        raise ValueError("k: key length is 0; attention over no keys is undefined")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected True or False, got {type(return_lse).__name__}")
    left, right = bf16_api._window(causal, window, diagonal)
    scale_value = scale_of(scale, d)   # the bf16 path's check: bools and past-float32 refused
    table = {name: _descale(name, x, b, hk, host, handle) for name, x in descales.items()}
    if not host:
        for name, arr in arrays.items():
            _check_e4m3_geometry(name, arr, layout)
        devices = {n: a.device for n, a in arrays.items() if a.device is not None}
        if len(set(devices.values())) > 1:
            raise ValueError("q, k, v: expected arrays on one device, got " + ", ".join(
                f"{n} on CUDA device {dv}" for n, dv in devices.items()))
    plan = Plan(True, host, arrays["q"], arrays["k"], arrays["v"], None, layout, b, h, hk, lq,
                lk, d, scale_value, handle, stream_object, return_lse, (left, right),
                lk - lq if diagonal == "bottom_right" else 0, False, table)
    if out is not None:
        plan.out = _check_out(plan, out)
    return plan


def _check_out(plan: Plan, out):
    """out for e4m3 inputs: bf16 of the output's shape, on the inputs' side."""
    expected = plan.out_shape
    if plan.host:
        if not isinstance(out, np.ndarray):
            raise ValueError(f"out: q, k, v are NumPy arrays, so out must be one too, got "
                             f"{type(out).__name__}")
        arr = out
    else:
        if isinstance(out, np.ndarray):
            raise ValueError("out: q, k, v are device arrays, so out must be a device array "
                             "too, got a NumPy array")
        arr = tensors.as_device_array(out, name="out", stream=plan.stream)
    if np.dtype(arr.dtype) != BF16:
        raise TypeError(f"out: expected dtype bfloat16, got {arr.dtype}")
    if tuple(arr.shape) != expected:
        raise ValueError(f"out: expected shape {expected} for layout {plan.layout!r}, got "
                         f"{tuple(arr.shape)}")
    if not plan.host:
        tma.check_base(arr.ptr, "out")
        tma.map_geometry(plan.layout, plan.batch, plan.heads, plan.seq_q, plan.head_dim, 64,
                         64, arr.strides, "out")
    return arr


# --------------------------------------------------------------------------- the call

def attention(q, k, v, *, precision="fp8", stage=None, scale=None, layout="bhld", out=None,
              stream=None, return_lse=False, causal=False, window=None, diagonal="bottom_right",
              q_descale=None, k_descale=None, v_descale=None, smooth_k=False):
    """ptxattn.attention(..., precision="fp8"): see the module docstring; the other arguments
    as for the bf16 path. Returns bf16 out (and float32 lse with return_lse)."""
    plan = validate(q, k, v, precision=precision, stage=stage, scale=scale, layout=layout,
                    out=out, stream=stream, return_lse=return_lse, causal=causal, window=window,
                    diagonal=diagonal, q_descale=q_descale, k_descale=k_descale,
                    v_descale=v_descale, smooth_k=smooth_k)
    return fp8_forward.run(plan)

"""The plans' steady torch runs: one Python frame from a layer's tensors to its launches.

A serving plan's run() is called once a layer, thousands of times with the same geometry,
and issue 25 gives it 10 µs of host time. After a plan's first run of torch tensors has
validated their geometry, the plan builds one of the closures below over what it validated:
the tensor type and bf16 (the torch module of that run), the device, the stream, each
tensor's shape and strides, the output's and LSE's shapes. A later run is then:
- the checks tensors.torch_ptr makes, written out once per tensor (an exact torch.Tensor,
  bf16, on the device, no requires_grad, no negative view, these strides and this shape) and
  torch's current stream: what can differ from one call to the next;
- a dict lookup on the tensors' addresses (and the fresh LSE's, workspace's): the launches
  frozen for them (fastlaunch.Frozen: every argument fixed, nothing rewritten);
- the launches, as one CUDA graph of them unless the stream is being captured (replay.py).
What depends on addresses alone (16-byte bases, a caller's output overlapping no input) is
checked once, when the plan freezes the launches of those addresses (its `freeze`, which
returns None for addresses it refuses): a lookup that hits found addresses that passed.
The checks are written out in each closure rather than called through a helper per tensor
(which would read better): a Python call costs ~0.1 µs on the H200's host, and four or six
of them would be a tenth of the target. A closure returns None for anything else, and the
plan's full path then decides (and raises its errors, in its words). Nothing here is kept
between calls but what the plan holds.
"""

from __future__ import annotations

from . import driver, replay


def prefill_run(types, device: int, stream: int, checked: tuple, lse_shape, ws_words: int,
                table_ptr, frozen: dict, freeze):
    """PrefillPlan's steady run(q, k, v, out) -> out, (out, lse) or None.

    types: tensors._torch_types() of the validating run; checked: (shape, strides) of q, k,
    v and of the output (contiguous, q's shape); lse_shape: None without the LSE; table_ptr:
    the plan's tile table (host offsets) or None (device offsets: a fresh int32 workspace of
    ws_words each run); frozen: the plan's dict of frozen launches by address tuple;
    freeze(key): the launches for a key not in it (checked and remembered there) or None."""
    tensor, bf16, raw = types[1], types[2], types[4]
    float32, int32 = types[5], types[0].int32
    current = raw if raw is not None else _public_stream(types[0])
    capturing = _capture_check(types[0], stream, device)
    (qs, qst), (ks, kst), (vs, vst), (os_, ost) = checked

    def run(q, k, v, out):
        try:
            if not (type(q) is tensor and type(k) is tensor and type(v) is tensor
                    and q.dtype is bf16 and k.dtype is bf16 and v.dtype is bf16
                    and q.is_cuda and k.is_cuda and v.is_cuda
                    and q.get_device() == device and k.get_device() == device
                    and v.get_device() == device
                    and not (q.requires_grad or k.requires_grad or v.requires_grad)
                    and not (q.is_neg() or k.is_neg() or v.is_neg())
                    and q.stride() == qst and k.stride() == kst and v.stride() == vst
                    and q.shape == qs and k.shape == ks and v.shape == vs):
                return None
            if out is not None and not (
                    type(out) is tensor and out.dtype is bf16 and out.is_cuda
                    and out.get_device() == device and not out.requires_grad
                    and not out.is_neg() and out.stride() == ost and out.shape == os_):
                return None
        except RuntimeError:             # stride() of a tensor without strides (nested, CSR)
            return None
        if current(device) != stream:
            return None
        if out is None:
            out = q.new_empty(os_)
        lse = q.new_empty(lse_shape, dtype=float32) if lse_shape is not None else None
        ws = q.new_empty((ws_words,), dtype=int32) if table_ptr is None else None
        key = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
               lse.data_ptr() if lse is not None else 0,
               table_ptr if ws is None else ws.data_ptr())
        launches = frozen.get(key)
        if launches is None:
            launches = freeze(key)
            if launches is None:
                return None
        replay.run(launches, stream, capturing)
        del ws                           # torch's caching allocator: stream-ordered
        return out if lse is None else (out, lse)

    return run


def decode_run(types, geometry, layers: dict, freeze):
    """DecodePlan's steady run(q, k_cache, v_cache, out, k, v) -> out, (out, lse) or None.

    geometry: the plan's _TorchDecode; layers: its per-layer dicts by (k_cache, v_cache)
    address, each of frozen launches by address tuple; freeze(layer, key): the launches of a
    key not in the layer's dict (checked and remembered there) or None."""
    tensor, bf16, raw = types[1], types[2], types[4]
    float32 = types[5]
    current = raw if raw is not None else _public_stream(types[0])
    device, stream = geometry.device, geometry.stream
    capturing = _capture_check(types[0], stream, device)
    (qs, qst), (cs, cst), (vcs, vcst) = geometry.q, geometry.k_cache, geometry.v_cache
    (os_, ost) = geometry.out
    new = geometry.new
    ns, nst = new if new is not None else (None, None)
    lse_shape, ws_floats = geometry.lse_shape, geometry.ws_floats

    def run(q, k_cache, v_cache, out, k, v):
        try:
            if not (type(q) is tensor and type(k_cache) is tensor and type(v_cache) is tensor
                    and q.dtype is bf16 and k_cache.dtype is bf16 and v_cache.dtype is bf16
                    and q.is_cuda and k_cache.is_cuda and v_cache.is_cuda
                    and q.get_device() == device and k_cache.get_device() == device
                    and v_cache.get_device() == device
                    and not (q.requires_grad or k_cache.requires_grad
                             or v_cache.requires_grad)
                    and not (q.is_neg() or k_cache.is_neg() or v_cache.is_neg())
                    and q.stride() == qst and k_cache.stride() == cst
                    and v_cache.stride() == vcst
                    and q.shape == qs and k_cache.shape == cs and v_cache.shape == vcs):
                return None
            if new is None:
                if k is not None or v is not None:
                    return None
            elif not (type(k) is tensor and type(v) is tensor
                      and k.dtype is bf16 and v.dtype is bf16 and k.is_cuda and v.is_cuda
                      and k.get_device() == device and v.get_device() == device
                      and not (k.requires_grad or v.requires_grad)
                      and not (k.is_neg() or v.is_neg())
                      and k.stride() == nst and v.stride() == nst
                      and k.shape == ns and v.shape == ns):
                return None
            if out is not None and not (
                    type(out) is tensor and out.dtype is bf16 and out.is_cuda
                    and out.get_device() == device and not out.requires_grad
                    and not out.is_neg() and out.stride() == ost and out.shape == os_):
                return None
        except RuntimeError:             # stride() of a tensor without strides (nested, CSR)
            return None
        layer = layers.get((k_cache.data_ptr(), v_cache.data_ptr()))
        if layer is None or current(device) != stream:
            return None
        if out is None:
            out = q.new_empty(os_)
        lse = q.new_empty(lse_shape, dtype=float32) if lse_shape else None
        ws = q.new_empty((ws_floats,), dtype=float32) if ws_floats else None
        key = (q.data_ptr(), out.data_ptr(), lse.data_ptr() if lse is not None else 0,
               ws.data_ptr() if ws is not None else 0,
               k.data_ptr() if new is not None else 0, v.data_ptr() if new is not None else 0)
        launches = layer.get(key)
        if launches is None:
            launches = freeze(layer, key)
            if launches is None:
                return None
        replay.run(launches, stream, capturing)
        del ws                           # torch's caching allocator: stream-ordered
        return out if lse is None else (out, lse)

    return run


def _capture_check(torch, stream: int, device: int):
    """A zero-argument check of whether `stream` is being captured. A closure asks it after
    checking that `stream` is torch's current stream on `device`; torch's own check (a
    runtime call, no ctypes) reads the current stream of torch's current device, so it is
    used while that device is `device`, and the driver's otherwise (and where torch's CUDA
    build lacks either call)."""
    check = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
    current = getattr(torch._C, "_cuda_getDevice", None)
    try:
        if check is None or current is None or not torch.cuda.is_available():
            raise LookupError
        check()
    except Exception:                    # noqa: BLE001 - a CPU build's stand-ins
        return lambda: driver.is_capturing(stream)

    def capturing() -> bool:
        if current() == device:
            return check()
        return driver.is_capturing(stream)
    return capturing


def _public_stream(torch):
    """torch's current raw stream through the public call (where the private one is missing)."""
    def current(device: int) -> int:
        return torch.cuda.current_stream(device).cuda_stream
    return current

"""attention_backward(q, k, v, out, lse, dout): validate, plan workspaces, launch three kernels.

The pipe, in stream order:
  1. preprocess (ptx/sm90/backward/preprocess.ptx): delta = rowsum(dO * O) and neg_lse =
     -lse * log2(e) per query row into per-call workspaces, the fp32 dQ accumulator zeroed;
  2. the main kernel (a lineage stage, or the production kernel's build for the head dim):
     dK, dV written in place, dQ / scale added into the accumulator;
  3. postprocess (ptx/sm90/backward/postprocess.ptx): dQ = scale * accumulator, to bf16.
Every workspace comes fresh for each call and is never cached: from the stream-ordered
allocator (tensors.empty), or from the caller's allocator when one is given (`allocator=`:
ptxattn.torch passes torch.empty, so that the caching allocator, and its private pool under
CUDA-graph capture, owns every byte); the deterministic mode's semaphores are zeroed on the
stream before the launch.

Everything about the arguments is checked before the first driver call (bad input gets a
ValueError/TypeError naming the argument on any machine, and nothing is written).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

from . import bwd_builds, driver, ptx, tensors, tma
# The forward's validation helpers
from .plan import LAYOUTS, _bhld, _classify
from .plan import _window as _mask_bounds
from .plan import caller_stream as _caller_stream
from .plan import qkv_dims as _qkv_dims
from .plan import scale_of as _scale_value
from .bwd_builds import CONSUMER_ROWS, Stage
from .errors import JitError, PtxattnError
from .stages import SWIZZLE_128B, ptx_root
from .tensors import BF16, DeviceArray

ENTRY = "ptxattn_bwd"
PREPROCESS = ("sm90/backward/preprocess.ptx", "ptxattn_bwd_preprocess")
POSTPROCESS = ("sm90/backward/postprocess.ptx", "ptxattn_bwd_postprocess")
STATS_ROWS_PER_CTA = 16          # rows a CTA of the pre- and postprocess (their headers)
STATS_THREADS = 128
TMA_CHUNK = 64                   # 128-byte swizzled boxes: 64 bf16 of D innermost
F32 = np.dtype(np.float32)


@dataclass
class BackwardPlan:
    """What validation learned: everything needed to launch, nothing on the GPU yet."""
    host: bool                       # NumPy in -> NumPy out
    q: object
    k: object
    v: object
    out: object
    lse: object
    dout: object
    layout: str
    batch: int
    heads: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int
    scale: float
    window: tuple[int, int]          # (left, right), -1 unbounded (causal: right 0)
    diag_offset: int                 # Lk - Lq (bottom-right) or 0 (top-left)
    deterministic: bool
    stage: Stage
    stream: int
    stream_object: object = None
    variant: str | None = None       # the production build's row of the table (None: today's)

    @property
    def masked(self) -> bool:
        return self.window != (-1, -1)

    @property
    def empty(self) -> bool:
        """No query rows, heads or batches: dq is empty, dk and dv are zeros."""
        return self.seq_q == 0 or self.heads == 0 or self.batch == 0

    @property
    def tiles(self) -> bwd_builds.Build:
        """The head dim's build (and variant): its tiles (the lineage's, at D = 128, are
        today's build's)."""
        return bwd_builds.build(self.head_dim, self.variant)

    block_m = property(lambda self: self.tiles.block_m, doc="query rows a step")
    block_n = property(lambda self: self.tiles.block_n, doc="keys a CTA")
    dq_cols = property(lambda self: self.tiles.dq_cols, doc="one consumer's dQ slice width")
    dkv_cols = property(lambda self: self.tiles.dkv_cols, doc="one consumer's dK / dV columns")

    @property
    def seq_q_pad(self) -> int:
        return bwd_builds.padded_rows(self.seq_q, self.block_m)

    @property
    def q_shape(self):
        return tma.layout_shape(self.layout, self.batch, self.heads, self.seq_q, self.head_dim)

    @property
    def kv_shape(self):
        return tma.layout_shape(self.layout, self.batch, self.heads_kv, self.seq_k, self.head_dim)


# --------------------------------------------------------------------------- validation

def _classify_lse(lse, host: bool, stream: int):
    """The log-sum-exp: float32 (B, H, Lq); NumPy float64 is rounded to float32."""
    if isinstance(lse, np.ndarray):
        tensors.refuse_masked("lse", lse)
        if not host:
            raise ValueError("lse: q, k, v are device arrays, so lse must be one too, got a "
                             "NumPy (host) array")
        if lse.dtype not in (np.float32, np.float64):
            raise TypeError(f"lse: expected dtype float32 (the forward's return_lse=True), got "
                            f"{lse.dtype}")
        return lse
    if host:
        raise ValueError(f"lse: q, k, v are NumPy (host) arrays, so lse must be one too, got "
                         f"{type(lse).__name__}")
    if isinstance(lse, DeviceArray):
        if lse.dtype != F32:
            raise TypeError(f"lse: expected dtype float32, got {lse.dtype}")
        return lse
    if not (hasattr(lse, "__dlpack__") or hasattr(lse, "__cuda_array_interface__")):
        raise TypeError(f"lse: expected a CUDA array (DLPack or __cuda_array_interface__), got "
                        f"{type(lse).__name__}")
    return tensors.as_device_array(lse, name="lse", stream=stream, dtype=F32)


def _pick(stage, plan_args: dict) -> Stage:
    chosen = bwd_builds.PRODUCTION if stage is None else bwd_builds.get_stage(stage)
    why = chosen.unsupported(**plan_args)
    if why is not None:
        name, text = why
        other = "the production kernel (stage=None) takes it" if not chosen.production \
            else "no backward kernel takes it"
        raise ValueError(f"{name}: {chosen.title} does not take {text}; {other}")
    return chosen


def _validate(q, k, v, out, lse, dout, *, scale, layout, causal, window, diagonal,
              deterministic, stream, stage, variant=None) -> BackwardPlan:
    if not isinstance(layout, str) or layout.lower() not in LAYOUTS:
        raise ValueError(f"layout: expected 'bhld' (batch, heads, seq, head_dim) or 'bshd' "
                         f"(batch, seq, heads, head_dim), got {layout!r}")
    layout = layout.lower()
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected True or False, got "
                        f"{type(deterministic).__name__}")
    if stream is None:
        stream = _caller_stream((q, k, v, out, dout))
    handle = driver.stream_handle(stream)
    kinds, arrays = {}, {}
    for name, obj in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout)):
        kinds[name], arrays[name] = _classify(name, obj, handle)
    if len(set(kinds.values())) > 1:
        where = ", ".join(f"{n} is {'a NumPy (host) array' if h else 'a device array'}"
                          for n, h in kinds.items())
        raise ValueError(f"q, k, v, out, dout: expected all NumPy (host) arrays or all device "
                         f"arrays; {where}")
    host = kinds["q"]
    arrays["lse"] = _classify_lse(lse, host, handle)

    dims = _qkv_dims({n: arrays[n] for n in ("q", "k", "v")}, layout)
    (b, h, lq, d), (bk, hk, lk, dk) = dims["q"], dims["k"]
    for name in ("out", "dout"):
        if _bhld(name, arrays[name].shape, layout) != dims["q"]:
            raise ValueError(f"{name}: expected q's shape {tuple(arrays['q'].shape)} (the "
                             f"forward's output, layout {layout!r}), got "
                             f"{tuple(arrays[name].shape)}")
    if tuple(arrays["lse"].shape) != (b, h, lq):
        raise ValueError(f"lse: expected shape (batch, heads, seq_q) = {(b, h, lq)} (the "
                         f"forward's return_lse=True), got {tuple(arrays['lse'].shape)}")
    if lk == 0:
        raise ValueError("k: key length is 0; attention over no keys is undefined "
                         "(softmax of an empty row)")
    left, right = _mask_bounds(causal, window, diagonal)
    if not host:
        devices = {n: a.device for n, a in arrays.items() if a.device is not None}
        if len(set(devices.values())) > 1:
            raise ValueError("q, k, v, out, lse, dout: expected arrays on one device, got "
                             + ", ".join(f"{n} on CUDA device {dv}" for n, dv in devices.items()))
    empty = lq == 0 or h == 0 or b == 0
    chosen = _pick(stage, dict(head_dim=d, seq_q=lq, seq_k=lk, gqa=hk != h,
                               masked=(left, right) != (-1, -1), deterministic=deterministic))
    if variant is not None:
        if not chosen.production:
            raise ValueError(f"variant: build variants are the production kernel's; "
                             f"{chosen.title} has none (got variant={variant!r})")
        row = bwd_builds.build(d, variant)       # a ValueError naming the variant, or its row
        if deterministic and not row.deterministic:
            raise ValueError(f"variant: {variant!r} adds dQ from the consumers' registers in no "
                             f"fixed order, so it cannot run deterministic=True; give "
                             f"deterministic=False or another variant")
    if chosen.production and d in bwd_builds.HEAD_DIMS:
        variant = bwd_builds.chosen_variant(d, deterministic, variant)
    plan = BackwardPlan(host, arrays["q"], arrays["k"], arrays["v"], arrays["out"],
                        arrays["lse"], arrays["dout"], layout, b, h, hk, lq, lk, d,
                        _scale_value(scale, d), (left, right),
                        lk - lq if diagonal == "bottom_right" else 0, deterministic, chosen,
                        handle, stream, variant)
    if not host and not empty:
        for name, heads, seq, rows in (("q", h, lq, plan.block_m), ("k", hk, lk, plan.block_n),
                                       ("v", hk, lk, plan.block_n), ("out", h, lq, 64),
                                       ("dout", h, lq, plan.block_m)):
            arr = arrays[name]
            tma.check_base(arr.ptr, name)
            tma.map_geometry(layout, b, heads, seq, d, rows, TMA_CHUNK, arr.strides, name)
        if any(s <= 0 for n, s in zip(plan.lse.shape, plan.lse.strides) if n > 1):
            raise ValueError(f"lse: strides must be positive, got {plan.lse.strides}")
        if plan.lse.ptr % 4:
            raise ValueError(f"lse: base address 0x{plan.lse.ptr:x} is not 4-byte aligned")
    return plan


# --------------------------------------------------------------------------- kernels

_FUNCTIONS: dict[tuple, driver.Function] = {}
_FUNCTIONS_LOCK = threading.RLock()


def source(file: str, defines: dict | None = None) -> ptx.Expanded:
    """The expanded PTX of a backward file (includes from ptx/sm90/include)."""
    path = ptx_root() / file
    if not path.is_file():
        raise FileNotFoundError(f"backward kernel {file}: no PTX file at {path}")
    return ptx.expand_file(path, [path.parent.parent / "include"], defines)


def kernel(file: str, entry: str, defines: dict | None = None, smem_bytes: int = 0):
    """One backward kernel, JIT-compiled once per (device, file, defines)."""
    ctx = driver.context()
    key = (ctx.ordinal, file, tuple(sorted((defines or {}).items())))
    function = _FUNCTIONS.get(key)
    if function is not None:
        return function
    with _FUNCTIONS_LOCK:
        if key not in _FUNCTIONS:
            expanded = source(file, defines)
            label = file + "".join(f" -D{k}={v}" for k, v in sorted((defines or {}).items()))
            try:
                module = driver.load_module(expanded.text, label)
            except JitError as exc:
                annotated, where = ptx.annotate(expanded, exc.log)
                raise JitError(exc.label, exc.result, exc.log, annotated, where) from None
            function = module.function(entry)
            function.set_max_dynamic_smem(smem_bytes)
            _FUNCTIONS[key] = function
        return _FUNCTIONS[key]


def defines_for(plan_or_stage, head_dim: int | None = None, masked: bool = False,
                variant: str | None = None) -> dict:
    """The preprocessor defines of a main-kernel build (the production kernel: per head dim,
    mask and build-table variant; a lineage stage: none)."""
    stage = plan_or_stage.stage if isinstance(plan_or_stage, BackwardPlan) else plan_or_stage
    if isinstance(plan_or_stage, BackwardPlan):
        head_dim, masked = plan_or_stage.head_dim, plan_or_stage.masked
        variant = plan_or_stage.variant
    if not stage.production:
        return {}
    return {"HEAD_DIM": str(head_dim), **({"PTXATTN_MASKED": "1"} if masked else {}),
            **bwd_builds.build(head_dim, variant).defines}


# --------------------------------------------------------------------------- launch

def _strides(layout: str, arr) -> tuple[int, int, int]:
    """(row, head, batch) element strides of a 4-D array in `layout`."""
    b, h, r, _ = tma.bhl_strides(layout, arr.shape, arr.strides)
    return r, h, b


def _kv_store_map(ptr, plan: BackwardPlan, strides, name):
    """dK / dV: a box of one consumer's 64 rows x its columns (all of D, or half at D = 256)."""
    geo = tma.map_geometry(plan.layout, plan.batch, plan.heads_kv, plan.seq_k, plan.head_dim,
                           CONSUMER_ROWS, TMA_CHUNK, strides, name)
    box = (TMA_CHUNK, CONSUMER_ROWS, plan.dkv_cols // TMA_CHUNK, 1, 1)
    tma.check_base(ptr, name)
    return tma._encode(int(ptr), geo["dims"], geo["strides"], box, SWIZZLE_128B, TMA_CHUNK, name)


class PreparedBackward:
    """One backward call with its device buffers, maps and three launches built.

    launch() enqueues all three; the tests also run them one at a time (launch_preprocess,
    launch_main, launch_postprocess) and read the workspaces (neg_lse, delta, dq_accum)."""

    def __init__(self, plan: BackwardPlan):
        self.plan = plan
        self.stage = plan.stage
        self._specs: list = []
        self._keep: list = []
        self._owned: list = []
        self.dq = self.dk = self.dv = None
        self.results = None           # what attention_backward returns: DeviceArrays, or the
                                      # caller's allocator's arrays
        self.neg_lse = self.delta = self.dq_accum = self.semaphores = None

    # -- the three launches
    def launch_preprocess(self) -> None:
        if self.semaphores is not None:
            driver.memset_u8(self.semaphores.ptr, 0, self.semaphores.nbytes,
                             stream=self.plan.stream)
        self._specs[0]()

    def launch_main(self) -> None:
        self._specs[1]()

    def launch_postprocess(self) -> None:
        self._specs[2]()

    def launch(self) -> None:
        if not self._specs:
            return
        self.launch_preprocess()
        self.launch_main()
        self.launch_postprocess()

    def close(self) -> None:
        """Free what this object allocated (NumPy inputs' copies, workspaces; outputs only on
        the NumPy path, after they were copied out). Synchronizes first."""
        driver.synchronize(self.plan.stream)
        for array in self._owned:
            array.free()
        self._owned = []
        self._specs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _empty_result(plan: BackwardPlan, allocate):
    """dq empty; dk, dv zero: no query row attends, so no key gets a gradient. (arrays,
    objects): the DeviceArrays and what the caller gets (the allocator's objects, if any)."""
    if plan.host:
        result = (np.zeros(plan.q_shape, BF16), np.zeros(plan.kv_shape, BF16),
                  np.zeros(plan.kv_shape, BF16))
        return result, result
    arrays = [allocate(plan.q_shape, BF16)]
    for _ in range(2):
        x = allocate(plan.kv_shape, BF16)
        if x[0].size:
            driver.memset_u16(x[0].ptr, 0, x[0].size, stream=plan.stream)
        arrays.append(x)
    return tuple(a for a, _ in arrays), tuple(o for _, o in arrays)


def _allocator_of(plan: BackwardPlan, allocator):
    """allocate(shape, dtype) -> (DeviceArray, what the caller gets back): fresh memory for
    one call, from `allocator` (the caller's, e.g. torch.empty) or stream-ordered
    (tensors.empty, freed on the stream when the array goes)."""
    if allocator is None or plan.host:
        def allocate(shape, dtype):
            if not math.prod(shape) and not plan.host:
                x = DeviceArray(0, shape, device=plan.q.device, dtype=dtype)
            else:
                x = tensors.empty(shape, stream=plan.stream, dtype=dtype,
                                  stream_owner=None if plan.host else plan.stream_object)
            x.stream = plan.stream
            return x, x
        return allocate

    def allocate(shape, dtype):
        obj = allocator(tuple(shape), np.dtype(dtype))
        name = f"allocator({tuple(shape)}, {np.dtype(dtype).name})"
        x = tensors.as_device_array(obj, name=name, stream=plan.stream, dtype=dtype)
        if tuple(x.shape) != tuple(shape) or not x.is_contiguous or x.dtype != np.dtype(dtype):
            raise ValueError(f"allocator: expected a contiguous {np.dtype(dtype).name} array "
                             f"of shape {tuple(shape)}, got {x.dtype} {tuple(x.shape)} strides "
                             f"{x.strides}")
        if x.size and x.ptr % 16:
            raise ValueError(f"allocator: the array at 0x{x.ptr:x} is not 16-byte aligned")
        if x.device is not None and plan.q.device is not None and x.device != plan.q.device:
            raise ValueError(f"allocator: gave an array on CUDA device {x.device}, q is on "
                             f"{plan.q.device}")
        return x, obj
    return allocate


def _inputs_on_stream(plan: BackwardPlan, ctx) -> tuple:
    """Device inputs: on this context's device, their pending writes ordered before us."""
    out = []
    for name in ("q", "k", "v", "out", "lse", "dout"):
        arr = getattr(plan, name)
        if plan.host:
            host = np.ascontiguousarray(arr.astype(np.float32) if name == "lse" else arr)
            if name == "lse":
                dev = tensors.empty(host.shape, stream=plan.stream, dtype=F32)
                driver.memcpy_htod(dev.ptr, host, stream=plan.stream)
                dev.staging = host
            else:
                dev = tensors.from_numpy(host, stream=plan.stream)
            out.append(dev)
            continue
        if arr.device is None:
            arr.device = driver.pointer_device(arr.ptr)
        if arr.device != ctx.ordinal:
            raise ValueError(f"{name}: on CUDA device {arr.device}, but ptxattn runs on "
                             f"device {ctx.ordinal} (set PTXATTN_DEVICE={arr.device})")
        pending = arr.producer_stream if arr.producer_stream is not None else arr.stream
        if pending is not None and pending != plan.stream:
            driver.stream_wait(plan.stream, pending)
        arr.used_on(plan.stream)
        out.append(arr)
    return tuple(out)


def build(plan: BackwardPlan, allocator=None) -> PreparedBackward:
    """Device buffers, tensor maps, parameters and the three launch specs of a plan.
    allocator: see prepare_backward."""
    prepared = PreparedBackward(plan)
    allocate = _allocator_of(plan, allocator)
    if plan.empty:
        (prepared.dq, prepared.dk, prepared.dv), prepared.results = _empty_result(plan, allocate)
        return prepared
    ctx = driver.context()
    stage, defines = plan.stage, defines_for(plan)
    smem = stage.smem_for(plan.head_dim, plan.variant)
    if smem > ctx.max_smem_optin:
        raise PtxattnError(f"{stage.label} needs {smem} bytes of shared memory per CTA; this "
                           f"GPU allows {ctx.max_smem_optin}")
    # The JIT first: when it fails, nothing is allocated yet.
    main = kernel(stage.file, ENTRY, defines, smem)
    pre = kernel(*PREPROCESS)
    post = kernel(*POSTPROCESS, plan.tiles.postprocess_defines or None)
    stream = plan.stream
    q, k, v, out, lse, dout = _inputs_on_stream(plan, ctx)
    if plan.host:
        prepared._owned += [q, k, v, out, lse, dout]
    B, H, Hkv, Lq, Lk, D = (plan.batch, plan.heads, plan.heads_kv, plan.seq_q, plan.seq_k,
                            plan.head_dim)
    Lq_pad = plan.seq_q_pad

    (dq, dq_obj), (dk, dk_obj), (dv, dv_obj) = (allocate(plan.q_shape, BF16),
                                                allocate(plan.kv_shape, BF16),
                                                allocate(plan.kv_shape, BF16))
    neg_lse, delta = allocate((B, H, Lq_pad), F32)[0], allocate((B, H, Lq_pad), F32)[0]
    accum = allocate((B, H, Lq_pad, D), F32)[0]
    sem = allocate((B, H, Lq_pad // plan.block_m), F32)[0] if plan.deterministic else None
    prepared.dq, prepared.dk, prepared.dv = dq, dk, dv
    prepared.results = (dq_obj, dk_obj, dv_obj)
    prepared.neg_lse, prepared.delta, prepared.dq_accum = neg_lse, delta, accum
    prepared.semaphores = sem
    if allocator is None or plan.host:      # ours: close() frees them
        prepared._owned += [neg_lse, delta, accum] + ([sem] if sem is not None else [])
    else:                                   # the caller's: referenced until the call is done
        prepared._keep.append((neg_lse, delta, accum, sem))
    if plan.host:
        prepared._owned += [dq, dk, dv]

    # 1. preprocess
    o_r, o_h, o_b = _strides(plan.layout, out)
    do_r, do_h, do_b = _strides(plan.layout, dout)
    l_b, l_h, l_r = (s if n > 1 else c for n, s, c in
                     zip(lse.shape, lse.strides, tma.contiguous_strides(lse.shape)))
    U64, U32 = driver.U64, driver.U32
    pre_params = ((out.ptr, o_r, o_h, o_b, dout.ptr, do_r, do_h, do_b, lse.ptr, l_r, l_h, l_b,
                   neg_lse.ptr, delta.ptr, accum.ptr, Lq, Lq_pad, H, D),
                  (driver.PTR, U64, U64, U64, driver.PTR, U64, U64, U64, driver.PTR, U64, U64,
                   U64, driver.PTR, driver.PTR, driver.PTR, U32, U32, U32, U32))
    stats_grid = (Lq_pad // STATS_ROWS_PER_CTA, H, B)
    specs = [driver.LaunchSpec(pre, stats_grid, (STATS_THREADS, 1, 1), 0, pre_params,
                               stream=stream)]

    # 2. the main kernel
    def qkv_map(name, arr, heads, seq, rows):
        return tma.encode_qkvo_map(arr.ptr, plan.layout, B, heads, seq, D, rows, SWIZZLE_128B,
                                   TMA_CHUNK, arr.strides, name=name)

    maps = (qkv_map("q", q, H, Lq, plan.block_m), qkv_map("k", k, Hkv, Lk, plan.block_n),
            qkv_map("v", v, Hkv, Lk, plan.block_n), qkv_map("dout", dout, H, Lq, plan.block_m),
            _kv_store_map(dk.ptr, plan, dk.strides, "dk"),
            _kv_store_map(dv.ptr, plan, dv.strides, "dv"))
    values = (*maps, neg_lse.ptr, delta.ptr, accum.ptr, Lq, Lq_pad, Lk, H, B, plan.scale)
    types = (driver.BY_VALUE,) * 6 + (driver.PTR,) * 3 + (U32,) * 5 + (driver.F32,)
    if stage.production:
        # an unbounded window side as Lq + Lk: as good as infinite, and no s32 overflow
        left, right = (Lq + Lk if x < 0 else min(x, Lq + Lk) for x in plan.window)
        values += (H // Hkv, plan.diag_offset, left, right, sem.ptr if sem is not None else 0)
        types += (U32, driver.S32, driver.S32, driver.S32, driver.PTR)
    grid = (-(-Lk // plan.block_n), Hkv, B)
    specs.append(driver.LaunchSpec(main, grid, (stage.threads, 1, 1), smem, (values, types),
                                   stream=stream))
    prepared._keep.append(maps)

    # 3. postprocess
    d_r, d_h, d_b = _strides(plan.layout, dq)
    post_params = ((accum.ptr, dq.ptr, d_r, d_h, d_b, Lq, Lq_pad, H, D,
                    plan.block_m.bit_length() - 1, plan.dq_cols.bit_length() - 1, plan.scale),
                   (driver.PTR, driver.PTR, U64, U64, U64, U32, U32, U32, U32, U32, U32,
                    driver.F32))
    specs.append(driver.LaunchSpec(post, stats_grid, (STATS_THREADS, 1, 1), 0, post_params,
                                   stream=stream))
    prepared._specs = specs
    prepared._keep.append((q, k, v, out, lse, dout))
    return prepared


def prepare_backward(q, k, v, out, lse, dout, *, scale=None, layout: str = "bhld",
                     causal: bool = False, window=None, diagonal: str = "bottom_right",
                     deterministic: bool = False, stream=None, stage=None,
                     allocator=None, variant=None) -> PreparedBackward:
    """Validate, copy NumPy inputs in, allocate outputs and workspaces, build the launches.
    Arguments as for attention_backward; stage=None is the production kernel, "b1".. a
    lineage stage (head dim 128, no mask, no GQA, Lq % 64 == 0, Lk % 128 == 0).

    variant: a row of the production kernel's build table other than today's (a name in
    bwd_builds.VARIANT_NAMES, e.g. "qsplit" at head dim 256), for measuring it against
    today's build in one process; None (or "default") is today's build.

    allocator(shape, dtype) -> array: for device inputs, where dq, dk, dv and every workspace
    come from (dtype a NumPy dtype: bfloat16 or float32; the array contiguous, 16-byte
    aligned, a DLPack or __cuda_array_interface__ producer on q's device, e.g.
    `lambda shape, dtype: torch.empty(shape, dtype=..., device=q.device)`). It is called for
    this call only; nothing it returns is kept past the prepared call. None: stream-ordered
    memory of the library's own (tensors.empty). Ignored for NumPy inputs."""
    return build(_validate(q, k, v, out, lse, dout, scale=scale, layout=layout, causal=causal,
                           window=window, diagonal=diagonal, deterministic=deterministic,
                           stream=stream, stage=stage, variant=variant), allocator)


def attention_backward(q, k, v, out, lse, dout, *, scale=None, layout: str = "bhld",
                       causal: bool = False, window=None, diagonal: str = "bottom_right",
                       deterministic: bool = False, stream=None, allocator=None):
    """(dq, dk, dv): the gradients of attention(q, k, v, ...) for an upstream gradient dout.

    out and lse are what the forward returned with return_lse=True (lse: float32 (B, H, Lq),
    natural log); every other argument means what it means for ptxattn.attention, and must be
    what the forward was called with. dq has q's shape, dk and dv k's and v's (B, Hkv, Lk, D)
    in `layout`: GQA/MQA gradients are summed over each group's query heads. A query row that
    sees no key gives dq = 0 and nothing to dk and dv.

    NumPy in -> NumPy out (bf16 arrays; float32/float64 rounded to bf16 as in attention(),
    lse float32 or float64); DLPack / __cuda_array_interface__ in -> DeviceArrays out,
    launched asynchronously on `stream` (None: the inputs' framework's current stream).
    deterministic=True adds dQ in a fixed order (a semaphore per query block): gradients are
    bit-for-bit equal across runs, at some cost in speed.
    allocator= (device inputs): the caller's allocator for the outputs and workspaces (see
    prepare_backward); the outputs then come back as its arrays (e.g. torch tensors)."""
    prepared = prepare_backward(q, k, v, out, lse, dout, scale=scale, layout=layout,
                                causal=causal, window=window, diagonal=diagonal,
                                deterministic=deterministic, stream=stream, allocator=allocator)
    if prepared.plan.host and not prepared.plan.empty:
        try:
            prepared.launch()
            result = tuple(x.to_numpy() for x in (prepared.dq, prepared.dk, prepared.dv))
        finally:
            try:
                prepared.close()
            except Exception:
                pass
        return result
    prepared.launch()
    return prepared.results

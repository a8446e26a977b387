"""Launch and ABI: from a validated Plan to a queued cuLaunchKernelEx.

The kernel (JIT-compiled once per device and build), the caller's arrays made ready on the
launch stream, the tensor maps, the parameters packed after one table (params_of below: the
kernel's `.param` list, which tests/test_launch_params.py checks in every kernel's PTX), and
the launch geometry. target() is the device's side of the kernel choice; build() does the rest.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass

import numpy as np

from . import driver, kv_multicast, tensors, tma
from .choice import pick_stage, specialized
from .errors import PtxattnError
from .plan import Plan
from .stages import ENTRY, Stage
from .tensors import DeviceArray, to_bf16

# A testing knob: cap the grid of persistent stages (e.g. 2), so that each CTA walks several
# tiles even at a small shape (compute-sanitizer runs, bench/sanitize.sh). Read by target().
PERSISTENT_CTAS_ENV = "PTXATTN_PERSISTENT_CTAS"
UNBOUNDED = 1 << 30              # an unbounded window side, as the kernel reads it


# --------------------------------------------------------------------------- the parameter table

@dataclass(frozen=True)
class Param:
    """One kernel parameter: its name in the PTX `.param` list, how the host passes it (a
    driver ctype; driver.BY_VALUE is a CUtensorMap's 128 bytes, copied by the driver) and its
    PTX declaration (`.param <ptx> <name>`, an array's length as `[n]`)."""
    name: str
    ctype: object
    ptx: str


def _tensor_map(name: str) -> Param:
    # .param .align 64 .b8 tmap_q[128], read through cvta.param as a TMA operand
    return Param(name, driver.BY_VALUE, ".align 64 .b8[128]")


# The parameters every kernel takes, in order (ptx/sm90/README.md, "Kernel ABI").
LINEAGE_PARAMS: tuple[Param, ...] = (
    _tensor_map("tmap_q"), _tensor_map("tmap_k"), _tensor_map("tmap_v"), _tensor_map("tmap_o"),
    Param("o_ptr", driver.PTR, ".u64"),            # O's base (epilogues that store per thread)
    Param("o_row_stride", driver.U64, ".u64"),     # O's strides in elements
    Param("o_head_stride", driver.U64, ".u64"),
    Param("o_batch_stride", driver.U64, ".u64"),
    Param("seq_q", driver.U32, ".u32"),
    Param("seq_k", driver.U32, ".u32"),
    Param("heads", driver.U32, ".u32"),
    Param("batch", driver.U32, ".u32"),
    Param("softmax_scale", driver.F32, ".f32"),
)
# What the production kernel takes after them.
PRODUCTION_PARAMS: tuple[Param, ...] = (
    Param("heads_per_kv", driver.U32, ".u32"),     # GQA group: query heads per K/V head
    Param("lse_ptr", driver.U64, ".u64"),          # float32 (B, H, Lq) log-sum-exp, or 0: none
    Param("diag_offset", driver.S32, ".s32"),      # Lk - Lq (bottom-right) or 0 (top-left)
    Param("window_left", driver.S32, ".s32"),      # the keys row r sees: [r + diag - left,
    Param("window_right", driver.S32, ".s32"),     #   r + diag + right]; UNBOUNDED: no edge
)
# What the production kernel's builds but the varlen one take after those: the tile walk's
# section in (batch, head) pairs (include/tile_walk.ptxh; the host's: tile_walk.host_section).
WALK_SECTION = Param("walk_section", driver.U32, ".u32")
# What the production kernel's varlen build (PTXATTN_VARLEN: flash_attn_varlen_func) takes
# after those: the tile table varlen_tiles.ptx wrote (scheduler.ptxh) and q's rows (the LSE's
# row stride, (heads, total_q)).
VARLEN_PARAMS: tuple[Param, ...] = (
    Param("tiles_ptr", driver.PTR, ".u64"),
    Param("total_q", driver.U32, ".u32"),
)
# What its paged build (PTXATTN_PAGED: block_table=) takes after those: the int32 block table
# (its row stride in entries, the entries a row holds), the pool's pages, log2 of a page's rows,
# and the check-bounds report (0: none; kv_paged.ptxh).
PAGED_PARAMS: tuple[Param, ...] = (
    Param("block_table_ptr", driver.PTR, ".u64"),
    Param("bt_row_stride", driver.U32, ".u32"),
    Param("max_pages", driver.U32, ".u32"),
    Param("num_pages", driver.U32, ".u32"),
    Param("page_shift", driver.U32, ".u32"),
    Param("bounds_ptr", driver.PTR, ".u64"),
)
# A dynamic tile scheduler's two u32 counters (Stage.dynamic_tiles), after the rest.
TILE_COUNTER = Param("tile_counter", driver.PTR, ".u64")
COUNTER_BYTES = 8
# A traced build's event buffer (PTXATTN_TRACE: the TRACE_PARAM macro), always last; passed by
# the tool that records it (tools/trace.py) as one of prepare()'s extra_params.
TRACE_BUF = Param("trace_buf", driver.PTR, ".u64")


def params_of(stage: Stage) -> tuple[Param, ...]:
    """The parameter list of a kernel's launch, in order (a build variant's extra_params, the
    trace buffer, come after it)."""
    return (LINEAGE_PARAMS + (PRODUCTION_PARAMS if stage.production else ())
            + ((WALK_SECTION,) if stage.production and not stage.varlen else ())
            + (VARLEN_PARAMS if stage.varlen else ())
            + (PAGED_PARAMS if stage.paged else ())
            + ((TILE_COUNTER,) if stage.dynamic_tiles else ()))


@functools.lru_cache(maxsize=64)
def slot(params: tuple[Param, ...], name: str) -> int:
    """Where the parameter `name` sits in `params` (ValueError when it is not there)."""
    for i, param in enumerate(params):
        if param.name == name:
            return i
    raise ValueError(f"{name}: not a parameter of this kernel "
                     f"({', '.join(p.name for p in params)})")


def pack(params: tuple[Param, ...], values: dict) -> tuple[tuple, tuple]:
    """The tuple form ((values...), (types...)) of kernelParams: `values` by name, in the
    table's order. Every parameter needs a value, and every value a parameter."""
    if len(values) != len(params) or any(p.name not in values for p in params):
        names = {p.name for p in params}
        missing = [p.name for p in params if p.name not in values]
        stray = [name for name in values if name not in names]
        raise ValueError(f"kernel parameters: missing {missing}, not in the table {stray}")
    return tuple(values[p.name] for p in params), tuple(p.ctype for p in params)


# --------------------------------------------------------------------------- a prepared call

class PreparedAttention:
    """One attention call with device buffers, tensor maps and parameters built.

    `launch()` only enqueues cuLaunchKernelEx (what a benchmark times between
    events); `out` is the DeviceArray the kernel writes.
    """

    def __init__(self, plan: Plan, stage: Stage, out: DeviceArray, spec=None, keep=(),
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
        self.abi = ()                         # its parameters (params_of), by build()
        self._steady = None                   # set by build(): see fastpath.Steady

    def launch(self) -> None:
        if self._spec is not None:
            if threading.get_ident() != self._thread:
                # another thread than the one that prepared it: make the context current here
                driver.context()
            self._spec()

    def close(self) -> None:
        """Free the device memory this object allocated (NumPy inputs' copies, an output it
        made, the tile counter) now rather than at garbage collection; the caller's own
        arrays are never touched. Synchronizes first: a queued launch may still use it."""
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


# --------------------------------------------------------------------------- the kernel

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


# --------------------------------------------------------------------------- the build

@dataclass(frozen=True)
class Target:
    """Where and what a plan runs: the context, the build of the kernel for its device, and
    the PTXATTN_PERSISTENT_CTAS cap (None: the SM count)."""
    ctx: object
    stage: Stage
    ctas_cap: int | None


def empty(plan: Plan) -> PreparedAttention:
    """A plan with nothing to compute: an empty output (and LSE), no launch, no driver."""
    device = None if plan.host else plan.q.device
    out = plan.out if isinstance(plan.out, DeviceArray) else DeviceArray(
        0, plan.out_shape, device=device)
    lse = None
    if plan.want_lse:
        lse = plan.lse_out if isinstance(plan.lse_out, DeviceArray) else DeviceArray(
            0, plan.lse_shape, device=device, dtype=np.float32)
    return PreparedAttention(plan, plan.stage, out, lse=lse)


def target(plan: Plan) -> Target:
    """The kernel choice made again with the device known (its compute capability), and the
    production build for this call. Validation chose without the device; a Blackwell GPU
    runs another lineage, which api.prepare() checks (selfcheck) before its first launch."""
    cap = persistent_ctas()
    ctx = driver.context()
    stage = pick_stage(plan.stage if plan.stage_requested else None, plan.head_dim,
                       plan.seq_q, plan.seq_k, ctx.compute_capability,
                       gqa=plan.heads_kv != plan.heads, lse=plan.want_lse, masked=plan.masked)
    stage = specialized(stage, plan.head_dim, plan.masked)   # the production build for this call
    return Target(ctx, stage, cap)


def build(plan: Plan, where: Target, defines=None, extra_params=(),
          walk_rule: str = "l2-walk") -> PreparedAttention:
    """JIT (once), the caller's arrays ready on the stream, maps, parameters, geometry.

    defines and extra_params are a build variant's, walk_rule the production walk's section
    rule (tile_walk.WALKS; a measurement's, tools: see api.prepare)."""
    ctx = where.ctx
    stage = where.stage.with_defines(defines)     # a bf16 measurement variant's own tile
    # the K/V multicast build (a measurement's): refused before anything is compiled or touched
    multicast = kv_multicast.requested(defines)
    if multicast:
        kv_multicast.check(plan, stage, defines)
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
    values = dict(tmap_q=maps[0], tmap_k=maps[1], tmap_v=maps[2], tmap_o=maps[3],
                  o_ptr=out.ptr, o_row_stride=o_row, o_head_stride=o_head,
                  o_batch_stride=o_batch, seq_q=Lq, seq_k=Lk, heads=H, batch=B,
                  softmax_scale=plan.scale)
    keep = [q, k, v, maps]
    lse = None
    if plan.want_lse and plan.lse_out is not None and not plan.host:
        lse = plan.lse_out                  # the caller's buffer (lse_out=): its allocator
        pending = lse.producer_stream if lse.producer_stream is not None else lse.stream
        if pending is not None and pending != stream:
            driver.stream_wait(stream, pending)
        lse.used_on(stream)
    elif plan.want_lse:
        lse = tensors.empty(plan.lse_shape, stream=stream, dtype=np.float32,
                            stream_owner=plan.stream_object)
        owned += (lse,)
    if lse is not None:
        lse.stream = stream
    if stage.production:
        # GQA group size, where the log-sum-exp goes (0: not wanted), the diagonal and the
        # window (read by the masked build only)
        # A side of 2^30 or more is unbounded too (no length reaches it): passed as is, a side
        # near 2^31 overflows the kernel's s32 key arithmetic, and one past it wraps in the
        # s32 parameter, and keys that rows must see are dropped without an error.
        left, right = (UNBOUNDED if x < 0 else min(x, UNBOUNDED) for x in plan.window)
        values.update(heads_per_kv=H // Hkv, lse_ptr=lse.ptr if lse is not None else 0,
                      diag_offset=plan.diag_offset, window_left=left, window_right=right)
    cap = where.ctas_cap
    ctas = ctx.sm_count if cap is None else min(ctx.sm_count, cap)
    cluster, grid = stage.cluster, None
    if multicast:
        # clusters of two CTAs walk tile pairs: the grid is 2 x the clusters that run at once
        pairs = B * H * (-(-Lq // stage.block_m) // 2)
        n = kv_multicast.clusters(pairs, driver.max_active_clusters(
            function, (stage.threads, 1, 1), stage.smem_bytes, kv_multicast.CLUSTER, stream),
            cap)
        cluster, grid, ctas = kv_multicast.CLUSTER, (2 * n, 1, 1), n
    if stage.production and not stage.varlen:
        values["walk_section"] = walk_section(plan, stage, ctx, ctas, walk_rule,
                                              pairs=multicast)
    if stage.dynamic_tiles:
        # the dynamic tile scheduler's two u32 counters: zero before the first launch, and
        # the kernel's last CTA resets them, so every later launch of this object (all on its
        # stream, in order) finds zeros. This object's own, as its out is: stream-ordered
        # memory of its stream, freed there. attention()'s remembered calls never reuse it
        # (fastpath: a fresh counter per call).
        counter = driver.DeviceBuffer(COUNTER_BYTES, stream=stream,
                                      stream_owner=plan.stream_object)
        driver.memset_u8(counter.ptr, 0, COUNTER_BYTES, stream=stream)
        values["tile_counter"] = counter.ptr
        keep.append(counter)
    abi = params_of(stage)
    args, types = pack(abi, values)
    # Parameters a build variant adds after the table's (e.g. trace_buf with PTXATTN_TRACE).
    args += tuple(value for value, _ in extra_params)
    types += tuple(ctype for _, ctype in extra_params)
    grid = grid or stage.grid(B, H, Lq, ctas)
    spec = driver.LaunchSpec(function, grid, (stage.threads, 1, 1), stage.smem_bytes,
                             (args, types), cluster=cluster, stream=stream)
    prepared = PreparedAttention(plan, stage, out, spec, keep=tuple(keep), owned=owned, lse=lse)
    prepared.abi = abi
    # What a steady call (the fast path of attention(), fastpath.py) replaces per call: the O
    # map and pointer (tmap_o, o_ptr: a fresh output each call) and the LSE pointer (lse_ptr).
    prepared._steady = (ctx, (plan.layout, B, H, Lq, D, stage.q_box_rows, stage.swizzle,
                              stage.tma_chunk, out.strides, "out"), lse is not None)
    return prepared


def walk_section(plan: Plan, stage: Stage, ctx, ctas: int, rule: str = "l2-walk",
                 pairs: bool = False) -> int:
    """The production walk's section for this call (tile_walk.host_section): from the plan's
    shape and mask, the build's tiles, this device's L2 size and its CTAs at most. pairs: the
    K/V multicast build's walk over tile pairs (ctas: its clusters)."""
    from .tile_walk import Problem, host_section
    window = plan.window if plan.masked else None
    problem = Problem(plan.batch, plan.heads, plan.seq_q, plan.seq_k, plan.head_dim,
                      plan.heads_kv, window, stage.block_m, stage.block_n)
    if pairs:
        problem = kv_multicast.pair_problem(problem)
    return host_section(problem, getattr(ctx, "l2_bytes", None), ctas, rule)

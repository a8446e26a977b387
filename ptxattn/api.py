"""The public API: attention(q, k, v) and prepare(q, k, v) -> PreparedAttention.

A call's path: fastpath.steady_call (a launch remembered for exactly these arguments is
replayed), else plan.validate (the arguments, read into a Plan, before any driver call) ->
launch.target (the device's kernel choice and build) -> a first-use self-check for a lineage
never run here (selfcheck) -> launch.build (JIT once, maps, parameters) -> launch; then
fastpath.remember. docs/ARCHITECTURE.md draws it.
"""

from __future__ import annotations

import dataclasses

from . import launch, selfcheck, stages
from .fastpath import remember, steady_call
from .launch import PreparedAttention
from .plan import Plan, check_device_geometry, validate
from .stages import Stage

__all__ = ["attention", "prepare", "PreparedAttention"]


def attention(q, k, v, *, stage=None, scale=None, layout: str = "bhld", out=None, stream=None,
              return_lse: bool = False, causal: bool = False, window=None,
              diagonal: str = "bottom_right", lse_out=None, precision: str = "bf16",
              q_descale=None, k_descale=None, v_descale=None, smooth_k: bool = False):
    """softmax(scale * q k^T + mask) v, bf16 in and out, fp32 accumulation.

    precision="fp8" runs the FP8 (e4m3) forward instead (ptxattn/fp8.py): bf16 inputs are
    quantized inside, or e4m3 inputs come with q_descale, k_descale, v_descale (float32
    (batch, heads_kv), FlashAttention-3's convention); smooth_k subtracts K's per-channel mean
    before quantizing. It trades ~5% relative error for up to twice the tensor rate.

    q: (B, H, Lq, D), k and v: (B, Hkv, Lk, D) for layout "bhld"; (B, L, H, D) for "bshd".
    Any lengths Lq, Lk >= 1; Hkv divides H (grouped-query / multi-query attention: query
    head h reads k/v head h // (H // Hkv)). return_lse=True returns (out, lse), lse float32
    of shape (B, H, Lq): the natural log of sum_j exp(scale * q.k_j) per query row;
    lse_out= (with return_lse=True) is the caller's contiguous float32 (B, H, Lq) array for
    it (a NumPy array for NumPy inputs), written and returned, so that nothing is allocated
    by the library when out= is given too (CUDA-graph capture).

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
    if (precision != "bf16" or smooth_k is not False
            or any(x is not None for x in (q_descale, k_descale, v_descale))):
        if lse_out is not None:
            raise ValueError("lse_out: the FP8 path (precision='fp8', descales, smooth_k) "
                             "returns its LSE in a new array; pass lse_out=None")
        from . import fp8
        return fp8.attention(q, k, v, precision=precision, stage=stage, scale=scale,
                             layout=layout, out=out, stream=stream, return_lse=return_lse,
                             causal=causal, window=window, diagonal=diagonal,
                             q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                             smooth_k=smooth_k)
    result, key = steady_call(q, k, v, out, stage, scale, layout, stream, return_lse, causal,
                              window, diagonal, lse_out=lse_out)
    if result is not None:
        return result
    prepared = prepare(q, k, v, stage=stage, scale=scale, layout=layout, out=out, stream=stream,
                       return_lse=return_lse, causal=causal, window=window, diagonal=diagonal,
                       lse_out=lse_out)
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
        if lse_out is not None:
            lse_out[...] = lse
            lse = lse_out
        return (result, lse) if return_lse else result
    prepared.launch()
    if key is not None:
        remember(key, prepared)
    result = out if out is not None else prepared.out
    if not return_lse:
        return result
    return result, (lse_out if lse_out is not None else prepared.lse)


def prepare(q, k, v, *, stage=None, scale=None, layout: str = "bhld", out=None,
            stream=None, return_lse: bool = False, causal: bool = False, window=None,
            diagonal: str = "bottom_right", defines: dict | None = None,
            extra_params=(), lse_out=None, walk_rule: str = "l2-walk") -> PreparedAttention:
    """Validate, pick the stage, copy NumPy inputs in, build maps and parameters.

    Arguments as for `attention`. Call `.launch()` to enqueue the kernel (as
    often as wanted: it always reads the same inputs and writes `.out`).
    For build variants (tools, not users): `defines` go to the preprocessor
    (e.g. {"PTXATTN_TRACE": 1}; a bf16 measurement variant's, {"BF16_BLOCK_N": "80"}
    (builds.BF16_VARIANTS), also gives the launch that variant's tile) and `extra_params`, (value, ctypes type)
    pairs, follow the table's parameters (launch.params_of), e.g. the trace
    buffer: ((trace_ptr, launch.TRACE_BUF.ctype),); `walk_rule` (a measurement's) names
    the section rule of the production walk (tile_walk.WALKS: "l2-walk", what attention()
    runs; "today", "head-major": the walks before it; "l2-band": windows sized by their
    band; "section:N": N pairs).
    """
    from .tile_walk import is_rule, rule_error
    if not is_rule(walk_rule):
        raise ValueError(rule_error(walk_rule))
    plan = validate(q, k, v, stage=stage, scale=scale, layout=layout, out=out, stream=stream,
                    return_lse=return_lse, causal=causal, window=window, diagonal=diagonal,
                    lse_out=lse_out)
    if plan.empty:   # nothing to compute: an empty output, no launch, no driver
        return launch.empty(plan)
    where = launch.target(plan)
    if where.stage.arch != stages.HOPPER:   # a never-run lineage: checked before its first launch
        _first_use(plan, where.stage, where.ctx.ordinal)
    return launch.build(plan, where, defines, tuple(extra_params), walk_rule)


def _first_use(plan: Plan, stage: Stage, device: int) -> None:
    """Before a Blackwell stage's launch: validation checked the device arrays against the
    stage it picked without knowing the GPU (a Hopper one); check them against this one, then
    run (once per process) its self-check against the reference (selfcheck.ensure)."""
    if not plan.host and stage is not plan.stage:
        checked = dataclasses.replace(plan, stage=stage)
        for name, seq, rows in (("q", plan.seq_q, stage.q_box_rows),
                                ("k", plan.seq_k, stage.block_n), ("v", plan.seq_k, stage.block_n)):
            check_device_geometry(name, getattr(plan, name), checked, seq, rows)
        if plan.out is not None:
            check_device_geometry("out", plan.out, checked, plan.seq_q, stage.q_box_rows)
    selfcheck.ensure(stage, device)

"""ptxattn inside PyTorch models (extra `torch`; the core library never imports this).

- `ptxattn::attention`, a torch.library custom op (torch.compile(fullgraph=True) traces it;
  CUDA graphs capture it): `ptxattn.torch.attention(q, k, v, scale=, layout=, is_causal=,
  window=, diagonal=, return_lse=, deterministic=)`. Differentiable: its autograd formula
  runs the backward kernels through `ptxattn::attention_backward` (also a custom op with a
  fake), so loss.backward(), torch.compile of forward + backward and a CUDA-graph capture of
  a whole training step work.
- `scaled_dot_product_attention(...)`: torch's SDPA semantics, ptxattn where the kernel takes
  the call (tensors that require grad included), torch's SDPA elsewhere (warned once per
  reason, counted: fallback_counts()).
- `register_diffusers()`: a "ptxattn" attention backend for diffusers
  (`transformer.set_attention_backend("ptxattn")`); `register_diffusers(fp8=True)` the opt-in
  "ptxattn_fp8" one (ptxattn.torch.fp8: e4m3, ~5% relative error; never the default).
- `register_transformers()`: `attn_implementation="ptxattn"` for transformers models (decode
  steps on the split-KV decode kernel, with the dynamic and the static cache; training on
  the forward and backward kernels), and `"paged|ptxattn"` for its continuous batching
  (generate_batch: packed sequences on the varlen kernels, a paged cache's decode steps on
  the paged decode kernel; packed_call_counts() counts them).
- `flash_attn_with_kvcache(...)`: FlashAttention's KV-cache call as the op
  `ptxattn::flash_attn_with_kvcache` (fake implementation; compile- and graph-safe).

Importing this module registers the op (torch.library needs torch >= 2.4).
"""

from __future__ import annotations

try:
    import torch as _torch
except ImportError as e:            # pragma: no cover - depends on the environment
    raise ImportError("ptxattn.torch needs PyTorch: pip install 'ptxattn[torch]'") from e

if not hasattr(_torch.library, "custom_op"):  # pragma: no cover
    raise ImportError(f"ptxattn.torch needs torch >= 2.4 (torch.library.custom_op); "
                      f"this is torch {_torch.__version__}")

from ._op import attention, library_takes_causal  # noqa: E402
from .kvcache import flash_attn_with_kvcache  # noqa: E402
from . import fp8  # noqa: E402,F401  (registers ptxattn::attention_fp8)
from .sdpa import (REASONS, fallback_counts, fallback_reason, packed_call_counts,  # noqa: E402
                   reset_fallback_counts, scaled_dot_product_attention)


class MissingModelLibraryError(ImportError):
    """register_diffusers()/register_transformers() without the model library installed."""


def _require(package: str, minimum: str, caller: str) -> None:
    """ImportError naming what to install when `package` cannot be imported (its own import
    error chained): a bare ModuleNotFoundError from deep inside says neither."""
    import importlib
    try:
        importlib.import_module(package)
    except ImportError as e:
        raise MissingModelLibraryError(
            f"{caller} needs {package} (>= {minimum}), which is not importable here "
            f"({type(e).__name__}: {e}): pip install '{package}>={minimum}', or the extra "
            "that brings it: pip install -e '.[models]' in a checkout") from e


def register_diffusers(fp8: bool = False) -> str:
    """Register the "ptxattn" backend (fp8=True: the opt-in "ptxattn_fp8") with diffusers'
    attention dispatch; returns its name.
    Needs diffusers (>= 0.35, extra `models`): MissingModelLibraryError (an ImportError) says
    so when it is not installed."""
    _require("diffusers", "0.35", "register_diffusers()")
    from .diffusers_backend import register
    return register(fp8=fp8)


def register_transformers() -> str:
    """Register "ptxattn" and "paged|ptxattn" (continuous batching: generate_batch and
    ContinuousBatchingManager) with transformers' AttentionInterface; returns "ptxattn".
    Needs transformers (>= 4.56, extra `models`): MissingModelLibraryError otherwise."""
    _require("transformers", "4.56", "register_transformers()")
    from .transformers_backend import register
    return register()


__all__ = ["attention", "flash_attn_with_kvcache", "scaled_dot_product_attention",
           "fallback_counts",
           "packed_call_counts", "reset_fallback_counts", "fallback_reason", "REASONS", "library_takes_causal",
           "register_diffusers", "register_transformers", "MissingModelLibraryError"]

"""ptxattn: hand-written PTX FlashAttention kernels, driven from Python.

Importing the package is free: the CUDA bindings and the driver are loaded
on first use (PEP 562 lazy attributes), so `import ptxattn` works on a
machine without a GPU and `ptxattn.attention_reference` never needs one.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "attention": "api",
    "prepare": "api",
    "PreparedAttention": "api",
    "flash_attn_func": "flash",
    "flash_attn_with_kvcache": "decode",
    "flash_attn_varlen_func": "varlen",
    "plan_varlen": "serving",
    "plan_decode": "serving",
    "attention_backward": "backward",
    "prepare_backward": "backward",
    "attention_backward_reference": "reference_backward",
    "attention_reference": "reference",
    "error_metrics": "reference",
    "passes": "reference",
    "random_qkv": "reference",
    "DeviceArray": "tensors",
    "as_device_array": "tensors",
    "from_numpy": "tensors",
    "empty": "tensors",
    "device_info": "driver",
    "synchronize": "driver",
    "Stream": "driver",
    "get_stage": "stages",
    "all_stages": "stages",
    "Stage": "stages",
    "PtxattnError": "errors",
    "NoGpuError": "errors",
    "CudaError": "errors",
    "JitError": "errors",
}
_SUBMODULES = ("api", "backward", "driver", "errors", "ptx", "reference", "stages", "tensors", "tma")

__all__ = sorted(_EXPORTS) + list(_SUBMODULES)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'ptxattn' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return __all__

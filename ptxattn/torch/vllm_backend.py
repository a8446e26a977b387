"""ptxattn as a vLLM attention backend (vLLM's V1 interface: AttentionBackend, AttentionImpl).

    from ptxattn.torch import vllm_backend
    vllm_backend.register()       # before the engine starts, in every worker process
    llm = vllm.LLM(model, attention_config={"backend": "CUSTOM"})   # or --attention-backend CUSTOM

The backend is vLLM's FlashAttention backend with ptxattn's kernels: the same paged cache
(2, num_blocks, block_size, Hkv, D) in the NHD layout, the same metadata (vLLM's
FlashAttentionMetadataBuilder builds it; cascade attention is never chosen), and the same call,
flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=query_start_loc, seqused_k=seq_lens,
block_table=block_table, causal, window) per layer, for prefill, chunked prefill, decode and
mixed batches alike. The new tokens' keys and values go into their cache slots first
(do_kv_cache_update: slot_mapping, -1 for a padded token), in torch ops that neither wait for
the GPU nor depend on the order of a scatter, so that vLLM can capture them in CUDA graphs.

What it takes: bf16, head dims 64/128/256, block sizes of 16 to 256 (a power of two), decoder
attention, causal or a sliding window, on compute capability 9.0. What it refuses (vLLM then
picks another backend, or the layer's constructor raises NotImplementedError): ALiBi, logit
soft-capping, attention sinks, an FP8 KV cache, encoder and cross attention, fused output
quantization.

vLLM need not be installed to import this module: without it the classes are plain classes
with the interface's methods (tests/test_vllm_backend.py drives them with vLLM's metadata
fields on the emulator); with it they derive from vLLM's base classes, so vLLM's defaults for
the rest of the interface apply. The interface followed is vLLM's main branch of late 2026
(vllm/v1/attention/backend.py, backends/flash_attn.py, backends/registry.py).
"""

from __future__ import annotations

import functools

import torch

try:                                               # vLLM's bases when it is installed
    from vllm.v1.attention.backend import AttentionBackend as _BackendBase
    from vllm.v1.attention.backend import AttentionImpl as _ImplBase
except ImportError:                                # the interface alone (tests, docs)
    _BackendBase = _ImplBase = object

from .. import varlen
from ..builds import HEAD_DIMS
from ..decode_builds import MAX_PAGE_SIZE, MIN_PAGE_SIZE

# the paged kernels' page sizes: the powers of two from MIN_PAGE_SIZE to MAX_PAGE_SIZE
BLOCK_SIZES = tuple(1 << s for s in range(MIN_PAGE_SIZE.bit_length() - 1,
                                          MAX_PAGE_SIZE.bit_length()))
DECODER = "decoder"                                # vLLM's AttentionType.DECODER


class PtxattnBackend(_BackendBase):
    """vLLM's AttentionBackend: names, cache shape and what the kernels support."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    supported_dtypes = [torch.bfloat16]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"                            # AttentionBackendEnum.CUSTOM's member name

    @staticmethod
    def get_impl_cls():
        return PtxattnImpl

    @staticmethod
    def get_builder_cls():
        return _builder_cls()

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        return list(BLOCK_SIZES)

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        if block_size not in BLOCK_SIZES:
            raise ValueError(f"ptxattn: block size {block_size}; the paged kernels take "
                             f"{', '.join(map(str, BLOCK_SIZES))}")
        if head_size not in HEAD_DIMS:
            raise ValueError(f"ptxattn: head size {head_size}; the kernels are built for "
                             f"{', '.join(map(str, HEAD_DIMS))}")
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        # NHD only: the kernels read (num_blocks, block_size, Hkv, D) pages
        if include_num_layers_dimension:
            return (2, 0, 1, 3, 4, 5)
        return (0, 1, 2, 3, 4)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size in HEAD_DIMS

    @classmethod
    def supports_dtype(cls, dtype) -> bool:
        return dtype in cls.supported_dtypes

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return kv_cache_dtype in (None, "auto", "bfloat16")

    @classmethod
    def supports_block_size(cls, block_size) -> bool:
        return block_size is None or block_size in BLOCK_SIZES

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == DECODER

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        # vLLM's DeviceCapability is a (major, minor) named tuple
        return tuple(capability)[:2] == (9, 0)      # sm_90a kernels (Hopper)

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla,
                             has_sink, use_sparse, device_capability) -> str | None:
        if use_mla or use_sparse:
            return "ptxattn: no MLA or sparse attention"
        if has_sink:
            return "ptxattn: no attention sinks"
        return None


class PtxattnImpl(_ImplBase):
    """vLLM's AttentionImpl: one layer's attention over the paged cache."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes=None, sliding_window=None, kv_cache_dtype: str = "auto",
                 logits_soft_cap=None, attn_type: str = DECODER,
                 kv_sharing_target_layer_name=None, sinks=None, **unsupported) -> None:
        refused = [name for name, given in (
            ("alibi_slopes", alibi_slopes is not None),
            ("logits_soft_cap", bool(logits_soft_cap)),
            ("sinks", sinks is not None),
            ("an FP8 KV cache", str(kv_cache_dtype).startswith("fp8")),
            (f"attn_type {attn_type!r}", str(getattr(attn_type, "value", attn_type)) != DECODER),
        ) if given] + sorted(k for k, val in unsupported.items() if val not in (None, False))
        if refused:
            raise NotImplementedError(f"ptxattn's vLLM backend does not support "
                                      f"{', '.join(refused)}")
        if head_size not in HEAD_DIMS:
            raise NotImplementedError(f"ptxattn's vLLM backend: head size {head_size}; the "
                                      f"kernels are built for {', '.join(map(str, HEAD_DIMS))}")
        if num_kv_heads is None:
            num_kv_heads = num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"ptxattn: {num_kv_heads} KV heads do not divide {num_heads}")
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        # vLLM's sliding window w: a query sees itself and the w - 1 keys before it
        self.window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """Write the new tokens' keys and values into their slots (vLLM's
        reshape_and_cache_flash): slot s is row s % block_size of block s // block_size;
        slot -1 is a padded token, written nowhere."""
        if self.kv_sharing_target_layer_name is not None or key is None or value is None:
            return
        key_cache, value_cache = kv_cache.unbind(0)
        write_slots(key_cache, key, slot_mapping)
        write_slots(value_cache, value, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None,
                output_scale=None, output_block_scale=None):
        """query (num_tokens, H, D); kv_cache (2, num_blocks, block_size, Hkv, D) with this
        step's tokens already written; output (num_tokens, H, D) or (num_tokens, H * D), of
        which the first num_actual_tokens rows are written. Returns output."""
        if output is None:
            raise ValueError("ptxattn's vLLM backend writes into vLLM's output buffer "
                             "(accept_output_buffer): output= is required")
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("ptxattn's vLLM backend: no fused output quantization")
        if attn_metadata is None:                  # vLLM's profiling run
            return output.fill_(0)
        if getattr(attn_metadata, "use_cascade", False):
            raise NotImplementedError("ptxattn's vLLM backend: no cascade attention (its "
                                      "builder never asks for it)")
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache.unbind(0)
        out = output[:n].view(n, self.num_heads, self.head_size)
        varlen.flash_attn_varlen_func(
            query[:n], key_cache, value_cache, attn_metadata.query_start_loc, None,
            attn_metadata.max_query_len, attn_metadata.max_seq_len,
            causal=bool(getattr(attn_metadata, "causal", True)), window_size=self.window,
            softmax_scale=self.scale, seqused_k=attn_metadata.seq_lens,
            block_table=attn_metadata.block_table, out=out)
        return output


def write_slots(cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache (num_blocks, block_size, Hkv, D) <- new's first len(slot_mapping) rows at their
    slots; slot -1 writes nothing. No host wait (graph-capturable) and no order dependence:
    a -1 entry is pointed at the last real token's slot with that token's own row, so where
    two writes meet a slot they write the same bytes (with no real token at all, every entry
    writes slot 0's own row back to it)."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    flat = cache.view(-1, cache.shape[-2], cache.shape[-1])
    rows = new[:n]
    real = slot_mapping >= 0
    positions = torch.arange(n, device=slot_mapping.device)
    last = torch.where(real, positions, torch.zeros_like(positions)).argmax()
    slots = torch.where(real, slot_mapping, slot_mapping[last]).clamp_min(0).long()
    sources = torch.where(real.view(n, 1, 1), rows, rows[last].unsqueeze(0))
    sources = torch.where((slot_mapping[last] >= 0).view(1, 1, 1), sources, flat[:1])
    flat.index_copy_(0, slots, sources.to(flat.dtype))


@functools.lru_cache(maxsize=None)
def _builder_cls():
    """vLLM's FlashAttention metadata builder, never choosing cascade attention, nor FA3's
    ahead-of-time schedule (whose set-up expects FlashAttentionImpl layers)."""
    try:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder
    except ImportError as e:
        raise ImportError("ptxattn's vLLM backend builds vLLM's FlashAttention metadata: "
                          "vLLM must be installed") from e

    class PtxattnMetadataBuilder(FlashAttentionMetadataBuilder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.aot_schedule = False

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            return super().build(0, common_attn_metadata, fast_build)

        def use_cascade_attention(self, *args, **kwargs) -> bool:
            return False
    return PtxattnMetadataBuilder


def register() -> None:
    """Register PtxattnBackend as vLLM's CUSTOM attention backend (needs vLLM)."""
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError as e:
        raise ImportError("ptxattn.torch.vllm_backend.register(): vLLM is not installed") from e
    register_backend(AttentionBackendEnum.CUSTOM, f"{__name__}.PtxattnBackend")

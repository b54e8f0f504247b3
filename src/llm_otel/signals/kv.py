"""KV-cache footprint of one request, from the engine's model and cache config.

Formula (full attention, every layer the same; docs/signals.md)::

    bytes_per_token = 2 (K and V) * layers * kv_heads * head_dim * dtype_bytes
    blocks(tokens)  = ceil(tokens / block_size)
    bytes(tokens)   = blocks(tokens) * block_size * bytes_per_token

The engine allocates whole blocks, so the footprint is counted in blocks. At admission the
request holds its prompt; at finish it holds prompt + output - 1 tokens (the last sampled token
is returned but never fed back through the model, so its KV is never written).
"""

from __future__ import annotations

import dataclasses
from typing import Any

_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
                "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "fp8_ds_mla": 1}


@dataclasses.dataclass(frozen=True)
class KVSpec:
    """Per-engine KV geometry. ``num_blocks``: blocks in the engine's KV pool (None if unknown)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_size: int
    num_blocks: int | None = None

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def blocks(self, tokens: int) -> int:
        """Whole blocks holding ``tokens`` tokens (0 for none)."""
        return -(-max(0, tokens) // self.block_size)

    def bytes(self, tokens: int) -> int:
        """KV bytes of ``tokens`` tokens rounded up to whole blocks."""
        return self.blocks(tokens) * self.bytes_per_block

    @property
    def capacity_bytes(self) -> int | None:
        return None if self.num_blocks is None else self.num_blocks * self.bytes_per_block

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> "KVSpec | None":
        """From a vLLM ``VllmConfig``: ``model_config.get_num_layers(parallel_config)``,
        ``get_num_kv_heads(parallel_config)`` (per tensor-parallel rank), ``get_head_size()``,
        ``cache_config.cache_dtype`` (``auto`` = ``model_config.dtype``), ``cache_config.block_size``,
        ``cache_config.num_gpu_blocks`` (set once the engine core reported its KV pool). None when
        a field is missing or the model is not plain attention (MLA, hybrid/Mamba layers)."""
        try:
            model = vllm_config.model_config
            parallel = vllm_config.parallel_config
            cache = vllm_config.cache_config
            if getattr(model, "use_mla", False) or getattr(model, "is_hybrid", False):
                return None
            dtype = str(cache.cache_dtype)
            if dtype == "auto":
                dtype_bytes = int(getattr(model.dtype, "itemsize", 0)) or _DTYPE_BYTES.get(
                    str(model.dtype).removeprefix("torch."), 0)
            else:
                dtype_bytes = _DTYPE_BYTES.get(dtype, 0)
            num_blocks = getattr(cache, "num_gpu_blocks", None)
            spec = cls(layers=int(model.get_num_layers(parallel)), kv_heads=int(model.get_num_kv_heads(parallel)),
                       head_dim=int(model.get_head_size()), dtype_bytes=dtype_bytes,
                       block_size=int(cache.block_size),
                       num_blocks=int(num_blocks) if num_blocks else None)
        except Exception:  # noqa: BLE001 - an engine layout we do not know: no KV signals
            return None
        if min(spec.layers, spec.kv_heads, spec.head_dim, spec.dtype_bytes, spec.block_size) <= 0:
            return None
        return spec

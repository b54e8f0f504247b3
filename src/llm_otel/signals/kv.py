"""KV-cache footprint of one request, from the engine's model and cache geometry (plain values the
engine adapter reads, e.g. :func:`llm_otel.instrumentation.vllm.fields.kv_spec`).

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

_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "fp8_ds_mla": 1,
}


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
    def checked(cls, **fields: Any) -> KVSpec | None:
        """A spec from the engine's values (the dataclass fields), or None when any size is not
        positive (an engine layout the formula does not cover)."""
        spec = cls(**fields)
        if min(spec.layers, spec.kv_heads, spec.head_dim, spec.dtype_bytes, spec.block_size) <= 0:
            return None
        return spec


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a KV dtype: a torch dtype (its ``itemsize``) or a cache-dtype name
    (``float16``, ``bfloat16``, ``fp8_e4m3``, ``torch.float16`` ...); 0 when unknown."""
    size = getattr(dtype, "itemsize", 0)
    if isinstance(size, int) and size > 0:
        return size
    return _DTYPE_BYTES.get(str(dtype).removeprefix("torch."), 0)

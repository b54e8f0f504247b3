"""vLLM configuration and request fields that the core's serving signals (:mod:`llm_otel.signals`)
take as plain values: the KV geometry from ``VllmConfig`` and the request-class engine fields from
``EngineCoreRequest``. Read once per engine (KV) or once per request (classes), in the frontend.
"""

from __future__ import annotations

from typing import Any

from llm_otel.config.classes import ENGINE_LORA, ENGINE_PRIORITY
from llm_otel.signals.kv import KVSpec, dtype_bytes


def kv_spec(vllm_config: Any) -> KVSpec | None:
    """KV geometry from a vLLM ``VllmConfig``: ``model_config.get_num_layers(parallel_config)``,
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
        size = dtype_bytes(model.dtype) if dtype == "auto" else dtype_bytes(dtype)
        num_blocks = getattr(cache, "num_gpu_blocks", None)
        return KVSpec.checked(
            layers=int(model.get_num_layers(parallel)),
            kv_heads=int(model.get_num_kv_heads(parallel)),
            head_dim=int(model.get_head_size()),
            dtype_bytes=size,
            block_size=int(cache.block_size),
            num_blocks=int(num_blocks) if num_blocks else None,
        )
    except Exception:  # noqa: BLE001 - silent: an engine layout we do not know: no KV signals
        return None


def class_fields(request: Any) -> dict[str, str | None]:
    """The request-class engine sources of a vLLM ``EngineCoreRequest``: ``engine:priority``
    (``priority``, an int, as text) and ``engine:lora`` (``lora_request.lora_name``); None where
    absent."""
    if request is None:
        return {}
    priority = getattr(request, "priority", None)
    lora = getattr(request, "lora_request", None)
    name = getattr(lora, "lora_name", None) if lora is not None else None
    return {
        ENGINE_PRIORITY: None if priority is None else str(priority),
        ENGINE_LORA: None if name is None else str(name),
    }

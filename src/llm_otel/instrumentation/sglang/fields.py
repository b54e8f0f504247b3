"""SGLang configuration and request fields that the core's serving signals (:mod:`llm_otel.signals`)
take as plain values: the KV geometry from the ``TokenizerManager``'s ``ModelConfig`` and
``ServerArgs``, and the request-class engine fields from a ``GenerateReqInput``. Read once per
manager (KV) or once per request (classes), in the HTTP process (or tokenizer worker).
"""

from __future__ import annotations

from typing import Any

from llm_otel.config.classes import ENGINE_LORA, ENGINE_PRIORITY
from llm_otel.signals.kv import KVSpec, dtype_bytes


def kv_spec(manager: Any) -> KVSpec | None:
    """KV geometry of an SGLang ``TokenizerManager``: ``model_config.num_hidden_layers``,
    ``model_config.get_num_kv_heads(server_args.tp_size)`` (per tensor-parallel rank),
    ``model_config.head_dim``, ``server_args.kv_cache_dtype`` (``auto`` = ``model_config.dtype``),
    ``server_args.page_size`` (tokens per KV page, the block). The pool size is the scheduler's
    (``max_total_num_tokens``), not known here: ``num_blocks`` is None. None when a field is missing or
    the model is not plain attention (MLA, hybrid sliding-window or Mamba layers)."""
    try:
        model = manager.model_config
        server = manager.server_args
        arch = getattr(getattr(model, "attention_arch", None), "name", "")
        if arch not in ("MHA", "") or getattr(model, "is_hybrid_swa", False) or getattr(model, "is_hybrid", False):
            return None
        dtype = str(getattr(server, "kv_cache_dtype", "auto") or "auto")
        size = dtype_bytes(model.dtype) if dtype == "auto" else dtype_bytes(dtype)
        return KVSpec.checked(
            layers=int(model.num_hidden_layers),
            kv_heads=int(model.get_num_kv_heads(int(getattr(server, "tp_size", 1) or 1))),
            head_dim=int(model.head_dim),
            dtype_bytes=size,
            block_size=int(getattr(server, "page_size", None) or 1),
            num_blocks=None,
        )
    except Exception:  # noqa: BLE001 - silent: an engine layout we do not know: no KV signals
        return None


def class_fields(obj: Any, index: int = 0) -> dict[str, str | None]:
    """The request-class engine sources of an SGLang ``GenerateReqInput`` (request ``index`` of a
    batch): ``engine:priority`` (``priority``, an int, as text) and ``engine:lora`` (``lora_path``, or
    its ``index``-th entry for a batch); None where absent."""
    if obj is None:
        return {}
    priority = getattr(obj, "priority", None)
    lora = getattr(obj, "lora_path", None)
    if isinstance(lora, (list, tuple)):
        lora = lora[index] if 0 <= index < len(lora) else None
    return {
        ENGINE_PRIORITY: None if priority is None else str(priority),
        ENGINE_LORA: None if lora is None else str(lora),
    }

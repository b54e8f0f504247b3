"""The part of vLLM's KV-connector API llm-otel reads (prefill/decode disaggregation, docs/disaggregated.md):
one table, held to the real source of every connector below by tests/contracts (goldens generated
from vLLM's wheels), used by :mod:`~llm_otel.instrumentation.vllm.kv_transfer`.

vLLM 0.32 (``vllm/distributed/kv_transfer/kv_connector/v1/base.py``, ``KVConnectorBase_V1``): the
engine core's scheduler holds a scheduler-role connector (``Scheduler.connector``), each worker a
worker-role one (``vllm.distributed.kv_transfer.get_kv_transfer_group()``). llm-otel wraps methods
of those two *instances* (never a class: subclasses override the base's methods), so one table
serves every connector, ``MultiConnector`` included (its own methods delegate to its members).
"""

from __future__ import annotations

#: Scheduler-role connector methods wrapped on ``Scheduler.connector`` (engine-core process), with
#: the parameters the wrappers read, in order.
SCHEDULER_METHODS: dict[str, tuple[str, ...]] = {
    # -> (external tokens | None, load asynchronously)
    "get_num_new_matched_tokens": ("request", "num_computed_tokens"),
    # num_external_tokens > 0: the request's blocks for external KV are allocated: receive starts
    "update_state_after_alloc": ("request", "blocks", "num_external_tokens"),
    # -> (delay freeing the blocks until the peer read them, kv_transfer_params for the response)
    "request_finished": ("request", "block_ids"),
    # the same for connectors with hybrid-allocator support (SupportsHMA): block ids per KV group
    "request_finished_all_groups": ("request", "block_ids"),
}

#: Worker-role connector methods timed per step on the worker's connector (worker process):
#: load calls, then save calls (``llm.engine.step.kv_transfer.receive_time`` / ``send_time``).
WORKER_LOAD_METHODS: dict[str, tuple[str, ...]] = {
    "start_load_kv": ("forward_context",),
    "wait_for_layer_load": ("layer_name",),
}
WORKER_SAVE_METHODS: dict[str, tuple[str, ...]] = {
    "save_kv_layer": ("layer_name", "kv_layer", "attn_metadata"),
    "wait_for_save": (),
}

#: ``KVConnectorOutput`` fields (``vllm/v1/outputs.py``) the engine-core hook reads from
#: ``ModelRunnerOutput.kv_connector_output`` in ``Scheduler.update_from_output``.
CONNECTOR_OUTPUT_FIELDS: tuple[str, ...] = (
    "finished_sending",
    "finished_recving",
    "invalid_block_ids",
    "failed_recving",
)

#: ``kv_transfer_params`` keys read (request body -> ``SamplingParams.extra_args["kv_transfer_params"]``
#: -> ``Request.kv_transfer_params``; the prefill side's ``request_finished`` returns them).
PARAMS_READ: tuple[str, ...] = (
    "do_remote_prefill",
    "do_remote_decode",
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "remote_prefill_cached_tokens",
)

#: Key llm-otel adds to the ``kv_transfer_params`` a prefill instance returns: the request span's
#: W3C context ``{"traceparent": ..., "tracestate": ...}``, which a decode instance joins when
#: the request carries no ``traceparent`` header.
TRACE_CONTEXT_KEY = "trace_context"

#: The connectors held to their source (factory name -> module, class).
CONNECTORS: dict[str, tuple[str, str]] = {
    "ExampleConnector": ("vllm.distributed.kv_transfer.kv_connector.v1.example_connector", "ExampleConnector"),
    "NixlConnector": ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector", "NixlConnector"),
    "NixlPushConnector": ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector", "NixlPushConnector"),
    "OffloadingConnector": ("vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector", "OffloadingConnector"),
    "MultiConnector": ("vllm.distributed.kv_transfer.kv_connector.v1.multi_connector", "MultiConnector"),
    "LMCacheConnectorV1": ("vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector", "LMCacheConnectorV1"),
}

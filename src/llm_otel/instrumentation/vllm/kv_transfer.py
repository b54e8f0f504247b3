"""Prefill/decode disaggregation in vLLM (docs/disaggregated.md): the KV transfer of each request
as ``llm.kv_transfer`` spans, the connector's time per step, the request's disaggregation role,
and the trace context a prefill instance hands to the decode instance in ``kv_transfer_params``.

What is read, and where (vLLM 0.32; the API surface is :mod:`.kv_surface`, held to the source of
every connector by tests/contracts):

* **Engine core** (:class:`SchedulerKV`): the scheduler's connector (``Scheduler.connector``)
  gets its :data:`~.kv_surface.SCHEDULER_METHODS` wrapped on the instance. A receive starts when
  ``update_state_after_alloc(request, blocks, num_external_tokens)`` allocates blocks for
  external tokens (``get_num_new_matched_tokens`` said whether the load is asynchronous); it ends
  with the step that loaded it (a synchronous load runs inside that step's model execution - the
  span starts at the worker's first load call of that step and lasts as long as its load calls
  took in all), or when the connector reports the request in
  ``KVConnectorOutput.finished_recving`` (asynchronous; the request waited in
  WAITING_FOR_REMOTE_KVS). ``failed_recving`` or one of its blocks in ``invalid_block_ids`` ends it
  with ``error.type`` ``kv_load_failed`` / ``kv_invalid_blocks`` (and vLLM's
  ``kv_load_failure_policy``); a request gone before its KV arrived ends it with ``aborted``. A send
  is the prefill side's: with ``request_finished`` returning ``delay_free_blocks`` the peer pulls
  (NIXL) and the span runs until ``finished_sending``; otherwise the connector saved the KV inside
  the request's prefill steps (``ExampleConnector``) and the span starts at the worker's first save
  call in them and lasts as long as its save calls took in all (``save_kv_layer`` runs layer by
  layer inside the forward: the span is the connector's own time, not the forward's).
* **Worker** (:class:`WorkerKV`): the worker's connector (``get_kv_transfer_group()``) gets its
  load and save methods timed; each step's totals and windows ride back on the step's
  ``ModelRunnerOutput`` (:func:`~.carrier.set_step_kv_time`, rank 0's worker; not under async
  scheduling, whose output object is built later) to the engine core, which puts them on
  ``llm.engine.step`` and uses the windows for synchronous transfers.
* **Frontend** (:func:`add_trace_context`, :func:`trace_context_of`): a finished request's
  ``EngineCoreOutput.kv_transfer_params`` gets the request span's W3C context under
  :data:`~.kv_surface.TRACE_CONTEXT_KEY` when the instance is a prefill one (``kv_producer``, or
  the request asked for ``do_remote_decode``); a decode instance joins that context when the
  request carries no ``traceparent``.

Bytes: tokens x the bytes one token occupies in this engine's paged cache (``page_size_bytes`` x
layers of every KV-cache group / ``block_size``, from ``Scheduler.kv_cache_config``).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import wrapt

from llm_otel.instrumentation.vllm import kv_surface
from llm_otel.instrumentation.vllm.carrier import request_span_context, set_step_kv_time, step_kv_time
from llm_otel.propagation import extract_carrier
from llm_otel.semconv import attributes as A
from llm_otel.telemetry import Telemetry
from llm_otel.telemetry.kv_transfer import RECEIVE, SEND, KVTransfer

logger = logging.getLogger("llm_otel")

MAX_PENDING = 65_536  # transfers tracked at once per engine core (bounded memory)
ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


def instance_role(vllm_config: Any) -> str | None:
    """The instance's disaggregation role from ``vllm_config.kv_transfer_config.kv_role``
    (``prefill`` / ``decode`` / ``both``); None without a KV connector."""
    cfg = getattr(vllm_config, "kv_transfer_config", None)
    if cfg is None or not getattr(cfg, "kv_connector", None):
        return None
    return ROLES.get(str(getattr(cfg, "kv_role", "")), "both")


def annotate_process(role: str | None) -> None:
    """Put the instance's disaggregation role on this process's resource (every vLLM process
    that learns it: frontend at engine registration, engine core at its first schedule, worker at
    its first step with a connector); no connector: nothing."""
    if role is not None:
        from llm_otel.process.identity import annotate

        annotate({A.LLM_DISAGGREGATION_ROLE: role})


def request_params(sampling_params: Any) -> dict | None:
    """A request's ``kv_transfer_params`` (``SamplingParams.extra_args["kv_transfer_params"]``,
    where vLLM's OpenAI server puts the body's field); None when absent or not a dict."""
    extra = getattr(sampling_params, "extra_args", None)
    params = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    return params if isinstance(params, dict) else None


def request_role(role: str | None, params: dict | None) -> str | None:
    """The request's role on an instance of ``role``: a ``kv_producer`` / ``kv_consumer``
    instance's own (client-sent params cannot change it); on a ``kv_both`` instance ``prefill``
    when its params say ``"do_remote_decode": true``, ``decode`` for ``"do_remote_prefill": true``
    (booleans only, as vLLM's connectors write them), else ``both``."""
    if role != "both" or not params:
        return role
    if params.get("do_remote_decode") is True:
        return "prefill"
    if params.get("do_remote_prefill") is True:
        return "decode"
    return role


def remote_engine(params: dict | None) -> str | None:
    """The peer the params name: ``remote_engine_id``, else ``remote_host:remote_port``."""
    if not params:
        return None
    engine = params.get("remote_engine_id")
    if engine:
        return str(engine)
    host, port = params.get("remote_host"), params.get("remote_port")
    return f"{host}:{port}" if host else None


def trace_context_of(body_request: Any) -> dict[str, str] | None:
    """The W3C trace context a prefill instance left in the ``kv_transfer_params`` of a request
    body (OpenAI ``CompletionRequest`` / ``ChatCompletionRequest``): a carrier dict
    (``traceparent``, ``tracestate``) when it is valid, else None (client input: invalid values
    are ignored the way an invalid ``traceparent`` header is)."""
    params = getattr(body_request, "kv_transfer_params", None)
    ctx = params.get(kv_surface.TRACE_CONTEXT_KEY) if isinstance(params, dict) else None
    return extract_carrier(ctx) if isinstance(ctx, dict) else None


def add_trace_context(output: Any, carrier: dict[str, str]) -> None:
    """Put ``carrier`` into a finished request's ``EngineCoreOutput.kv_transfer_params`` (a new dict:
    the connector's own is not changed), before vLLM copies them into the response."""
    params = output.kv_transfer_params
    output.kv_transfer_params = {**(params if isinstance(params, dict) else {}), kv_surface.TRACE_CONTEXT_KEY: carrier}


def _call_arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


class _Pending:
    """A transfer the engine core has seen start and not yet end."""

    __slots__ = ("start_ns", "tokens", "blocks", "block_ids", "asynchronous", "parent", "params", "role")

    def __init__(self, start_ns: int, tokens: int, blocks: int, asynchronous: bool, request: Any, role: str | None):
        self.start_ns = start_ns
        self.tokens = tokens
        self.blocks = blocks
        self.block_ids: frozenset[int] = frozenset()
        self.asynchronous = asynchronous
        self.parent = request_span_context(getattr(request, "sampling_params", None))
        self.params = getattr(request, "kv_transfer_params", None)
        self.role = role


class SchedulerKV:
    """Engine-core side: request transfers from the scheduler's connector and each step's
    ``KVConnectorOutput`` (module docstring). One per scheduler; the engine loop is one thread."""

    def __init__(self, telemetry: Telemetry, scheduler: Any) -> None:
        self.telemetry = telemetry
        connector = scheduler.connector
        self.connector_name = type(connector).__name__
        vllm_config = getattr(scheduler, "vllm_config", None)
        self.role = instance_role(vllm_config)
        annotate_process(self.role)
        cfg = getattr(vllm_config, "kv_transfer_config", None)
        self.policy = getattr(cfg, "kv_load_failure_policy", None)
        self.block_size = int(getattr(scheduler, "block_size", 0) or getattr(scheduler.cache_config, "block_size", 16))
        self.bytes_per_token = _bytes_per_token(getattr(scheduler, "kv_cache_config", None), self.block_size)
        self._async: dict[str, bool] = {}  # req id -> get_num_new_matched_tokens said "asynchronous"
        self._receiving: dict[str, _Pending] = {}
        self._sending: dict[str, _Pending] = {}  # pulled by the peer: until finished_sending
        self._saved: dict[
            str, tuple[int, int]
        ] = {}  # req id -> (first save call, + time in save calls) of its prefill steps
        self._finishing = False  # request_finished inside request_finished_all_groups: once
        for name in kv_surface.SCHEDULER_METHODS:
            method = getattr(connector, name, None)
            if method is not None and not isinstance(method, wrapt.FunctionWrapper):
                setattr(connector, name, wrapt.FunctionWrapper(method, getattr(self, "_" + name)))

    # --- connector wrappers (scheduler thread) ---------------------------------------------------
    def _get_num_new_matched_tokens(self, wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        try:
            request = _call_arg(args, kwargs, 0, "request")
            if isinstance(result, tuple) and result[0] and len(self._async) < MAX_PENDING:
                self._async[request.request_id] = bool(result[1])
        except Exception as exc:  # noqa: BLE001
            self.telemetry.errors.report("vllm.kv.get_num_new_matched_tokens", exc)
        return result

    def _update_state_after_alloc(self, wrapped, instance, args, kwargs):
        try:
            request = _call_arg(args, kwargs, 0, "request")
            n = _call_arg(args, kwargs, 2, "num_external_tokens")
            rid = request.request_id
            asynchronous = self._async.pop(rid, False)
            if isinstance(n, int) and n > 0 and len(self._receiving) < MAX_PENDING:
                params = getattr(request, "kv_transfer_params", None)
                p = _Pending(
                    time.time_ns(),
                    n,
                    math.ceil(n / self.block_size),
                    asynchronous,
                    request,
                    request_role(self.role, params) or "decode",
                )
                blocks = _call_arg(args, kwargs, 1, "blocks")
                ids = blocks.get_block_ids() if hasattr(blocks, "get_block_ids") else ()
                p.block_ids = frozenset(b for group in ids for b in group)
                self._receiving[rid] = p
        except Exception as exc:  # noqa: BLE001
            self.telemetry.errors.report("vllm.kv.update_state_after_alloc", exc)
        return wrapped(*args, **kwargs)

    def _request_finished(self, wrapped, instance, args, kwargs):
        if self._finishing:  # the connector's request_finished_all_groups calling request_finished
            return wrapped(*args, **kwargs)
        self._finishing = True
        try:
            result = wrapped(*args, **kwargs)
        finally:
            self._finishing = False
        try:
            self._finished(_call_arg(args, kwargs, 0, "request"), result)
        except Exception as exc:  # noqa: BLE001
            self.telemetry.errors.report("vllm.kv.request_finished", exc)
        return result

    _request_finished_all_groups = _request_finished

    def _finished(self, request: Any, result: Any) -> None:
        rid = request.request_id
        self._async.pop(rid, None)
        window = self._saved.pop(rid, None)
        params = getattr(request, "kv_transfer_params", None)
        role = request_role(self.role, params)
        if role != "prefill":
            return
        delay_free = bool(result[0]) if isinstance(result, tuple) and result else False
        prompt = int(getattr(request, "num_prompt_tokens", 0) or 0)
        if delay_free:  # the peer pulls the blocks: until finished_sending
            if len(self._sending) < MAX_PENDING:
                p = _Pending(time.time_ns(), prompt, math.ceil(prompt / self.block_size), True, request, role)
                p.params = result[1] if len(result) > 1 and isinstance(result[1], dict) else params
                self._sending[rid] = p
        elif window is not None:  # saved inside its prefill steps
            p = _Pending(window[0], prompt, math.ceil(prompt / self.block_size), False, request, role)
            self._emit(rid, p, SEND, window[1])

    # --- each step's output (before vLLM processes it) ------------------------------------------
    def on_output(self, scheduler: Any, scheduler_output: Any, model_runner_output: Any) -> tuple | None:
        """``Scheduler.update_from_output``: end the transfers this step's output finishes; returns
        ``(receive_s, send_s, completed)`` for the step span (None: no connector activity)."""
        now = time.time_ns()
        worker = step_kv_time(model_runner_output)
        kv_out = getattr(model_runner_output, "kv_connector_output", None)
        completed = 0
        load_window = save_window = None
        if worker is not None:
            load_ns, load_first, save_ns, save_first = worker
            # a window starts at the step's first call and lasts as long as the calls took in all:
            # per-layer calls (save_kv_layer, wait_for_layer_load) interleave with the forward
            load_window = (load_first, load_first + load_ns) if load_ns else None
            save_window = (save_first, save_first + save_ns) if save_ns else None
        if save_window is not None and self.role in ("prefill", "both"):
            scheduled_ids = [r.req_id for r in scheduler_output.scheduled_new_reqs]
            scheduled_ids += scheduler_output.scheduled_cached_reqs.req_ids
            for rid in scheduled_ids:
                old = self._saved.get(rid)
                if old is None and len(self._saved) >= MAX_PENDING:
                    continue
                self._saved[rid] = save_window if old is None else (old[0], old[1] + save_ns)
        if self._receiving:
            invalid = set(getattr(kv_out, "invalid_block_ids", None) or ())
            failed = set(getattr(kv_out, "failed_recving", None) or ())
            received = set(getattr(kv_out, "finished_recving", None) or ())
            scheduled = scheduler_output.num_scheduled_tokens
            requests = scheduler.requests
            for rid in list(self._receiving):
                p = self._receiving[rid]
                error = None
                if rid in failed:
                    error = "kv_load_failed"
                elif invalid and p.block_ids & invalid:
                    error = "kv_invalid_blocks"
                elif p.asynchronous:
                    if rid not in received:
                        if rid not in requests:
                            error = "aborted"
                        else:
                            continue
                elif rid not in scheduled:
                    if rid not in requests:
                        error = "aborted"
                    else:
                        continue  # a synchronous load not yet scheduled
                del self._receiving[rid]
                end = now
                if not p.asynchronous and load_window is not None and error is None:
                    p.start_ns, end = load_window  # the worker's load calls of the step that loaded it
                self._emit(rid, p, RECEIVE, end, error)
                completed += 1
        if self._sending:
            sent = set(getattr(kv_out, "finished_sending", None) or ())
            for rid in [r for r in self._sending if r in sent]:
                self._emit(rid, self._sending.pop(rid), SEND, now)
                completed += 1
        if worker is None and not completed:
            return None
        return (
            (worker[0] / 1e9) if worker is not None else 0.0,
            (worker[2] / 1e9) if worker is not None else 0.0,
            completed,
        )

    def on_step_span(self, span: Any, figures: tuple | None) -> None:
        """The step span's role and connector figures (``on_output``'s result), set by the core."""
        receive_s, send_s, completed = figures if figures is not None else (0.0, 0.0, 0)
        self.telemetry.kv_transfers.on_step(span, self.role, receive_s, send_s, completed)

    def _emit(self, rid: str, p: _Pending, direction: str, end_ns: int, error: str | None = None) -> None:
        self.telemetry.kv_transfers.record(
            KVTransfer(
                connector=self.connector_name,
                direction=direction,
                start_ns=p.start_ns,
                end_ns=end_ns,
                request_id=rid,
                parent=p.parent,
                tokens=p.tokens,
                blocks=p.blocks,
                nbytes=p.tokens * self.bytes_per_token if self.bytes_per_token else None,
                remote_engine=remote_engine(p.params if isinstance(p.params, dict) else None),
                asynchronous=p.asynchronous,
                role=p.role,
                error_type=error,
                load_failure_policy=str(self.policy) if error is not None and self.policy else None,
            )
        )


def _bytes_per_token(kv_cache_config: Any, block_size: int) -> int:
    """Bytes one token's KV occupies in the paged cache: the page size of every KV-cache group's
    spec x its layers, over ``block_size`` (``KVCacheConfig.kv_cache_groups[i].kv_cache_spec.page_size_bytes``,
    ``.layer_names``); 0 when unknown."""
    total = 0
    try:
        for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
            spec = group.kv_cache_spec
            total += int(spec.page_size_bytes) * len(group.layer_names) // max(1, int(spec.block_size))
    except Exception:  # noqa: BLE001 - silent: bytes are left out (documented: 0 when unknown)
        return 0
    return total


class WorkerKV:
    """Worker side: the time each step spends in the worker connector's load and save calls.

    :meth:`begin_step` at the start of ``execute_model``, :meth:`stamp` on the step's
    ``ModelRunnerOutput``; with no KV connector both are one attribute check."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.active: bool | None = None  # None: not looked yet; False: no connector here
        self._load = [0, 0]  # ns in the calls this step, epoch ns of the first call's start
        self._save = [0, 0]

    def attach(self) -> None:
        """Wrap the worker connector's load/save methods (once; no connector: inactive)."""
        self.active = False
        try:
            from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

            if not has_kv_transfer_group():
                return
            connector = get_kv_transfer_group()
            # KVConnectorBase_V1.__init__ keeps the engine's VllmConfig as _vllm_config
            annotate_process(instance_role(getattr(connector, "_vllm_config", None)))
        except Exception as exc:  # noqa: BLE001
            self.telemetry.errors.report("vllm.kv.worker_attach", exc)
            return
        try:
            for methods, acc in (
                (kv_surface.WORKER_LOAD_METHODS, self._load),
                (kv_surface.WORKER_SAVE_METHODS, self._save),
            ):
                for name in methods:
                    method = getattr(connector, name, None)
                    if method is not None and not isinstance(method, wrapt.FunctionWrapper):
                        setattr(connector, name, wrapt.FunctionWrapper(method, _timed(acc)))
        except Exception as exc:  # noqa: BLE001
            self.telemetry.errors.report("vllm.kv.worker_attach", exc)
            return
        self.active = True

    def begin_step(self) -> None:
        """At the start of ``execute_model``: the first time, find the worker's connector; then
        the step's totals start from zero."""
        if self.active is None:
            self.attach()
        if self.active:
            self._load[0] = self._save[0] = 0

    def stamp(self, output: Any) -> None:
        """Put the step's connector time on its ``ModelRunnerOutput`` (:func:`~.carrier.set_step_kv_time`)."""
        if not self.active or output is None or not (self._load[0] or self._save[0]):
            return
        set_step_kv_time(output, (self._load[0], self._load[1], self._save[0], self._save[1]))
        self._load[0] = self._save[0] = 0


def _timed(acc: list[int]):
    def wrapper(wrapped, instance, args, kwargs):
        t0 = time.time_ns()
        try:
            return wrapped(*args, **kwargs)
        finally:
            if not acc[0]:
                acc[1] = t0
            acc[0] += max(1, time.time_ns() - t0)

    return wrapper

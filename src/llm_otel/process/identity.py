"""Process identity: the resource attributes that tell one serving process from another.

A serving engine is many processes (vLLM: API servers, an engine core per data-parallel rank, a
worker per tensor/pipeline-parallel rank, possibly Ray actors on other hosts). Their telemetry only
stays apart in a backend when each process's resource says which process it is: two engine cores
exporting cumulative series under the same resource corrupt each other (CASES.md C14).

:func:`process_identity` builds the attributes from what the caller knows (any engine). Engines
know their processes, this module does not: an engine adapter reports how to read the identity of
the process it runs in (:func:`read_identity_with`; vLLM's reader,
:mod:`llm_otel.instrumentation.vllm.process`, reads the attributes below from vLLM's own objects)
and the providers built here afterwards use it (:func:`current_process_identity`; without one,
:func:`generic_process_identity`: role, process name, Ray). For vLLM:

==========================================  =============================================================
attribute                                   where it comes from
==========================================  =============================================================
``llm.process.role``                        the caller, or the vLLM process kind (below)
``process.pid``, ``host.name``              ``os.getpid()``, ``socket.gethostname()``
``service.instance.id``                     a UUID v4 per process, or ``<inherited>/<role><indices>.<pid>``
                                            when ``OTEL_RESOURCE_ATTRIBUTES`` sets one (a pod's, shared by
                                            all its processes); the inherited value stays in
                                            ``llm.process.inherited_instance_id``
``llm.process.name``                        vLLM's multiprocessing process name (``ApiServer_1``,
                                            ``EngineCore_DP1``, ``VllmWorker-3``) or Ray actor class + rank
``llm.process.api_server.index``            ``ApiServer_<i>`` (``vllm.v1.utils.APIServerProcessManager``)
``llm.process.data_parallel.rank``          engine core: ``dp_rank`` of ``EngineCoreProc.run_engine_core``
                                            / the Ray actor; worker: ``ParallelConfig.data_parallel_index``
``llm.process.tensor_parallel.rank``,       worker: its global ``rank`` (``WorkerProc`` / ``rpc_rank``)
``llm.process.pipeline_parallel.rank``      with ``tensor_parallel_size`` x ``prefill_context_parallel_size``
``llm.process.ray``                         this process is a Ray worker process (``ray`` imported and its
                                            global worker in worker mode)
==========================================  =============================================================

Processes that learn what they are after their providers exist (a LightLLM child spawned under
``opentelemetry-instrument``: ``sitecustomize`` builds the providers before multiprocessing has
unpickled the function the child will run; a gunicorn worker forked from its master) keep their
providers and have the resource re-labelled: :func:`track` registers the providers llm-otel built
for this process, :func:`relabel` gives their resource a new role and indices (before the process
makes spans), and after ``os.fork`` each tracked resource gets the child's own
``process.pid``, ``process.parent_pid`` (where the resource has one) and ``service.instance.id``,
keeping role and indices. An engine adapter that knows the role calls :func:`relabel` again.

Anything that cannot be read leaves its attribute out with one log line naming what was missing;
nothing here raises.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import sys
import uuid
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from llm_otel.errors import process_errors
from llm_otel.export.resources import resource_of as _untyped_resource_of
from llm_otel.export.resources import set_attributes as _set_attributes
from llm_otel.sampling.budget import set_default_budget_key
from llm_otel.semconv import attributes as A

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource

logger = logging.getLogger("llm_otel")

# export.resources is not annotated: what it returns, for this module's typed callers
_resource_of: Callable[[object], Resource | None] = _untyped_resource_of

# the instance id of this process, made once per pid (a forked child gets its own)
_INSTANCE_IDS: dict[int, str] = {}


def inherited_instance_id(env: Mapping[str, str] | None = None) -> str | None:
    """``service.instance.id`` from ``OTEL_RESOURCE_ATTRIBUTES`` (``k=v,k=v``, values
    percent-decoded as the SDK does), or None."""
    env = os.environ if env is None else env
    raw = env.get("OTEL_RESOURCE_ATTRIBUTES") or ""
    for item in raw.split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip() == A.SERVICE_INSTANCE_ID:
            from urllib.parse import unquote

            value = unquote(value.strip())
            return value or None
    return None


def _suffix(
    role: str, api_server_index: int | None, dp_rank: int | None, pp_rank: int | None, tp_rank: int | None, pid: int
) -> str:
    parts = [role]
    for prefix, value in (("api", api_server_index), ("dp", dp_rank), ("pp", pp_rank), ("tp", tp_rank)):
        if value is not None:
            parts.append(f"{prefix}{value}")
    parts.append(str(pid))
    return ".".join(parts)


def process_identity(
    role: str,
    *,
    process_name: str | None = None,
    api_server_index: int | None = None,
    dp_rank: int | None = None,
    tp_rank: int | None = None,
    pp_rank: int | None = None,
    ray: bool | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Resource attributes identifying this process (any engine).

    ``role``: ``llm.process.role`` (``frontend``, ``engine_core``, ``worker``, or an engine's own
    role name). Indices left None are left out. The ``service.instance.id`` is a UUID v4 made once
    per pid (it stays when the process learns its role later), or, when an instance id is inherited
    (``OTEL_RESOURCE_ATTRIBUTES`` in ``env``, default ``os.environ``),
    ``<inherited>/<role>[.api<i>][.dp<r>][.pp<r>][.tp<r>].<pid>`` for the role and indices of this
    call. Never raises.
    """
    pid = os.getpid()
    attrs: dict[str, Any] = {A.LLM_PROCESS_ROLE: role, A.PROCESS_PID: pid}
    try:
        attrs[A.HOST_NAME] = socket.gethostname()
    except OSError as exc:  # pragma: no cover - gethostname does not fail on Linux
        logger.info("llm-otel: host.name left out of this process's resource (%s)", exc)
    inherited = inherited_instance_id(env)
    if inherited:
        # a function of the role, indices and pid, never cached: a process forked from a labelled
        # parent (its fork hook re-labels it with the parent's role) that then learns its own role
        # (a vLLM engine core under fork) must not keep the parent's role in its id
        instance = f"{inherited}/{_suffix(role, api_server_index, dp_rank, pp_rank, tp_rank, pid)}"
    else:
        cached = _INSTANCE_IDS.get(pid)
        if cached is None:
            cached = str(uuid.uuid4())
            _INSTANCE_IDS.clear()  # only this pid's id is ever needed (a fork child drops its parent's)
            _INSTANCE_IDS[pid] = cached
        instance = cached
    attrs[A.SERVICE_INSTANCE_ID] = instance
    if inherited:
        attrs[A.LLM_PROCESS_INHERITED_INSTANCE_ID] = inherited
    for key, value in (
        (A.LLM_PROCESS_NAME, process_name),
        (A.LLM_PROCESS_API_SERVER_INDEX, api_server_index),
        (A.LLM_PROCESS_DATA_PARALLEL_RANK, dp_rank),
        (A.LLM_PROCESS_TENSOR_PARALLEL_RANK, tp_rank),
        (A.LLM_PROCESS_PIPELINE_PARALLEL_RANK, pp_rank),
        (A.LLM_PROCESS_RAY, ray),
    ):
        if value is not None:
            attrs[key] = value
    return attrs


# --- re-labelling: resources of processes that learn their role late ---------------------------
# identity keys a relabel replaces, and the process_identity() keyword each comes from
_LABELS = {
    A.LLM_PROCESS_NAME: "process_name",
    A.LLM_PROCESS_API_SERVER_INDEX: "api_server_index",
    A.LLM_PROCESS_DATA_PARALLEL_RANK: "dp_rank",
    A.LLM_PROCESS_TENSOR_PARALLEL_RANK: "tp_rank",
    A.LLM_PROCESS_PIPELINE_PARALLEL_RANK: "pp_rank",
    A.LLM_PROCESS_RAY: "ray",
}
_IDENTITY_KEYS = frozenset(_LABELS) | {
    A.LLM_PROCESS_ROLE,
    A.PROCESS_PID,
    A.HOST_NAME,
    A.SERVICE_INSTANCE_ID,
    A.LLM_PROCESS_INHERITED_INSTANCE_ID,
}
# the providers llm-otel built in this process (weakly): their *current* resource is re-labelled
# (SDK 1.45+ replaces a provider's resource with a merged copy after fork, in its own fork hook)
_TRACKED: list[weakref.ref[object]] = []
_FORK_HOOKS = [0]  # after-fork re-label hooks registered (track); the newest one acts


def _tracked() -> list[Resource]:
    """The distinct current resources of the live tracked providers."""
    providers = [r() for r in _TRACKED]
    _TRACKED[:] = [ref for ref, provider in zip(_TRACKED, providers, strict=False) if provider is not None]
    out: list[Resource] = []
    for provider in providers:
        resource = _resource_of(provider) if provider is not None else None
        if resource is not None and all(resource is not seen for seen in out):
            out.append(resource)
    return out


_ANNOTATED: list[weakref.ref[object]] = []  # providers :func:`annotate` reaches besides the tracked ones


def annotated(*providers: object) -> None:
    """Register providers whose resource :func:`annotate` extends but that are never re-labelled
    (vLLM's engine-core and worker providers: their identity is fixed when they are built)."""
    for provider in providers:
        if provider is not None and all(r() is not provider for r in _ANNOTATED):
            _ANNOTATED.append(weakref.ref(provider))


def track(*providers: object) -> None:
    """Register tracer / meter providers llm-otel built for this process from
    :func:`process_identity` so that :func:`relabel` and ``fork`` re-label their resource."""
    for provider in providers:
        if provider is not None and all(r() is not provider for r in _TRACKED):
            _TRACKED.append(weakref.ref(provider))
            if hasattr(os, "register_at_fork"):
                # after-fork hooks run in the order they were registered: this one runs after the
                # provider's own (SDK 1.45+ gives the child's resource a new process-dependent
                # service.instance.id, a UUID, in it), so the child's identity is the last word.
                # Only the newest such hook re-labels: it runs after every tracked provider's own
                _FORK_HOOKS[0] += 1

                def _after_fork_hook(n: int = _FORK_HOOKS[0]) -> None:
                    if n == _FORK_HOOKS[0]:
                        _relabel_after_fork()

                os.register_at_fork(after_in_child=_after_fork_hook)


def tracked_identity() -> dict[str, Any] | None:
    """The identity attributes of the resource of this process's tracked providers (None when
    llm-otel built no providers here: the application's own resource is never re-labelled)."""
    for resource in _tracked():
        return {k: v for k, v in resource.attributes.items() if k in _IDENTITY_KEYS}
    return None


def relabel(
    role: str,
    *,
    process_name: str | None = None,
    api_server_index: int | None = None,
    dp_rank: int | None = None,
    tp_rank: int | None = None,
    pp_rank: int | None = None,
    ray: bool | None = None,
) -> dict[str, Any] | None:
    """Give every tracked resource of this process (:func:`track`) the identity of ``role`` with
    these indices (see :func:`process_identity`; indices left None are removed), keeping every
    other attribute (service name, detectors' attributes). Call it before the process makes spans
    under its new role: spans made earlier keep the old label only in what they already exported.
    Returns the new identity attributes, or None when nothing is tracked here. Never raises."""
    resources = _tracked()
    if not resources:
        return None
    try:
        made = process_identity(
            role,
            process_name=process_name,
            api_server_index=api_server_index,
            dp_rank=dp_rank,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            ray=ray,
        )
        for resource in resources:
            kept = {k: v for k, v in resource.attributes.items() if k not in _IDENTITY_KEYS}
            if A.PROCESS_PARENT_PID in kept:
                kept[A.PROCESS_PARENT_PID] = os.getppid()
            _set_attributes(resource, {**kept, **made})
        for ref in _TRACKED:  # providers whose resource lives elsewhere too (the exporter process's)
            changed = getattr(ref(), "resource_changed", None)
            if changed is not None:
                changed()
        logger.debug(
            "llm-otel: this process (pid %d) is a %s process: %s", os.getpid(), role, made.get(A.SERVICE_INSTANCE_ID)
        )
        return made
    except Exception as exc:  # noqa: BLE001 - identity must never stop the engine process
        process_errors().report(
            "process.identity.relabel", exc, f"could not re-label this process's resource as {role}"
        )
        return None


def annotate(attributes: Mapping[str, Any]) -> bool:
    """Add ``attributes`` to every tracked resource of this process (:func:`track`,
    :func:`annotated`), e.g. the
    instance's disaggregation role once the engine's configuration is known; they survive
    :func:`relabel`. Spans made earlier keep the old resource only in what they already exported.
    Returns whether any resource was changed. Never raises."""
    try:
        resources = _tracked()
        for ref in _ANNOTATED:
            resource = _resource_of(ref()) if ref() is not None else None
            if resource is not None and all(resource is not seen for seen in resources):
                resources.append(resource)
        for resource in resources:
            _set_attributes(resource, {**resource.attributes, **attributes})
        for ref in _TRACKED:
            changed = getattr(ref(), "resource_changed", None)
            if changed is not None:
                changed()
        return bool(resources)
    except Exception as exc:  # noqa: BLE001 - identity must never stop the engine process
        process_errors().report("process.identity.annotate", exc, "could not annotate this process's resource")
        return False


def _relabel_after_fork() -> None:
    """In a forked child: the tracked resources get this pid and its own instance id, same role and
    indices (gunicorn workers forked from their master, Celery prefork, vLLM under ``fork``)."""
    current = tracked_identity()
    if current is None:
        return
    kwargs = {kw: current[key] for key, kw in _LABELS.items() if key in current}
    relabel(str(current.get(A.LLM_PROCESS_ROLE) or "frontend"), **kwargs)


def in_ray_worker() -> bool:
    """True in a Ray worker process (an actor or task), read from Ray's global worker when ``ray``
    is already imported (it always is in a Ray actor; importing it here would cost seconds)."""
    if "ray" not in sys.modules:
        return False
    try:
        from ray._private import worker as ray_worker  # ray 2.x

        return bool(getattr(ray_worker.global_worker, "mode", None) == ray_worker.WORKER_MODE)
    except Exception:  # noqa: BLE001 - silent: an unknown Ray layout: not a Ray worker we can recognise
        return False


# --- the identity of this process for providers built here ------------------------------------
# reader(role, env) -> identity attributes: set by an engine adapter that can tell more than the
# generic reading below (vLLM: API-server index, DP/TP/PP ranks read from its process objects,
# llm_otel.instrumentation.vllm.process); the newest one registered is used
_READER: list[Callable[[str | None, Mapping[str, str] | None], dict[str, Any]]] = []


def read_identity_with(reader: Callable[[str | None, Mapping[str, str] | None], dict[str, Any]]) -> None:
    """An engine adapter reports how to read this process's identity (``reader(role, env)`` returns
    :func:`process_identity`'s attributes; it must never raise). Used by
    :func:`current_process_identity` from now on, i.e. by every provider built afterwards."""
    _READER[:] = [reader]


def generic_process_identity(role: str | None = None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What any process can tell about itself: ``role`` (default ``frontend``), its multiprocessing
    name (none for ``MainProcess``), whether it is a Ray worker, pid, host and instance id."""
    name = multiprocessing.current_process().name
    return process_identity(
        role or "frontend", process_name=None if name == "MainProcess" else name, ray=in_ray_worker(), env=env
    )


def current_process_identity(role: str | None = None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The identity of this process for providers built from the environment: what the engine
    adapter's reader finds (:func:`read_identity_with`; vLLM's indices in a vLLM process), else
    :func:`generic_process_identity`. Never raises."""
    if _READER:
        return _READER[0](role, env)
    try:
        return generic_process_identity(role, env)
    except Exception as exc:  # noqa: BLE001 - identity must never stop the engine process
        process_errors().report(
            "process.identity.generic", exc, "process identity incomplete; only role and pid are set"
        )
        return process_identity(role or "frontend", env=env)


def server_budget_key() -> str | None:
    """The key under which the API servers of one serving launcher share their trace budget
    (:class:`llm_otel.sampling.SharedTraceBudget`), or None for a process that is not one of
    several API servers (it keeps its own budget).

    A process is an API server of a launcher when its identity (the resource of the providers
    llm-otel built here, :func:`tracked_identity`) has ``llm.process.api_server.index`` - vLLM's
    ``ApiServer_<i>`` of ``vllm serve --api-server-count N``, spawned by the launcher. The key is
    the launcher's pid (``os.getppid()``) and its start time in clock ticks since boot (field 22 of
    ``/proc/<ppid>/stat``, where readable), so that a later process that reuses the pid does not
    inherit the budget. Never raises."""
    try:
        ident = tracked_identity()
        if not ident or ident.get(A.LLM_PROCESS_API_SERVER_INDEX) is None:
            return None
        ppid = os.getppid()
        if ppid <= 1:  # orphaned: its launcher is gone
            return None
        try:
            with open(f"/proc/{ppid}/stat", "rb") as f:
                # the command name (field 2) may hold spaces and parentheses: split after its end
                start = f.read().rsplit(b")", 1)[1].split()[19].decode()
        except (OSError, IndexError, UnicodeDecodeError):
            start = "0"
        return f"launcher-{ppid}-{start}"
    except Exception as exc:  # noqa: BLE001 - the budget then stays per process
        process_errors().report("sampling.shared_budget", exc, "no shared trace budget key; per process")
        return None


set_default_budget_key(server_budget_key)  # the API servers of one launcher share one trace budget

"""Process identity: the resource attributes that tell one serving process from another.

A serving engine is many processes (vLLM: API servers, an engine core per data-parallel rank, a
worker per tensor/pipeline-parallel rank, possibly Ray actors on other hosts). Their telemetry only
stays apart in a backend when each process's resource says which process it is: two engine cores
exporting cumulative series under the same resource corrupt each other (CASES.md C14).

:func:`process_identity` builds the attributes from what the caller knows (any engine);
:func:`vllm_process_identity` reads them from vLLM's own objects in this process:

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

vLLM starts its children with ``multiprocessing`` (``spawn`` on CPU, ``fork`` or ``spawn`` on GPU):
the child's :func:`multiprocessing.current_process` is the ``Process`` object its parent built,
target keyword arguments included, so the engine core's ``dp_rank`` and the worker's ``rank`` and
``vllm_config`` are read from there before vLLM has initialised its process groups (the
``vllm.general_plugins`` entry point runs that early). Ray actors are not ``multiprocessing``
children; their identity comes from the vLLM object that loads the plugins (``EngineCore`` /
``WorkerWrapperBase``), found on the calling stack, which holds the same configuration.

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
import re
import socket
import sys
import uuid
import weakref
from typing import Any, Mapping

from llm_otel.errors import process_errors
from llm_otel.semconv import attributes as A

logger = logging.getLogger("llm_otel")

# the instance id of this process, made once per pid (a forked child gets its own)
_INSTANCE_IDS: dict[int, str] = {}
_IDENTITIES: dict[int, dict[str, Any]] = {}  # the last vLLM identity made in this pid
_API_SERVER_RE = re.compile(r"^ApiServer_(\d+)$")
_ENGINE_CORE_RE = re.compile(r"^(?:EngineCore|DPEngineCoreActor)(?:_DP(\d+))?$")
_WORKER_RE = re.compile(r"^VllmWorker-(\d+)$")
# frames searched for the vLLM object that loads the plugins (EngineCore.__init__ ->
# load_general_plugins -> plugin.register -> ... -> here)
_STACK_DEPTH = 24


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


def _suffix(role: str, api_server_index: int | None, dp_rank: int | None, pp_rank: int | None,
            tp_rank: int | None, pid: int) -> str:
    parts = [role]
    for prefix, value in (("api", api_server_index), ("dp", dp_rank), ("pp", pp_rank), ("tp", tp_rank)):
        if value is not None:
            parts.append(f"{prefix}{value}")
    parts.append(str(pid))
    return ".".join(parts)


def process_identity(role: str, *, process_name: str | None = None, api_server_index: int | None = None,
                     dp_rank: int | None = None, tp_rank: int | None = None, pp_rank: int | None = None,
                     ray: bool | None = None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
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
        instance = _INSTANCE_IDS.get(pid)
        if instance is None:
            instance = str(uuid.uuid4())
            _INSTANCE_IDS.clear()  # only this pid's id is ever needed (a fork child drops its parent's)
            _INSTANCE_IDS[pid] = instance
    attrs[A.SERVICE_INSTANCE_ID] = instance
    if inherited:
        attrs[A.LLM_PROCESS_INHERITED_INSTANCE_ID] = inherited
    for key, value in ((A.LLM_PROCESS_NAME, process_name), (A.LLM_PROCESS_API_SERVER_INDEX, api_server_index),
                       (A.LLM_PROCESS_DATA_PARALLEL_RANK, dp_rank), (A.LLM_PROCESS_TENSOR_PARALLEL_RANK, tp_rank),
                       (A.LLM_PROCESS_PIPELINE_PARALLEL_RANK, pp_rank), (A.LLM_PROCESS_RAY, ray)):
        if value is not None:
            attrs[key] = value
    return attrs


# --- re-labelling: resources of processes that learn their role late ---------------------------
# identity keys a relabel replaces, and the process_identity() keyword each comes from
_LABELS = {A.LLM_PROCESS_NAME: "process_name", A.LLM_PROCESS_API_SERVER_INDEX: "api_server_index",
           A.LLM_PROCESS_DATA_PARALLEL_RANK: "dp_rank", A.LLM_PROCESS_TENSOR_PARALLEL_RANK: "tp_rank",
           A.LLM_PROCESS_PIPELINE_PARALLEL_RANK: "pp_rank", A.LLM_PROCESS_RAY: "ray"}
_IDENTITY_KEYS = frozenset(_LABELS) | {A.LLM_PROCESS_ROLE, A.PROCESS_PID, A.HOST_NAME, A.SERVICE_INSTANCE_ID,
                                       A.LLM_PROCESS_INHERITED_INSTANCE_ID}
# the providers llm-otel built in this process (weakly): their *current* resource is re-labelled
# (SDK 1.45+ replaces a provider's resource with a merged copy after fork, in its own fork hook)
_TRACKED: list[weakref.ref] = []
_FORK_HOOKS = [0]  # after-fork re-label hooks registered (track); the newest one acts


def _resource_of(provider):
    sdk_config = getattr(provider, "_sdk_config", None)  # MeterProvider
    return getattr(sdk_config, "resource", None) if sdk_config is not None else getattr(provider, "resource", None)


def _tracked() -> list:
    """The distinct current resources of the live tracked providers."""
    providers = [r() for r in _TRACKED]
    _TRACKED[:] = [ref for ref, provider in zip(_TRACKED, providers) if provider is not None]
    out: list = []
    for provider in providers:
        resource = _resource_of(provider) if provider is not None else None
        if resource is not None and all(resource is not seen for seen in out):
            out.append(resource)
    return out


def track(*providers) -> None:
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
                os.register_at_fork(after_in_child=lambda n=_FORK_HOOKS[0]: n == _FORK_HOOKS[0]
                                    and _relabel_after_fork())


def tracked_identity() -> dict[str, Any] | None:
    """The identity attributes of the resource of this process's tracked providers (None when
    llm-otel built no providers here: the application's own resource is never re-labelled)."""
    for resource in _tracked():
        return {k: v for k, v in resource.attributes.items() if k in _IDENTITY_KEYS}
    return None


def _set_attributes(resource, attrs: Mapping[str, Any]) -> None:
    # The SDK's Resource is immutable by API; its attributes live in one BoundedAttributes that
    # every tracer, span and metric reader reads through the same Resource object, so replacing it
    # re-labels them all (opentelemetry-sdk 1.42: Resource.__init__ / .attributes). Only this
    # process's copy changes (after fork) or nothing has used it yet (a spawned child's bootstrap).
    from opentelemetry.attributes import BoundedAttributes

    resource._attributes = BoundedAttributes(attributes=dict(attrs), immutable=True)


def relabel(role: str, *, process_name: str | None = None, api_server_index: int | None = None,
            dp_rank: int | None = None, tp_rank: int | None = None, pp_rank: int | None = None,
            ray: bool | None = None) -> dict[str, Any] | None:
    """Give every tracked resource of this process (:func:`track`) the identity of ``role`` with
    these indices (see :func:`process_identity`; indices left None are removed), keeping every
    other attribute (service name, detectors' attributes). Call it before the process makes spans
    under its new role: spans made earlier keep the old label only in what they already exported.
    Returns the new identity attributes, or None when nothing is tracked here. Never raises."""
    resources = _tracked()
    if not resources:
        return None
    try:
        made = process_identity(role, process_name=process_name, api_server_index=api_server_index,
                                dp_rank=dp_rank, tp_rank=tp_rank, pp_rank=pp_rank, ray=ray)
        for resource in resources:
            kept = {k: v for k, v in resource.attributes.items() if k not in _IDENTITY_KEYS}
            if A.PROCESS_PARENT_PID in kept:
                kept[A.PROCESS_PARENT_PID] = os.getppid()
            _set_attributes(resource, {**kept, **made})
        for ref in _TRACKED:  # providers whose resource lives elsewhere too (the exporter process's)
            changed = getattr(ref(), "resource_changed", None)
            if changed is not None:
                changed()
        logger.debug("llm-otel: this process (pid %d) is a %s process: %s", os.getpid(), role,
                     made.get(A.SERVICE_INSTANCE_ID))
        return made
    except Exception as exc:  # noqa: BLE001 - identity must never stop the engine process
        process_errors().report("export.identity.relabel", exc,
                                f"could not re-label this process's resource as {role}")
        return None


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

        return getattr(ray_worker.global_worker, "mode", None) == ray_worker.WORKER_MODE
    except Exception:  # noqa: BLE001 - silent: an unknown Ray layout: not a Ray worker we can recognise
        return False


def _vllm_object_on_stack() -> tuple[str, Any, dict] | None:
    """(``"engine_core"`` | ``"worker"``, the object, its frame's locals) for the vLLM
    ``EngineCore`` or ``WorkerWrapperBase`` whose method called us (``EngineCore.__init__`` /
    ``WorkerWrapperBase.init_worker`` -> ``load_general_plugins``), else None."""
    frame = sys._getframe(1)
    for _ in range(_STACK_DEPTH):
        frame = frame.f_back
        if frame is None:
            return None
        local = frame.f_locals
        owner = local.get("self")
        if owner is None:
            continue
        for cls in type(owner).__mro__:
            if cls.__module__ == "vllm.v1.engine.core" and cls.__name__ == "EngineCore":
                return "engine_core", owner, local
            if cls.__module__ == "vllm.v1.worker.worker_base" and cls.__name__ == "WorkerWrapperBase":
                return "worker", owner, local
    return None


def vllm_api_server_index(process_name: str | None = None) -> int | None:
    """*i* of a vLLM API server process ``ApiServer_<i>`` (this process when ``process_name`` is
    None); None for any other process."""
    name = multiprocessing.current_process().name if process_name is None else process_name
    match = _API_SERVER_RE.match(name)
    return int(match.group(1)) if match else None


def _int(value: Any) -> int | None:
    try:
        return None if value is None or isinstance(value, bool) else int(value)
    except (TypeError, ValueError):
        return None


def _worker_ranks(rank: int | None, vllm_config: Any, why: list[str]) -> tuple[int | None, int | None, int | None]:
    """(dp, tp, pp) rank of a worker from its global rank within its engine and vLLM's
    ``ParallelConfig`` (ranks are laid out PP-major, then PCP, then TP: ``vllm.distributed.
    parallel_state.initialize_model_parallel``)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if parallel is None:
        why.append("no vllm_config.parallel_config")
        return None, None, None
    # data_parallel_index: vLLM's DP rank even for dense models, whose independent engines each
    # run with data_parallel_rank 0 in their process groups (vllm/config/parallel.py)
    dp = _int(getattr(parallel, "data_parallel_index", None))
    if dp is None:
        dp = _int(getattr(parallel, "data_parallel_rank", None))
    tp_size = _int(getattr(parallel, "tensor_parallel_size", None))
    pcp_size = _int(getattr(parallel, "prefill_context_parallel_size", 1)) or 1
    if rank is None or not tp_size:
        why.append("worker rank or tensor_parallel_size unreadable")
        return dp, None, None
    return dp, rank % tp_size, rank // (tp_size * pcp_size)


def vllm_dp_rank() -> int | None:
    """This process's data-parallel rank as its resource gives it (the identity made for its
    providers, else read now); None when unknown. vLLM labels its own metrics ``engine=<rank>``."""
    made = _IDENTITIES.get(os.getpid())
    if made is None:
        made = vllm_process_identity()
    return made.get(A.LLM_PROCESS_DATA_PARALLEL_RANK)


def vllm_process_identity(role: str | None = None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Resource attributes of this vLLM process (see the module table).

    ``role``: the caller's view of the role (``plugin.process_role()``); when the process is
    recognised as a vLLM engine core or worker, that wins (a Ray actor's multiprocessing name says
    nothing). Unreadable indices are left out with one ``info`` log line. Never raises."""
    try:
        made = _vllm_process_identity(role, env)
        _IDENTITIES.clear()
        _IDENTITIES[os.getpid()] = made
        return made
    except Exception as exc:  # noqa: BLE001 - identity must never stop the engine process
        process_errors().report("export.identity.vllm", exc, "process identity incomplete; only role and pid are set")
        return process_identity(role or "frontend", env=env)


def current_process_identity(role: str | None = None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The identity of this process for providers built from the environment: vLLM's indices where
    this is a vLLM process (:func:`vllm_process_identity`), else ``role`` (default ``frontend``),
    pid, host and instance id. Never raises."""
    return vllm_process_identity(role, env)


def vllm_stack_role() -> str | None:
    """In a Ray actor (whose process name says nothing): ``engine_core`` / ``worker`` when a vLLM
    ``EngineCore`` / ``WorkerWrapperBase`` up the calling stack is loading the plugins; else None."""
    if not in_ray_worker():  # elsewhere the process name tells (an in-process engine core is the frontend's)
        return None
    try:
        found = _vllm_object_on_stack()
    except Exception:  # noqa: BLE001 - silent: feature probe: no vLLM object on the stack
        return None
    return found[0] if found is not None else None


def _vllm_process_identity(role: str | None, env: Mapping[str, str] | None) -> dict[str, Any]:
    proc = multiprocessing.current_process()
    name = proc.name
    kwargs = getattr(proc, "_kwargs", None) or {}  # the Process's target kwargs, as its parent built it
    ray = in_ray_worker()
    why: list[str] = []
    api = dp = tp = pp = None
    match_api = _API_SERVER_RE.match(name)
    match_core = _ENGINE_CORE_RE.match(name)
    match_worker = _WORKER_RE.match(name)
    # a Ray actor is no multiprocessing child: the vLLM object loading the plugins says what it is.
    # Only there - an engine core vLLM runs inside the frontend's process is part of the frontend
    found = None if (match_api or match_core or match_worker or not ray) else _vllm_object_on_stack()
    if match_api:
        role = "frontend"
        api = int(match_api.group(1))
    elif match_core:
        role = "engine_core"
        dp = _int(kwargs.get("dp_rank"))
        if dp is None:
            dp = _int(match_core.group(1)) if match_core.group(1) else 0
    elif match_worker:
        role = "worker"
        dp, tp, pp = _worker_ranks(_int(kwargs.get("rank", match_worker.group(1))), kwargs.get("vllm_config"), why)
    elif found is not None:  # a Ray actor: an engine core or a worker
        role, owner, local = found
        config = getattr(owner, "vllm_config", None)
        parallel = getattr(config, "parallel_config", None)
        if role == "engine_core":
            # EngineCoreActorMixin sets data_parallel_index before EngineCore.__init__ loads plugins
            dp = _int(getattr(parallel, "data_parallel_index", None))
            if dp is None:
                dp = _int(getattr(parallel, "data_parallel_rank", None))
            if dp is None:
                why.append("no data-parallel rank on the engine core's parallel_config")
            if ray:
                name = f"DPEngineCoreActor_DP{dp}" if dp is not None else "DPEngineCoreActor"
        else:
            # init_worker's kwargs hold the rank the executor finally assigned (Ray re-sorts its
            # actors by node after creating them); global_rank otherwise
            worker_kwargs = local.get("kwargs")
            rank = _int(worker_kwargs.get("rank")) if isinstance(worker_kwargs, dict) else None
            if rank is None:
                rank = _int(getattr(owner, "global_rank", getattr(owner, "rpc_rank", None)))
            dp, tp, pp = _worker_ranks(rank, config, why)
            if ray:
                name = "RayWorkerWrapper"
    else:
        role = role or "frontend"
        if role != "frontend":
            why.append(f"process {name!r} is not one vLLM names")
    if why:
        logger.info("llm-otel: some indices of this vLLM %s process are left out of its resource: %s",
                    role, "; ".join(why))
    return process_identity(role, process_name=None if name == "MainProcess" else name, api_server_index=api,
                            dp_rank=dp, tp_rank=tp, pp_rank=pp, ray=ray, env=env)

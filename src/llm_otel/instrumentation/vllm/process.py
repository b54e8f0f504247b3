"""Which vLLM process this is: the identity (role, ranks) of a vLLM process, read from vLLM's own
objects, for its resource (:mod:`llm_otel.process.identity` holds the table of attributes).

vLLM starts its children with ``multiprocessing`` (``spawn`` on CPU, ``fork`` or ``spawn`` on GPU):
the child's :func:`multiprocessing.current_process` is the ``Process`` object its parent built,
target keyword arguments included, so the engine core's ``dp_rank`` and the worker's ``rank`` and
``vllm_config`` are read from there before vLLM has initialised its process groups (the
``vllm.general_plugins`` entry point runs that early). Ray actors are not ``multiprocessing``
children; their identity comes from the vLLM object that loads the plugins (``EngineCore`` /
``WorkerWrapperBase``), found on the calling stack, which holds the same configuration.

Importing this module reports the reader to the process runtime
(:func:`llm_otel.process.identity.read_identity_with`): the providers built in this process from
then on carry vLLM's labels. ``llm_otel.instrumentation.vllm`` and its plugin import it.
Anything that cannot be read leaves its attribute out with one log line; nothing here raises.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import sys
from collections.abc import Mapping
from typing import Any

from llm_otel.errors import process_errors
from llm_otel.process.identity import in_ray_worker, process_identity, read_identity_with
from llm_otel.semconv import attributes as A

logger = logging.getLogger("llm_otel")

_IDENTITIES: dict[int, dict[str, Any]] = {}  # the last vLLM identity made in this pid
_API_SERVER_RE = re.compile(r"^ApiServer_(\d+)$")
_ENGINE_CORE_RE = re.compile(r"^(?:EngineCore|DPEngineCoreActor)(?:_DP(\d+))?$")
_WORKER_RE = re.compile(r"^VllmWorker-(\d+)$")
# frames searched for the vLLM object that loads the plugins (EngineCore.__init__ ->
# load_general_plugins -> plugin.register -> ... -> here)
_STACK_DEPTH = 24


def _vllm_object_on_stack() -> tuple[str, Any, dict] | None:
    """(``"engine_core"`` | ``"worker"``, the object, its frame's locals) for the vLLM
    ``EngineCore`` or ``WorkerWrapperBase`` whose method called us (``EngineCore.__init__`` /
    ``WorkerWrapperBase.init_worker`` -> ``load_general_plugins``), else None."""
    frame = sys._getframe(1)
    for _ in range(_STACK_DEPTH):
        back = frame.f_back
        if back is None:
            return None
        frame = back
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
        process_errors().report(
            "instrumentation.vllm.identity", exc, "process identity incomplete; only role and pid are set"
        )
        return process_identity(role or "frontend", env=env)


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
        logger.info(
            "llm-otel: some indices of this vLLM %s process are left out of its resource: %s", role, "; ".join(why)
        )
    return process_identity(
        role,
        process_name=None if name == "MainProcess" else name,
        api_server_index=api,
        dp_rank=dp,
        tp_rank=tp,
        pp_rank=pp,
        ray=ray,
        env=env,
    )


def engine_process_role(process_name: str) -> str | None:
    """``engine_core`` / ``worker`` for the multiprocessing name vLLM gives a child it starts
    (``EngineCore_DP<r>``, ``VllmWorker-<rank>``), else None."""
    return (
        "engine_core" if _ENGINE_CORE_RE.match(process_name) else "worker" if _WORKER_RE.match(process_name) else None
    )


# the providers built in this process from now on carry vLLM's labels
read_identity_with(vllm_process_identity)

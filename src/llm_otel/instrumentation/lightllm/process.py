"""Which LightLLM process this is: role and ranks for its resource (``llm_otel.process.identity``).

LightLLM's launcher (``python -m lightllm.server.api_server``) sets the ``spawn`` start method and
starts every stage with ``multiprocessing.Process(target=<start function>, args=...)`` without a
name (``lightllm/utils/start_utils.py``), then runs the HTTP tier as a separate ``gunicorn``
program whose master forks the HTTP workers. Under ``opentelemetry-instrument`` each child builds
its providers while ``sitecustomize`` runs, before multiprocessing has unpickled the function it
will run; the function is known when multiprocessing bootstraps the ``Process`` object the parent
pickled (``spawn._main`` -> ``Process._bootstrap``, with its target and arguments), where
:func:`relabel_this_process` re-labels the resource (a child started with ``fork``: multiprocessing's
after-fork hooks, which ``spawn`` does not run). A gunicorn worker is re-labelled right after the fork; an HTTP worker that builds
``HttpServerManager`` is ``frontend`` whatever started it.

==========================================================================  ===================  =========================
process target (``module:function``), main fc72ffab / v1.0.0 / v1.0.1        ``llm.process.role``  indices
==========================================================================  ===================  =========================
``python -m lightllm.server.api_server`` (``sys.orig_argv``)                 ``launcher``
``gunicorn ... lightllm.server.api_http:app`` master / forked worker         ``http_master`` /
                                                                             ``frontend``
``router.manager:start_router_process``                                      ``router``           (v1.0.x with one GPU: the
                                                                                                  model runs in here)
``router.model_infer.model_rpc:_init_env``                                   ``worker``           tp, dp rank
``detokenization.manager:start_detokenization_process``                      ``detokenizer``
``visualserver.manager:start_visual_process`` / ``.model_infer.model_rpc:    ``visual`` /
_init_env``                                                                  ``visual_worker``
``audioserver.manager:start_audio_process`` (main)                          ``audio``
``embed_cache.manager:start_cache_manager``                                  ``cache``
``metrics.manager:start_metric_manager``                                     ``metrics``
``health_monitor.manager:start_health_check_process``                        ``health_monitor``
P/D ``*_kv_move_manager`` / ``*_trans_process`` / ``up_status`` ``_init_env``  ``kv_transfer``
==========================================================================  ===================  =========================

Model-infer ranks (``_init_env`` arguments): main and v1.0.1 pass ``(args, rank, rank_in_node,
node_world_size, ...)``; LightLLM's ``dist_utils.init_distributed_env`` makes ``dp_world_size =
world_size // dp``, ``rank_in_dp = rank % dp_world_size`` (the TP rank reported) and the DP rank
``rank // dp_world_size``. v1.0.0 passes ``(args, tp_rank, ...)`` and has no DP groups of that kind:
its backends write the shared-memory results on ``tp_rank < dp_size`` (``ContinuesBatchBackend.
post_handel``), so those ranks are the masters, each its own DP index (``_init_reqs``:
``cur_dp_index = self.tp_rank``).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from typing import Any

from llm_otel.errors import process_errors
from llm_otel.process.bootstrap import at_forked_bootstrap, at_spawned_bootstrap

logger = logging.getLogger("llm_otel")

_S = "lightllm.server."
_KV = f"{_S}router.model_infer.mode_backend.continues_batch.pd_mode."
# (module, function) of a multiprocessing target -> llm.process.role
TARGETS: dict[tuple[str, str], str] = {
    (f"{_S}router.manager", "start_router_process"): "router",
    (f"{_S}router.model_infer.model_rpc", "_init_env"): "worker",
    (f"{_S}detokenization.manager", "start_detokenization_process"): "detokenizer",
    (f"{_S}visualserver.manager", "start_visual_process"): "visual",
    (f"{_S}visualserver.model_infer.model_rpc", "_init_env"): "visual_worker",
    (f"{_S}audioserver.manager", "start_audio_process"): "audio",
    (f"{_S}embed_cache.manager", "start_cache_manager"): "cache",
    (f"{_S}metrics.manager", "start_metric_manager"): "metrics",
    (f"{_S}health_monitor.manager", "start_health_check_process"): "health_monitor",
    (f"{_KV}decode_node_impl.decode_kv_move_manager", "_init_env"): "kv_transfer",
    (f"{_KV}decode_node_impl.decode_trans_process", "_init_env"): "kv_transfer",
    (f"{_KV}decode_node_impl.up_status", "_init_env"): "kv_transfer",
    (f"{_KV}prefill_node_impl.prefill_kv_move_manager", "_init_env"): "kv_transfer",
    (f"{_KV}prefill_node_impl.prefill_trans_process", "_init_env"): "kv_transfer",
}
HTTP_APP = "lightllm.server.api_http:app"
LAUNCHER = "lightllm.server.api_server"

# what this process was found to be: (role, {identity keyword: value}); the worker's master test
# reads it (v1.0.0 has no dist_utils rank function)
_found: dict[int, tuple[str, dict[str, Any]]] = {}


def _int(value: Any) -> int | None:
    try:
        return None if value is None or isinstance(value, bool) else int(value)
    except (TypeError, ValueError):
        return None


def _arg(args: Any, name: str) -> Any:
    return args.get(name) if isinstance(args, dict) else getattr(args, name, None)


def worker_ranks(target_args: tuple) -> dict[str, Any]:
    """``{"tp_rank", "dp_rank", "master"}`` of a model-infer ``_init_env`` call (see the module
    docstring for the two signatures); values that cannot be read are left out."""
    out: dict[str, Any] = {}
    if len(target_args) < 2:
        return out
    args, rank = target_args[0], _int(target_args[1])
    if rank is None:
        return out
    dp = _int(_arg(args, "dp")) or 1
    # main / v1.0.1: (args, rank, rank_in_node: int, node_world_size: int, info_queue, ...);
    # v1.0.0: (args, tp_rank, info_queue, ...)
    v1_0_0 = not (len(target_args) > 3 and _int(target_args[2]) is not None and _int(target_args[3]) is not None)
    if v1_0_0:
        out["tp_rank"] = rank
        out["master"] = rank < dp
        if rank < dp:
            out["dp_rank"] = rank
        return out
    world = _int(_arg(args, "tp"))
    if not world or world % dp:
        out["tp_rank"] = rank
        return out
    dp_world = world // dp
    out.update(tp_rank=rank % dp_world, dp_rank=rank // dp_world, master=rank % dp_world == 0)
    return out


def classify(proc: Any = None, argv: list[str] | None = None) -> tuple[str, dict[str, Any]] | None:
    """(role, identity keywords plus ``master`` for a model-infer worker) of the LightLLM process
    ``proc`` (default: this one) from its multiprocessing target, or of a main process from its
    command line (``argv``: default ``sys.orig_argv``); None when it is no LightLLM process we
    know (an application embedding LightLLM keeps ``frontend``)."""
    proc = multiprocessing.current_process() if proc is None else proc
    target = getattr(proc, "_target", None)
    if target is not None:
        key: tuple[Any, Any] = (getattr(target, "__module__", None), getattr(target, "__name__", None))
        role = TARGETS.get(key)
        if role is None:
            return None
        extra: dict[str, Any] = {"process_name": f"{key[0]}:{key[1]}"}
        if role == "worker":
            extra.update(worker_ranks(tuple(getattr(proc, "_args", ()) or ())))
        return role, extra
    argv = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    if HTTP_APP in argv and any(os.path.basename(a).startswith("gunicorn") for a in argv):
        return "http_master", {}
    if LAUNCHER in argv or any(a.endswith(os.path.join("lightllm", "server", "api_server.py")) for a in argv):
        return "launcher", {}
    return None


def relabel_this_process(role: str | None = None, **extra: Any) -> None:
    """Re-label this process's resource (:func:`llm_otel.process.identity.relabel`) as what
    :func:`classify` finds, or as ``role``/``extra`` when given. Never raises."""
    try:
        if role is None:
            found = classify()
            if found is None:
                return
            role, extra = found
        from llm_otel.process.identity import relabel

        _found.clear()
        _found[os.getpid()] = (role, dict(extra))
        master = extra.pop("master", None)
        relabel(role, **extra)
        if exports(role, master):  # its exporter process starts now, not with its first spans
            _prewarm()
    except Exception as exc:  # noqa: BLE001
        process_errors().report(
            "instrumentation.lightllm.process.relabel",
            exc,
            "could not tell which LightLLM process this is; its spans keep the old labels",
        )


def relabel_as_found() -> None:
    """Give providers built after this process was found to be a LightLLM process (the launcher,
    a child once bootstrapped, a forked HTTP worker) the labels found then; nothing when none was
    found. Never raises."""
    made = found()
    if made is not None:
        relabel_this_process(made[0], **made[1])


EXPORTING_ROLES = ("frontend", "router", "worker")
"""The LightLLM processes that emit spans: the HTTP worker (request spans), the router (engine
steps; with v1.0.x on one GPU the model runs there too) and the model-infer worker of a DP group's
master rank (device steps, ``llm.logit_dist``)."""


def exports(role: str, master: bool | None = None) -> bool:
    """Whether a LightLLM process of ``role`` will export spans, so that its exporter process is
    started as soon as the process is known (:func:`_prewarm`: its start-up, about a second of CPU,
    overlaps the model's loading instead of the first requests' steps, whose spans would otherwise
    wait for it). A model-infer worker only when it is (or may be: ``master`` None) its DP group's
    master rank; the detokenizer, cache, metrics and other stages export nothing and start none."""
    return role in EXPORTING_ROLES and not (role == "worker" and master is False)


def _prewarm() -> None:
    from opentelemetry import trace

    from llm_otel.export.offload import prewarm

    prewarm(trace.get_tracer_provider())


def found() -> tuple[str, dict[str, Any]] | None:
    """What :func:`relabel_this_process` found in this process (None before, or elsewhere)."""
    return _found.get(os.getpid())


def is_master_worker() -> bool | None:
    """For a model-infer process: whether it is the master of its DP group, from its ``_init_env``
    arguments (v1.0.0 has no ``dist_utils.get_current_rank_in_dp``); None when unknown."""
    made = found()
    if made is None or made[0] != "worker":
        # the model server runs inside the router when v1.0.x serves on one GPU: rank 0
        return True if made is not None and made[0] == "router" else None
    return made[1].get("master")


_installed = False


def install() -> None:
    """Label this process now (launcher, gunicorn master) and have it re-labelled when it turns out
    to be a LightLLM child (multiprocessing bootstrap, spawn or fork) or a forked gunicorn worker.
    Idempotent; never raises."""
    global _installed
    if _installed:
        return
    _installed = True
    try:
        relabel_this_process()
        if "--multiprocessing-fork" in sys.argv:  # a spawned child, before it knows its target
            at_spawned_bootstrap(_relabel_as)
        # a child started with fork: multiprocessing's after-fork hooks run in its bootstrap
        # (spawn's SpawnProcess._after_fork runs none of them)
        at_forked_bootstrap(relabel_this_process)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_after_os_fork)
    except Exception as exc:  # noqa: BLE001
        process_errors().report(
            "instrumentation.lightllm.process.install", exc, "LightLLM process labels not installed"
        )


def _relabel_as(process: Any) -> None:
    """At a spawned child's bootstrap (:func:`~llm_otel.process.bootstrap.at_spawned_bootstrap`):
    re-label as what the ``Process`` object its parent pickled says, before the target runs."""
    found = classify(process)
    if found is not None:
        relabel_this_process(*found[:1], **found[1])


def _after_os_fork() -> None:
    # a child of the gunicorn master is an HTTP worker (the master forks nothing else)
    made = _found.get(os.getppid())
    if made is not None and made[0] == "http_master":
        relabel_this_process("frontend")

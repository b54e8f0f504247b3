"""What runs when a process starts: the bootstrap of a child that ``multiprocessing`` spawned or
forked, where an engine's process learns what it is (its role, from the ``Process`` object its parent
pickled) before the engine's code runs there.

* :func:`at_spawned_bootstrap`: a child started with ``spawn`` (a fresh interpreter, where
  ``opentelemetry-instrument`` runs before the child knows what it is): one patch of
  ``BaseProcess._bootstrap``, callbacks called once with the ``Process`` object before its target
  runs. Used by LightLLM's re-labelling (:mod:`llm_otel.instrumentation.lightllm.process`) and
  vLLM's engine-process providers (:mod:`llm_otel.instrumentation.vllm.plugin`).
* :func:`at_forked_bootstrap`: a child started with ``fork`` (``multiprocessing``'s after-fork
  hooks, which ``spawn`` does not run), after the child is named and before its target runs.

Threads that must run again in a forked child register with :mod:`llm_otel.process.forks`;
resources are re-labelled after ``os.fork`` by :mod:`llm_otel.process.identity`.
"""

from __future__ import annotations

import multiprocessing.util
from collections.abc import Callable
from typing import Any

from llm_otel.errors import guard

_bootstrap_callbacks: list[Callable[[Any], None]] = []
_bootstrap_original: Any = None  # multiprocessing's own BaseProcess._bootstrap while ours is installed


def at_spawned_bootstrap(callback: Callable[[Any], None]) -> None:
    """In a child that multiprocessing spawned, where ``opentelemetry-instrument`` runs before the
    child knows what it is: call ``callback(process)`` once, when multiprocessing runs the
    ``Process`` object its parent pickled (``spawn._main`` -> ``Process._bootstrap`` -> ``run()``),
    after ``_bootstrap`` made it the current process with its parent known and before ``run()``
    calls the target: its name, target and arguments tell the process's role. (A spawned child
    runs none of multiprocessing's after-fork hooks, so this patches ``BaseProcess._bootstrap`` of
    this interpreter; the patch removes itself at its first call.) A callback already registered is
    not added again; a failing one is counted and logged once (site
    ``instrumentation.process_bootstrap``); never raises."""
    global _bootstrap_original
    from multiprocessing.process import BaseProcess

    if callback in _bootstrap_callbacks:
        return
    _bootstrap_callbacks.append(callback)
    if _bootstrap_original is not None:
        return
    original = _bootstrap_original = BaseProcess.__dict__["_bootstrap"]

    def _bootstrap(self: BaseProcess, *args: Any, **kwargs: Any) -> Any:
        callbacks = list(_bootstrap_callbacks)
        _remove_bootstrap_patch()
        run = self.run

        def _run() -> None:
            self.__dict__.pop("run", None)
            for call in callbacks:
                with guard(
                    "instrumentation.process_bootstrap", message="could not label or set up this process at its start"
                ):
                    call(self)
            return run()

        self.run = _run  # type: ignore[method-assign]  # per instance, removed again in _run
        return original(self, *args, **kwargs)

    BaseProcess._bootstrap = _bootstrap  # type: ignore[attr-defined]  # private, not in typeshed


def cancel_at_spawned_bootstrap(callback: Callable[[Any], None]) -> None:
    """Undo :func:`at_spawned_bootstrap` for ``callback`` if the bootstrap has not run yet
    (``uninstrument()``); the patch goes with the last callback."""
    if callback in _bootstrap_callbacks:
        _bootstrap_callbacks.remove(callback)
    if not _bootstrap_callbacks:
        _remove_bootstrap_patch()


def _remove_bootstrap_patch() -> None:
    global _bootstrap_original
    from multiprocessing.process import BaseProcess

    _bootstrap_callbacks.clear()
    if _bootstrap_original is not None:
        BaseProcess._bootstrap = _bootstrap_original  # type: ignore[attr-defined]  # private, not in typeshed
        _bootstrap_original = None


class _Anchor:
    """multiprocessing's after-fork registry holds its objects weakly: one per callback, kept here."""

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback


_anchors: list[_Anchor] = []


def at_forked_bootstrap(callback: Callable[[], None]) -> None:
    """Call ``callback()`` in every child that ``multiprocessing`` starts from this process with
    ``fork`` (in its bootstrap: after the child is named, before its target runs), as long as this
    process lives. The callback must not raise (multiprocessing would abort the child's start)."""
    anchor = _Anchor(callback)
    _anchors.append(anchor)
    multiprocessing.util.register_after_fork(anchor, _call)


def _call(anchor: _Anchor) -> None:
    anchor.callback()

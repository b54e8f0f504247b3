"""A vLLM process going away: the frontend stopping its engine processes gives them time to flush
their telemetry before vLLM kills them, and an engine process starts its own flush as vLLM begins
its teardown (docs/vllm.md "Process lifecycle").

Engine functions wrapped (vLLM 0.32): ``vllm.v1.engine.utils.shutdown(procs, timeout)`` /
``vllm.v1.utils.shutdown`` (``procs``: ``multiprocessing.Process``-like, ``is_alive()``, ``pid``,
``terminate()``), ``EngineCore.shutdown``, ``WorkerProc.shutdown``.
"""

from __future__ import annotations

import time

from llm_otel.errors import guard
from llm_otel.telemetry import Telemetry


def flush_before_kill(telemetry: Telemetry, hook: str):
    """vLLM's process-manager ``shutdown(procs, timeout)``: SIGTERM, then SIGKILL once
    ``timeout`` seconds have passed (0 under the OpenAI server). When vLLM's timeout is shorter
    than the flush deadline, the processes it stops are
    sent SIGTERM first and vLLM proceeds once each of them (and their workers) has flushed
    its telemetry or exited, at the latest after the deadline. A longer vLLM timeout (``None``
    means its 5 s) is left alone. This process's own flush waits for its exit (an offline
    ``LLM`` collected mid-program stops its engine without ending the program)."""
    # their deadlines start a little after our SIGTERM (when their shutdown begins): the margin
    # lets a process that gives up say so before vLLM kills it
    window = telemetry.settings.flush_deadline_s + 0.5

    def wrapper(wrapped, instance, args, kwargs):
        with guard(hook, telemetry.errors) as g:
            from llm_otel.process.lifecycle import wait_flushed

            procs = kwargs.pop("procs", args[0] if args else None)
            timeout = kwargs.pop("timeout", args[1] if len(args) > 1 else None)
            if timeout is not None and timeout < window:
                # SIGTERM now; vLLM's own SIGTERM and kill follow once they flushed or exited
                live = [p for p in procs if p.is_alive() and p.pid is not None]
                for p in live:
                    p.terminate()
                wait_flushed([p.pid for p in live], time.monotonic() + window)
        if g.failed:
            return wrapped(*args, **kwargs)
        return wrapped(procs, timeout=timeout, **kwargs)

    return wrapper


class ProcessHooks:
    """Mixin of :class:`~llm_otel.instrumentation.vllm.adapter.VLLMAdapter`: the wrapper factories
    of the process-lifecycle hooks."""

    telemetry: Telemetry

    def process_shutdown(self, hook: str):
        """vLLM's process-manager ``shutdown(procs, timeout)``: :func:`flush_before_kill`."""
        return flush_before_kill(self.telemetry, hook)

    def process_exiting(self, hook: str):
        """EngineCore.shutdown / WorkerProc.shutdown: :func:`flush_at_exit`."""
        return flush_at_exit(hook)


def flush_at_exit(hook: str):
    """EngineCore.shutdown / WorkerProc.shutdown: this engine process starts its flush now,
    before vLLM's own teardown (the engine core then waits for its workers, which flush at the
    same time)."""

    def wrapper(wrapped, instance, args, kwargs):
        from llm_otel.process.lifecycle import begin_shutdown

        begin_shutdown()
        return wrapped(*args, **kwargs)

    return wrapper

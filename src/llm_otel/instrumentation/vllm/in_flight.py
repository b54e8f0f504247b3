"""Requests in flight when vLLM's engine fails or this process exits: each one still tracked ends
with ``error.type`` (the exception's class name, or ``shutdown``) and its metrics are counted, so
nothing vLLM will never finish is lost. A mixin of :class:`~.adapter.VLLMAdapter`, which holds the
per-engine request state it ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from llm_otel.errors import guard
from llm_otel.telemetry import RequestRecord

if TYPE_CHECKING:
    from collections.abc import MutableMapping

    from llm_otel.instrumentation.vllm.requests import EngineState
    from llm_otel.telemetry import Telemetry

_REPORTED = "_llm_otel_reported"  # set on an exception a hook has reported (one span per failure)


class InFlight:
    """Ends the requests an engine (or this process) leaves unfinished."""

    telemetry: Telemetry
    _states: MutableMapping[Any, EngineState]  # OutputProcessor -> its tracked requests

    def _fail_in_flight(self, hook: str, engine: Any, error: BaseException) -> bool:
        """End every request still tracked for ``engine`` with ``error.type`` = the exception's
        class name; True if there was any. The exception's message is not recorded (it can quote
        the prompt)."""
        with guard(hook, self.telemetry.errors):
            if not self._end_in_flight(
                self._states.get(getattr(engine, "output_processor", None)), type(error).__name__
            ):
                return False
            try:
                setattr(error, _REPORTED, True)
            except Exception:  # noqa: BLE001 - silent: exceptions with __slots__
                pass
            return True
        return False

    # --- process lifecycle ------------------------------------------------------------------
    def engine_failed(self, hook: str):
        """OutputProcessor.propagate_error(e): vLLM hands ``e`` (``EngineDeadError`` when the engine
        core died) to every waiting request; each request in flight ends with ``error.type`` =
        the exception's class name, its metrics counted."""

        def wrapper(wrapped, instance, args, kwargs):
            with guard(hook, self.telemetry.errors):
                error = kwargs.get("e", args[0] if args else None)
                if isinstance(error, BaseException):
                    self._end_in_flight(self._states.get(instance), type(error).__name__)
            return wrapped(*args, **kwargs)

        return wrapper

    def fail_in_flight_at_exit(self) -> int:
        """End every request still tracked when this process exits (``error.type=shutdown``):
        vLLM will never finish them, and their spans and metrics would otherwise be lost."""
        return sum(
            self._end_in_flight(state, "shutdown", "the process exited before the request finished")
            for state in list(self._states.values())
        )

    def _end_in_flight(self, state: EngineState | None, error_type: str, message: str | None = None) -> int:
        """End every request ``state`` still tracks with ``error_type``; returns how many."""
        if state is None:
            return 0
        n = 0
        for rid in list(state.records):
            rec = cast(RequestRecord, state.pop(rid))  # tracked: not None
            rec.error_type = error_type
            if message is not None:
                rec.error_message = message
            self.telemetry.finish(rec)
            n += 1
        return n

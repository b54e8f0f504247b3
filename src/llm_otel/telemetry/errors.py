"""The core's name for :mod:`llm_otel.errors` (``HookErrors``, ``guard``, ``process_errors``).

The implementation lives in the leaf module ``llm_otel.errors`` because the layers below the core
report failures in the same style (exporters, the exporter-process buffer, the process lifecycle,
GPU helpers, the health endpoint): importing ``llm_otel.telemetry.errors`` runs
``llm_otel.telemetry``'s ``__init__``, which imports ``signals`` and ``gpu`` - a cycle from those,
and an upward import from ``export``.
"""

from llm_otel.errors import HookErrors, guard, process_errors

__all__ = ["HookErrors", "guard", "process_errors"]

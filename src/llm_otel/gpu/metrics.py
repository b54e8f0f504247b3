"""Per-GPU utilisation and memory gauges with the engine phase, read from NVML at collection time.

``llm.gpu.utilization`` (1), ``llm.gpu.memory.usage`` (By) - both with ``hw.id`` (NVML index) and
``llm.engine.phase`` from a :class:`~llm_otel.telemetry.engine_state.PhaseClock` - and
``llm.gpu.memory.limit`` (By). NVML is read in the metric reader's thread (a Prometheus scrape or
the periodic OTLP export), never on the engine's loop. Without NVML (no driver, no GPU, no
``nvidia-ml-py``) nothing is registered and one line is logged: the metrics are absent, not zero.
A failing read returns no points for that collection (logged once).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from llm_otel.errors import process_errors
from llm_otel.semconv import attributes as A
from llm_otel.semconv import metrics as M

logger = logging.getLogger("llm_otel")

Device = tuple[int, float, int, int]  # (NVML index, utilisation fraction, memory used By, memory total By)


class DeviceSource(Protocol):
    """Per-device readings, like :meth:`llm_otel.gpu.nvml.NvmlSource.devices`."""

    def devices(self) -> Sequence[Device]:
        """One :data:`Device` per visible GPU. Raises any exception when unavailable."""
        ...


class GpuMetrics:
    """Registers the GPU gauges on ``meter`` for ``source`` (an object with ``devices()`` like
    :class:`llm_otel.gpu.nvml.NvmlSource`); ``phase`` is a zero-argument callable returning the
    engine phase now."""

    def __init__(self, meter: Meter, source: DeviceSource, phase: Callable[[], str]) -> None:
        self.source = source
        self.phase = phase

        def util(_options: CallbackOptions) -> list[Observation]:
            return [
                Observation(u, {A.HW_ID: str(i), A.LLM_ENGINE_PHASE: ph}) for ph, (i, u, _used, _total) in self._read()
            ]

        def used(_options: CallbackOptions) -> list[Observation]:
            return [
                Observation(b, {A.HW_ID: str(i), A.LLM_ENGINE_PHASE: ph}) for ph, (i, _u, b, _total) in self._read()
            ]

        def limit(_options: CallbackOptions) -> list[Observation]:
            return [Observation(total, {A.HW_ID: str(i)}) for _ph, (i, _u, _b, total) in self._read()]

        meter.create_observable_gauge(
            M.LLM_GPU_UTILIZATION,
            callbacks=[util],
            unit=M.LLM_GPU_UTILIZATION_UNIT,
            description="GPU utilisation (NVML) with the engine phase.",
        )
        meter.create_observable_gauge(
            M.LLM_GPU_MEMORY_USAGE,
            callbacks=[used],
            unit=M.LLM_GPU_MEMORY_USAGE_UNIT,
            description="GPU memory in use (NVML) with the engine phase.",
        )
        meter.create_observable_gauge(
            M.LLM_GPU_MEMORY_LIMIT,
            callbacks=[limit],
            unit=M.LLM_GPU_MEMORY_LIMIT_UNIT,
            description="GPU memory size (NVML).",
        )

    def _read(self) -> list[tuple[str, Device]]:
        try:
            devices = self.source.devices()
            phase = self.phase()
        except Exception as exc:  # noqa: BLE001 - NVMLError mid-run: no points this time
            process_errors().report(
                "gpu.metrics.read", exc, "NVML read failed; GPU metrics are absent until it recovers"
            )
            return []
        return [(phase, d) for d in devices]


def register_gpu_metrics(
    meter: Meter, phase: Callable[[], str], source: DeviceSource | None = None
) -> GpuMetrics | None:
    """The GPU gauges on ``meter`` from NVML (or ``source``); None, with one log line, without NVML."""
    if source is None:
        from llm_otel.gpu.nvml import NvmlSource

        try:
            source = NvmlSource()
        except RuntimeError as exc:
            logger.info("llm-otel: GPU metrics absent (%s)", exc)
            return None
    return GpuMetrics(meter, source, phase)

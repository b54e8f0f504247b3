"""GPU utilisation signals for the adaptive sampler: an NVML poller, or any pluggable source.

:class:`UtilizationPoller` runs a daemon thread that reads a :class:`SignalSource` every
``period_s`` seconds and keeps an exponentially weighted moving average (``alpha`` per sample) of
utilisation in [0, 1]. Readers (the sampler, per root span) only read a float. The NVML source
averages ``nvmlDeviceGetUtilizationRates().gpu`` (percent -> fraction) and memory used/total
(``nvmlDeviceGetMemoryInfo``) over the devices the process can see (``CUDA_VISIBLE_DEVICES`` as
indices). No NVML, no driver or no GPU: the source is unavailable, reported once, and
``utilization`` stays None so the sampler uses its base rate. NVML errors mid-run: the poller
backs off (doubling its period up to 60 s) and reports unavailable until a read succeeds.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any, Protocol

from llm_otel.errors import process_errors

logger = logging.getLogger("llm_otel")


class SignalSource(Protocol):
    """Anything that returns current utilisation in [0, 1] (GPU, queue depth, KV-cache usage)."""

    def read(self) -> float:
        """Current utilisation in [0, 1]. Raises any exception when unavailable."""


class UtilizationReader(Protocol):
    """What the adaptive sampler and the signals read utilisation from: a
    :class:`UtilizationPoller` or alike."""

    @property
    def utilization(self) -> float | None:
        """Utilisation in [0, 1], or None while unknown."""
        ...

    def stop(self) -> None:
        """Stop reading (a poller's thread)."""
        ...


class NvmlSource:
    """Mean GPU utilisation (fraction) of the visible devices via pynvml / nvidia-ml-py.

    Raises RuntimeError at construction when NVML or a GPU is not available.
    """

    def __init__(self) -> None:
        try:
            import pynvml  # provided by nvidia-ml-py
        except ImportError as exc:
            raise RuntimeError("nvidia-ml-py (pynvml) is not installed") from exc
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
            raise RuntimeError(f"NVML unavailable: {exc}") from exc
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        indices = list(range(count))
        if visible:
            try:
                indices = [int(v) for v in visible.split(",") if v.strip() and int(v) < count]
            except ValueError:
                pass  # UUIDs or MIG ids: use every device
        if not indices:
            raise RuntimeError("no GPU visible to NVML")
        self._nvml = pynvml
        self.indices = indices
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
        self.memory_fraction = 0.0
        self.memory_used_bytes = 0  # summed over the visible devices at the last read
        self.memory_total_bytes = 0

    def devices(self) -> list[tuple[int, float, int, int]]:
        """Per visible device: (NVML index, utilisation fraction over NVML's last sample period,
        memory used bytes, memory total bytes). Raises any NVML error."""
        out = []
        for index, h in zip(self.indices, self._handles, strict=True):  # one handle per index, built together
            info = self._nvml.nvmlDeviceGetMemoryInfo(h)
            out.append(
                (index, self._nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0, int(info.used), int(info.total))
            )
        return out

    def read(self) -> float:
        util = mem = 0.0
        used = total = 0
        for h in self._handles:
            util += self._nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
            info = self._nvml.nvmlDeviceGetMemoryInfo(h)
            mem += info.used / info.total if info.total else 0.0
            used += int(info.used)
            total += int(info.total)
        self.memory_fraction = mem / len(self._handles)
        self.memory_used_bytes, self.memory_total_bytes = used, total
        return util / len(self._handles)


class UtilizationPoller:
    """Background EWMA of a signal source. ``utilization`` is None until a first good read."""

    def __init__(self, source: SignalSource | None, period_s: float = 1.0, alpha: float = 0.3) -> None:
        if not 0 < alpha <= 1 or period_s <= 0:
            raise ValueError("alpha must be in (0, 1] and period_s > 0")
        self.source = source
        self.period_s = period_s
        self.alpha = alpha
        self.utilization: float | None = None
        self.available = source is not None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.owner: weakref.ref[Any] | None = (
            None  # weakref to the tracer provider whose collection stops it (build_providers)
        )

    @classmethod
    def from_nvml(cls, period_s: float = 1.0, alpha: float = 0.3) -> UtilizationPoller:
        """A poller on NVML, or an unavailable one (logged once) when NVML cannot be used."""
        try:
            return cls(NvmlSource(), period_s, alpha)
        except RuntimeError as exc:
            logger.info("llm-otel: GPU utilisation unavailable (%s); the sampler uses its base rate", exc)
            return cls(None, period_s, alpha)

    def sample(self) -> float | None:
        """Read the source once and fold it into the average (the poller thread calls this)."""
        if self.source is None:
            return None
        try:
            value = min(1.0, max(0.0, float(self.source.read())))
        except Exception as exc:  # noqa: BLE001
            process_errors().report("gpu.nvml.read", exc, "utilisation read failed; backing off")
            self.available = False
            return None
        self.available = True
        self.utilization = (
            value if self.utilization is None else self.alpha * value + (1 - self.alpha) * self.utilization
        )
        return self.utilization

    def start(self) -> UtilizationPoller:
        if self.source is None or self._thread is not None:
            return self

        def loop() -> None:
            delay = self.period_s
            while not self._stop.wait(delay):
                ok = self.sample() is not None
                delay = self.period_s if ok else min(60.0, delay * 2)

        name = getattr(self.source, "thread_name", "llm-otel-gpu-poller")
        self._thread = threading.Thread(target=loop, name=name, daemon=True)
        self._thread.start()
        from llm_otel.process.forks import restart_in_fork_child  # a leaf: imports nothing of llm_otel

        restart_in_fork_child(self)
        return self

    def _restart_after_fork(self) -> None:
        """In a forked child: the thread did not come along; start it again unless stopped."""
        if self._thread is not None and not self._stop.is_set():
            self._thread = None
            self._stop = threading.Event()
            self.start()

    def stop(self) -> None:
        self._stop.set()

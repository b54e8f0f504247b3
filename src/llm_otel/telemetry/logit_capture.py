"""Which requests get ``llm.logit_dist``, and the statistics of their rows of a step's logits,
taken around an engine's sampler. One policy and one capture for every engine; the adapters say
only which rows belong to which request and where the sampled token ids are.

Choice (:func:`logit_dist_chosen`, :func:`logit_top_k`): ``LLM_OTEL_LOGIT_DIST_RATIO`` of the
sampled requests, chosen by the random low 56 bits of the W3C trace id, so every process of an
engine (and every choice of a request) makes the same choice without telling the others.

Capture (:func:`capture_rows`, :class:`StepLogits`, :func:`wrap_sampler`): the chosen rows of the
step's ``(rows, vocab)`` logits are gathered and reduced on their device *before* the sampler runs
(samplers modify logits in place); after it the statistics, the sampled tokens and their log-probs
are packed into one ``(rows, 2k+4)`` tensor and brought to host: synchronously by
:meth:`StepLogits.to_host`, or without waiting for the device by :meth:`StepLogits.stage` - a
non-blocking copy into pinned host memory and a CUDA event, collected at a later step when the
event has completed (:class:`StagedLogits`). Nothing is allocated or launched while a CUDA graph
is being captured (:data:`llm_otel.gpu.capture.capture_gate`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from opentelemetry.trace import Span

from llm_otel.config import Settings
from llm_otel.gpu.capture import capture_gate

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from llm_otel.errors import HookErrors
    from llm_otel.telemetry.logits import LogitStats, TorchLogitStats

# ``wrapped(*args, **kwargs)``, the sampler instance, args, kwargs -> the sampler's output (wrapt's wrapper signature)
SamplerWrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]

_LOW_56 = (1 << 56) - 1


def logit_dist_chosen(ratio: float, span: Span) -> bool:
    """Whether a sampled request whose request span is ``span`` gets logit statistics: all with
    ``ratio`` >= 1, else those whose trace id's low 56 bits (random in W3C trace ids) fall below
    ``ratio`` of their range - the same answer in every process that sees the trace."""
    if ratio >= 1.0:
        return True
    return (span.get_span_context().trace_id & _LOW_56) < ratio * (1 << 56)


def logit_top_k(
    settings: Settings, span: Span | None, *, recording: bool, limit: int | None = None, user_asked: bool = False
) -> int:
    """k of the logit statistics a request gets (0: none): ``LLM_OTEL_LOGPROBS_TOP_K`` (at most
    ``limit``, the engine's own cap on log-probs) for a recording request that the user asked
    log-probs for or that :func:`logit_dist_chosen` picks."""
    k = settings.logprobs_top_k if limit is None else min(settings.logprobs_top_k, limit)
    if not recording or k <= 0:
        return 0
    # a recording request has a span
    return k if user_asked or logit_dist_chosen(settings.logit_dist_ratio, cast(Span, span)) else 0


class StepLogits:
    """Statistics of the chosen rows of one step's logits: reduced on the logits' device at
    :func:`capture_rows`, brought to host by :meth:`to_host` after the sampler ran.

    ``rows``: the logit rows reduced (row j of the statistics is ``rows[j]``); ``stats``: the
    :class:`~llm_otel.telemetry.logits.TorchLogitStats` on device.
    """

    __slots__ = ("rows", "stats", "k")

    def __init__(self, rows: list[int], stats: TorchLogitStats, k: int) -> None:
        self.rows = rows
        self.stats = stats
        self.k = k

    def to_host(
        self, sampled: Any = None, sampled_rows: list[int] | None = None
    ) -> tuple[LogitStats, NDArray[Any] | None]:
        """``(LogitStats, sampled log-probs (rows,) or None)`` in one synchronous transfer.
        ``sampled``: the sampler's token ids as a torch tensor, ``(n,)`` or ``(n, m)`` (column 0 is
        taken), whose rows ``sampled_rows`` (default: :attr:`rows`) are the chosen requests' tokens,
        in order."""
        stats, sampled_lp, _ = self.stage(sampled, sampled_rows, synchronous=True).result()
        return stats, sampled_lp

    def stage(
        self,
        sampled: Any = None,
        sampled_rows: list[int] | None = None,
        sampled_cols: list[int] | None = None,
        num_valid: Any = None,
        *,
        synchronous: bool = False,
    ) -> StagedLogits:
        """Start bringing the statistics to host without waiting for the device.

        Args:
            sampled: the sampler's token ids, a torch ``(n,)`` or ``(n, m)`` tensor (under
                speculative decoding ``(num_reqs, drafts + 1)`` with -1 for rejected positions).
            sampled_rows: per reduced row, its row in ``sampled`` (default: :attr:`rows`).
            sampled_cols: per reduced row, its column in a 2-D ``sampled`` (default: 0).
            num_valid: optional ``(n,)`` tensor, valid tokens per row of ``sampled`` (MRv2's
                ``num_sampled``); positions at or beyond it count as no token.
            synchronous: copy to host now (the engine waits for the device), as :meth:`to_host`.

        Returns:
            A :class:`StagedLogits`; its :meth:`~StagedLogits.result` gives the host statistics,
            the sampled tokens' log-probs and the token ids (-1 where a reduced row has no emitted
            token). On CPU the work is done at once; on CUDA the copy goes to pinned memory with
            ``non_blocking=True`` and an event is recorded on the current stream after it.
        """
        import torch

        with torch.no_grad():
            picked = None
            if sampled is not None:
                rows = self.rows if sampled_rows is None else sampled_rows
                pin = sampled.device.type == "cuda"
                r = torch.tensor(rows, dtype=torch.long, pin_memory=pin).to(sampled.device, non_blocking=True)
                if sampled.dim() > 1:
                    cols = [0] * len(rows) if sampled_cols is None else sampled_cols
                    c = torch.tensor(cols, dtype=torch.long, pin_memory=pin).to(sampled.device, non_blocking=True)
                    picked = sampled[r, c].long()
                    if num_valid is not None:
                        picked = torch.where(c < num_valid.to(sampled.device)[r], picked, torch.full_like(picked, -1))
                else:
                    picked = sampled.index_select(0, r).long()
            packed = self.stats.pack(picked)
            with_sampled = picked is not None
            if packed.device.type != "cuda" or synchronous:
                return StagedLogits(packed.cpu(), None, None, self.stats.k, with_sampled)
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            return StagedLogits(host, event, packed, self.stats.k, with_sampled)


class StagedLogits:
    """One step's packed statistics on their way to host (:meth:`StepLogits.stage`).

    ``host``: the ``(rows, 2k+2)`` or ``(rows, 2k+4)`` host tensor (pinned on CUDA, written by a
    non-blocking copy); ``event``: the CUDA event recorded after that copy, None when the data is
    already on host; ``device``: the device tensor, kept alive until the copy is done."""

    __slots__ = ("host", "event", "device", "k", "with_sampled")

    def __init__(self, host: Any, event: Any, device: Any, k: int, with_sampled: bool) -> None:
        self.host = host
        self.event = event
        self.device = device
        self.k = k
        self.with_sampled = with_sampled

    def ready(self) -> bool:
        """True when :meth:`result` will not wait for the device (``event.query()``; never blocks)."""
        if self.event is None:
            return True
        if not self.event.query():
            return False
        self.event = self.device = None  # the copy is done: result() will not wait
        return True

    def result(self) -> tuple[LogitStats, NDArray[Any] | None, NDArray[Any] | None]:
        """``(LogitStats, sampled log-probs (rows,) or None, sampled token ids (rows,) int64 or
        None)``; token id -1 (log-prob NaN) where a row has no emitted token. Waits for the copy
        (``event.synchronize()``) when it is not :meth:`ready` yet."""
        from llm_otel.telemetry.logits import unpack_packed

        if self.event is not None:
            self.event.synchronize()
            self.event = None
            self.device = None
        return unpack_packed(self.host.numpy(), self.k, self.with_sampled)


def stage_row(
    stats: LogitStats, sampled_lp: NDArray[Any] | None, j: int, k: int, time_ns: int
) -> tuple[int, Any, Any, float, float, bool, float]:
    """Row ``j`` of host ``stats`` (:meth:`StepLogits.to_host`) as one logit row of a
    :class:`~llm_otel.telemetry.stages.StageRecord`: ``(time_ns, top_ids (k,), top_logprobs (k,),
    entropy, margin, nonfinite, sampled_logprob)``."""
    return (
        time_ns,
        stats.top_ids[j, :k],
        stats.top_logprobs[j, :k],
        float(stats.entropy[j]),
        float(stats.margin[j]),
        bool(stats.nonfinite[j]),
        float(sampled_lp[j]) if sampled_lp is not None else math.nan,
    )


def capture_rows(logits: Any, rows: list[int], k: int) -> StepLogits | None:
    """Reduce ``rows`` of the torch ``(rows, vocab)`` ``logits`` on their device (top-``k``,
    entropy, non-finite) before the sampler may modify them in place. None when no row is chosen,
    or while a CUDA graph is being captured (no allocation or launch may happen then)."""
    if not rows or capture_gate.capturing():
        return None
    import torch

    from llm_otel.telemetry.logits import TorchLogitStats

    # staged host->device copy: no wait for the engine's stream (a blocking copy would wait for
    # the forward pass here)
    index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    return StepLogits(rows, TorchLogitStats(logits.index_select(0, index), k), k)


def wrap_sampler(
    errors: HookErrors,
    hook: str,
    before: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any],
    after: Callable[[Any, Any, Any], Any],
) -> SamplerWrapper:
    """A wrapt wrapper around an engine's sampler: ``before(instance, args, kwargs)`` returns a
    plan (None: nothing to capture this step) before the sampler runs, ``after(instance, plan,
    output)`` reads its output. Failures of either are counted under ``hook`` and never reach the
    engine; the sampler runs exactly as called and its output is returned untouched.

    Per-step guard inline (not ``errors.guard``): this runs on every engine step."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        plan = None
        try:
            plan = before(instance, args, kwargs)
        except Exception as exc:  # noqa: BLE001
            errors.report(hook, exc)
        output = wrapped(*args, **kwargs)
        if plan is not None:
            try:
                after(instance, plan, output)
            except Exception as exc:  # noqa: BLE001
                errors.report(hook, exc)
        return output

    return wrapper

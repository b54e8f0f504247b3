"""Which requests get ``llm.logit_dist``, and the statistics of their rows of a step's logits,
taken around an engine's sampler. One policy and one capture for every engine; the adapters say
only which rows belong to which request and where the sampled token ids are.

Choice (:func:`logit_dist_chosen`, :func:`logit_top_k`): ``LLM_OTEL_LOGIT_DIST_RATIO`` of the
sampled requests, chosen by the random low 56 bits of the W3C trace id, so every process of an
engine (and every choice of a request) makes the same choice without telling the others.

Capture (:func:`capture_rows`, :class:`StepLogits`, :func:`wrap_sampler`): the chosen rows of the
step's ``(rows, vocab)`` logits are gathered and reduced on their device *before* the sampler runs
(samplers modify logits in place); after it one ``(rows, 2k+3)`` transfer brings top-k, entropy,
non-finite flags and the sampled tokens' log-probs to host. Nothing is allocated or launched while
a CUDA graph is being captured (:data:`llm_otel.gpu.capture.capture_gate`).
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
        """``(LogitStats, sampled log-probs (rows,) or None)`` in one transfer. ``sampled``: the
        sampler's token ids as a torch tensor, ``(n,)`` or ``(n, m)`` (column 0 is taken), whose
        rows ``sampled_rows`` (default: :attr:`rows`) are the chosen requests' tokens, in order."""
        picked = None
        if sampled is not None:
            import torch

            rows = self.rows if sampled_rows is None else sampled_rows
            index = torch.tensor(rows, dtype=torch.long).to(sampled.device, non_blocking=True)
            picked = sampled.index_select(0, index)
            if picked.dim() > 1:
                picked = picked[:, 0]
        return self.stats.to_host(picked)


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

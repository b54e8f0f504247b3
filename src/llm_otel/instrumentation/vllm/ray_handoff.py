"""Ray: engine processes that vLLM starts as Ray actors get the user's llm-otel configuration.

Ray actors are not children of the frontend: they do not inherit its environment, so
``LLM_OTEL_ENABLED`` (which turns the ``vllm.general_plugins`` entry point on) and the ``OTEL_*``
exporter settings would be missing there. vLLM copies a chosen part of the driver's environment
to its Ray actors (``vllm.ray.ray_env.get_env_vars_to_copy``: engine-core actors through
``RuntimeEnv(env_vars=...)`` in ``vllm/v1/engine/utils.py``, workers through
``WorkerWrapperBase.update_environment_variables`` before ``init_worker`` loads the plugins) -
variables with the prefixes in ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY`` among them.
:func:`hand_off_environment` adds ``OTEL_`` and ``LLM_OTEL_`` there when llm-otel instruments a
vLLM frontend, so the actors instrument themselves with the same configuration; their role and
ranks come from :mod:`llm_otel.instrumentation.vllm.process` (the vLLM object loading the plugins).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

PREFIXES_ENV = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
PREFIXES = ("OTEL_", "LLM_OTEL_")


def hand_off_environment(env: MutableMapping[str, str] | None = None) -> str | None:
    """Add :data:`PREFIXES` to ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY`` in ``env`` (default
    ``os.environ``), keeping the user's own prefixes. Returns the previous value ("" when unset),
    or None when nothing had to change."""
    env = os.environ if env is None else env
    previous = env.get(PREFIXES_ENV, "")
    present = [p.strip() for p in previous.split(",") if p.strip()]
    missing = [p for p in PREFIXES if p not in present]
    if not missing:
        return None
    env[PREFIXES_ENV] = ",".join(present + missing)
    return previous


def restore_environment(previous: str | None, env: MutableMapping[str, str] | None = None) -> None:
    """Undo :func:`hand_off_environment` (``previous`` is what it returned)."""
    if previous is None:
        return
    env = os.environ if env is None else env
    if previous:
        env[PREFIXES_ENV] = previous
    else:
        env.pop(PREFIXES_ENV, None)

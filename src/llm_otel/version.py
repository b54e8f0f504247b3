"""The llm-otel version, in a module of its own so that any layer (the core's tracer and meter
scopes, adapters) can import it without importing the package's public face (``llm_otel``), which
imports them. Kept equal to ``version`` in pyproject.toml (tests/test_public_api.py checks)."""

__version__ = "0.1.0"

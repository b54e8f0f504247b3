"""The LightLLM distribution this instrumentation supports.

PyPI has only ``lightllm 0.0.1`` (a 2024 snapshot); source installs of ModelTC/lightllm report
``1.0.1`` for every commit since March 2025, so the version says nothing about the layout: the
hook table (hooks.py) detects it from the modules themselves.
"""

_instruments: tuple[str, ...] = ("lightllm >= 0.0.1",)

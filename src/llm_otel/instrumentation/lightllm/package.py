"""The LightLLM distribution this instrumentation supports: any, checked by the code's shape.

PyPI has only ``lightllm 0.0.1`` (a 2024 snapshot); source installs of ModelTC/lightllm report
``1.0.1`` for every commit since March 2025, and a source checkout on ``PYTHONPATH`` has no
distribution metadata at all. A distribution requirement would therefore say nothing true, and
would make ``instrument()`` skip a checkout silently: there is none, and the hook table
(hooks.py) detects the layout from the modules themselves.
"""

_instruments: tuple[str, ...] = ()

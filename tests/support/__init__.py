"""Test support: helpers the tests share, none of them a test.

``tests/conftest.py`` puts ``tests/`` on ``sys.path``, so tests and benchmarks import these as
``from support.otlp_receiver import OTLPReceiver``. Contents:

* ``otlp_receiver`` - an in-process OTLP receiver (gRPC and HTTP) that decodes what it receives
* ``semconv_live`` - the live semantic-conventions check over every span a session emits
* ``vllm_env`` - the environment every vLLM test process runs with, ``wait_for_vllm_server``
* ``vllm_servers`` - starts and stops a real vLLM OpenAI API server (``spawn`` or forced ``fork``)
* ``triton_server`` - a real Triton Inference Server from ``.venv-triton``
* ``ops_harness`` - loads the Prometheus rules and Grafana dashboards in ``examples/``
* ``tiny_lora`` - writes a tiny LoRA adapter for the tiny test model

Scripts the tests start as processes (run by path, never imported): ``vllm_fork_launcher.py``,
``vllm_serve_launcher.py``, ``ops_engine_app.py``. They import nothing from ``tests/``.
"""

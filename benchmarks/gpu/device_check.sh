#!/usr/bin/env bash
# Device check of the GPU step timeline (docs/gpu.md, issue 6). Run on a CUDA machine from the
# repository root:  bash benchmarks/gpu/device_check.sh      (well under 5 minutes)
# Needs: torch with CUDA, cupy (cupy-cuda12x / cupy-cuda13x), numpy, opentelemetry-sdk; uses the
# repository's .venv when it has them, else python3. Report: $OUT/device_check.md (+ .json) when
# $OUT is set, else benchmarks/gpu/out/. Exit 0 pass, 1 a check failed, 2 cannot run here.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, cupy" 2>/dev/null; then PY=.venv/bin/python; else PY=python3; fi
fi
DEST=${OUT:-benchmarks/gpu/out}
mkdir -p "$DEST"
{
    echo "== $(date -u +%FT%TZ) $(hostname)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,mig.mode.current --format=csv 2>&1 || echo "nvidia-smi: not available"
    "$PY" -c "import sys, importlib; print(sys.version.split()[0], *[f'{m}={getattr(importlib.import_module(m), \"__version__\", \"?\")}' for m in ('numpy', 'torch', 'cupy', 'opentelemetry.sdk', 'nvtx') if importlib.util.find_spec(m.split('.')[0])])" 2>&1
} | tee "$DEST/device_env.txt"
PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} timeout 270 "$PY" benchmarks/gpu/device_check.py --out "$DEST/device_check.md" "$@"
rc=$?
[ $rc -eq 124 ] && echo "device check timed out after 270 s" | tee -a "$DEST/device_check.md"
exit $rc

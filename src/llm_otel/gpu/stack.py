"""Which CUDA major each GPU library of this process was built for, and whether they agree.

The CuPy ring buffer (:mod:`llm_otel.gpu.ring`) compiles its kernel with the NVRTC of CuPy's CUDA
build (``cupy-cuda12x`` -> CUDA 12 libraries, ``cupy-cuda13x`` -> CUDA 13). Beside a torch built
for another major (vLLM 0.33 pulls torch built for CUDA 13) CuPy finds no matching libraries and
the ring cannot start; this module names the mismatch and the extra that fixes it, for the ring's
start-up warning and ``llm-otel doctor``. Nothing here imports CuPy; torch is read from
``sys.modules`` unless ``import_torch`` is asked for.
"""

from __future__ import annotations

import dataclasses
import email.message
import importlib.metadata
import re
import sys
from typing import cast

#: CuPy wheel -> CUDA major it loads (the llm-otel extra that installs it in EXTRA_FOR_MAJOR)
CUPY_WHEELS = {"cupy-cuda11x": 11, "cupy-cuda12x": 12, "cupy-cuda13x": 13}
EXTRA_FOR_MAJOR = {12: "llm-otel[gpu-cu12]", 13: "llm-otel[gpu]"}


@dataclasses.dataclass(frozen=True)
class CudaStack:
    """CUDA builds of torch and CuPy.

    Attributes:
        torch_cuda: ``torch.version.cuda`` (``"13.0"``), None for a CPU torch or no torch.
        cupy_dist: installed CuPy distribution (``cupy-cuda13x``), None when none is installed.
        cupy_cuda_major: the CUDA major that distribution loads (None: unknown, e.g. a source build).
    """

    torch_cuda: str | None
    cupy_dist: str | None
    cupy_cuda_major: int | None

    @property
    def torch_cuda_major(self) -> int | None:
        match = re.match(r"(\d+)", self.torch_cuda or "")
        return int(match.group(1)) if match else None

    @property
    def mismatch(self) -> bool:
        """True when both majors are known and differ (the ring's kernel cannot be built)."""
        t, c = self.torch_cuda_major, self.cupy_cuda_major
        return t is not None and c is not None and t != c

    def advice(self) -> str:
        """One sentence naming both versions and the extra to install (for a mismatch)."""
        extra = EXTRA_FOR_MAJOR.get(self.torch_cuda_major or -1)
        fix = (
            f"pip uninstall {self.cupy_dist} && pip install '{extra}'"
            if extra
            else f"install the CuPy wheel for CUDA {self.torch_cuda_major}"
        )
        return (
            f"CuPy ({self.cupy_dist}, CUDA {self.cupy_cuda_major}) and torch (CUDA {self.torch_cuda}) "
            f"use different CUDA majors; the GPU step ring cannot compile its kernel and step "
            f"timing falls back to the host clock. Fix: {fix}"
        )


def installed_cupy() -> tuple[str | None, int | None]:
    """``(distribution name, CUDA major)`` of the installed CuPy, from package metadata."""
    found = None
    for dist in importlib.metadata.distributions():
        # an email Message at run time (typeshed's PackageMetadata has .get only from 3.12)
        metadata = cast(email.message.Message, dist.metadata)
        name = (metadata.get("Name") or "").lower().replace("_", "-")
        if name in CUPY_WHEELS:
            return name, CUPY_WHEELS[name]
        if name == "cupy":  # a source build: its CUDA is whatever it was compiled against
            found = (name, None)
    return found or (None, None)


def cuda_stack(import_torch: bool = False) -> CudaStack:
    """The :class:`CudaStack` of this process. torch is only imported when ``import_torch``
    (``llm-otel doctor``); inside an engine it is already loaded."""
    torch = sys.modules.get("torch")
    if torch is None and import_torch:
        try:
            torch = importlib.import_module("torch")
        except Exception:  # noqa: BLE001 - silent: feature probe: no torch
            torch = None
    torch_cuda = getattr(getattr(torch, "version", None), "cuda", None) if torch is not None else None
    dist, major = installed_cupy()
    return CudaStack(torch_cuda=torch_cuda, cupy_dist=dist, cupy_cuda_major=major)

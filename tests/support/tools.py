"""What a test needs from outside llm-otel's Python test dependencies: promtool and prometheus
(Debian's package, installed by .ci/install.sh), the CUDA toolkit's nvcc and NVTX 3 headers and a C
compiler (on the machine image), and what .ci/install.sh builds beside the venv: .venv-triton,
.venv/lightllm-pypi, check-jsonschema's script.

:func:`require` skips a test that lacks one on a developer's machine, saying how to get it, and
fails it under CI (``CI`` set to anything but ``0``/``false``/``no``; ``.ci/run`` sets it): a missing
install step must fail the run, never turn into tests skipped in silence."""

from __future__ import annotations

import os
import shutil
from typing import TypeVar

import pytest

T = TypeVar("T")


def in_ci() -> bool:
    """True under CI (``CI`` set and not ``0``/``false``/``no``), as ``.ci/run`` runs the suite."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require(what: str, found: T | None, how: str) -> T:
    """``found`` when it is truthy; else skip (a developer's machine) or fail (CI) naming ``what``
    is missing and ``how`` to get it."""
    if found:
        return found
    message = f"{what} is not available: {how}"
    if in_ci():
        pytest.fail(f"{message} (CI must not skip the tests that need it)", pytrace=False)
    pytest.skip(message)


def binary(name: str, how: str) -> str:
    """The path of executable ``name`` on PATH, or skip/fail as :func:`require`."""
    return require(name, shutil.which(name), how)

"""Import-only stand-ins for modules SGLang's CPU path imports but never calls (tests only).

SGLang 0.5.23 imports ``sgl_kernel`` (its CUDA kernel wheel) and ``torchvision.transforms`` (whose
PyPI builds need CUDA torch) at module level on its CPU path without calling them there. Every
attribute of a stand-in module is a :class:`Absent` object: reading attributes of it works (import
time code such as ``InterpolationMode.BICUBIC``), calling it or instantiating it raises
``RuntimeError`` naming the missing function, so a code path that does run them fails loudly instead
of computing something fake. Submodules (``sgl_kernel.kvcacheio``, ``torchvision.transforms.v2.functional``)
are made on import by :class:`StandInFinder`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class _AbsentMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return absent(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{cls.__qualname__} is an import-only stand-in; SGLang called it on CPU")

    def __getitem__(cls, item: Any) -> Any:
        return absent(f"{cls.__qualname__}[{item!r}]")


def absent(qualname: str) -> type:
    """A class standing for the missing attribute ``qualname``: raises when called."""
    return _AbsentMeta(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname})


def module_getattr(modname: str) -> Any:
    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return absent(f"{modname}.{name}")

    return __getattr__


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes every submodule of the stand-in packages in ``roots`` an empty stand-in module."""

    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if any(fullname.startswith(root + ".") for root in self.roots):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = module_getattr(spec.name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install(package: str, module_globals: dict[str, Any]) -> None:
    """Turns the package ``package`` (its ``__init__`` globals) into a stand-in."""
    module_globals["__getattr__"] = module_getattr(package)
    if not any(isinstance(f, StandInFinder) and package in f.roots for f in sys.meta_path):
        sys.meta_path.append(StandInFinder((package,)))

"""Stand-ins for GPU-kernel packages SGLang 0.5.23 imports but never runs on CPU (tests only).

``install()`` must run before the first ``import sglang``. A package that is really
installed (a GPU machine) is never replaced. Each stub answers every attribute: a
CapWords name is an empty class (so ``isinstance`` checks work), anything else a
permissive placeholder. Decorators return the function unchanged, so module bodies
that define kernels at import time load, and launching one (``kernel[grid](...)``)
raises TypeError because a plain function is not subscriptable. Importing the stubs
also makes torch believe triton exists; keep SGLang out of processes that run other
tests (tests/sglang/_run.py).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

# Top-level package -> why it is stubbed (where SGLang imports it, why it never runs).
STUBBED: dict[str, str] = {
    # Triton is a GPU kernel compiler (a ~1 GB install). sglang/srt/utils/common.py:91
    # imports it unconditionally and many modules decorate kernels with @triton.jit at
    # import time; the CPU transfer path launches none of them.
    "triton": "GPU kernel compiler; kernels are only defined, never launched, on CPU",
    # torchvision's compiled ops (nms, roi_align...) are built against a CUDA torch and
    # fail to register against torch 2.13.0+cpu. Only multimodal preprocessing imports
    # it (configs/__init__.py:71 -> nano_nemotron_vl.py:22 -> multimodal/internvl_utils.py:5);
    # no transfer-path code calls it.
    "torchvision": "vision ops for multimodal preprocessing, never called on the transfer path",
}


class _Placeholder:
    """Any attribute, call or decoration of a stubbed GPU-kernel module."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Bare decorator (@triton.jit) or decorator factory (@triton.jit(...)).
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return _Placeholder(f"{self._name}()")

    def __getitem__(self, key: Any) -> Any:
        return _Placeholder(f"{self._name}[]")

    def __repr__(self) -> str:
        return f"<CPU test stub {self._name}>"


class _StubType(type):
    """Metaclass: attributes of a stubbed class are placeholders too."""

    def __getattr__(cls, attr: str) -> _Placeholder:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{cls.__qualname__}.{attr}")


class _StubModule(types.ModuleType):
    """A stubbed module: CapWords names are classes (isinstance works), the rest placeholders."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        if attr[:1].isupper():
            cls = _StubType(attr, (), {"__init__": lambda self, *a, **k: None})
            cls.__module__ = self.__name__
            setattr(self, attr, cls)
            return cls
        return _Placeholder(f"{self.__name__}.{attr}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``name`` and every ``name.sub.module`` of the stubbed packages."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.split(".")[0] not in _active:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+cpu-test-stub"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


_active: set[str] = set()
_finder = _StubFinder()


def install() -> list[str]:
    """Stub every package in STUBBED that is not installed; return the stubbed names."""
    for name in STUBBED:
        if name not in _active and importlib.util.find_spec(name) is None:
            _active.add(name)
    if _active and _finder not in sys.meta_path:
        sys.meta_path.append(_finder)
    return sorted(_active)

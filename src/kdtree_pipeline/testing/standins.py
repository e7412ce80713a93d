"""Import-time stand-ins for two compiled packages SGLang imports but the verify path never uses.

**Used only by test harnesses** (the ``integrate`` gate's worker processes and
the CPU tests in ``tests/test_sglang_*.py``), **never by the plugin**: a
server runs with its real packages, and the plugin never touches
``sys.modules``. Each installer does nothing when the real package imports.

Why they exist:

- ``sgl_kernel`` (SGLang's compiled CUDA package, several hundred MB) cannot be
  installed on the offline GPU host, yet on a CUDA machine
  ``sglang.srt.layers.attention.triton_backend`` and ``memory_pool`` import
  names from it at module load. None of those names is called on the Triton
  TARGET_VERIFY path except ``sgl_kernel.utils.is_arch_support_pdl``, which the
  stand-in implements as sgl_kernel does (compute capability major >= 9).
  Every other name is a placeholder that raises :class:`StandInError` when
  called or instantiated (except as a plain decorator, which returns the
  function unchanged), so code that *uses* sgl_kernel fails loudly instead of
  running something else. SGLang's own Python code stays the code under test.
- ``torchvision``: ``sglang.srt.configs`` imports ``torchvision.transforms`` at
  module load (for multimodal image preprocessing). The torchvision wheels
  available to the CPU test machine are CUDA builds that cannot load next to a
  CPU-only torch, so on such a machine the import fails. The stand-in makes
  every ``torchvision.*`` name a placeholder class; attention never uses them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any


class StandInError(RuntimeError):
    """A stand-in placeholder was used for real work."""


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}", cls._strict)


def _placeholder(qualname: str, strict: bool) -> type:
    """A class standing for any imported name (usable as a base class, decorator target...)."""

    def _new(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # used as a decorator at import time: leave the function as it is
        if cls._strict:
            raise StandInError(
                f"{qualname} is an import-time stand-in (kdtree_pipeline.testing.standins): the real "
                "package is not installed here, and this code path needs it"
            )
        return object.__new__(cls)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        return self

    return _PlaceholderMeta(
        qualname.rsplit(".", 1)[-1],
        (),
        {"__new__": _new, "__call__": _call, "__init__": lambda self, *a, **k: None,
         "__qualname__": qualname, "_strict": strict},
    )


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``<root>`` and every ``<root>.*`` submodule as a placeholder module."""

    def __init__(self, root: str, strict: bool, attrs: dict[str, dict[str, Any]]):
        self.root, self.strict, self.attrs = root, strict, attrs

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == self.root or name.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        mod = types.ModuleType(spec.name, f"import-time stand-in for {spec.name} (kdtree_pipeline.testing.standins)")
        mod.__path__ = []
        mod.__version__ = "0.0.0+standin"
        mod.__dict__.update(self.attrs.get(spec.name, {}))
        strict = self.strict

        def __getattr__(name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return _placeholder(f"{spec.name}.{name}", strict)

        mod.__getattr__ = __getattr__  # type: ignore[method-assign]
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _is_arch_support_pdl() -> bool:
    """As ``sgl_kernel.utils.is_arch_support_pdl``: Hopper or newer."""
    import torch

    return torch.cuda.get_device_capability(torch.cuda.current_device())[0] >= 9


def _installed(root: str) -> bool:
    return any(isinstance(f, _StandInFinder) and f.root == root for f in sys.meta_path)


def _install(root: str, strict: bool, attrs: dict[str, dict[str, Any]]) -> None:
    for name in [m for m in sys.modules if m == root or m.startswith(root + ".")]:
        del sys.modules[name]  # a half-imported real package
    sys.meta_path.insert(0, _StandInFinder(root, strict, attrs))


def install_sgl_kernel_standin() -> bool:
    """Install the ``sgl_kernel`` stand-in unless the real package is importable.
    Returns True when the stand-in is (now) in place."""
    if _installed("sgl_kernel"):
        return True
    if importlib.util.find_spec("sgl_kernel") is not None:
        return False
    pdl = {"is_arch_support_pdl": _is_arch_support_pdl}
    _install("sgl_kernel", True, {"sgl_kernel": dict(pdl), "sgl_kernel.utils": dict(pdl)})
    return True


def install_torchvision_standin() -> bool:
    """Install the ``torchvision`` stand-in unless the real package imports.
    Returns True when the stand-in is (now) in place."""
    if _installed("torchvision"):
        return True
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or a CUDA build next to a CPU torch
        _install("torchvision", False, {})
        return True
    return False

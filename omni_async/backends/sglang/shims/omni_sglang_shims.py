"""Import-only stand-ins that let SGLang 0.5.23 import on a CPU-only machine.

* ``torchvision``: SGLang imports it at module level in a few multimodal helpers
  (``sglang/srt/multimodal/internvl_utils.py`` among them) that text models never call.
  PyPI's torchvision beside a CPU torch does not import ("operator torchvision::nms does
  not exist"), so a stub stands in: any name resolves to a placeholder, and calling one
  raises a clear error.
* ``vllm._custom_ops``: on a platform that is neither CUDA nor ROCm, SGLang's
  ``RotaryEmbedding.__init__`` imports ``rotary_embedding`` from it as a fallback kernel;
  the native forward is what runs on CPU, so the stand-in raises if it is ever called.

The stand-ins are served by a meta-path finder, and only while no real package of that
name is installed and only once ``sglang`` has started importing, so nothing else in the
interpreter (transformers' availability checks, for instance) sees a fake package.

This file is self-contained (standard library only): scripts/install_sglang.sh puts its
folder on the venv's path through a ``.pth`` file, and the sglang backend also calls
:func:`install` before it imports sglang.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

_SHIMMED_ROOTS = ("torchvision", "vllm")
_MARKER = "_omni_async_sglang_shim_finder"


class _Unavailable:
    """A name from a shimmed package: attribute access chains, use raises."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __getattr__(self, name: str) -> "_Unavailable":
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Unavailable(f"{self._qualname}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"{self._qualname} is an import-only stand-in installed by omni-async for SGLang on "
            "CPU; the real package is not installed"
        )

    def __repr__(self) -> str:
        return f"<omni-async stand-in {self._qualname}>"


def _rotary_embedding_unavailable(*args, **kwargs):
    raise RuntimeError(
        "vllm._custom_ops.rotary_embedding is an import-only stand-in (omni-async); "
        "SGLang's native rotary forward is expected on CPU"
    )


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Unavailable(f"{self.__name__}.{name}")


class _ShimLoader(importlib.abc.Loader):
    def create_module(self, spec):
        if spec.name == "vllm._custom_ops":
            mod = types.ModuleType(spec.name)
            mod.rotary_embedding = _rotary_embedding_unavailable
            return mod
        if spec.name == "vllm":
            return types.ModuleType(spec.name)  # only _custom_ops is offered
        return _StubModule(spec.name)

    def exec_module(self, module) -> None:
        module.__omni_async_shim__ = True
        if module.__name__ in ("torchvision", "vllm"):
            module.__path__ = []  # a package, so that submodules resolve
            module.__version__ = "0.0.0+omni-async-shim"
        elif module.__name__.startswith("torchvision."):
            module.__path__ = []


def _real_package_exists(root: str, finder: "_ShimFinder") -> bool:
    for other in sys.meta_path:
        if other is finder or getattr(other, _MARKER, False):
            continue
        find = getattr(other, "find_spec", None)
        if find is None:
            continue
        try:
            if find(root, None) is not None:
                return True
        except Exception:
            continue
    return False


class _ShimFinder(importlib.abc.MetaPathFinder):
    _omni_async_sglang_shim_finder = True

    def __init__(self) -> None:
        self._real: dict[str, bool] = {}

    def find_spec(self, fullname, path=None, target=None):
        root = fullname.partition(".")[0]
        if root not in _SHIMMED_ROOTS:
            return None
        if "sglang" not in sys.modules:
            return None  # only SGLang's imports get the stand-ins
        if root == "vllm" and fullname not in ("vllm", "vllm._custom_ops"):
            return None
        if root not in self._real:
            self._real[root] = _real_package_exists(root, self)
        if self._real[root]:
            return None
        return importlib.machinery.ModuleSpec(fullname, _ShimLoader(), is_package=fullname.count(".") < 2)


def install() -> None:
    """Add the finder at the end of ``sys.meta_path`` (idempotent)."""
    if any(getattr(f, _MARKER, False) for f in sys.meta_path):
        return
    sys.meta_path.append(_ShimFinder())


install()

"""Building the C++ CPU kernels once per torch build, at install time.

The kernels are compiled with the system compiler (``torch.utils.cpp_extension``, about
20-40 s per kernel set on 2 cores) into a folder of their own under ``kernels/`` of the
user's cache folder for omni-async (:func:`user_cache_folder`, where converted GGUF
files are cached too; ``OMNI_ASYNC_KERNEL_CACHE`` overrides), named by a key
of what the binary depends on: the torch version and commit, its C++ ABI, the Python
ABI tag, the machine, the source and the flags. Not by the environment's path: two
environments with the same torch share one build, and neither rebuilds the other's
(torch's own cache is keyed by name alone while its build command names each
environment's include path, so every switch rebuilt). A built set is imported straight
from its shared library, without ninja.

``scripts/setup.sh`` builds every set (``python -m omni_async.kernels.cpu_build``). When a
start finds a set missing, :func:`.cpu_kernels.ensure_built_in_background` says so on stderr with an
estimate and builds it in a detached process while this one serves with the portable
torch ops; an option that asks for a kernel explicitly (``cpu_fused_ops=True``) still
builds in the foreground, since it cannot run without it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Sequence

from .. import errors
from ..logs import log

# The machine that builds a kernel is the one that runs it, so -march=native is safe
# (the CPU model is part of the key).
BASE_CFLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fopenmp")
CACHE_ENV = "OMNI_ASYNC_KERNEL_CACHE"
# Seconds one kernel set takes to compile on the 2-core machine this was measured on.
BUILD_SECONDS_ESTIMATE = 40
# Where the CPU's model name and instruction-set flags are read (part of the key).
CPUINFO = Path("/proc/cpuinfo")


def torch_build() -> dict[str, Any]:
    """What a compiled extension depends on: the torch build, not where it is installed."""
    import torch

    return {
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", None),
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "python": sys.implementation.cache_tag,
        "machine": platform.machine(),
        "cpu": _cpu_model(),
    }


def _cpu_model() -> str:
    """The model name and the instruction-set flags of the first CPU: a cloud "AMD EPYC"
    names Zen 3 (AVX2) and Zen 4 (AVX-512) alike, and a -march=native build for the one
    stops the other with an illegal instruction."""
    try:
        lines = CPUINFO.read_text().split("\n\n", 1)[0].splitlines()
        facts = [line for line in lines if line.startswith(("model name", "flags"))]
        if facts:
            return hashlib.sha256("\n".join(facts).encode()).hexdigest()[:12]
    except OSError:
        pass
    return platform.processor()


def cache_key(build: dict[str, Any], source: str, cflags: Sequence[str]) -> str:
    """A short hash of the torch build, the source and the flags."""
    text = repr(sorted(build.items())) + "\0" + source + "\0" + " ".join(cflags)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# Builds made before the kernels moved into the user's cache folder for omni-async were
# kept here, a folder that ignored XDG_CACHE_HOME: a build found only there is copied
# over once (a few MB), not rebuilt.
LEGACY_ROOT = Path("~/.cache/omni_async/kernels")


def user_cache_folder() -> Path:
    """The user's cache folder for omni-async: ``$XDG_CACHE_HOME/omni-async``, else
    ``~/.cache/omni-async`` (the GGUF cache's too, unless ``OMNI_ASYNC_CACHE_DIR`` moves
    that one alone)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "omni-async"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or user_cache_folder() / "kernels")


class CppKernels:
    def __init__(self, name: str, source: str, functions: Sequence[str] | None, option: str, extra_cflags: Sequence[str] = ()) -> None:
        """``functions``: the names to bind; None when ``source`` has its own
        ``PYBIND11_MODULE`` (a class, or bindings with options)."""
        self.name, self.source = name, source
        self.functions = None if functions is None else list(functions)
        self.option = option  # the engine option these kernels serve, for the error
        self.cflags = [*BASE_CFLAGS, *extra_cflags]
        self._lock = threading.Lock()
        self._module: Any = None

    @property
    def folder(self) -> Path:
        return cache_root() / f"{self.name}-{cache_key(torch_build(), self.source, self.cflags)}"

    @property
    def library(self) -> Path:
        return self.folder / f"{self.name}.so"

    def load(self) -> Any:
        """The compiled extension: imported from the cache, or built there first."""
        with self._lock:
            if self._module is None:
                if not self.library.is_file():
                    self._adopt_legacy_build()
                if not self.library.is_file():
                    print(f"omni-async: building the C++ kernels {self.name} (about {BUILD_SECONDS_ESTIMATE} s, once per torch build)",
                          file=sys.stderr, flush=True)
                    self._module = self._build()
                else:
                    self._module = self._import()
            return self._module

    def is_built(self) -> bool:
        if self._module is not None or self.library.is_file():
            return True
        self._adopt_legacy_build()
        return self.library.is_file()

    def _adopt_legacy_build(self) -> None:
        """Copy this key's build from the folder of before (see :data:`LEGACY_ROOT`)."""
        legacy = LEGACY_ROOT.expanduser() / self.folder.name
        if os.environ.get(CACHE_ENV) or not (legacy / self.library.name).is_file():
            return
        target = self.folder
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            scratch = Path(tempfile.mkdtemp(prefix=f".{self.name}-", dir=target.parent))
            shutil.copytree(legacy, scratch, dirs_exist_ok=True)
            os.replace(scratch, target)
        except OSError as exc:
            log.warning("cpu_kernels_legacy_copy_failed", source=str(legacy), error=repr(exc))

    def _build(self) -> Any:
        """Compile into a fresh folder and move it into place (a reader never sees half a
        build); the module as built."""
        from torch.utils.cpp_extension import load_inline

        target = self.folder
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{self.name}-", dir=target.parent))
        try:
            module = load_inline(
                self.name, cpp_sources=self.source, functions=self.functions, extra_cflags=self.cflags,
                extra_ldflags=["-fopenmp"], build_directory=str(scratch), is_python_module=True,
            )
            try:
                os.replace(scratch, target)
            except OSError:  # another process finished first: its build is the same
                pass
            return module
        except Exception as exc:  # no compiler, no ninja, a failed build
            message = f"{self.option}: the C++ kernels {self.name} could not be built: {exc!r}"
            log.error(f"{self.option}_build_failed", error=repr(exc))
            print(f"omni-async: {message}", file=sys.stderr, flush=True)
            raise errors.ConfigError(message) from exc
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _import(self) -> Any:
        import torch  # noqa: F401  (the extension links against torch's libraries)

        spec = importlib.util.spec_from_file_location(self.name, self.library)
        if spec is None or spec.loader is None:
            raise errors.ConfigError(f"{self.option}: cannot import {self.library}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

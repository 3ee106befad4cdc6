"""Where Triton's compiled kernels live, and which compiles happen outside a warm-up.

Why: Triton compiles a kernel at the launch that first meets a specialisation of it
(its constexprs, argument dtypes, integers equal to 1 or divisible by 16, pointer
alignment). Met inside a request, that is hundreds of milliseconds on the launching
thread: a fresh process's first NV256 run on the H100 ran at 35.0k tok/s with a first
token of 1.18 s, against 0.23 s once warm. The engine therefore compiles what a request
can launch while it starts (``runners/kernel_warmup.py``), and the binaries go to an
on-disk cache of ours, so that the next process loads them instead of compiling.

The cache is a folder of its own under the CPU kernels' cache root
(:func:`.cpu_build.cache_root`: ``OMNI_ASYNC_KERNEL_CACHE``, else ``kernels/`` in the
user's cache folder for omni-async), named by a key of what a binary depends on
outside Triton's own key (which already holds Triton's version, the source, the GPU
target and the options): the torch build, the Python ABI, the machine, Triton's and
CUDA's versions. A ``TRITON_CACHE_DIR`` set by the user is left as it is.

:class:`CompileWatch` counts the compiles (or loads from the disk cache: either costs a
request time) that happen outside a warm-up, and logs each with the kernel's
specialisation: a first run's missing speed shows up there by name.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

from ..logs import log
from .cpu_build import cache_key, cache_root

CACHE_ENV = "TRITON_CACHE_DIR"


def cache_facts() -> dict[str, Any]:
    """What a compiled Triton kernel depends on besides Triton's own cache key."""
    import torch

    spec = importlib.util.find_spec("triton")
    triton_version = None
    if spec is not None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            triton_version = version("triton")
        except PackageNotFoundError:
            triton_version = "unknown"
    return {
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", None),
        "cuda": torch.version.cuda,
        "python": sys.implementation.cache_tag,
        "machine": platform.machine(),
        "triton": triton_version,
    }


def cache_dir() -> Path:
    """Our folder for Triton's compiled kernels (not created here)."""
    return cache_root() / f"triton-{cache_key(cache_facts(), 'triton', ())}"


def use_cache_dir() -> Path | None:
    """Point Triton's on-disk cache at :func:`cache_dir` (through ``TRITON_CACHE_DIR``,
    which Triton reads at each compile, and which the processes this one starts
    inherit); the folder in use, or None when the user set their own."""
    if os.environ.get(CACHE_ENV):
        return None
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # an unwritable cache root: Triton's default folder then
        log.warning("triton_cache_unwritable", folder=str(folder), error=repr(exc))
        return None
    os.environ[CACHE_ENV] = str(folder)
    return folder


class CompileWatch:
    """Triton's post-compile hook, counting the kernels compiled (or loaded from disk)
    in this process, and those that were not inside :meth:`warming`. Installed once,
    keeping any hook installed before it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._warming = 0
        self.compiles = 0
        self.late: list[str] = []  # the kernels compiled outside a warm-up, by specialisation
        self._installed = False
        self._previous: Any = None

    def install(self) -> bool:
        """Hook into Triton (where its runtime has the hook); whether the watch is on."""
        with self._lock:
            if self._installed:
                return True
            try:
                from triton import knobs
            except ImportError:  # an older Triton: no hook to watch through
                return False
            runtime = getattr(knobs, "runtime", None)
            if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
                return False
            self._previous = runtime.jit_post_compile_hook
            runtime.jit_post_compile_hook = self._on_compile
            self._installed = True
            return True

    def _on_compile(self, **info: Any) -> Any:
        """Triton's hook (keywords only: ``key``, ``repr``, ``fn``, ``compile``...; taken
        as a mapping, so that a Triton passing more or fewer still compiles)."""
        name = str(info.get("repr") or info.get("key"))
        with self._lock:
            self.compiles += 1
            late = self._warming == 0
            if late:
                self.late.append(name)
        if late:
            log.warning("triton_compile_outside_warmup", kernel=name)
        if self._previous is not None:
            return self._previous(**info)
        return None

    def late_kernels(self) -> list[str]:
        with self._lock:
            return list(self.late)

    @contextlib.contextmanager
    def warming(self) -> Iterator[None]:
        """Compiles inside this block are the warm-up's (any thread's)."""
        with self._lock:
            self._warming += 1
        try:
            yield
        finally:
            with self._lock:
                self._warming -= 1


WATCH = CompileWatch()


def late_compiles() -> list[str]:
    """The kernels this process compiled outside a warm-up since the watch was
    installed (by the first engine warm-up on CUDA), each by its specialisation."""
    return WATCH.late_kernels()

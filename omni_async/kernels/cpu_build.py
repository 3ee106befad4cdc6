"""Building the C++ CPU kernels on first use.

``torch.utils.cpp_extension.load_inline`` compiles with the system compiler and ninja and
caches the result (about 20 s once per kernel set, then a load). A kernel set is built
once per process, under a lock; a build that cannot happen (no compiler, no ninja, a
compile error) is a ``ConfigError`` that names the option that asked for it.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

from .. import errors
from ..logs import log

# The machine that builds a kernel is the one that runs it, so -march=native is safe.
BASE_CFLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fopenmp")


class CppKernels:
    def __init__(self, name: str, source: str, functions: Sequence[str], option: str, extra_cflags: Sequence[str] = ()) -> None:
        self.name, self.source, self.functions = name, source, list(functions)
        self.option = option  # the engine option these kernels serve, for the error
        self.cflags = [*BASE_CFLAGS, *extra_cflags]
        self._lock = threading.Lock()
        self._module: Any = None

    def load(self) -> Any:
        """The compiled extension (built on first call)."""
        with self._lock:
            if self._module is None:
                from torch.utils.cpp_extension import load_inline

                try:
                    self._module = load_inline(
                        self.name, cpp_sources=self.source, functions=self.functions,
                        extra_cflags=self.cflags, extra_ldflags=["-fopenmp"],
                    )
                except Exception as exc:  # no compiler, no ninja, a failed build
                    log.error(f"{self.option}_build_failed", error=repr(exc))
                    raise errors.ConfigError(f"{self.option}=True, but its C++ kernels could not be built: {exc!r}") from exc
            return self._module

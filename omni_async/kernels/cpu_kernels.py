"""Every C++ CPU kernel in one extension: built at install (``scripts/setup.sh`` runs this
module), or in the background when a start finds it missing (:mod:`.cpu_build` builds and
caches it; this module puts it together).

One extension rather than one per kernel family: the decode stack (:mod:`.cpu_stack`)
calls the attention (:mod:`.cpu_paged`), elementwise (:mod:`.cpu_fused`) and block GEMM
(:mod:`.cpu_quant`) functions that the per-op path calls, compiled once, so the two paths compute the same bits; and one compile is shorter than
four. Each family keeps the floating-point contraction it was first built with (see
SOURCE), so the per-op path's bits are those of the separate extensions before."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

from typing import Any

from . import cpu_sources as src
from .cpu_build import BUILD_SECONDS_ESTIMATE, CppKernels, cache_root


def _module_def() -> str:
    """The extension's Python bindings: every family's functions (the GIL released while
    they run, as torch's own ops release it) and the decode stack's class."""
    lines = ["PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {"]
    for name in src.PAGED_FUNCTIONS + src.FUSED_FUNCTIONS + src.QUANT_FUNCTIONS:
        lines.append(f'  m.def("{name}", &{name}, "{name}", py::call_guard<py::gil_scoped_release>());')
    lines.append(src.STACK_BINDINGS)
    lines.append("}")
    return "\n".join(lines)


_PRELUDE = "#include <torch/extension.h>\n#include <algorithm>\n#include <cmath>\n#include <cstdint>\n"
# The elementwise kernels round where the torch reference rounds: floating-point contraction
# off for them alone (an FMA the compiler chose would skip a rounding). The attention and
# block GEMM kernels keep the compiler's contraction they were first built with, their exp
# included (a copy of the polynomial compiled with it), so their bits do not change.
_NO_CONTRACTION = '#pragma GCC push_options\n#pragma GCC optimize("fp-contract=off")\n'
_CONTRACTED_EXP = src.FUSED_EXP_POLY.replace("exp_poly(", "exp_poly_contracted(")
SOURCE = "\n".join([_PRELUDE, _NO_CONTRACTION, src.FUSED_EXP_POLY, src.FUSED_SOURCE, "#pragma GCC pop_options", _CONTRACTED_EXP,
                     src.PAGED_SOURCE, src.QUANT_SOURCE, src.STACK_SOURCE, _module_def()])
KERNELS = CppKernels("omni_async_cpu", SOURCE, None, "cpu_kernels")


def load() -> Any:
    """The compiled extension (built on first call); ConfigError when it cannot be built."""
    return KERNELS.load()


def all_kernels() -> list[CppKernels]:
    return [KERNELS]


def all_built() -> bool:
    return all(k.is_built() for k in all_kernels())


_background: subprocess.Popen | None = None


def ensure_built_in_background() -> bool:
    """True when every kernel set is built. Otherwise start one detached build of the
    missing ones (once per process), say so on stderr, and return False: the caller
    serves with the torch ops this time."""
    global _background
    missing = [k.name for k in all_kernels() if not k.is_built()]
    if not missing:
        return True
    if _background is None:
        estimate = BUILD_SECONDS_ESTIMATE * len(missing)
        print(f"omni-async: the C++ CPU kernels are not built for this torch yet; building them in the background "
              f"(about {estimate} s, once; scripts/setup.sh does it at install). Serving with the portable torch ops "
              f"until the next start.", file=sys.stderr, flush=True)
        _background = subprocess.Popen(
            [sys.executable, "-m", "omni_async.kernels.cpu_kernels", "--quiet"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """Build every kernel set for this torch (scripts/setup.sh runs this)."""
    args = list(sys.argv[1:] if argv is None else argv)
    for kernels in all_kernels():
        if kernels.is_built():
            continue
        if "--quiet" in args:
            sys.stderr = open(os.devnull, "w")
        kernels.load()
    if "--quiet" not in args:
        print(f"omni-async: C++ CPU kernels ready in {cache_root()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Every C++ CPU kernel set together: built at install (``scripts/setup.sh`` runs this
module), or in the background when a start finds them missing (:mod:`.cpu_build` builds
and caches one set; this module knows the sets)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

from . import cpu_fused, cpu_paged, cpu_quant
from .cpu_build import BUILD_SECONDS_ESTIMATE, CppKernels, cache_root


def all_kernels() -> list[CppKernels]:
    return [cpu_paged._KERNELS, cpu_fused._KERNELS, cpu_quant._KERNELS]


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

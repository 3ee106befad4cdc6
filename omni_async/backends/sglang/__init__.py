"""The SGLang backend: the same AsyncOmniScheduler, composing SGLang's own scheduling
machinery (batch selection, result processing, radix cache, memory pools, retraction
and aborts) and its tensor-parallel model worker, in-process.

Importing this package does not import SGLang; :func:`build_sglang_stage` does, and
fails with :class:`SGLangUnavailableError` naming the install route when SGLang is
missing. Nothing else in omni_async imports SGLang.

Install: ``pip install -e '.[sglang]'`` in the checkout (pins ``sglang==0.5.23``), or on a
CPU-only machine ``bash scripts/install_sglang.sh`` (see ``shims/``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

from ... import errors

if TYPE_CHECKING:
    from ...config import SchedulerConfig
    from ..base import BuiltStage

SGLANG_VERSION = "0.5.23"
INSTALL_HINT = (
    "install the extra with `pip install -e '.[sglang]'` in the omni-async checkout (it pins sglang==0.5.23), "
    "or on a CPU-only machine run `bash scripts/install_sglang.sh`"
)


class SGLangUnavailableError(errors.OmniAsyncError, ImportError):
    """backend='sglang' was asked for but SGLang (the pinned version) cannot be imported."""


def install_shims() -> None:
    """Install the import-only stand-ins SGLang needs on a CPU-only machine."""
    from .shims import omni_sglang_shims

    omni_sglang_shims.install()


def sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def require_sglang() -> None:
    """Raise :class:`SGLangUnavailableError` unless the pinned SGLang imports."""
    version = sglang_version()
    if version is None:
        raise SGLangUnavailableError(f"backend='sglang' needs SGLang {SGLANG_VERSION}, which is not installed: {INSTALL_HINT}")
    if version != SGLANG_VERSION:
        raise SGLangUnavailableError(
            f"backend='sglang' needs SGLang {SGLANG_VERSION} exactly (its internals move between "
            f"releases), found {version}: {INSTALL_HINT}"
        )
    install_shims()
    try:
        importlib.import_module("sglang.srt.managers.schedule_batch")
    except Exception as exc:  # a broken install: missing dependency, missing shim
        raise SGLangUnavailableError(f"SGLang {version} is installed but does not import ({exc!r}): {INSTALL_HINT}") from exc


def build_sglang_stage(
    path_or_name: str,
    *,
    config: "SchedulerConfig",
    device: str = "cpu",
    dtype: Any = None,
    seed: int = 0,
) -> "BuiltStage":
    """``backend="sglang"`` in the backend registry lands here."""
    require_sglang()
    from .builder import build_stage

    return build_stage(path_or_name, config=config, device=device, dtype=dtype, seed=seed)


__all__ = [
    "INSTALL_HINT",
    "SGLANG_VERSION",
    "SGLangUnavailableError",
    "build_sglang_stage",
    "install_shims",
    "require_sglang",
    "sglang_version",
]

"""The package version, read from the installed distribution's metadata (one source:
pyproject.toml); a source tree that was never installed reports ``0+unknown``."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("omni-async")
except PackageNotFoundError:  # pragma: no cover - running from an uninstalled tree
    __version__ = "0+unknown"

"""omni_async: an asyncio-native scheduler for the autoregressive stages of omni models.

The names below are imported when first used (PEP 562's module ``__getattr__``), not when
the package is: ``import omni_async`` and its light modules must not pay for torch's
import (seconds), because the command line's ``--help`` and usage errors, and the pytest
plugin (``omni_async.testing``, which pytest loads in every run of an environment where
the package is installed), run through them. ``from omni_async import Engine`` imports
the engine then, as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import errors
from .version import __version__

if TYPE_CHECKING:
    from .client.loopbridge import EventLoopMismatchError
    from .config import SamplingParams, SchedulerConfig
    from .engine import Engine, RequestHandle
    from .messages import CompletionOutput, GenerationResult, IncomingMessage, OutgoingMessage, RequestPayload, StreamDelta
    from .scheduler import AsyncOmniScheduler

# Each public name and the module that defines it.
_MODULE_OF = {
    "AsyncOmniScheduler": ".scheduler",
    "CompletionOutput": ".messages",
    "Engine": ".engine",
    "EventLoopMismatchError": ".client.loopbridge",
    "GenerationResult": ".messages",
    "IncomingMessage": ".messages",
    "OutgoingMessage": ".messages",
    "RequestHandle": ".engine",
    "RequestPayload": ".messages",
    "SamplingParams": ".config",
    "SchedulerConfig": ".config",
    "StreamDelta": ".messages",
}

__all__ = sorted([*_MODULE_OF, "__version__", "errors"])


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use and keep the name here."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

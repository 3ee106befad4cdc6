"""omni_async: an asyncio-native scheduler for the autoregressive stages of omni models."""

from . import errors
from .config import SamplingParams, SchedulerConfig
from .engine import Engine, RequestHandle
from .client.loopbridge import EventLoopMismatchError
from .messages import CompletionOutput, GenerationResult, IncomingMessage, OutgoingMessage, RequestPayload, StreamDelta
from .scheduler import AsyncOmniScheduler
from .version import __version__

__all__ = [
    "AsyncOmniScheduler",
    "CompletionOutput",
    "Engine",
    "EventLoopMismatchError",
    "GenerationResult",
    "IncomingMessage",
    "OutgoingMessage",
    "RequestHandle",
    "RequestPayload",
    "SamplingParams",
    "SchedulerConfig",
    "StreamDelta",
    "__version__",
    "errors",
]

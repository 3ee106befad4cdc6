"""omni_async: an asyncio-native scheduler for the autoregressive stages of omni models."""

from . import errors
from .config import SamplingParams, SchedulerConfig
from .engine import Engine, RequestHandle
from .loopbridge import EventLoopMismatchError
from .messages import CompletionOutput, GenerationResult, IncomingMessage, OutgoingMessage, RequestPayload, StreamDelta
from .scheduler import AsyncOmniScheduler

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
    "errors",
]
__version__ = "0.1.0"

"""Typed errors. Every failure a caller can see is one of these.

A request that fails gets exactly one terminal ``error`` message carrying one of these
exceptions; :class:`~omni_async.engine.Engine` raises it from ``generate``/``result``.
"""

from __future__ import annotations


class OmniAsyncError(Exception):
    """Base class of every error omni_async raises on purpose."""


class InvalidRequestError(OmniAsyncError, ValueError):
    """The request itself is malformed: empty prompt, token outside the vocabulary,
    a sampling value out of range, an unknown field."""


class RequestRejectedError(OmniAsyncError):
    """The request is well formed but cannot be served under the configured limits:
    context length, KV capacity, a full queue or backlog, a duplicate id."""


class OverloadedError(RequestRejectedError):
    """The request cannot start in time: the server is at the load it can serve on time
    (a speech stream that would play with gaps, or make others do so). ``reason`` says
    which limit: ``queue_full``, ``ttfp_budget``. Try again later (HTTP 503)."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class RequestAbortedError(OmniAsyncError):
    """The request was aborted before it finished. ``output_ids`` holds what was
    generated up to the abort."""

    def __init__(self, message: str, *, output_ids: list[int] | None = None) -> None:
        super().__init__(message)
        self.output_ids: list[int] = list(output_ids or [])


class SchedulerClosedError(RequestAbortedError):
    """The scheduler closed while the request was open, or a request was submitted
    after close."""


class ConsumerStalledError(RequestAbortedError):
    """A pipeline conversation's reader fell behind past its deadline or its bound on
    held events; the conversation was aborted in both stages."""


class RequestFailedError(OmniAsyncError):
    """Serving the request raised (a request builder, a result adapter, the model
    runner). The original exception is ``__cause__``."""


class ModelLoadError(OmniAsyncError):
    """A checkpoint cannot be loaded faithfully: unsupported architecture, rope
    scaling, missing or mismatched tensors."""


class AdminError(OmniAsyncError):
    """An admin action failed; the reply's message says why."""


class ConfigError(OmniAsyncError, ValueError):
    """The engine or scheduler configuration cannot be honoured: an unknown loop or
    backend, a limit out of range, a device that is not there, an option a backend
    does not support."""


class DeviceError(OmniAsyncError, RuntimeError):
    """A model step failed on the device side, not because of any one request: the
    family of step errors a request sees with its own type kept."""


class DeviceTimeoutError(DeviceError):
    """A model step did not complete within its watchdog limit (``step_timeout_s``, or
    the CUDA event watchdog)."""


class RankFailedError(DeviceError):
    """A rank of a tensor-parallel engine died, or a collective with it failed or timed
    out: the engine cannot run steps any more, so every request it serves ends with
    this error (closing still returns)."""


class KVAllocationError(OmniAsyncError, RuntimeError):
    """The paged KV allocator was asked for more pages than are free, or to free pages
    twice: a scheduling bug, never a user error."""


class LengthLimitWarning(UserWarning):
    """A request asked for more new tokens than the context holds after its prompt; it
    is served with the room left (generation would stop there anyway), and this says so
    rather than shorten it silently. The HTTP server refuses such a request (400
    ``context_length_exceeded``) and the command line refuses it too."""

    def __init__(self, asked: int, served: int, prompt_tokens: int, context_length: int) -> None:
        self.asked, self.served = asked, served
        self.prompt_tokens, self.context_length = prompt_tokens, context_length
        self.reason = (
            f"this model's maximum context length is {context_length} tokens; the prompt has {prompt_tokens} "
            f"and {asked} more were asked for (over by {prompt_tokens + asked - context_length})"
        )
        super().__init__(f"max_new_tokens={asked}: {self.reason}; at most {served} tokens will be generated")

"""Structured events, handed to the application's logging configuration as fields.

Every event goes to the ``omni_async`` stdlib logger as one record whose message is the
event name and whose fields are record attributes (``extra``), also gathered in
``record.omni_fields``. So the application decides how events look:

- plain stdlib logging shows the event name (add ``%(request_id)s`` etc. to a format);
- a JSON formatter, or structlog's ``ProcessorFormatter`` with ``ExtraAdder`` in its
  ``foreign_pre_chain``, receives ``{"event": "scheduler_finish", "request_id": ...}``
  with each field as a field of its own, never a pre-rendered string.

The library adds only a ``NullHandler``: nothing is printed unless the application (or
the command line, :func:`configure_cli_logging`) configures logging. Lifecycle events of a
request (debug level): ``scheduler_request_build_start``, ``scheduler_request_build_end``,
``scheduler_queue_enter``, ``scheduler_prefill_start``, ``scheduler_first_emit``,
``scheduler_finish``. Info level: ``engine_model_loaded`` (with timings),
``engine_started``, ``engine_stopped``, ``scheduler_started``, ``scheduler_stopped``,
``scheduler_paused``, ``scheduler_resumed``, ``scheduler_weights_updated``. Error level:
``scheduler_batch_failed`` (a failed step) and other failures.
"""

from __future__ import annotations

import logging
from typing import Any

LOGGER_NAME = "omni_async"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

_stdlib = logging.getLogger(LOGGER_NAME)
_stdlib.addHandler(logging.NullHandler())

# LogRecord attributes a field must not overwrite (``extra`` refuses them).
_RESERVED = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def _safe(fields: dict[str, Any]) -> dict[str, Any]:
    """Rename fields that collide with LogRecord attributes (``name`` -> ``name_``)."""
    return {(f"{k}_" if k in _RESERVED else k): v for k, v in fields.items()}


class EventLogger:
    """``log.info("event", key=value, ...)``: the structlog calling convention, emitted as
    a stdlib record that carries the fields. Level checks come first, so a disabled
    debug event costs one ``isEnabledFor``."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger

    def _emit(self, level: int, event: str, fields: dict[str, Any]) -> None:
        if not self._logger.isEnabledFor(level):
            return
        exc_info = fields.pop("exc_info", None)
        extra = _safe(fields)
        extra["omni_fields"] = dict(fields)
        self._logger.log(level, event, exc_info=exc_info, extra=extra, stacklevel=3)

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit(logging.ERROR, event, fields)

    def exception(self, event: str, **fields: Any) -> None:
        fields.setdefault("exc_info", True)
        self._emit(logging.ERROR, event, fields)


log = EventLogger(_stdlib)


def debug_enabled() -> bool:
    return _stdlib.isEnabledFor(logging.DEBUG)


class KeyValueFormatter(logging.Formatter):
    """The command line's format: ``time level event key=value ...``."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "omni_fields", None)
        if fields:
            line += " " + " ".join(f"{k}={v!r}" for k, v in fields.items())
        return line


def parse_log_level(level: str) -> int:
    """A level name (any case) -> its number; anything else is a ValueError naming the choices."""
    name = str(level).upper()
    if name not in LOG_LEVELS:
        raise ValueError(f"invalid log level {level!r}; choose one of {', '.join(LOG_LEVELS)}")
    return logging.getLevelName(name)


def configure_cli_logging(level: str = "WARNING") -> None:
    """Log ``omni_async`` events to stderr at ``level`` (the command line's setting)."""
    handler = logging.StreamHandler()
    handler.setFormatter(KeyValueFormatter("%(asctime)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(parse_log_level(level))

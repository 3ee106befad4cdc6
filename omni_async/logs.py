"""Structured lifecycle events through structlog, routed to stdlib logging.

Events go to the ``omni_async`` stdlib logger, so an application decides what it sees
(``logging.getLogger("omni_async").setLevel(logging.DEBUG)``) and nothing is printed by
default. Lifecycle events of the reference: ``scheduler_request_build_start``,
``scheduler_request_build_end``, ``scheduler_queue_enter``, ``scheduler_prefill_start``,
``scheduler_first_emit``, ``scheduler_finish``.
"""

from __future__ import annotations

import logging

import structlog

_stdlib = logging.getLogger("omni_async")

log = structlog.wrap_logger(
    _stdlib,
    processors=[
        structlog.stdlib.filter_by_level,
        structlog.processors.TimeStamper(fmt="iso", key="ts"),
        structlog.processors.format_exc_info,
        structlog.processors.KeyValueRenderer(key_order=["event", "request_id"], sort_keys=True),
    ],
    wrapper_class=structlog.stdlib.BoundLogger,
)


def debug_enabled() -> bool:
    return _stdlib.isEnabledFor(logging.DEBUG)


def configure_cli_logging(level: str = "WARNING") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.WARNING), format="%(message)s")

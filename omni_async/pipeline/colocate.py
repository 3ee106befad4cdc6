"""Stages that share one device, each built with its share of the device's memory.

A thinker and a talker on one GPU must not size themselves from whatever memory is free
when each loads (the first would take most of the card). Each stage gets a
``memory_budget`` (:mod:`omni_async.memory_budget`) instead, so the split is what the caller
asked for in any load order, and shares that cannot fit are refused before anything is
loaded (their sum) or as the stage loads (a share too small for its model).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence


from ..backends.native.builder import build_native_stack, build_scheduler
from ..backends.native.stack import NativeStack
from ..config import SchedulerConfig
from ..engine import check_device
from ..errors import ConfigError
from ..memory_budget import check_budget
from ..scheduler import AsyncOmniScheduler
from ..stage.weak import weak_method

__all__ = ["check_shares", "build_stage_scheduler", "build_talker", "talker_request_builder", "TALKER_MIN_CHUNKS"]

# The talker starts once this many thinker chunks have arrived (its prompt: BOS and them).
TALKER_MIN_CHUNKS = 3


def check_shares(shares: Sequence[float | int | None]) -> None:
    """Each share is a memory budget (a fraction of the device's total memory, or bytes);
    fractions together may not exceed the whole device."""
    for share in shares:
        if share is not None:
            check_budget(share)
    fractions = [s for s in shares if isinstance(s, float)]
    if sum(fractions) > 1.0 + 1e-9:
        raise ConfigError(f"the stages' memory shares {tuple(shares)} add up to {sum(fractions):.3g} of the device, more than all of it")


def build_stage_scheduler(
    path_or_name: str,
    *,
    device: str = "cpu",
    loop: str = "normal",
    dtype: Any = None,
    seed: int = 0,
    memory_budget: float | int | None = None,
    capture_hidden: bool = False,
    callbacks: dict[str, Any] | None = None,
    **limits: Any,
) -> tuple[AsyncOmniScheduler, NativeStack]:
    """One native stage with its memory budget, as ``Engine.from_pretrained`` would
    build it (the same plan), and the stack it was built from.
    ``capture_hidden``: each step's hidden states go out with its stream messages."""
    check_device(device)
    config = SchedulerConfig.from_kwargs(loop=loop, memory_budget=memory_budget, **limits)
    stack = build_native_stack(path_or_name, config, device=device, dtype=dtype, seed=seed, capture_hidden=capture_hidden)
    return build_scheduler(stack, **(callbacks or {})), stack


def talker_request_builder(
    min_chunks: int = TALKER_MIN_CHUNKS,
) -> tuple[Callable[[Any], Any], Callable[[Any, bool], bool], Callable[[AsyncOmniScheduler, NativeStack], None]]:
    """The talker's callbacks: its request is deferred until ``min_chunks`` thinker chunks
    have arrived (or the thinker finished); its prompt is the talker model's BOS and the
    thinker's tokens so far (modulo the talker's vocabulary); later chunks collect on its
    request data.

    Returns (request_builder, request_build_ready, bind): call ``bind(scheduler, stack)``
    once the talker is built; the scheduler is held weakly (no reference cycle)."""
    bound: dict[str, Any] = {}

    def build(payload: Any) -> Any:
        vocab = bound["vocab"]
        tokens = [t % vocab for chunk in payload.prefetched_chunks for t in chunk.token_ids]
        payload.input_ids = [bound["bos"]] + tokens
        data = bound["default"](payload)
        data.stream_chunks = []  # the prefetched ones became the prompt
        return data

    def ready(payload: Any, done: bool) -> bool:
        return len(payload.prefetched_chunks) >= min_chunks or done

    def bind(scheduler: AsyncOmniScheduler, stack: NativeStack) -> None:
        cfg = stack.loaded.config
        bound.update(
            default=weak_method(scheduler.intake.default_request_builder),
            bos=cfg.bos_token_id if cfg.bos_token_id is not None else 0,
            vocab=cfg.vocab_size,
        )

    return build, ready, bind


def build_talker(
    path_or_name: str, *, min_chunks: int = TALKER_MIN_CHUNKS, **stage: Any
) -> tuple[AsyncOmniScheduler, NativeStack]:
    """A talker stage (see :func:`talker_request_builder`) over ``path_or_name``; the
    arguments of :func:`build_stage_scheduler`."""
    build, ready, bind = talker_request_builder(min_chunks)
    sched, stack = build_stage_scheduler(
        path_or_name, callbacks={"request_builder": build, "request_build_ready": ready}, **stage
    )
    bind(sched, stack)
    return sched, stack

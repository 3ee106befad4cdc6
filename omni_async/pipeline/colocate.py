"""Stages that share one device, each built with its share of the device's memory.

A thinker and a talker on one GPU must not size themselves from whatever memory is free
when each loads (the first would take most of the card). Each stage gets a
``memory_budget`` (:mod:`omni_async.memory_budget`) instead, so the split is what the caller
asked for in any load order, and shares that cannot fit are refused before anything is
loaded (their sum) or as the stage loads (a share too small for its model).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


from ..backends.native.builder import build_native_stack, build_scheduler
from ..backends.native.stack import NativeStack
from ..config import SchedulerConfig
from ..engine import check_device
from .. import errors
from ..core.conditioning import StepConditioning
from ..errors import ConfigError
from ..memory_budget import check_budget
from ..scheduler import AsyncOmniScheduler
from ..stage.emission import default_result_adapter
from ..stage.weak import weak_method

__all__ = ["check_shares", "build_stage_scheduler", "build_talker", "talker_request_builder", "to_talker", "TALKER_MIN_CHUNKS", "HIDDEN_ROWS"]

# ``result.extra`` key of a hidden-fed talker: the thinker rows its request read.
HIDDEN_ROWS = "hidden_rows"
# The talker starts once this many thinker chunks have arrived (its prompt: BOS and a
# placeholder per thinker row of them).
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
    loop: str | None = None,
    dtype: Any = None,
    seed: int = 0,
    memory_budget: float | int | None = None,
    capture_hidden: bool = False,
    conditioning_size: int | None = None,
    callbacks: dict[str, Any] | None = None,
    **limits: Any,
) -> tuple[AsyncOmniScheduler, NativeStack]:
    """One native stage with its memory budget, as ``Engine.from_pretrained`` would
    build it (the same plan), and the stack it was built from.
    ``capture_hidden``: each step's hidden states go out with its stream messages
    (``delta.hidden_states``). ``conditioning_size``: the stage takes conditioning rows
    of that size through ``thinker_to_talker_proj`` (:mod:`omni_async.models.conditioning`)."""
    check_device(device)
    config = SchedulerConfig.from_kwargs(loop=loop, memory_budget=memory_budget, **limits)
    stack = build_native_stack(path_or_name, config, device=device, dtype=dtype, seed=seed, capture_hidden=capture_hidden,
                               conditioning_size=conditioning_size)
    return build_scheduler(stack, **(callbacks or {})), stack


def talker_request_builder(
    min_chunks: int = TALKER_MIN_CHUNKS, inputs: str = "hidden", pad_id: int | None = None
) -> tuple[dict[str, Callable[..., Any]], Callable[[AsyncOmniScheduler, NativeStack], None]]:
    """The talker's callbacks: its request is deferred until ``min_chunks`` thinker chunks
    have arrived (or the thinker finished).

    ``inputs="hidden"`` (the default): the talker reads the thinker's hidden states. Its
    prompt is the talker's BOS, then one placeholder (``pad_id``, BOS by default) per
    thinker row of the first ``min_chunks`` chunks; its request's ``conditioning`` (start
    1) gets every chunk's ``delta.hidden_states`` rows as they arrive (the deferred chunks
    first; kept for the request's life: a prefill after a retraction reads them again), so
    position p >= 1 adds the projected thinker row p - 1, and a position waits for its
    row; the thinker's end closes it (later positions add nothing).
    ``inputs="tokens"``: the prompt is BOS and the thinker's tokens so far (modulo the
    talker's vocabulary); later chunks collect on its request data.

    Returns (callbacks for :func:`build_stage_scheduler`, bind): call ``bind(scheduler,
    stack)`` once the talker is built; the scheduler is held weakly (no reference cycle)."""
    if inputs not in ("hidden", "tokens"):
        raise ConfigError(f"talker inputs must be 'hidden' or 'tokens', got {inputs!r}")
    bound: dict[str, Any] = {}

    def build(payload: Any) -> Any:
        chunks = payload.prefetched_chunks
        if inputs == "hidden":
            # The first ``min_chunks`` chunks only, however many arrived before the build:
            # the prompt (and so the tokens) does not depend on when the build ran.
            pad = bound["pad"]
            payload.input_ids = [bound["bos"]] + [pad] * sum(len(c.token_ids) for c in chunks[:min_chunks])
        else:
            vocab = bound["vocab"]
            payload.input_ids = [bound["bos"]] + [t % vocab for c in chunks for t in c.token_ids]
        data = bound["default"](payload)
        data.stream_chunks = []  # the prefetched ones became the prompt
        if inputs == "hidden":
            # Filled by on_chunk, the deferred chunks first (the stage replays them).
            data.req.conditioning = StepConditioning(start=1)
        return data

    def ready(payload: Any, done: bool) -> bool:
        return len(payload.prefetched_chunks) >= min_chunks or done

    def on_chunk(data: Any, chunk: Any) -> None:
        cond = data.req.conditioning
        if cond is None:
            data.stream_chunks.append(chunk)
            return
        rows = chunk_rows(chunk)
        n = len(chunk.token_ids)
        if rows is None or tuple(rows.shape) != (n, bound["width"]):
            raise errors.InvalidRequestError(
                f"the talker reads one thinker hidden state of size {bound['width']} per thinker token: a chunk of "
                f"{n} tokens came with {'no rows' if rows is None else f'rows of shape {tuple(rows.shape)}'} "
                "(build the thinker with capture_hidden=True)"
            )
        cond.add(to_talker(rows, bound["device"], bound["dtype"], bound["stream"]))

    def on_done(data: Any) -> None:
        data.stream_done = True
        if data.req.conditioning is not None:
            data.req.conditioning.close()

    def bind(scheduler: AsyncOmniScheduler, stack: NativeStack) -> None:
        cfg = stack.loaded.config
        bos = cfg.bos_token_id if cfg.bos_token_id is not None else 0
        bound.update(
            default=weak_method(scheduler.door.build_default),
            bos=bos,
            pad=bos if pad_id is None else pad_id,
            vocab=cfg.vocab_size,
            device=stack.device,
            stream=getattr(stack.runner, "stream", None),
        )
        if inputs == "hidden":
            proj = getattr(stack.loaded.model, "thinker_to_talker_proj", None)
            if proj is None:
                raise ConfigError("a talker fed by hidden states needs a stage built with conditioning_size")
            if not 0 <= bound["pad"] < cfg.vocab_size:
                raise ConfigError(f"talker pad_id {bound['pad']} is outside the talker's vocabulary (0..{cfg.vocab_size - 1})")
            bound.update(width=proj.in_features, dtype=proj.weight.dtype)

    def result(data: Any) -> Any:
        out = default_result_adapter(data)
        out.extra[HIDDEN_ROWS] = consumed_rows(data.req)
        return out

    callbacks = {"request_builder": build, "request_build_ready": ready}
    if inputs == "hidden":
        callbacks.update(stream_chunk_handler=on_chunk, stream_done_handler=on_done, result_adapter=result)
    return callbacks, bind


def consumed_rows(req: Any) -> int:
    """Thinker rows a finished talker request read: one per computed position from the
    conditioning's start on (the last token is sampled, never an input), up to the rows
    that arrived."""
    cond = req.conditioning
    computed = len(req.prompt_ids) + len(req.output_ids) - 1
    return max(0, min(cond.available, computed - cond.start))


def chunk_rows(chunk: Any) -> Any:
    """A thinker delta's hidden-state rows: ``delta.hidden_states``, or where a custom
    stream output builder made the delta from a step's outputs, their
    ``extra["hidden_states"]``; None without either."""
    rows = getattr(chunk, "hidden_states", None)
    if rows is None:
        rows = (getattr(chunk, "extra", None) or {}).get("hidden_states")
    return rows


def to_talker(rows: Any, device: torch.device, dtype: torch.dtype, stream: Any = None) -> Any:
    """A thinker chunk's rows as the talker reads them: on the talker's device and in
    its projection's dtype (an asynchronous copy when the stages sit on two devices or
    differ in dtype, none when they share both).
    On CUDA the rows are marked as used by the talker's stream, so the caching allocator
    does not hand their memory out again while a talker step may still read them."""
    if rows.device != device or rows.dtype != dtype:
        rows = rows.to(device=device, dtype=dtype, non_blocking=True)
    if rows.device.type == "cuda":
        rows.record_stream(stream if stream is not None else torch.cuda.current_stream(rows.device))
    return rows


def build_talker(
    path_or_name: str,
    *,
    min_chunks: int = TALKER_MIN_CHUNKS,
    inputs: str = "hidden",
    conditioning_size: int | None = None,
    pad_id: int | None = None,
    **stage: Any,
) -> tuple[AsyncOmniScheduler, NativeStack]:
    """A talker stage (see :func:`talker_request_builder`) over ``path_or_name``; the
    arguments of :func:`build_stage_scheduler`. ``inputs="hidden"`` needs
    ``conditioning_size``: the thinker's hidden size."""
    callbacks, bind = talker_request_builder(min_chunks, inputs, pad_id)
    if inputs == "hidden" and conditioning_size is None:
        raise ConfigError("a talker fed by hidden states needs conditioning_size (the thinker's hidden size)")
    sched, stack = build_stage_scheduler(
        path_or_name, callbacks=callbacks, conditioning_size=conditioning_size if inputs == "hidden" else None, **stage
    )
    bind(sched, stack)
    return sched, stack

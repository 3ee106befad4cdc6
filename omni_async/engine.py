"""Engine: the user-facing async API over an AsyncOmniScheduler.

``generate`` / ``stream`` / ``submit`` send one ``new_request`` per completion into the
stage's inbox. The stage's messages reach the engine's router in batches
(:class:`~omni_async.client.router.Router`), which hands each to its
:class:`~omni_async.client.handle.RequestHandle`: tokens are detokenised incrementally,
stop strings checked, and each handle's reader woken once per batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import time
import uuid
import warnings
from typing import Any, AsyncIterator

import anyio
import torch

from . import errors
from .backends.registry import build_stage
from .text.chat import render_chat_ids
from .client.completion import Completion
from .config import SAMPLING_SEED_MASK, SamplingParams, SchedulerConfig
from .client.handle import RequestHandle, SubmittedStream
from .client.router import Router
from .client.heap import configure_gc
from .logs import log
from .client.loopbridge import call_soon_on, maybe_marshal, running_asyncio_loop
from .messages import GenerationResult, IncomingMessage, StreamDelta
from .stage.request_checks import CheckedPayload, check_request, metadata_of, refuse_unknown_fields, sampling_of
from .scheduler import AsyncOmniScheduler
from .stage.weak import weak_method
from .text.tokenizer import Tokenizer

__all__ = ["Engine", "RequestHandle"]


def completion_seed(seed: int | None, index: int) -> int | None:
    """Completion ``index``'s seed: the request's own for the first, a stable hash of
    (seed, index) for the others, so ``n`` seeded completions differ, deterministically."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"omni-async-n\x1f{seed}\x1f{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & SAMPLING_SEED_MASK


def completion_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Completion ``index``'s terms, of ``n``: one completion, its own seed. The prompt
    is scored by the first completion alone (the request's ``prompt_logprobs`` are its
    own): a row that scores computes every prompt position, while the others, unscored,
    start on the pages it computed (the prefix cache) and prefill only the rest. (A
    request that generates nothing sends its first completion alone,
    :func:`stage_completions`; the others keep its terms.)"""
    replace: dict[str, Any] = {"n": 1, "seed": completion_seed(sampling.seed, index)}
    if index > 0 and sampling.prompt_logprobs is not None and sampling.max_new_tokens > 0:
        replace["prompt_logprobs"] = None
    return dataclasses.replace(sampling, **replace)


def stage_completions(sampling: SamplingParams) -> int:
    """How many of the ``n`` completions go to the stage: all, but the first alone for a
    request that generates nothing (``max_new_tokens=0``, scoring its prompt): its
    completions are alike, and the others end with the first one's result."""
    return 1 if sampling.max_new_tokens == 0 else sampling.n


def check_device(device: Any) -> None:
    """Refuse a CUDA device this torch cannot use, naming what is missing."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = (
            f"this torch build ({torch.__version__}) has no CUDA support"
            if torch.version.cuda is None
            else f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device (driver or CUDA_VISIBLE_DEVICES)"
        )
        raise errors.ConfigError(f"device={str(device)!r} needs CUDA, but {why}; use device='cpu' or install a CUDA torch")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise errors.ConfigError(f"device={str(device)!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")


class Engine:
    """Load a model and serve it through an AsyncOmniScheduler. Use ``async with``."""

    def __init__(self, scheduler: AsyncOmniScheduler, *, tokenizer: Tokenizer | None = None, stack: Any = None, plan: Any = None) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.stack = stack
        # What the stage was built to (omni_async/core/plan.py's StagePlan; also
        # info()["plan"]); None for a stage assembled by hand.
        self.plan = plan
        # Weak: the stage holds the router (its output sink), so the router must not hold
        # the engine (no reference cycle; a closed engine is freed by reference counting).
        self._router = Router(abort_stage_request=weak_method(self._abort_stage_request), event_loop=weak_method(self._serving_loop))
        self._serve_task: "asyncio.Task[None] | None" = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self._closed = False
        self._ids = itertools.count()
        self._serving_cm: Any = None

    @classmethod
    def from_pretrained(
        cls,
        path_or_name: str,
        *,
        device: str = "cpu",
        loop: str | None = None,
        backend: str = "native",
        dtype: Any = None,
        seed: int = 0,
        **limits: Any,
    ) -> "Engine":
        """Load a Hugging Face style folder or ``"tiny"``. ``limits`` are SchedulerConfig fields;
        ``loop=None`` leaves the loop to the stage plan (the fastest measured for the device)."""
        check_device(device)
        config = SchedulerConfig.from_kwargs(loop=loop, **limits)
        started = time.perf_counter()
        built = build_stage(backend, path_or_name, config=config, device=device, dtype=dtype, seed=seed)
        engine = cls(built.scheduler, tokenizer=built.tokenizer, stack=built.stack, plan=built.plan)
        configure_gc(config.gc_freeze, config.gc_gen0_threshold, str(device))
        log.info(
            "engine_model_loaded",
            model=str(path_or_name),
            backend=backend,
            device=str(device),
            loop=built.scheduler.config.loop,
            load_seconds=round(time.perf_counter() - started, 4),
            kv_capacity_tokens=built.scheduler.limits.kv_capacity_tokens,
            context_length=built.scheduler.limits.context_length,
        )
        return engine

    @classmethod
    async def load(
        cls, path_or_name: str, *, device: str = "cpu", loop: str | None = None, backend: str = "native",
        dtype: Any = None, seed: int = 0, **limits: Any,
    ) -> "Engine":
        """``from_pretrained`` in a worker thread: reading and building a checkpoint takes
        seconds, and the event loop keeps serving meanwhile. Same arguments; the engine
        starts on first use (or ``async with``) in the calling loop."""
        build = functools.partial(
            cls.from_pretrained, path_or_name, device=device, loop=loop, backend=backend, dtype=dtype, seed=seed, **limits
        )
        return await anyio.to_thread.run_sync(build)

    def _serving_loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop this engine serves on (None until started)."""
        return self._loop

    # ------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> "Engine":
        if running_asyncio_loop() is None:
            # Not asyncio (trio): the engine serves in a task group this block owns.
            self._serving_cm = self._serving_in_group()
            await self._serving_cm.__aenter__()
        else:
            await self.start()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        cm, self._serving_cm = self._serving_cm, None
        if cm is not None:
            await cm.__aexit__(*exc_info)
        else:
            await self.aclose()

    @contextlib.asynccontextmanager
    async def _serving_in_group(self) -> AsyncIterator[None]:
        if self._closed or self._started:
            raise errors.SchedulerClosedError("engine is closed" if self._closed else "engine is already serving")
        self._started = True
        self.scheduler.attach_output_sink(self._router.deliver, columns=self._router.deliver_step)
        async with anyio.create_task_group() as tg:
            await tg.start(self.scheduler.run)
            log.info("engine_started", loop=self.scheduler.config.loop)
            try:
                yield
            finally:
                with anyio.CancelScope(shield=True):
                    await self._aclose_here()

    async def start(self) -> None:
        if self._closed:
            raise errors.SchedulerClosedError("engine is closed")
        if self._started:
            return await maybe_marshal(self._loop, _nothing)
        if running_asyncio_loop() is None:
            raise errors.ConfigError("outside asyncio (trio), serve the engine with `async with engine:`")
        self._started = True
        # Served by this engine: the stage's messages come straight to the handles, one
        # call per step (a scheduler used on its own keeps its outbox).
        self.scheduler.attach_output_sink(self._router.deliver, columns=self._router.deliver_step)
        self._loop = asyncio.get_running_loop()
        serving = self._loop.create_future()

        async def serve() -> None:
            # The scheduler and the outbox router run in a task of their own, so the
            # engine is not tied to whichever task happened to start it.
            async with anyio.create_task_group() as tg:
                await tg.start(self.scheduler.run)
                serving.set_result(None)

        self._serve_task = asyncio.create_task(serve(), name="omni-async-engine")
        await asyncio.wait({serving, self._serve_task}, return_when=asyncio.FIRST_COMPLETED)
        if not serving.done():
            self._serve_task.result()  # the scheduler failed to start: raise its error
        log.info("engine_started", loop=self.scheduler.config.loop)

    async def aclose(self) -> None:
        """End every open request (SchedulerClosedError), stop the loop and the worker."""
        if self._closed:
            return
        await maybe_marshal(self._loop, self._aclose_here)

    async def _aclose_here(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.scheduler.aclose()
        task, self._serve_task = self._serve_task, None
        if task is not None:
            await asyncio.shield(task)
        log.info("engine_stopped")

    def _abort_stage_request(self, sub_id: str) -> None:
        if not self.scheduler.closed:
            self.scheduler.abort(sub_id)

    # ------------------------------------------------------------ requests

    async def submit(
        self,
        prompt: str | None = None,
        *,
        input_ids: list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | dict[str, Any] | None = None,
        request_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        add_special_tokens: bool = True,
        input_embeds: Any = None,
        **unknown: Any,
    ) -> RequestHandle:
        """Validate the request against the model's limits (raising the typed error now),
        then send it; the handle streams or awaits its output.

        ``input_embeds``: the prompt as a ``[L, hidden_size]`` float tensor (or numpy
        array, or nested list) used in place of the token embeddings, instead of
        ``prompt`` / ``input_ids`` / ``messages`` (docs/omni-data-path.md)."""
        refuse_unknown_fields(unknown)
        if self._closed or self.scheduler.closed:
            raise errors.SchedulerClosedError("engine is closed")
        await self.start()
        return await maybe_marshal(
            self._loop,
            lambda: self._submit_here(prompt, input_ids, messages, sampling, request_id, metadata, add_special_tokens, input_embeds),
            self._router.abort,  # a caller on another loop cancelled after the request was sent
        )

    async def _submit_here(
        self, prompt: Any, input_ids: Any, messages: Any, sampling: Any, request_id: Any, metadata: Any, add_special_tokens: bool,
        input_embeds: Any = None,
    ) -> RequestHandle:
        ids = self._input_ids(prompt, input_ids, messages, add_special_tokens, input_embeds)
        sampling = sampling_of(sampling)
        metadata = metadata_of(metadata)
        rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        if not isinstance(rid, str) or not rid:
            raise errors.InvalidRequestError("request_id must be a non-empty string")
        subs = [rid] if sampling.n == 1 else [f"{rid}/{i}" for i in range(sampling.n)]
        if self._router.is_taken(rid, subs):
            raise errors.RequestRejectedError(f"duplicate request id {rid!r}: a request with this id is active")
        if sampling.stop and self.tokenizer is None:
            raise errors.InvalidRequestError("stop strings need a tokenizer, and this model has none: use stop_token_ids")
        # The stage's door, here: the stage takes the verdict and does not check again.
        verdict = check_request(ids if input_embeds is None else None, sampling, self.scheduler.limits, input_embeds=input_embeds)
        if (limit := verdict.length_warning(self.scheduler.limits.context_length)) is not None:
            warnings.warn(limit, stacklevel=3)
        ids, input_embeds = verdict.prompt_ids, verdict.input_embeds  # placeholder ids for embeddings
        per_sub = [sampling] if sampling.n == 1 else [completion_sampling(sampling, i) for i in range(sampling.n)]
        comps = [Completion(i, sub, per_sub[i], self.tokenizer) for i, sub in enumerate(subs)]
        sent = stage_completions(sampling)
        handle = RequestHandle(rid, comps, ids, self._router.hooks, followers=len(subs) - sent)
        try:
            for sub, sp in zip(subs[:sent], per_sub):
                payload = CheckedPayload(request_id=sub, input_ids=[] if input_embeds is not None else list(ids), sampling=sp,
                                         metadata=dict(metadata), input_embeds=input_embeds, verdict=verdict)
                self.scheduler.inbox.send_nowait(IncomingMessage(sub, "new_request", payload))
                self._router.route(sub, handle)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._router.unroute(subs)
            raise errors.SchedulerClosedError("engine is closed") from None
        self._router.open(handle)
        return handle

    async def generate(
        self, prompt: str | None = None, *, input_ids: list[int] | None = None, messages: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | dict[str, Any] | None = None, request_id: str | None = None,
        metadata: dict[str, Any] | None = None, add_special_tokens: bool = True, input_embeds: Any = None, **unknown: Any,
    ) -> GenerationResult:
        """Submit one request and await its result (the arguments of :meth:`submit`)."""
        handle = await self.submit(
            prompt, input_ids=input_ids, messages=messages, sampling=sampling, request_id=request_id,
            metadata=metadata, add_special_tokens=add_special_tokens, input_embeds=input_embeds, **unknown,
        )
        return await handle.result()

    def stream(
        self, prompt: str | None = None, *, input_ids: list[int] | None = None, messages: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | dict[str, Any] | None = None, request_id: str | None = None,
        metadata: dict[str, Any] | None = None, add_special_tokens: bool = True, input_embeds: Any = None, **unknown: Any,
    ) -> AsyncIterator[StreamDelta]:
        """Submit one request and yield its deltas (the arguments of :meth:`submit`). The
        request is submitted when iteration starts; after that each step is the handle's
        own iteration, with no generator of this method's in between."""
        return SubmittedStream(lambda: self.submit(
            prompt, input_ids=input_ids, messages=messages, sampling=sampling, request_id=request_id,
            metadata=metadata, add_special_tokens=add_special_tokens, input_embeds=input_embeds, **unknown,
        ))

    async def abort(self, request_id: str) -> None:
        call_soon_on(self._loop, lambda: self._abort_now(request_id))

    def _abort_now(self, request_id: str) -> None:
        handle = self._router.get(request_id)
        if handle is not None:
            self._router.abort(handle)

    def _input_ids(self, prompt: Any, input_ids: Any, messages: Any, add_special_tokens: bool, input_embeds: Any = None) -> Any:
        given = [n for n, v in (("prompt", prompt), ("input_ids", input_ids), ("messages", messages),
                                ("input_embeds", input_embeds)) if v is not None]
        if len(given) > 1:
            raise errors.InvalidRequestError(
                f"give either prompt or input_ids or messages or input_embeds, not {' and '.join(given)}"
            )
        if input_embeds is not None:
            return []  # the rows are checked by check_request
        if messages is not None:
            return render_chat_ids(self.tokenizer, messages)
        if prompt is not None:
            if not isinstance(prompt, str):
                raise errors.InvalidRequestError(f"prompt must be a str, got {type(prompt).__name__}")
            if self.tokenizer is None:
                raise errors.InvalidRequestError(
                    "this model has no tokenizer (no tokenizer.json in its folder): pass input_ids instead of prompt"
                )
            if prompt == "":
                raise errors.InvalidRequestError("empty prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if input_ids is None:
            raise errors.InvalidRequestError("empty prompt: give prompt, input_ids, messages or input_embeds")
        return input_ids  # checked against the vocabulary by check_request

    # ------------------------------------------------------------ admin

    async def admin(self, action: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        return await maybe_marshal(self._loop, lambda: self.scheduler.admin(action, payload))

    async def model_info(self) -> dict[str, Any]:
        return await self.admin("model_info")

    async def flush_cache(self) -> dict[str, Any]:
        """Empty the prefix cache (refused while requests are active)."""
        return await self.admin("flush_cache")

    async def pause(self, mode: str = "abort") -> dict[str, Any]:
        return await self.admin("pause_generation", {"mode": mode})

    async def resume(self, *, torch_empty_cache: bool = True) -> dict[str, Any]:
        return await self.admin("continue_generation", {"torch_empty_cache": torch_empty_cache})

    async def update_weights_from_disk(self, model_path: str, **payload: Any) -> dict[str, Any]:
        return await self.admin("update_weights_from_disk", {"model_path": str(model_path), **payload})

    async def update_weights_from_tensor(self, named_tensors: Any, **payload: Any) -> dict[str, Any]:
        return await self.admin("update_weights_from_tensor", {"named_tensors": named_tensors, **payload})

    async def weights_checker(self, action: str = "checksum") -> dict[str, Any]:
        return await self.admin("weights_checker", {"action": action})

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str = "weight_update_group", **payload: Any
    ) -> dict[str, Any]:
        return await self.admin(
            "init_weights_update_group",
            {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name, **payload},
        )

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str = "weight_update_group", **payload: Any
    ) -> dict[str, Any]:
        return await self.admin(
            "update_weights_from_distributed", {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name, **payload}
        )

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        return await self.admin("destroy_weights_update_group", {"group_name": group_name})

    @property
    def open_requests(self) -> list[str]:
        return self._router.open_requests


async def _nothing() -> None:
    return None

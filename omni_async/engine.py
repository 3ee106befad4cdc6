"""Engine: the user-facing async API over an AsyncOmniScheduler.

``generate`` / ``stream`` / ``submit`` each send one ``new_request`` into the
scheduler's inbox; a router task owned by the engine delivers outbox messages to the
request's :class:`RequestHandle`. Cancelling a task that awaits a request aborts it.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from typing import Any, AsyncIterator

import anyio

from . import errors
from .builder import NativeStack, build_native_stack, build_scheduler
from .channels import drain_stream
from .config import SamplingParams, SchedulerConfig
from .messages import GenerationResult, IncomingMessage, OutgoingMessage, RequestPayload, StreamDelta
from .scheduler import AsyncOmniScheduler
from .tokenizer import Tokenizer

_TERMINAL = ("result", "error")


class RequestHandle:
    """One submitted request: iterate it for stream deltas, or await ``result()``."""

    def __init__(self, engine: "Engine", request_id: str) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[OutgoingMessage] = asyncio.Queue()
        self._terminal: OutgoingMessage | None = None
        self._deltas: list[StreamDelta] = []

    @property
    def done(self) -> bool:
        return self._terminal is not None

    def _deliver(self, msg: OutgoingMessage) -> None:
        self._queue.put_nowait(msg)

    async def _next(self) -> OutgoingMessage:
        try:
            msg = await self._queue.get()
        except BaseException:
            if self._terminal is None:
                self._engine._abort_now(self.request_id)
            raise
        if msg.type in _TERMINAL:
            self._terminal = msg
        return msg

    async def __aiter__(self) -> AsyncIterator[StreamDelta]:
        try:
            while self._terminal is None:
                msg = await self._next()
                if msg.type == "stream":
                    self._deltas.append(msg.data)
                    yield self._with_text(msg.data)
            self._raise_if_error()
        finally:
            if self._terminal is None:  # the consumer stopped early
                self._engine._abort_now(self.request_id)

    async def result(self) -> GenerationResult:
        while self._terminal is None:
            msg = await self._next()
            if msg.type == "stream":
                self._deltas.append(msg.data)
        self._raise_if_error()
        result = self._terminal.data
        if isinstance(result, GenerationResult) and result.text is None:
            result.text = self._engine._decode(result.output_ids)
        return result

    def _raise_if_error(self) -> None:
        assert self._terminal is not None
        if self._terminal.type == "error":
            err = self._terminal.data
            raise err if isinstance(err, BaseException) else errors.RequestFailedError(str(err))

    def _with_text(self, delta: StreamDelta) -> StreamDelta:
        if delta.text is None and self._engine.tokenizer is not None:
            delta.text = self._engine._decode(delta.token_ids)
        return delta


class Engine:
    """Load a model and serve it through an AsyncOmniScheduler. Use ``async with``."""

    def __init__(self, scheduler: AsyncOmniScheduler, *, tokenizer: Tokenizer | None = None, stack: NativeStack | None = None) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.stack = stack
        self._handles: dict[str, RequestHandle] = {}
        self._serve_task: "asyncio.Task[None] | None" = None
        self._started = False
        self._closed = False
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(
        cls,
        path_or_name: str,
        *,
        device: str = "cpu",
        loop: str = "normal",
        backend: str = "native",
        dtype: Any = None,
        seed: int = 0,
        **limits: Any,
    ) -> "Engine":
        """Load a Hugging Face style folder or ``"tiny"``. ``limits`` are SchedulerConfig fields."""
        config = SchedulerConfig.from_kwargs(loop=loop, **limits)
        if backend == "sglang":
            from .backends.sglang import build_sglang_engine

            return build_sglang_engine(path_or_name, config=config, device=device, dtype=dtype, seed=seed)
        if backend != "native":
            raise errors.InvalidRequestError(f"unknown backend {backend!r}; use 'native' or 'sglang'")
        stack = build_native_stack(path_or_name, config, device=device, dtype=dtype, seed=seed)
        return cls(build_scheduler(stack, config), tokenizer=stack.loaded.tokenizer, stack=stack)

    # ------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> "Engine":
        await self.start()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    async def start(self) -> None:
        if self._closed:
            raise errors.SchedulerClosedError("engine is closed")
        if self._started:
            return
        self._started = True
        serving = asyncio.get_running_loop().create_future()

        async def serve() -> None:
            # The scheduler and the outbox router run in a task of their own, so the
            # engine is not tied to whichever task happened to start it.
            async with anyio.create_task_group() as tg:
                await tg.start(self.scheduler.run)
                tg.start_soon(self._route_outbox)
                serving.set_result(None)

        self._serve_task = asyncio.create_task(serve(), name="omni-async-engine")
        await asyncio.wait({serving, self._serve_task}, return_when=asyncio.FIRST_COMPLETED)
        if not serving.done():
            self._serve_task.result()  # the scheduler failed to start: raise its error

    async def aclose(self) -> None:
        """End every open request (SchedulerClosedError), stop the loop and the worker."""
        if self._closed:
            return
        self._closed = True
        await self.scheduler.aclose()
        task, self._serve_task = self._serve_task, None
        if task is not None:
            await asyncio.shield(task)

    async def _route_outbox(self) -> None:
        async for msg in drain_stream(self.scheduler.outbox):
            handle = self._handles.get(msg.request_id)
            if handle is None:
                continue
            if msg.type in _TERMINAL:
                self._handles.pop(msg.request_id, None)
            handle._deliver(msg)

    # ------------------------------------------------------------ requests

    async def submit(
        self,
        prompt: str | None = None,
        *,
        input_ids: list[int] | None = None,
        sampling: SamplingParams | dict[str, Any] | None = None,
        request_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        **unknown: Any,
    ) -> RequestHandle:
        if unknown:
            raise errors.InvalidRequestError(f"unknown request field(s): {', '.join(sorted(unknown))}")
        if self._closed or self.scheduler.closed:
            raise errors.SchedulerClosedError("engine is closed")
        await self.start()
        ids = self._input_ids(prompt, input_ids)
        if sampling is None:
            sampling = SamplingParams()
        elif isinstance(sampling, dict):
            sampling = SamplingParams.from_dict(sampling)
        elif not isinstance(sampling, SamplingParams):
            raise errors.InvalidRequestError("sampling must be SamplingParams or a dict")
        rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        if not isinstance(rid, str) or not rid:
            raise errors.InvalidRequestError("request_id must be a non-empty string")
        if rid in self._handles:
            raise errors.RequestRejectedError(f"duplicate request id {rid!r}: a request with this id is active")
        handle = RequestHandle(self, rid)
        self._handles[rid] = handle
        payload = RequestPayload(request_id=rid, input_ids=ids, sampling=sampling, metadata=dict(metadata or {}))
        try:
            self.scheduler.inbox.send_nowait(IncomingMessage(rid, "new_request", payload))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._handles.pop(rid, None)
            raise errors.SchedulerClosedError("engine is closed") from None
        return handle

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> GenerationResult:
        handle = await self.submit(prompt, **kwargs)
        return await handle.result()

    async def stream(self, prompt: str | None = None, **kwargs: Any) -> AsyncIterator[StreamDelta]:
        handle = await self.submit(prompt, **kwargs)
        async for delta in handle:
            yield delta

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> None:
        if request_id in self._handles and not self.scheduler.closed:
            self.scheduler.abort(request_id)

    def _input_ids(self, prompt: str | None, input_ids: Any) -> list[int]:
        if prompt is not None and input_ids is not None:
            raise errors.InvalidRequestError("give either prompt or input_ids, not both")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise errors.InvalidRequestError(f"prompt must be a str, got {type(prompt).__name__}")
            if self.tokenizer is None:
                raise errors.InvalidRequestError(
                    "this model has no tokenizer (no tokenizer.json in its folder): pass input_ids instead of prompt"
                )
            if prompt == "":
                raise errors.InvalidRequestError("empty prompt")
            return self.tokenizer.encode(prompt)
        if input_ids is None:
            raise errors.InvalidRequestError("empty prompt: give prompt or input_ids")
        return list(input_ids) if isinstance(input_ids, tuple) else input_ids  # validated by the builder

    def _decode(self, ids: list[int]) -> str | None:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else None

    # ------------------------------------------------------------ admin

    async def admin(self, action: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        return await self.scheduler.admin(action, payload)

    async def model_info(self) -> dict[str, Any]:
        return await self.admin("model_info")

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
        return sorted(self._handles)

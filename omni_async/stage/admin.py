"""Admin actions: typed requests served at the top of a loop iteration (also while
paused), dispatched from one table, written against the stage's control API.

Every reply has the shape ``{"success", "message", "data", "error"}``. An action the
stage (or its model worker) does not support answers success with
``data = {"skipped": True, "unsupported": True}`` and says so, so that a trainer driving
several stages can treat every stage alike.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import anyio

from .. import errors
from ..logs import log
from .control import PAUSE_MODES, StageControl

MODEL_INFO = "model_info"
PAUSE_GENERATION = "pause_generation"
CONTINUE_GENERATION = "continue_generation"
UPDATE_WEIGHTS_FROM_DISK = "update_weights_from_disk"
UPDATE_WEIGHTS_FROM_TENSOR = "update_weights_from_tensor"
UPDATE_WEIGHTS_FROM_DISTRIBUTED = "update_weights_from_distributed"
INIT_WEIGHTS_UPDATE_GROUP = "init_weights_update_group"
DESTROY_WEIGHTS_UPDATE_GROUP = "destroy_weights_update_group"
WEIGHTS_CHECKER = "weights_checker"
FLUSH_CACHE = "flush_cache"


@dataclass
class AdminRequest:
    """One admin call on its way to the loop. ``reply`` is a thread-safe future, so the
    same request type serves the loop's own tasks and other threads."""

    action: str
    payload: dict[str, Any]
    reply: "concurrent.futures.Future[dict[str, Any]]" = field(default_factory=concurrent.futures.Future)

    def answer(self, reply: dict[str, Any]) -> None:
        if not self.reply.done():
            self.reply.set_result(reply)


Handler = Callable[[StageControl, dict[str, Any]], Awaitable[dict[str, Any]]]


def reply(success: bool, message: str, data: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"success": bool(success), "message": str(message), "data": dict(data or {}), "error": None if success else str(message)}


def failure(message: str, *, error: str | None = None) -> dict[str, Any]:
    return {"success": False, "message": message, "data": {}, "error": error or message}


def unsupported(action: str) -> dict[str, Any]:
    return reply(True, f"stage does not support {action}", {"skipped": True, "unsupported": True})


async def run_admin_action(control: StageControl, request: AdminRequest) -> dict[str, Any]:
    """Dispatch from the table; a handler that raises answers a failure."""
    handler = ACTIONS.get(request.action)
    if handler is None:
        return unsupported(request.action)
    try:
        return await handler(control, request.payload)
    except Exception as exc:
        log.error("scheduler_admin_failed", action=request.action, error=repr(exc))
        return failure(_describe(exc))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return f"missing key {exc.args[0]!r}"
    return str(exc) or repr(exc)


# ---------------------------------------------------------------- the actions


async def model_info(c: StageControl, payload: dict[str, Any]) -> dict[str, Any]:
    info = c.info()
    if c.model_worker is not None and hasattr(c.model_worker, "model_info"):
        info.update(c.model_worker.model_info())
    info.update({"stage_tp_rank": 0, "stage_tp_size": info.get("tensor_parallel_size", 1), "weight_version": c.state.weight_version})
    return reply(True, "ok", info)


async def pause_generation(c: StageControl, payload: dict[str, Any]) -> dict[str, Any]:
    mode = str(payload.get("mode") or "abort")
    if mode not in PAUSE_MODES:
        return reply(False, f"invalid pause mode: {mode}; choose one of {', '.join(PAUSE_MODES)}")
    num = await c.pause(mode)
    log.info("scheduler_paused", mode=mode, num_paused_requests=num)
    return reply(True, "generation paused", {"mode": mode, "num_paused_requests": num, "engine_paused": True})


async def continue_generation(c: StageControl, payload: dict[str, Any]) -> dict[str, Any]:
    if bool(payload.get("torch_empty_cache", True)):
        empty_device_cache()
    c.resume()
    log.info("scheduler_resumed")
    return reply(True, "generation continued", {"engine_paused": False})


async def run_weight_update(
    c: StageControl,
    payload: dict[str, Any],
    update: Callable[[dict[str, Any]], tuple[bool, str]],
    result_data: dict[str, Any],
    *,
    keep_pause_on_failure: bool = False,
) -> dict[str, Any]:
    """The weight-update lifecycle: pause, drain the step in flight, refuse while
    requests are active (unless aborting them or paused in retract mode), update on the
    forward thread, flush the cache, restore the pause state."""
    keep_pause = bool(payload.get("keep_pause", False))
    previously_paused, previous_mode = c.state.paused, c.state.pause_mode
    stay_paused = keep_pause
    c.state.paused = True
    num_paused = 0
    flush_success: bool | None = None
    try:
        await c.drain()
        if bool(payload.get("abort_all_requests", False)):
            num_paused = c.abort_all("aborted: weight update")
        else:
            active = c.active_request_ids()
            retracted = previously_paused and previous_mode == "retract"
            if active and not retracted:
                if not keep_pause:
                    c.state.paused = previously_paused
                return reply(
                    False,
                    "active requests are present; set abort_all_requests=true or pause_generation "
                    "with mode=retract before updating weights",
                    {
                        "active_request_count": len(active),
                        "active_request_ids": active[:16],
                        "abort_all_requests": False,
                        "pause_mode": previous_mode,
                        "engine_paused": c.state.paused,
                    },
                )
        try:
            success, message = await c.run_on_worker(update, payload)
        except Exception:
            stay_paused = stay_paused or keep_pause_on_failure
            raise
        if success and bool(payload.get("flush_cache", True)):
            flush_success = bool(c.core.flush_cache())
            success = success and flush_success
            if not flush_success:
                message = f"{message}; cache flush failed"
        if success:
            c.core.invalidate_cache()  # whatever flush_cache said: cached KV is of the old weights
        if keep_pause_on_failure and not success:
            stay_paused = True
        if bool(payload.get("torch_empty_cache", False)):
            empty_device_cache()
        if success:
            _bump_version(c, payload)
    finally:
        c.state.paused = True if stay_paused else previously_paused
        if not c.state.paused:
            c.wake.set()
    log.info("scheduler_weights_updated", success=bool(success), weight_version=c.state.weight_version)
    data = {
        "num_paused_requests": num_paused,
        "flush_cache": payload.get("flush_cache", True),
        "flush_success": flush_success,
        "keep_pause": keep_pause,
        "engine_paused": c.state.paused,
        "weight_version": c.state.weight_version,
    }
    data.update(result_data)
    return {"success": bool(success), "message": str(message), "data": data, "error": None if success else str(message)}


def _bump_version(c: StageControl, payload: dict[str, Any]) -> None:
    version = payload.get("weight_version")
    if version is not None:
        c.state.weight_version = str(version)
        return
    base, _, n = (c.state.weight_version or "initial").rpartition("+")
    c.state.weight_version = f"{base}+{int(n) + 1}" if base and n.isdigit() else f"{c.state.weight_version or 'initial'}+1"


def _worker_method(c: StageControl, name: str) -> Callable[..., Any] | None:
    worker = c.model_worker
    return getattr(worker, name, None) if worker is not None else None


async def update_weights_from_disk(c: StageControl, payload: dict[str, Any]) -> dict[str, Any]:
    fn = _worker_method(c, UPDATE_WEIGHTS_FROM_DISK)
    if fn is None:
        return unsupported(UPDATE_WEIGHTS_FROM_DISK)
    return await run_weight_update(c, payload, fn, {"model_path": payload.get("model_path"), "token_step": payload.get("token_step")})


async def update_weights_from_tensor(c: StageControl, payload: dict[str, Any]) -> dict[str, Any]:
    """Tensors pushed in-process (a colocated trainer): applied directly on the forward
    thread, between two steps, without pausing, refusing or flushing: the caller owns
    the timing, as with the threaded design this stage replaces."""
    fn = _worker_method(c, UPDATE_WEIGHTS_FROM_TENSOR)
    if fn is None:
        return unsupported(UPDATE_WEIGHTS_FROM_TENSOR)
    success, message = await c.run_on_worker(fn, payload)
    if success:
        c.core.invalidate_cache()
        _bump_version(c, payload)
    metadata_only = payload.get("named_tensors") is None and payload.get("serialized_named_tensors") is None
    return reply(success, message, {"metadata_only": metadata_only, "weight_version": c.state.weight_version})


async def update_weights_from_distributed(c: StageControl, payload: dict[str, Any]) -> dict[str, Any]:
    fn = _worker_method(c, UPDATE_WEIGHTS_FROM_DISTRIBUTED)
    if fn is None:
        return unsupported(UPDATE_WEIGHTS_FROM_DISTRIBUTED)
    data = {"group_name": payload.get("group_name"), "names": payload.get("names", [])}
    return await run_weight_update(c, payload, fn, data, keep_pause_on_failure=True)


async def flush_cache(c: StageControl, payload: dict[str, Any]) -> dict[str, Any]:
    """Empty the prefix cache; refused while requests are active (their KV is in use)."""
    active = c.active_request_ids()
    if active:
        return reply(False, "cannot flush the cache while requests are active", {"active_request_count": len(active)})
    await c.drain()
    flushed = bool(c.core.flush_cache())
    return reply(flushed, "cache flushed" if flushed else "cache flush failed: KV is still held", {})


async def init_weights_update_group(c: StageControl, payload: dict[str, Any]) -> dict[str, Any]:
    """Joining waits for the trainer: it runs on a thread of its own, and the stage
    serves it as a background admin task, so generation goes on meanwhile."""
    fn = _worker_method(c, INIT_WEIGHTS_UPDATE_GROUP)
    if fn is None:
        return unsupported(INIT_WEIGHTS_UPDATE_GROUP)
    success, message = await anyio.to_thread.run_sync(fn, payload, abandon_on_cancel=True)
    data = {"group_name": payload.get("group_name"), "world_size": payload.get("world_size"), "rank_offset": payload.get("rank_offset")}
    return reply(success, message, data)


async def destroy_weights_update_group(c: StageControl, payload: dict[str, Any]) -> dict[str, Any]:
    fn = _worker_method(c, DESTROY_WEIGHTS_UPDATE_GROUP)
    if fn is None:
        return unsupported(DESTROY_WEIGHTS_UPDATE_GROUP)
    success, message = fn(payload)
    return reply(success, message, {"group_name": payload.get("group_name")})


async def weights_checker(c: StageControl, payload: dict[str, Any]) -> dict[str, Any]:
    fn = _worker_method(c, WEIGHTS_CHECKER)
    if fn is None:
        return unsupported(WEIGHTS_CHECKER)
    action = str(payload.get("action") or "checksum")
    try:
        data = await c.run_on_worker(fn, action)
    except ValueError as exc:
        return reply(False, str(exc))
    data["weight_version"] = c.state.weight_version
    return reply(True, "ok", data)


def empty_device_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


ACTIONS: dict[str, Handler] = {
    MODEL_INFO: model_info,
    PAUSE_GENERATION: pause_generation,
    CONTINUE_GENERATION: continue_generation,
    UPDATE_WEIGHTS_FROM_DISK: update_weights_from_disk,
    UPDATE_WEIGHTS_FROM_TENSOR: update_weights_from_tensor,
    UPDATE_WEIGHTS_FROM_DISTRIBUTED: update_weights_from_distributed,
    INIT_WEIGHTS_UPDATE_GROUP: init_weights_update_group,
    DESTROY_WEIGHTS_UPDATE_GROUP: destroy_weights_update_group,
    WEIGHTS_CHECKER: weights_checker,
    FLUSH_CACHE: flush_cache,
}

# Served as tasks of their own, so that the loop keeps iterating while they wait.
BACKGROUND_ACTIONS = frozenset({INIT_WEIGHTS_UPDATE_GROUP})

__all__ = ["ACTIONS", "AdminRequest", "BACKGROUND_ACTIONS", "PAUSE_MODES", "failure", "reply", "run_admin_action", "unsupported", "errors"]

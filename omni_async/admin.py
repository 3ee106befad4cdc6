"""Admin actions, served at the top of a loop iteration (also while paused).

Every reply has the reference's shape: ``{"success", "message", "data", "error"}``.
An unknown action answers success with ``data = {"skipped": True, "unsupported": True}``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Callable

from . import errors

if TYPE_CHECKING:
    from .scheduler import AsyncOmniScheduler

MODEL_INFO = "model_info"
PAUSE_GENERATION = "pause_generation"
CONTINUE_GENERATION = "continue_generation"
UPDATE_WEIGHTS_FROM_DISK = "update_weights_from_disk"
UPDATE_WEIGHTS_FROM_TENSOR = "update_weights_from_tensor"
UPDATE_WEIGHTS_FROM_DISTRIBUTED = "update_weights_from_distributed"
INIT_WEIGHTS_UPDATE_GROUP = "init_weights_update_group"
DESTROY_WEIGHTS_UPDATE_GROUP = "destroy_weights_update_group"
WEIGHTS_CHECKER = "weights_checker"

PAUSE_MODES = ("abort", "retract", "in_place")


def reply(success: bool, message: str, data: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"success": bool(success), "message": str(message), "data": dict(data or {}), "error": None if success else str(message)}


def unsupported(action: str) -> dict[str, Any]:
    return reply(True, f"unsupported admin action: {action}", {"skipped": True, "unsupported": True})


async def run_admin_action(s: "AsyncOmniScheduler", action: str, payload: dict[str, Any]) -> dict[str, Any]:
    handler = ACTIONS.get(action)
    if handler is None:
        return unsupported(action)
    return await handler(s, payload)


async def model_info(s: "AsyncOmniScheduler", payload: dict[str, Any]) -> dict[str, Any]:
    info = dict(s._model_info)
    if s.model_worker is not None and hasattr(s.model_worker, "model_info"):
        info.update(s.model_worker.model_info())
    info.update(
        {
            "weight_version": s.weight_version,
            "stage_tp_rank": 0,
            "stage_tp_size": 1,
            "engine_paused": s.paused,
            "pause_mode": s.pause_mode,
            "loop": s.config.loop,
            "active_requests": len(s._live),
        }
    )
    info.update(s.core.stats())
    info.update(s.admission_stats())
    return reply(True, "ok", info)


async def pause_generation(s: "AsyncOmniScheduler", payload: dict[str, Any]) -> dict[str, Any]:
    mode = str(payload.get("mode") or "abort")
    if mode not in PAUSE_MODES:
        return reply(False, f"invalid pause mode: {mode}; choose one of {', '.join(PAUSE_MODES)}")
    s.paused = True
    s.pause_mode = mode
    await s.drain_inflight()
    num = 0
    if mode == "abort":
        num = s.abort_all_active("aborted: generation paused")
    elif mode == "retract":
        num = len(s.core.retract_all())
    return reply(True, "generation paused", {"mode": mode, "num_paused_requests": num, "engine_paused": True})


async def continue_generation(s: "AsyncOmniScheduler", payload: dict[str, Any]) -> dict[str, Any]:
    if bool(payload.get("torch_empty_cache", True)):
        empty_device_cache()
    s.paused = False
    s.pause_mode = None
    s.wake()
    return reply(True, "generation continued", {"engine_paused": False})


async def _on_worker(s: "AsyncOmniScheduler", fn: Callable[..., Any], *args: Any) -> Any:
    """Run a weight operation on the forward thread, so it is ordered with model steps."""
    return await s.executor.run(fn, *args)


async def run_weight_update(
    s: "AsyncOmniScheduler",
    payload: dict[str, Any],
    update: Callable[[dict[str, Any]], tuple[bool, str]],
    result_data: dict[str, Any],
    *,
    keep_pause_on_failure: bool = False,
) -> dict[str, Any]:
    """The reference's lifecycle around a weight update: pause, drain the step in
    flight, refuse while requests are active (unless aborting them or paused in retract
    mode), update, flush the cache, restore the pause state."""
    keep_pause = bool(payload.get("keep_pause", False))
    previously_paused = s.paused
    previous_mode = s.pause_mode
    stay_paused = keep_pause
    s.paused = True
    num_paused = 0
    flush_success: bool | None = None
    try:
        await s.drain_inflight()
        abort_all = bool(payload.get("abort_all_requests", False))
        if abort_all:
            num_paused = s.abort_all_active("aborted: weight update")
        else:
            active = s.active_request_ids()
            retracted = previously_paused and previous_mode == "retract"
            if active and not retracted:
                if retracted is False and not keep_pause:
                    s.paused = previously_paused
                return reply(
                    False,
                    "active requests are present; set abort_all_requests=true or pause_generation "
                    "with mode=retract before updating weights",
                    {
                        "active_request_count": len(active),
                        "active_request_ids": active[:16],
                        "abort_all_requests": False,
                        "pause_mode": previous_mode,
                        "engine_paused": s.paused,
                    },
                )
        try:
            success, message = await _on_worker(s, update, payload)
        except Exception:
            if keep_pause_on_failure:
                stay_paused = True
            raise
        if success and bool(payload.get("flush_cache", True)):
            flush_success = bool(s.core.flush_cache())
            success = success and flush_success
            if not flush_success:
                message = f"{message}; cache flush failed"
        if keep_pause_on_failure and not success:
            stay_paused = True
        if bool(payload.get("torch_empty_cache", False)):
            empty_device_cache()
        if success:
            version = payload.get("weight_version")
            s.weight_version = str(version) if version is not None else _next_version(s.weight_version)
    finally:
        s.paused = True if stay_paused else previously_paused
        if not s.paused:
            s.wake()
    data = {
        "num_paused_requests": num_paused,
        "flush_cache": payload.get("flush_cache", True),
        "flush_success": flush_success,
        "keep_pause": keep_pause,
        "engine_paused": s.paused,
        "weight_version": s.weight_version,
    }
    data.update(result_data)
    return {"success": bool(success), "message": str(message), "data": data, "error": None if success else str(message)}


def _next_version(version: str | None) -> str:
    base, _, n = (version or "initial").rpartition("+")
    return f"{base}+{int(n) + 1}" if base and n.isdigit() else f"{version or 'initial'}+1"


def _worker_method(s: "AsyncOmniScheduler", name: str) -> Callable[..., Any] | None:
    worker = s.model_worker
    return getattr(worker, name, None) if worker is not None else None


async def update_weights_from_disk(s: "AsyncOmniScheduler", payload: dict[str, Any]) -> dict[str, Any]:
    fn = _worker_method(s, "update_weights_from_disk")
    if fn is None:
        return unsupported(UPDATE_WEIGHTS_FROM_DISK)
    return await run_weight_update(
        s, payload, fn, {"model_path": payload.get("model_path"), "token_step": payload.get("token_step")}
    )


async def update_weights_from_tensor(s: "AsyncOmniScheduler", payload: dict[str, Any]) -> dict[str, Any]:
    fn = _worker_method(s, "update_weights_from_tensor")
    if fn is None:
        return unsupported(UPDATE_WEIGHTS_FROM_TENSOR)
    payload.setdefault("flush_cache", True)
    res = await run_weight_update(s, payload, fn, {"metadata_only": payload.get("named_tensors") is None and payload.get("serialized_named_tensors") is None})
    return res


async def update_weights_from_distributed(s: "AsyncOmniScheduler", payload: dict[str, Any]) -> dict[str, Any]:
    fn = _worker_method(s, "update_weights_from_distributed")
    if fn is None:
        return unsupported(UPDATE_WEIGHTS_FROM_DISTRIBUTED)
    return await run_weight_update(
        s,
        payload,
        fn,
        {"group_name": payload.get("group_name"), "names": payload.get("names", [])},
        keep_pause_on_failure=True,
    )


async def init_weights_update_group(s: "AsyncOmniScheduler", payload: dict[str, Any]) -> dict[str, Any]:
    """Joining waits for the trainer: it runs on a thread of its own, and the scheduler
    serves it as a background admin task, so generation goes on meanwhile."""
    import anyio

    fn = _worker_method(s, "init_weights_update_group")
    if fn is None:
        return unsupported(INIT_WEIGHTS_UPDATE_GROUP)
    success, message = await anyio.to_thread.run_sync(fn, payload, abandon_on_cancel=True)
    return reply(
        success,
        message,
        {"group_name": payload.get("group_name"), "world_size": payload.get("world_size"), "rank_offset": payload.get("rank_offset")},
    )


async def destroy_weights_update_group(s: "AsyncOmniScheduler", payload: dict[str, Any]) -> dict[str, Any]:
    fn = _worker_method(s, "destroy_weights_update_group")
    if fn is None:
        return unsupported(DESTROY_WEIGHTS_UPDATE_GROUP)
    success, message = fn(payload)
    return reply(success, message, {"group_name": payload.get("group_name")})


async def weights_checker(s: "AsyncOmniScheduler", payload: dict[str, Any]) -> dict[str, Any]:
    fn = _worker_method(s, "weights_checker")
    if fn is None:
        return unsupported(WEIGHTS_CHECKER)
    action = str(payload.get("action") or "checksum")
    try:
        data = await _on_worker(s, fn, action)
    except ValueError as exc:
        return reply(False, str(exc))
    data["weight_version"] = s.weight_version
    return reply(True, "ok", data)


def empty_device_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


ACTIONS: dict[str, Callable[["AsyncOmniScheduler", dict[str, Any]], Awaitable[dict[str, Any]]]] = {
    MODEL_INFO: model_info,
    PAUSE_GENERATION: pause_generation,
    CONTINUE_GENERATION: continue_generation,
    UPDATE_WEIGHTS_FROM_DISK: update_weights_from_disk,
    UPDATE_WEIGHTS_FROM_TENSOR: update_weights_from_tensor,
    UPDATE_WEIGHTS_FROM_DISTRIBUTED: update_weights_from_distributed,
    INIT_WEIGHTS_UPDATE_GROUP: init_weights_update_group,
    DESTROY_WEIGHTS_UPDATE_GROUP: destroy_weights_update_group,
    WEIGHTS_CHECKER: weights_checker,
}

# Served as tasks of their own, so that the loop keeps iterating while they wait.
BACKGROUND_ACTIONS = {INIT_WEIGHTS_UPDATE_GROUP}

__all__ = ["ACTIONS", "BACKGROUND_ACTIONS", "PAUSE_MODES", "run_admin_action", "reply", "unsupported", "errors"]

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


def empty_device_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


ACTIONS: dict[str, Callable[["AsyncOmniScheduler", dict[str, Any]], Awaitable[dict[str, Any]]]] = {
    MODEL_INFO: model_info,
    PAUSE_GENERATION: pause_generation,
    CONTINUE_GENERATION: continue_generation,
}

__all__ = ["ACTIONS", "PAUSE_MODES", "run_admin_action", "reply", "unsupported", "errors"]

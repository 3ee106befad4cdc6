"""The stage's public control API: pause, resume, drain, abort_all, active ids, info.

Admin actions (:mod:`omni_async.stage.admin`) are written against this API, and so are tests
and applications that need to steer or inspect a running stage.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, TypeVar

from .. import errors
from ..core.protocol import BatchCore, StepRunner
from .channels import WakeSignal
from .emission import Emission
from .state import StageState
from .executor import StepExecutor
from .intake import Intake
from .stepper import Stepper

T = TypeVar("T")
PAUSE_MODES = ("abort", "retract", "in_place")


class StageControl:
    def __init__(
        self,
        core: BatchCore,
        intake: Intake,
        emission: Emission,
        stepper: Stepper,
        runner: StepRunner,
        executor: StepExecutor,
        *,
        wake: WakeSignal,
        state: StageState,
        loop_name: str,
        model_info: dict[str, Any] | None = None,
        model_worker: Any = None,
    ) -> None:
        self.core = core
        self.intake = intake
        self.emission = emission
        self.stepper = stepper
        self.runner = runner
        self.executor = executor
        self.wake = wake
        self.loop_name = loop_name
        self.model_info = dict(model_info or {})
        self.model_worker = model_worker
        self.state = state

    # ------------------------------------------------------------ steering

    async def pause(self, mode: str = "abort") -> int:
        """Stop scheduling steps. ``abort`` ends every active request, ``retract``
        sends running ones back to waiting (KV freed), ``in_place`` keeps them as they
        are. The step in flight completes first. Returns how many requests it touched."""
        if mode not in PAUSE_MODES:
            raise errors.InvalidRequestError(f"invalid pause mode: {mode}; choose one of {', '.join(PAUSE_MODES)}")
        self.state.paused = True
        self.state.pause_mode = mode
        await self.drain()
        if mode == "abort":
            return self.abort_all("aborted: generation paused")
        if mode == "retract":
            return len(self.core.retract_all())
        return 0

    def resume(self) -> None:
        self.state.paused = False
        self.state.pause_mode = None
        self.wake.set()

    async def drain(self) -> None:
        """Process every step in flight."""
        await self.stepper.drain()

    def abort_all(self, reason: str) -> int:
        """End every active request now (arrivals and admission included), each with
        one aborted error. Returns how many."""
        with self.emission.coalesced():
            arrived = [rid for rid in self.intake.take_all_arrived_new() if not self.emission.is_live(rid)]
            for rid in arrived:
                self.emission.reject(rid, errors.RequestAbortedError(reason))
            payloads = self.intake.admission.drain_all()
            for payload in payloads:
                self.emission.reject(payload.request_id, errors.RequestAbortedError(reason))
            victims = self.core.abort_all()
            self.emission.end_all(victims, lambda req: errors.RequestAbortedError(reason, output_ids=req.output_ids))
        return len(victims) + len(payloads) + len(arrived)

    async def run_on_worker(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the forward thread, ordered with model steps (weight updates)."""
        return await self.executor.run(fn, *args)

    # ------------------------------------------------------------ introspection

    def active_request_ids(self) -> list[str]:
        """Requests arrived, being admitted, or admitted, and not yet terminated."""
        ids = set(self.emission.live) | set(self.intake.admission.active_ids()) | self.intake.arrived_ids()
        return sorted(ids)

    def info(self) -> dict[str, Any]:
        """A snapshot of the stage: loop, pause state, counters, core and admission."""
        st = self.stepper.stats
        info: dict[str, Any] = dict(self.model_info)
        info.update(
            {
                "weight_version": self.state.weight_version,
                "engine_paused": self.state.paused,
                "pause_mode": self.state.pause_mode,
                "loop": self.loop_name,
                "active_requests": len(self.emission.live),
                "iterations": st.iterations,
                "steps": st.steps,
                "prefill_steps": st.prefill_steps,
                "decode_steps": st.decode_steps,
                "decode_row_forwards": st.decode_row_forwards,
                "lookahead_steps": st.lookahead_steps,
                "early_steps": st.early_steps,
                "failed_steps": st.failed_steps,
                "tokens_out": st.tokens_out,
                "steps_in_flight": self.stepper.in_flight,
                # How a step's device completion is awaited now (event_wait="auto" polls
                # alone and blocks in a waiter thread while other stages share the loop).
                "device_wait": "thread" if self.executor.event_waiter.blocks_in_thread() else "poll",
                "step_timeout_s": self.stepper.watchdog.setting,
                "step_timeout_last_s": self.stepper.watchdog.last_s,
                "step_timeouts": self.stepper.watchdog.timeouts,
            }
        )
        info.update(self.core.stats())
        info.update(self.runner.stats())
        info.update(self.intake.admission.stats())
        info.update(self.intake.grammars.stats())
        return info


AdminHandler = Callable[[StageControl, dict[str, Any]], Awaitable[dict[str, Any]]]

"""The step watchdog: how long a model step may take before its requests fail with
:class:`~omni_async.errors.DeviceTimeoutError`.

``SchedulerConfig.step_timeout_s`` is ``"auto"`` (the default), a number of seconds, or
``None`` (no deadline: an explicit opt-out). ``"auto"`` gives each step a deadline that a
healthy step never reaches, scaled to the device and to the step's size::

    deadline_s = FLOOR_S + 2 * num_parameters * step_tokens / MIN_FLOPS[device]

``step_tokens`` is what the step computes: the prefill tokens of an extend step, one
token per row (``decode_steps`` per row in a multi-step launch) for a decode step;
``2 * num_parameters`` FLOPs per token is the dense forward's cost. ``MIN_FLOPS`` is far
below what any supported device sustains (1 GFLOP/s on CPU, where fp32 GEMMs on one
core already run at tens; 1 TFLOP/s on CUDA, hundreds of times below a data-centre
GPU), so attention's growth with the context, a loaded host and a slow part all fit
inside the margin; ``FLOOR_S`` covers fixed costs a first step can carry (a kernel
compiled or a graph captured on first use, a GC pass). SmolLM2-135M on CPU: a decode
step of 64 rows gets 137 s, a 4,096-token prefill 1,226 s. When the parameter count is
not known (another backend), a step gets ``UNKNOWN_MODEL_S``.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError

AUTO = "auto"
FLOOR_S = 120.0
MIN_FLOPS = {"cpu": 1e9, "cuda": 1e12}
UNKNOWN_MODEL_S = 600.0


def check_step_timeout(value: Any) -> None:
    """``"auto"``, ``None`` or a positive, finite number of seconds."""
    if value is None or value == AUTO:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise ConfigError(f"step_timeout_s must be 'auto', a positive number of seconds or None, got {value!r}")


def explicit_step_timeout(value: Any) -> float | None:
    """The configured seconds when a number was given; None for ``"auto"`` and ``None``."""
    return None if value is None or value == AUTO else float(value)


def step_tokens(batch: Any) -> int:
    """Tokens a scheduled step computes (see the module docstring)."""
    if batch.is_decode:
        row_steps = getattr(batch, "row_steps", None)
        return sum(row_steps) if row_steps else batch.size
    num_tokens = getattr(batch, "num_tokens", None)
    return int(num_tokens) if isinstance(num_tokens, int) else batch.size


def auto_deadline_s(device_type: str, num_parameters: int | None, tokens: int) -> float:
    """The ``"auto"`` deadline of one step (see the module docstring)."""
    if not num_parameters:
        return UNKNOWN_MODEL_S
    rate = MIN_FLOPS.get(device_type, MIN_FLOPS["cpu"])
    return FLOOR_S + 2.0 * num_parameters * max(1, tokens) / rate


class StepWatchdog:
    """Deadlines for steps, from the configured ``step_timeout_s``, the device type and
    the model's parameter count. ``last_s`` is the deadline of the latest step armed."""

    def __init__(self, setting: Any, *, device_type: str = "cpu", num_parameters: int | None = None) -> None:
        check_step_timeout(setting)
        self.setting = setting
        self.device_type = device_type
        self.num_parameters = num_parameters
        self.last_s: float | None = None
        self.timeouts = 0

    @classmethod
    def for_runner(cls, setting: Any, runner: Any) -> "StepWatchdog":
        """Sized by the runner's device and its model's parameter count, where the
        runner has them (the native runners do; others get ``UNKNOWN_MODEL_S``)."""
        device = getattr(runner, "device", None)
        model = getattr(runner, "model", None)
        params = getattr(model, "parameters", None)
        num_parameters = sum(p.numel() for p in params()) if callable(params) else None
        return cls(setting, device_type=getattr(device, "type", "cpu"), num_parameters=num_parameters)

    def deadline_s(self, batch: Any) -> float | None:
        """Seconds the step may take; None: no deadline."""
        if self.setting is None:
            deadline = None
        elif self.setting == AUTO:
            deadline = auto_deadline_s(self.device_type, self.num_parameters, step_tokens(batch))
        else:
            deadline = float(self.setting)
        self.last_s = deadline
        return deadline

    def close_wait_s(self) -> float | None:
        """How long closing waits for the worker to finish what is queued: not at all
        once a step hung (waiting again would only repeat its deadline), for ever with
        ``None``, else the configured seconds (``"auto"``: the floor)."""
        if self.setting is None:
            return None
        if self.timeouts:
            return 0.0
        return FLOOR_S if self.setting == AUTO else float(self.setting)

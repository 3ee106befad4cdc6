"""The backend registry, dispatch only: each backend builds a stage (its scheduler over
its own batch core, runner and memory) from a checkpoint. The engine asks the registry
by name and never imports a backend itself; backends are imported on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .. import errors
from .base import BuiltStage



def _native(path_or_name: str, *, config: "SchedulerConfig", device: Any, dtype: Any, seed: int) -> BuiltStage:
    from .native.builder import build_native_stage

    return build_native_stage(path_or_name, config=config, device=device, dtype=dtype, seed=seed)


def _sglang(path_or_name: str, *, config: "SchedulerConfig", device: Any, dtype: Any, seed: int) -> BuiltStage:
    if config.tensor_parallel_size > 1:
        # The in-process SGLang stack runs SGLang's parallel runtime with world size 1.
        raise errors.ConfigError(
            f"backend='sglang' runs with tensor_parallel_size=1 only (got {config.tensor_parallel_size}); "
            "use backend='native' for tensor parallelism"
        )
    if (config.decode_steps or 1) > 1:
        raise errors.ConfigError(f"backend='sglang' runs one decode forward per step (got decode_steps={config.decode_steps})")
    if config.hidden_states_layer is not None:
        raise errors.ConfigError("backend='sglang' hands out no hidden states; hidden_states_layer needs backend='native'")
    from .sglang import build_sglang_stage

    return build_sglang_stage(path_or_name, config=config, device=device, dtype=dtype, seed=seed)


BACKENDS: dict[str, Callable[..., BuiltStage]] = {"native": _native, "sglang": _sglang}


def build_stage(backend: str, path_or_name: str, *, config: "SchedulerConfig", device: Any = "cpu", dtype: Any = None, seed: int = 0) -> BuiltStage:
    builder = BACKENDS.get(backend)
    if builder is None:
        raise errors.ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    return builder(path_or_name, config=config, device=device, dtype=dtype, seed=seed)

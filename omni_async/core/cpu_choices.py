"""What a CPU stage runs on, decided from the configuration and the facts (pure): the
weights' layout and dtype (:class:`LoadPlan`, the part of the plan decided before the
weights load), and whether the C++ kernels take over from the torch ops. Part of the
stage plan (:mod:`.plan`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..config import SchedulerConfig
from .facts import CheckpointFacts, DeviceFacts, dtype_name

_BF16 = ("bfloat16", "bf16")


def default_quantization(config: SchedulerConfig, device: DeviceFacts, checkpoint: CheckpointFacts, dtype: Any = None) -> str | None:
    """The weights' layout: ``config.quantization`` when given; for a GGUF file on one CPU
    rank with the dtype left open, ``"q4"`` where the C++ kernels are built (the file's
    blocks read by the GEMMs directly: a batch-1 step streams a fifth of float32's bytes,
    perplexity within 2% of float32's, docs/notes/cpu-decode-2026-12-01.md); float32 stays
    the exact path (``dtype="float32"``)."""
    if config.quantization is not None or dtype is not None or device.type != "cpu" or config.tensor_parallel_size > 1:
        return config.quantization
    return "q4" if checkpoint.gguf and device.cpu_kernels_build else None


def load_dtype(config: SchedulerConfig, device: DeviceFacts, checkpoint: CheckpointFacts, dtype: Any = None) -> Any:
    """The dtype to load the weights in: ``dtype`` when given; on CPU (one rank, no
    quantization) bfloat16 for a checkpoint stored in reduced precision on a CPU with
    native bfloat16; else None (the loader's default: float32 on CPU, the checkpoint's
    on CUDA)."""
    if dtype is not None or device.type != "cpu" or config.tensor_parallel_size > 1:
        return dtype
    if config.quantization is None and device.native_bf16 and checkpoint.reduced_precision:
        return "bfloat16"
    return None


def wants_cpu_kernels(config: SchedulerConfig, device_type: str, dtype: Any) -> bool:
    """Whether the plan would turn the C++ CPU kernels on where they build (so whether
    they must be probed): on one CPU rank running inexactly (bfloat16 or int8), with a
    kernel option left open."""
    if device_type != "cpu" or config.tensor_parallel_size > 1:
        return False
    inexact = config.quantization is not None or (dtype is not None and dtype_name(dtype) in _BF16)
    return inexact and (config.cpu_attention_kernel is None or config.cpu_fused_ops is None)


def cpu_threads(config: SchedulerConfig, device: DeviceFacts) -> tuple[int | None, str]:
    """The intra-op threads a CPU stage of one rank runs on, and why (None elsewhere:
    a CUDA stage's kernels do not use them; a tensor-parallel rank sets its own).

    ``config.cpu_threads`` when given; the environment's count when ``OMP_NUM_THREADS``
    fixed it; else the CPUs the load average leaves idle, rounded, at least one and at
    most what torch already uses: threads beyond the idle cores wait at each parallel
    region's barrier for a core that another process holds."""
    if device.type != "cpu" or config.tensor_parallel_size > 1:
        return None, "not a CPU stage of one rank: left as it is"
    if config.cpu_threads is not None:
        return config.cpu_threads, f"cpu_threads={config.cpu_threads} as asked"
    have = device.intra_op_threads
    if device.threads_env is not None:
        return have, f"{device.threads_env} from the environment"
    if device.load_average is None:
        return have, f"torch's {have} (the load average cannot be read)"
    idle = device.cpus - device.load_average
    threads = max(1, min(have, int(idle + 0.5)))
    state = "oversubscribed" if idle <= 0 else f"{idle:.1f} idle"
    return threads, f"load average {device.load_average:.2f} on {device.cpus} CPUs ({state}): {threads} of torch's {have}"


def kernel_options(config: SchedulerConfig, device: DeviceFacts, dtype: Any) -> dict[str, bool]:
    """Each CPU kernel option, as given or decided (open: on where wanted and built)."""
    on = wants_cpu_kernels(config, device.type, dtype) and device.cpu_kernels_build
    return {name: (on if getattr(config, name) is None else bool(getattr(config, name))) for name in ("cpu_attention_kernel", "cpu_fused_ops")}


@dataclass(frozen=True)
class LoadPlan:
    """What is decided before the weights load: their layout (``config.quantization`` as
    given or decided) and the dtype the loader is asked for (None: its default). The
    stage plan takes these as made, after loading."""

    config: SchedulerConfig  # the caller's, with the quantization decided
    dtype: Any


def plan_load(config: SchedulerConfig, device: DeviceFacts, checkpoint: CheckpointFacts, dtype: Any = None) -> LoadPlan:
    """The weights' layout, then the dtype to load them in (:func:`default_quantization`,
    :func:`load_dtype`), from the facts read at the plan's entry."""
    quantization = default_quantization(config, device, checkpoint, dtype)
    if quantization != config.quantization:
        config = dataclasses.replace(config, quantization=quantization)
    return LoadPlan(config, load_dtype(config, device, checkpoint, dtype))


def kernels_may_matter(config: SchedulerConfig, device: DeviceFacts, checkpoint: CheckpointFacts, dtype: Any = None) -> bool:
    """Whether any decision could turn on whether the C++ CPU kernels build here, so
    whether that fact (seconds to learn the first time) must be read: a GGUF file whose
    blocks could run as they are (:func:`default_quantization`), or a path the kernels
    would serve (:func:`wants_cpu_kernels`)."""
    if device.type != "cpu" or config.tensor_parallel_size > 1:
        return False
    if checkpoint.gguf and dtype is None and config.quantization is None:
        return True
    return wants_cpu_kernels(config, device.type, load_dtype(config, device, checkpoint, dtype))

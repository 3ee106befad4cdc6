"""The CPU configuration a model gets when the caller leaves it open.

Measured on SmolLM2-135M (bench/RESULTS.md): a CPU with native bfloat16 instructions
(``avx512_bf16`` or AMX) runs the model faster in bfloat16 than in float32 once several
requests share a step, and the C++ kernels (``cpu_attention_kernel``, ``cpu_fused_ops``)
add to it at every batch size. So, on CPU with ``tensor_parallel_size=1``:

- ``quantization=None`` with ``dtype=None`` for a GGUF file (``smollm2`` included):
  ``"q4"``, the file's blocks read directly by the C++ kernels (a batch-1 step streams a
  sixth of float32's bytes; perplexity within 1% of float32, docs/notes/cpu-decode-2026-12-01.md),
  with the other kernels on. Float32 stays the exact path: pass ``dtype="float32"``.
- ``dtype=None``: ``bfloat16`` for a checkpoint stored in 16 bits or fewer (a GGUF file,
  or a folder whose ``config.json`` says bfloat16/float16) on a CPU with native bfloat16,
  unless int8 quantization is asked for; float32 otherwise (the exact reference path, and
  always for float32 checkpoints and the built-in ``tiny``).
- ``cpu_attention_kernel=None`` / ``cpu_fused_ops=None``: on when the engine runs in
  bfloat16 or int8 (paths that are not bit-exact anyway), if the kernels build; a machine
  without a compiler falls back to the torch ops with a warning. Off in float32, whose
  tokens equal transformers' float32 tokens bit for bit.

An explicit value for any of them is kept as given (``True`` for a kernel that cannot be
built stays a ``ConfigError``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from ...config import SchedulerConfig
from ...errors import ConfigError
from ...logs import log

CPU_FLAGS_FILE = "/proc/cpuinfo"
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_REDUCED = ("bfloat16", "float16", "bf16", "fp16", "half")
_KERNEL_OPTIONS = ("cpu_attention_kernel", "cpu_fused_ops")


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """Whether the CPU has bfloat16 dot-product instructions (read from /proc/cpuinfo;
    False where that cannot be read)."""
    try:
        text = Path(CPU_FLAGS_FILE).read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return any(flag in line.split() for flag in BF16_FLAGS)
    return False


def stored_in_reduced_precision(path_or_name: Any) -> bool:
    """A GGUF file (16-bit or quantised tensors), ``smollm2``, or a folder whose config
    names a 16-bit dtype; False for float32 folders and the built-in ``tiny``."""
    from ...models.gguf import SMOLLM2_NAME, is_gguf_path

    name = str(path_or_name)
    if name == SMOLLM2_NAME or is_gguf_path(name):
        return True
    try:
        raw = json.loads((Path(name) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return str(raw.get("torch_dtype") or raw.get("dtype") or "float32") in _REDUCED


def is_gguf_source(path_or_name: Any) -> bool:
    from ...models.gguf import SMOLLM2_NAME, is_gguf_path

    return str(path_or_name) == SMOLLM2_NAME or is_gguf_path(path_or_name)


def choose_cpu_defaults(path_or_name: Any, config: SchedulerConfig, device: torch.device, dtype: Any) -> tuple[Any, SchedulerConfig]:
    """``(dtype, config)`` with the open choices made (see the module docstring); on other
    devices the kernel options are simply off."""
    if device.type != "cpu" or config.tensor_parallel_size > 1:
        return dtype, _kernels(config, False)
    if dtype is None and config.quantization is None and is_gguf_source(path_or_name) and kernels_build():
        config = dataclasses.replace(config, quantization="q4")
    if dtype is None and config.quantization is None and cpu_has_native_bf16() and stored_in_reduced_precision(path_or_name):
        dtype = "bfloat16"
    inexact = config.quantization is not None or (dtype is not None and str(dtype).replace("torch.", "") in ("bfloat16", "bf16"))
    if inexact and any(getattr(config, name) is None for name in _KERNEL_OPTIONS):
        config = _kernels(config, kernels_build())
    return dtype, _kernels(config, False)


def _kernels(config: SchedulerConfig, on: bool) -> SchedulerConfig:
    """``config`` with every kernel option still open set to ``on``."""
    open_ = {name: on for name in _KERNEL_OPTIONS if getattr(config, name) is None}
    return dataclasses.replace(config, **open_) if open_ else config


@functools.lru_cache(maxsize=1)
def kernels_build() -> bool:
    """Whether the C++ kernel sets are built for this torch (scripts/setup.sh builds them)
    and load. When they are not, a background build starts (said on stderr, with an
    estimate) and this start answers no: it serves with the torch ops rather than wait.
    ``OMNI_ASYNC_CPU_KERNELS=0`` answers no without trying."""
    if os.environ.get("OMNI_ASYNC_CPU_KERNELS", "").strip().lower() in ("0", "false", "no", "off"):
        return False
    from ...kernels.cpu_build import all_kernels, ensure_built_in_background

    if not ensure_built_in_background():
        return False
    try:
        for kernels in all_kernels():
            kernels.load()
    except ConfigError as exc:
        log.warning("cpu_kernels_unavailable", error=str(exc))
        print(f"omni-async: the C++ CPU kernels could not be built, running the torch ops instead ({exc})", file=sys.stderr)
        return False
    return True

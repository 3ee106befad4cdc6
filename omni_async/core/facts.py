"""The facts a stage plan is decided from, as plain values: the device's and the
checkpoint's. The backends gather them once, at the plan's entry (for the native backend
``backends/native/facts.py``); the plan (:mod:`.plan`) and its CPU choices
(:mod:`.cpu_choices`) read them and never fetch anything themselves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_ITEMSIZE = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8, "int8": 1}


def dtype_name(dtype: Any) -> str:
    """A dtype's name without torch's prefix (``torch.bfloat16`` -> ``bfloat16``)."""
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class DeviceFacts:
    """What the plan needs to know about the device, as plain values."""

    type: str = "cpu"  # "cpu" | "cuda"
    total_bytes: int | None = None  # the device's memory (RAM on CPU)
    # Memory free for the KV: on CUDA after the weights are loaded; on CPU the RAM
    # available then. None: unknown.
    free_bytes: int | None = None
    native_bf16: bool = False  # the CPU has bfloat16 dot-product instructions
    # Both C++ CPU kernel sets build here (only probed when the plan would use them:
    # :func:`wants_cpu_kernels`).
    cpu_kernels_build: bool = False
    paged_kernel: bool = False  # Triton's paged decode attention runs here (CUDA)
    graph_buckets: tuple[int, ...] = ()  # batch sizes the decode graphs can capture
    # For the CPU thread choice (cpu_choices.cpu_threads): CPUs this process may use, the
    # 1-minute load average (None: unknown), torch's threads now, the variable that fixed
    # them ("OMP_NUM_THREADS=2").
    cpus: int = 1
    load_average: float | None = None
    intra_op_threads: int = 1
    threads_env: str | None = None


@dataclass(frozen=True)
class CheckpointFacts:
    """What the plan needs to know about the checkpoint (the local shard's KV heads under
    tensor parallelism). Before loading only ``reduced_precision`` is needed."""

    reduced_precision: bool = False  # stored in 16 bits or fewer (GGUF, a bf16/fp16 folder)
    gguf: bool = False  # a GGUF file (``smollm2`` included): its blocks can be read as they are
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    hidden_size: int = 0
    intermediate_size: int = 0
    vocab_size: int = 0
    max_position_embeddings: int = 0
    dtype: str = "float32"  # the loaded weights'
    weights_bytes: int = 0

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[dtype_name(self.dtype)]

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

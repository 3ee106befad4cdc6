"""Assemble a scheduler from a checkpoint: model, KV cache, runner, batch core."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch

from .config import SchedulerConfig
from .core.batch_core import NativeBatchCore
from .core.multi_step import resolve_decode_steps
from .cpu_defaults import choose_cpu_defaults
from .device import make_step_executor
from .errors import ConfigError
from .kv.allocator import PageAllocator
from .kv.cache import PagedKVCache
from .models.loader import LoadedModel, load_model, resolve_dtype
from .models.quantized import check_quantization, quantization_of, quantize_linears
from .runners.native import NativeModelRunner
from .scheduler import AsyncOmniScheduler, ModelLimits
from .weights import NativeModelWorker

T = TypeVar("T")

# CPU KV when kv_capacity_tokens is not given: this fraction of the memory available now,
# within [CPU_KV_MIN_TOKENS, CPU_KV_MAX_TOKENS] (the cap keeps start-up and tests quick;
# give kv_capacity_tokens for more). DEFAULT_CPU_KV_TOKENS is used when the available
# memory cannot be read.
DEFAULT_CPU_KV_TOKENS = 32768
CPU_KV_MEMORY_FRACTION = 0.1
CPU_KV_MIN_TOKENS = 2048
CPU_KV_MAX_TOKENS = 65536


@dataclass
class NativeStack:
    loaded: LoadedModel
    kv: PagedKVCache
    allocator: PageAllocator
    runner: NativeModelRunner
    core: NativeBatchCore
    limits: ModelLimits
    device: torch.device
    # The tensor-parallel group (rank 0's handle on the worker ranks), or None.
    tensor_parallel: Any = None


def kv_pages_for(config: SchedulerConfig, loaded: LoadedModel, device: torch.device, dtype: torch.dtype) -> int:
    cfg = loaded.model.config  # the local KV heads under tensor parallelism
    if config.kv_capacity_tokens is not None:
        tokens = config.kv_capacity_tokens
    elif device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        per_token = PagedKVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)
        tokens = int(free * config.kv_memory_fraction) // per_token
    else:
        per_token = PagedKVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)
        tokens = cpu_kv_tokens(per_token)
    return max(1, tokens // config.page_size)


def available_memory_bytes() -> int | None:
    """Memory available to new allocations now (psutil when installed, else sysconf)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def cpu_kv_tokens(bytes_per_token: int) -> int:
    """Why not a constant: 32k tokens of a large model's KV can exceed a small machine's
    memory, and are needlessly few on a big one."""
    avail = available_memory_bytes()
    if avail is None:
        return DEFAULT_CPU_KV_TOKENS
    tokens = int(avail * CPU_KV_MEMORY_FRACTION) // max(1, bytes_per_token)
    return max(CPU_KV_MIN_TOKENS, min(CPU_KV_MAX_TOKENS, tokens))


def build_native_stack(
    path_or_name: str,
    config: SchedulerConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: Any = None,
    seed: int = 0,
) -> NativeStack:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype, config = choose_cpu_defaults(path_or_name, config, device, dtype)
    requested = None if dtype is None else resolve_dtype(dtype, "float32", device)
    check_quantization(config.quantization, device, requested, config.tensor_parallel_size)
    if config.tensor_parallel_size > 1:
        from .parallel.launch import build_parallel_stack

        return build_parallel_stack(path_or_name, config, device=device, dtype=dtype, seed=seed)

    def build() -> NativeStack:
        loaded = load_model(path_or_name, dtype=dtype, device=device, seed=seed)
        quantize_linears(loaded.model, config.quantization)
        num_pages = kv_pages_for(config, loaded, device, next(loaded.model.parameters()).dtype)
        runner = NativeModelRunner(loaded.model, kv_cache(loaded, config, device, num_pages), device, seed=seed, fused_kernels=config.fused_kernels)
        return assemble_stack(loaded, config, device, num_pages, runner)

    return build_off_this_thread(build) if device.type == "cpu" else build()


def build_off_this_thread(build: Callable[[], T]) -> T:
    """Run ``build`` in a thread of its own and return (or raise) its result.

    On CPU a thread that runs a parallel torch op gets an OpenMP team for its life. Loading
    on the caller's thread would leave its team next to the step thread's, and with more
    OpenMP threads than cores libgomp sleeps between parallel regions, so every torch op of
    every step pays a thread wake-up: 10x per op on the 2-core VM (bench/RESULTS.md). The
    team of a thread that has ended is released."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = build()
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="omni-load", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def kv_cache(loaded: LoadedModel, config: SchedulerConfig, device: torch.device, num_pages: int) -> PagedKVCache:
    """The paged KV of the model's (local) KV heads, plus one page at the end that the
    allocator never hands out: the scratch page that padded graph rows, and multi-step
    rows past their last forward, write to."""
    cfg = loaded.model.config
    scratch = 1
    return PagedKVCache(
        num_layers=cfg.num_layers,
        num_pages=num_pages + scratch,
        page_size=config.page_size,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=next(loaded.model.parameters()).dtype,
        device=device,
    )


def assemble_stack(
    loaded: LoadedModel, config: SchedulerConfig, device: torch.device, num_pages: int, runner: NativeModelRunner, tensor_parallel: Any = None
) -> NativeStack:
    """Allocator, limits, CUDA graphs and batch core around a runner over ``num_pages``."""
    cfg = loaded.config
    kv = runner.kv
    allocator = PageAllocator(num_pages, config.page_size)
    context = cfg.max_position_embeddings
    if config.context_length is not None:
        if config.context_length > cfg.max_position_embeddings:
            raise ConfigError(
                f"context_length {config.context_length} exceeds the model's "
                f"max_position_embeddings {cfg.max_position_embeddings}"
            )
        context = config.context_length
    limits = ModelLimits(
        vocab_size=cfg.vocab_size,
        context_length=context,
        kv_capacity_tokens=allocator.capacity_tokens,
        eos_token_ids=cfg.eos_token_ids,
    )
    steps = resolve_decode_steps(config.decode_steps, device.type, config.tensor_parallel_size, config.page_size)
    runner.configure_decode_steps(steps, fused=config.fuse_decode_steps)
    if device.type == "cuda" and config.cuda_graphs:
        # With the paged kernel, attention costs what each sequence really holds, so
        # graphs can span the whole context; without it they span cuda_graph_max_len.
        runner.enable_cuda_graphs(
            scratch_page=num_pages,
            max_len=context if runner.use_kernel else min(config.cuda_graph_max_len, context),
            max_batch=min(config.cuda_graph_max_batch, config.max_running_requests),
        )
    if config.cpu_attention_kernel and device.type == "cpu":
        from .kernels.cpu_paged import load

        load()  # built now (ConfigError if it cannot be), not inside the first step
        runner.cpu_attention_kernel = True
    if config.cpu_fused_ops and device.type == "cpu":
        from .kernels.cpu_fused import CpuFusedOps, load as load_fused

        load_fused()  # built now (ConfigError if it cannot be), not inside the first step
        runner.model.ops = CpuFusedOps()
        runner.cpu_fused_ops = True
    core = NativeBatchCore(config, allocator, context, decode_steps=steps)
    core.multi_step_allowed = runner.multi_step_allowed
    return NativeStack(loaded, kv, allocator, runner, core, limits, device, tensor_parallel)


def build_scheduler(stack: NativeStack, config: SchedulerConfig, **callbacks: Any) -> AsyncOmniScheduler:
    info = {
        "model_path": stack.loaded.path,
        "load_format": stack.loaded.load_format,
        "model_family": stack.loaded.config.family,
        "device": str(stack.device),
        "dtype": str(next(stack.loaded.model.parameters()).dtype).replace("torch.", ""),
        "weight_version": "initial",
        "quantization": quantization_of(stack.loaded.model),
        "cpu_attention_kernel": stack.runner.cpu_attention_kernel,
        "cpu_fused_ops": stack.runner.cpu_fused_ops,
    }
    executor = make_step_executor(config.step_launch, stack.device.type, config.event_wait)
    tp = stack.tensor_parallel
    if tp is not None:
        info["tensor_parallel_size"] = tp.size
        worker = tp.model_worker(stack.loaded)
        executor.on_close.append(tp.close)  # the worker ranks stop with the scheduler
    else:
        worker = NativeModelWorker(stack.loaded.model, model_path=stack.loaded.path, load_format=stack.loaded.load_format, device=stack.device)
    return AsyncOmniScheduler(
        stack.runner,
        stack.core,
        stack.limits,
        config=config,
        executor=executor,
        model_info=info,
        model_worker=worker,
        **callbacks,
    )

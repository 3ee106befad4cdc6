"""A native stage's parts around a runner: allocator, limits, CUDA graphs, CPU kernels
and batch core (the same assembly on one device and on rank 0 of a tensor-parallel
group)."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch

from ...config import SchedulerConfig
from ...core.batch_core import NativeBatchCore
from ...core.device_defaults import running_limit
from ...core.multi_step import resolve_decode_steps
from ...errors import ConfigError
from ...kv.allocator import PageAllocator
from ...kv.cache import PagedKVCache
from ...models.loader import LoadedModel
from ...runners.cuda_graphs import DEFAULT_BUCKETS
from ...runners.native import NativeModelRunner
from ...scheduler import ModelLimits
from ...structured.grammar import GrammarCompiler

T = TypeVar("T")


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
    # The config the stack was built with, the fields left to the build (None) decided.
    config: SchedulerConfig | None = None


# Fields a config may leave to the build (None), decided per device and checkpoint.
DECIDED_AT_BUILD = ("max_running_requests", "cpu_attention_kernel", "cpu_fused_ops")


def with_build_decisions(config: SchedulerConfig, stack: NativeStack) -> SchedulerConfig:
    """``config`` with what building ``stack`` decided for the fields it left open."""
    built = stack.config
    if built is None:
        return config
    decided = {f: getattr(built, f) for f in DECIDED_AT_BUILD if getattr(config, f) is None}
    return dataclasses.replace(config, **decided) if decided else config


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
        grammar_compiler=GrammarCompiler(loaded.tokenizer, cfg.vocab_size) if loaded.tokenizer is not None else None,
    )
    if config.max_running_requests is None:
        buckets = [b for b in DEFAULT_BUCKETS if b <= config.cuda_graph_max_batch] or [config.cuda_graph_max_batch]
        config = dataclasses.replace(config, max_running_requests=running_limit(device.type, allocator.capacity_tokens, buckets))
    steps = resolve_decode_steps(config.decode_steps, device.type, config.tensor_parallel_size, config.page_size)
    runner.configure_decode_steps(steps, fused=config.fuse_decode_steps)
    if device.type == "cuda" and config.own_cuda_stream and config.tensor_parallel_size == 1:
        runner.use_own_stream(device)
    if device.type == "cuda" and config.cuda_graphs:
        # With the paged kernel, attention costs what each sequence really holds, so
        # graphs can span the whole context; without it they span cuda_graph_max_len.
        runner.enable_cuda_graphs(
            scratch_page=num_pages,
            max_len=context if runner.use_kernel else min(config.cuda_graph_max_len, context),
            max_batch=min(config.cuda_graph_max_batch, config.max_running_requests),
        )
    if config.cpu_attention_kernel and device.type == "cpu":
        from ...kernels.cpu_paged import load

        load()  # built now (ConfigError if it cannot be), not inside the first step
        runner.cpu_attention_kernel = True
    if config.cpu_fused_ops and device.type == "cpu":
        from ...kernels.cpu_fused import CpuFusedOps, load as load_fused

        load_fused()  # built now (ConfigError if it cannot be), not inside the first step
        runner.model.ops = CpuFusedOps()
        runner.cpu_fused_ops = True
    core = NativeBatchCore(config, allocator, context, decode_steps=steps)
    core.multi_step_allowed = runner.multi_step_allowed
    core.mixed_allowed = runner.mixed_prefill_allowed
    return NativeStack(loaded, kv, allocator, runner, core, limits, device, tensor_parallel, config)

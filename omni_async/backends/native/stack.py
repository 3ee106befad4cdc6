"""A native stage's parts around a runner: allocator, limits, CUDA graphs, CPU kernels
and batch core (the same assembly on one device and on rank 0 of a tensor-parallel
group)."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch

from ...core.batch_core import NativeBatchCore
from ...core.plan import StagePlan
from ...errors import ConfigError
from ...kernels.triton_cache import WATCH
from ...kv.allocator import PageAllocator
from ...kv.cache import PagedKVCache
from ...logs import log
from ...models.loader import LoadedModel
from ...runners.kernel_warmup import KernelWarmup, warm_host_copies
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
    # What the stage was built to (omni_async/core/plan.py).
    plan: StagePlan | None = None


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


def choose_hidden_layer(model: Any, layer: int | None) -> int:
    """Point the decoder's captured rows at ``layer`` (transformers' ``hidden_states``
    index; None or ``num_layers``: after the final norm), before any graph is captured;
    returns the index the stage then hands out. ConfigError outside ``[0, num_layers]``."""
    layers = model.config.num_layers
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= layers):
        raise ConfigError(f"hidden_states_layer must be in [0, {layers}] (the model has {layers} layers), got {layer}")
    model.hidden_layer = None if layer is None or layer == layers else layer
    return layers if layer is None else layer


def load_cpu_kernels(plan: StagePlan) -> None:
    """Build (or load from torch's cache) the C++ CPU kernels the plan turns on, now
    rather than inside the first step (ConfigError if they cannot be)."""
    if plan.cpu_attention_kernel:
        from ...kernels.cpu_paged import load

        load()
    if plan.cpu_fused_ops:
        from ...kernels.cpu_fused import load as load_fused

        load_fused()


def runner_options(plan: StagePlan, fused_kernels: bool) -> dict[str, Any]:
    """The runner's constructor options the plan decides (``fused_kernels``: the plan's
    ``config.fused_kernels``)."""
    return dict(
        fused_kernels=fused_kernels,
        cpu_attention_kernel=plan.cpu_attention_kernel,
        cpu_fused_ops=plan.cpu_fused_ops,
        decode_steps=plan.decode_steps,
        fuse_decode_steps=plan.fuse_decode_steps,
    )


def warm_up(runner: NativeModelRunner, plan: StagePlan, tensor_parallel: Any = None) -> None:
    """Every Triton kernel a request can launch, compiled now: the eager ones by
    :class:`~omni_async.runners.kernel_warmup.KernelWarmup`, the graphed ones by the
    capture. Compiles after this are counted and logged
    (:data:`omni_async.kernels.triton_cache.WATCH`). Under tensor parallelism the
    eager forwards are left out: the ranks run a forward's collectives in lockstep, and
    only the capture is sent to them. On CUDA the pinned host blocks of the steps'
    copies are made too (:func:`~omni_async.runners.kernel_warmup.warm_host_copies`),
    and the eager forwards run on the stream the steps run on (the runner's own, where it
    has one: ``ModelRunner.launch``): cuBLAS keeps its workspace per stream, so warmed on
    another stream, a request's first eager forward would set one up."""
    if runner.device.type == "cuda":
        warm_host_copies(plan.max_running_requests, plan.decode_steps.most)
    if runner.use_kernel:
        WATCH.install()
    with WATCH.warming():
        if runner.use_kernel and tensor_parallel is None:
            t0 = time.perf_counter()
            with torch.cuda.stream(runner.stream) if runner.stream is not None else contextlib.nullcontext():
                warmed = KernelWarmup(runner.model, runner.kv, runner.device, use_kernel=True).run(
                    plan.max_running_requests, plan.prefill_chunk if runner.warm_prefill else 0, plan.context_length)
            log.info("kernels_warm", seconds=round(time.perf_counter() - t0, 3), compiles=WATCH.compiles, **warmed)
        if plan.graph_max_len is not None:
            assert plan.kv_pages is not None
            runner.enable_cuda_graphs(scratch_page=plan.kv_pages, max_len=plan.graph_max_len, max_batch=plan.graph_max_batch)


def assemble_stack(
    loaded: LoadedModel, plan: StagePlan, device: torch.device, runner: NativeModelRunner, tensor_parallel: Any = None
) -> NativeStack:
    """Allocator, limits, CUDA graphs and batch core around a runner over the plan's pages."""
    cfg = loaded.config
    assert plan.kv_pages is not None and plan.context_length is not None
    hidden_layer = choose_hidden_layer(loaded.model, plan.config.hidden_states_layer)
    allocator = PageAllocator(plan.kv_pages, plan.page_size)
    limits = ModelLimits(
        vocab_size=cfg.vocab_size,
        context_length=plan.context_length,
        kv_capacity_tokens=allocator.capacity_tokens,
        eos_token_ids=cfg.eos_token_ids,
        grammar_compiler=GrammarCompiler(loaded.tokenizer, cfg.vocab_size) if loaded.tokenizer is not None else None,
        hidden_size=cfg.hidden_size if tensor_parallel is None else None,  # other ranks get no embeddings
        embeds_dtype=loaded.model.model.embed_tokens.weight.dtype,
        num_layers=cfg.num_layers,
        hidden_states_layer=hidden_layer,
    )
    if plan.own_stream:
        runner.use_own_stream(device)
    # A slot per running request now: the tables doubled from 64 slots as a burst joined
    # (runners/input_batch.py, _join_rows), reallocated host and device, in its first steps.
    runner.inputs.reserve(slots=plan.max_running_requests)
    warm_up(runner, plan, tensor_parallel)
    core = NativeBatchCore(plan.config, allocator, plan.context_length, decode_steps=plan.decode_steps, multi_step_allowed=runner.multi_step_allowed,
                           mixed_allowed=runner.mixed_prefill_allowed, hidden_for_all=runner.capture_hidden)
    return NativeStack(loaded, runner.kv, allocator, runner, core, limits, device, tensor_parallel, plan)

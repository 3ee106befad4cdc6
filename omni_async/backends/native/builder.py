"""Build a native stage from a checkpoint: the model loaded (off the caller's thread on
CPU, or across ranks under tensor parallelism), its KV cache sized, the runner and batch
core assembled (:mod:`.stack`), and the scheduler around them."""

from __future__ import annotations

import functools
from typing import Any

import torch

from ...config import SchedulerConfig
from ...errors import ConfigError
from ...kernels.triton_cache import use_cache_dir
from ...models.conditioning import attach_projection
from ...models.loader import load_model, resolve_dtype
from ...models.quantized import arithmetic, check_quantization, quantization_of, quantize_linears
from ...runners.native import NativeModelRunner
from ...scheduler import AsyncOmniScheduler
from ...stage.executor import make_step_executor
from ..base import BuiltStage
from ...core.cpu_choices import plan_load
from ...core.plan import StagePlan, plan_stage
from ...logs import log
from .facts import entry_facts, loaded_facts
from .kv_sizing import kv_cache
from .release import device_state_of, release_stage_memory
from .stack import NativeStack, assemble_stack, build_off_this_thread, load_cpu_kernels, runner_options
from .weights import NativeModelWorker


def build_native_stack(
    path_or_name: str,
    config: SchedulerConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: Any = None,
    seed: int = 0,
    capture_hidden: bool = False,
    conditioning_size: int | None = None,
) -> NativeStack:
    """The model loaded and everything around it, as the plan decides from ``config`` and
    the facts read once at its entry (:func:`.facts.entry_facts`): the load's decisions
    first (:func:`plan_load`), then, with what loading decided (:func:`.facts.loaded_facts`),
    the rest (:func:`plan_stage`), handed down to each part's constructor.
    ``capture_hidden``: each sampled row's hidden state goes out with its step (a
    downstream stage reads it). ``conditioning_size``:
    the stage takes per-position conditioning rows of that size (a talker fed by a
    thinker's hidden states) through ``thinker_to_talker_proj``
    (:mod:`omni_async.models.conditioning`), attached before CUDA graphs are captured."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        use_cache_dir()  # before the first compile, and inherited by the ranks it starts
    machine, stored = entry_facts(path_or_name, device, config, dtype)
    load = plan_load(config, machine, stored, dtype)
    requested = None if load.dtype is None else resolve_dtype(load.dtype, "float32", device)
    check_quantization(load.config.quantization, device, requested, config.tensor_parallel_size)
    if config.tensor_parallel_size > 1:
        if conditioning_size is not None:
            raise ConfigError("a conditioned stage (conditioning_size) runs on one device; set tensor_parallel_size=1")
        from .parallel.launch import build_parallel_stack

        return build_parallel_stack(path_or_name, load, machine, stored, device=device, asked_dtype=dtype, seed=seed)

    def build() -> NativeStack:
        loaded = load_model(path_or_name, dtype=load.dtype, device=device, seed=seed)
        quantize_linears(loaded.model, load.config.quantization)
        if conditioning_size is not None:
            attach_projection(loaded, conditioning_size, seed=seed)
        plan = plan_stage(load.config, *loaded_facts(machine, stored, device, loaded), dtype=dtype, load=load)
        log_plan(plan)
        set_cpu_threads(plan)
        load_cpu_kernels(plan)
        runner = NativeModelRunner(
            loaded.model, kv_cache(loaded, plan.page_size, device, plan.kv_pages), device, seed=seed,
            capture_hidden=capture_hidden, **runner_options(plan, plan.config.fused_kernels),
        )
        return assemble_stack(loaded, plan, device, runner)

    return build_off_this_thread(build) if device.type == "cpu" else build()


def set_cpu_threads(plan: StagePlan) -> None:
    """torch's intra-op threads as the plan chose: the process-wide count, which each
    thread takes at its first parallel op (the stage's step thread among them, started
    after this); a thread that ran one before keeps its own."""
    if plan.cpu_threads is not None and plan.cpu_threads != torch.get_num_threads():
        torch.set_num_threads(plan.cpu_threads)
        log.info("cpu_threads", threads=plan.cpu_threads, reason=plan.cpu_threads_reason)


def log_plan(plan: StagePlan) -> None:
    if plan.memory is not None:
        log.info("engine_memory_plan", device=plan.device, **plan.memory.as_dict())


def build_scheduler(stack: NativeStack, config: SchedulerConfig | None = None, **callbacks: Any) -> AsyncOmniScheduler:
    """The stage over ``stack``, configured as its plan says. ``config``, when passed,
    must be the one the stack was built from."""
    plan = stack.plan
    assert plan is not None
    if config is not None and not plan.made_from(config):
        raise ConfigError("build_scheduler's config differs from the one its stack was built from")
    config = plan.config
    mode = quantization_of(stack.loaded.model)
    dtype = str(next(stack.loaded.model.parameters()).dtype).replace("torch.", "")
    info = {
        "model_path": stack.loaded.path,
        "model_name": stack.loaded.name or stack.loaded.path,
        "load_format": stack.loaded.load_format,
        "model_family": stack.loaded.config.family,
        "device": str(stack.device),
        "dtype": dtype,
        "weight_version": "initial",
        "quantization": mode,
        "arithmetic": arithmetic(mode, dtype),  # what computes tokens and what scores prompts
        "cpu_attention_kernel": stack.runner.cpu_attention_kernel,
        "cpu_fused_ops": stack.runner.cpu_fused_ops,
        "num_parameters": sum(p.numel() for p in stack.loaded.model.parameters()),
        "plan": plan.as_dict(),
    }
    if stack.device.type == "cpu":
        # The intra-op threads a step's kernels use: the plan's (a thread takes the count
        # at its first parallel op, so torch.get_num_threads() here may be an older one's).
        info["cpu_threads"] = plan.cpu_threads or torch.get_num_threads()
        info["cpu_threads_reason"] = plan.cpu_threads_reason or "left as it is"
    executor = make_step_executor(config.step_launch, stack.device.type, config.event_wait)
    tp = stack.tensor_parallel
    if tp is not None:
        info["tensor_parallel_size"] = tp.size
        worker = tp.model_worker(stack.loaded)
        executor.on_close.append(tp.close)  # the worker ranks stop with the scheduler
    else:
        worker = NativeModelWorker(stack.loaded.model, model_path=stack.loaded.path, load_format=stack.loaded.load_format, device=stack.device)
    # Once the stage has closed, its model, KV, graphs and buffers go at once, not at a
    # GC pass (the executor closes with the stage, after its last step).
    executor.after_close.append(functools.partial(release_stage_memory, stack.device, device_state_of(stack, worker)))
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


def build_native_stage(path_or_name: str, *, config: SchedulerConfig, device: Any, dtype: Any, seed: int) -> BuiltStage:
    """``backend="native"`` in the backend registry lands here."""
    stack = build_native_stack(path_or_name, config, device=device, dtype=dtype, seed=seed)
    return BuiltStage(build_scheduler(stack), stack.loaded.tokenizer, stack, stack.plan)

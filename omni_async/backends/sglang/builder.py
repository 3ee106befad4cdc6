"""Assemble the SGLang stack in-process: server args, the parallel runtime (world size
1), SGLang's tensor-parallel model worker, its memory pools and radix cache, then the
omni-async batch core and runner over them, under an ordinary AsyncOmniScheduler.

No SGLang Engine and no scheduler subprocess: SGLang SIGKILLs its parent when an
Engine child dies, so everything runs in the caller's process, on the same worker
thread the native backend uses.
"""

from __future__ import annotations

import importlib.metadata
import json
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ... import errors
from ...config import SchedulerConfig
from ...stage.executor import ThreadStepExecutor
from ...core.facts import CheckpointFacts, DeviceFacts
from ...core.plan import StagePlan, plan_stage
from ...models.config import ModelConfig as OmniModelConfig
from ...scheduler import AsyncOmniScheduler, ModelLimits
from ..base import BuiltStage
from ...text.tokenizer import load_tokenizer

from sglang.srt.configs.model_config import ModelConfig as SGLangModelConfig
from sglang.srt.distributed import bootstrap
from sglang.srt.managers.overlap_utils import FutureMap
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.mem_cache import kv_cache_builder
from sglang.srt.runtime_context import SpawnRanks, publish
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from .core import SGLangBatchCore
from .runner import SGLangModelRunner
from .weights import SGLangModelWorker

# SGLang's process-wide parallel runtime (torch.distributed, world size 1 on gloo)
# can be initialised once per process; later stacks reuse it. One stack serves at a
# time: SGLang's configuration is process-global ("last publish wins").
_PROCESS_LOCK = threading.Lock()
_PARALLEL_READY = False
_ACTIVE: "SGLangStack | None" = None


@dataclass
class SGLangStack:
    """Everything the SGLang backend composes, for tests and admin introspection."""

    server_args: Any
    model_config: Any
    tp_worker: Any
    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
    tree_cache: Any
    future_map: Any
    kv_total_tokens: int  # allocator.available_size() with nothing allocated
    req_slots_total: int  # req_to_token_pool.available_size() with nothing allocated
    runner: SGLangModelRunner
    model_worker: SGLangModelWorker
    core: SGLangBatchCore
    limits: ModelLimits
    path: str
    device: torch.device
    tokenizer: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    plan: StagePlan | None = None

    @property
    def allocator(self) -> Any:
        return self.token_to_kv_pool_allocator

    def kv_leak_report(self) -> dict[str, int]:
        """Pool accounting: what is free, what the radix cache keeps, what is locked."""
        return {
            "kv_available": int(self.token_to_kv_pool_allocator.available_size()),
            "kv_total": self.kv_total_tokens,
            "tree_evictable": int(self.tree_cache.evictable_size()),
            "tree_protected": int(self.tree_cache.protected_size()),
            "req_slots_available": int(self.req_to_token_pool.available_size()),
            "req_slots_total": self.req_slots_total,
            "deferred_releases": self.core.num_deferred_releases,
        }


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_stack(
    path_or_name: str,
    config: SchedulerConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: Any = None,
    seed: int = 0,
) -> SGLangStack:
    global _PARALLEL_READY, _ACTIVE
    folder = Path(str(path_or_name))
    if str(path_or_name) == "tiny" or not (folder / "config.json").is_file():
        raise errors.ModelLoadError(
            f"{path_or_name!r}: backend='sglang' loads a Hugging Face style checkpoint folder "
            "(config.json + *.safetensors); the built-in 'tiny' model is native-only"
        )
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise errors.InvalidRequestError(f"backend='sglang' runs on cpu or cuda, not {device.type!r}")
    raw = json.loads((folder / "config.json").read_text())
    omni_cfg = OmniModelConfig.from_hf(raw)
    plan = plan_stage(
        config, DeviceFacts(type=device.type), CheckpointFacts(max_position_embeddings=omni_cfg.max_position_embeddings),
        dtype=dtype, backend="sglang",
    )
    kwargs: dict[str, Any] = dict(
        model_path=str(folder),
        device=device.type,
        dtype=plan.dtype,
        page_size=config.page_size,
        chunked_prefill_size=plan.chunked_prefill_size if plan.chunked_prefill_size > 0 else -1,
        max_prefill_tokens=plan.max_prefill_tokens,
        max_running_requests=plan.max_running_requests,
        skip_tokenizer_init=True,
        random_seed=int(seed),
        schedule_policy="fcfs",
        disable_overlap_schedule=True,  # omni-async's loops do the overlapping
        disable_radix_cache=not config.enable_prefix_cache,  # SGLang's own prefix cache
        sampling_backend="pytorch",
        load_format="safetensors",
        log_level="error",
    )
    if device.type == "cpu":
        kwargs.update(attention_backend="torch_native", disable_cuda_graph=True)
    else:
        kwargs.update(mem_fraction_static=config.kv_memory_fraction)
    if plan.kv_tokens is not None:
        kwargs["max_total_tokens"] = int(plan.kv_tokens)
    if plan.context_length is not None:
        kwargs["context_length"] = int(plan.context_length)

    with _PROCESS_LOCK:
        if _ACTIVE is not None and not getattr(_ACTIVE, "_closed", False):
            raise errors.InvalidRequestError(
                "an SGLang-backed engine is already open in this process; SGLang's configuration "
                "is process-wide, so close it before building another"
            )
        server_args = ServerArgs(**kwargs)
        gpu_id = device.index or 0
        publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=gpu_id))
        model_config = SGLangModelConfig.from_server_args(server_args)
        port = _free_port()
        if not _PARALLEL_READY:
            bootstrap.init_parallel_runtime(server_args=server_args, device=device.type, dist_port=port)
            _PARALLEL_READY = True
        bootstrap.init_layer_runtime(model_config=model_config)

        # SGLang's tensor-parallel model worker: loads the weights, then its pools.
        tp_worker = TpModelWorker(server_args=server_args, gpu_id=gpu_id, nccl_port=port)
        tp_worker.alloc_memory_pool()
        tp_worker.init_attention_backends()
        with torch.no_grad():  # Scheduler.init_all_cuda_graphs: eager runners when disabled
            tp_worker.init_cuda_graphs()

        kv = kv_cache_builder.build_kv_cache(
            server_args=server_args,
            model_config=model_config,
            tp_worker=tp_worker,
            page_size=config.page_size,
            spec_algorithm=SpeculativeAlgorithm.NONE,
            enable_metrics=False,
            enable_kv_cache_events=False,
            enable_hierarchical_cache=False,
        )
        req_to_token_pool = kv.req_to_token_pool
        allocator = kv.token_to_kv_pool_allocator
        tree_cache = kv.tree_cache
        future_map = FutureMap(
            tp_worker.device if isinstance(tp_worker.device, torch.device) else torch.device(tp_worker.device),
            SpeculativeAlgorithm.NONE,
            req_to_token_pool,
            needs_cpu_seq_lens=False,
        )
        # A row read before any step published to it (a step scheduled behind one that
        # then failed, its rows stale) must still hold a token id, not uninitialised
        # memory: such a step runs, and processing skips its rows.
        future_map.output_tokens_buf.zero_()
        info = tp_worker.get_worker_info()
        max_total_num_tokens, _max_prefill, max_running, _q, max_req_len = info[:5]

        # SGLang serves a request only while input + max_new_tokens stays within
        # max_req_len - 1 (see Scheduler.init_req_max_new_tokens); admission refuses
        # beyond that, with the usual message.
        context_length = int(max_req_len) - 1
        limits = ModelLimits(
            vocab_size=int(model_config.vocab_size),
            context_length=context_length,
            kv_capacity_tokens=int(max_total_num_tokens) - config.page_size,
            eos_token_ids=tuple(omni_cfg.eos_token_ids),
        )
        runner = SGLangModelRunner(tp_worker, future_map, seed=seed)
        core = SGLangBatchCore(
            plan.config,
            server_args=server_args,
            tp_worker=tp_worker,
            future_map=future_map,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=allocator,
            tree_cache=tree_cache,
            model_config=model_config,
            page_size=config.page_size,
            max_running_requests=min(plan.max_running_requests, int(max_running)),
            max_total_num_tokens=int(max_total_num_tokens),
            max_req_len=int(max_req_len),
            context_length=context_length,
        )
        stack = SGLangStack(
            server_args=server_args,
            model_config=model_config,
            tp_worker=tp_worker,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=allocator,
            tree_cache=tree_cache,
            future_map=future_map,
            kv_total_tokens=int(allocator.available_size()),
            req_slots_total=int(req_to_token_pool.available_size()),
            runner=runner,
            model_worker=SGLangModelWorker(tp_worker, model_path=str(folder)),
            core=core,
            limits=limits,
            path=str(folder),
            device=device,
            tokenizer=load_tokenizer(folder, omni_cfg),
            plan=plan,
        )
        core.stack = stack
        stack.info = {
            "backend": "sglang",
            "sglang_version": importlib.metadata.version("sglang"),  # the pinned one (require_sglang)
            "model_path": str(folder),
            "load_format": "safetensors",
            "model_family": omni_cfg.family,
            "device": str(device),
            "dtype": str(server_args.dtype),
            "attention_backend": kwargs.get("attention_backend", "default"),
            "max_total_num_tokens": int(max_total_num_tokens),
            "weight_version": "initial",
            "plan": plan.as_dict(),
        }
        stack._closed = False  # type: ignore[attr-defined]
        _ACTIVE = stack
        return stack


def release_stack(stack: SGLangStack) -> None:
    """Let another SGLang stack be built in this process (the parallel runtime stays)."""
    global _ACTIVE
    with _PROCESS_LOCK:
        stack._closed = True  # type: ignore[attr-defined]
        if _ACTIVE is stack:
            _ACTIVE = None


class StepTrackingExecutor(ThreadStepExecutor):
    """The native worker thread, noting when each step has run on it (success or not):
    the SGLang core releases a finished request's KV only once no step that reads it is
    still to run (see ``SGLangBatchCore._release``)."""

    def launch(self, fn: Callable[..., Any], *args: Any, inline: bool = False):  # type: ignore[override]
        def run_and_mark(*a: Any) -> Any:
            try:
                return fn(*a)
            finally:
                for arg in a:
                    batch = getattr(arg, "batch_data", None)
                    if batch is not None and hasattr(batch, "executed"):
                        batch.executed = True

        return super().launch(run_and_mark, *args)

    async def aclose(self, timeout_s: float | None = None) -> None:
        """The scheduler's shutdown: once the worker stopped, another SGLang stack may be
        built in this process."""
        try:
            await super().aclose(timeout_s)
        finally:
            stack = getattr(self, "stack", None)
            if stack is not None:
                release_stack(stack)


def build_scheduler(stack: SGLangStack, **callbacks: Any) -> AsyncOmniScheduler:
    """The stage over ``stack``, configured as its plan says. Its requests are built by
    the given builder (or the stage's default) and then checked for what this backend
    does not serve (:func:`refuse_unserved`)."""
    assert stack.plan is not None
    executor = StepTrackingExecutor()
    executor.stack = stack  # type: ignore[attr-defined]
    given = callbacks.pop("request_builder", None)

    def request_builder(payload: Any) -> Any:
        data = (given or scheduler.default_request_builder)(payload)
        refuse_unserved(data.req.sampling)
        return data

    scheduler = AsyncOmniScheduler(
        stack.runner,
        stack.core,
        stack.limits,
        request_builder=request_builder,
        config=stack.plan.config,
        executor=executor,
        model_info=dict(stack.info),
        model_worker=stack.model_worker,
        **callbacks,
    )
    return scheduler


def refuse_unserved(sampling: Any) -> None:
    """Scoring a prompt (``prompt_logprobs``, and ``max_new_tokens=0`` with it) is the
    native runner's: SGLang's runner computes logits at each row's last position only."""
    if getattr(sampling, "prompt_logprobs", None) is not None:
        raise errors.InvalidRequestError("prompt_logprobs is not supported by backend='sglang'; use backend='native'")


def build_stage(
    path_or_name: str,
    *,
    config: SchedulerConfig,
    device: str = "cpu",
    dtype: Any = None,
    seed: int = 0,
) -> "BuiltStage":
    """The SGLang stack and the scheduler over it; the scheduler's shutdown (its step
    executor's close) frees this process's SGLang slot."""
    stack = build_stack(path_or_name, config, device=device, dtype=dtype, seed=seed)
    try:
        scheduler = build_scheduler(stack)
    except BaseException:
        release_stack(stack)
        raise
    return BuiltStage(scheduler, stack.tokenizer, stack, stack.plan)

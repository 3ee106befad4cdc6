"""One plan per stage: every choice a :class:`SchedulerConfig` leaves open, made once.

:func:`plan_stage` turns the caller's config (``None`` where a choice is left to the
engine) and facts about the device and the checkpoint into a frozen :class:`StagePlan`
that the builders hand to each component's constructor and ``info()["plan"]`` reports.
It is a pure function of plain values (the builders read the facts:
:mod:`omni_async.backends.native.facts`), so every decision is tested without a device.

Why these defaults (measurements in bench/RESULTS.md):

- The loop (``loop=None``): ``overlap`` on CUDA, where it beat ``normal`` on every figure
  measured: NV256 on the H200 57.9k against 47.8k tok/s sampled, 57.4k against 48.5k
  greedy, batch 1 0.890 against 1.099 ms a token (2026-12-05); W256 68.8k against 51.5k;
  a co-located thinker and talker 1.92 s against 2.33 s. ``normal`` on CPU, where the
  three loops were equal within the run-to-run spread (the tiny model at 64 clients:
  overlap 1.02x, async_decode 1.03x; at one client 0.96x and 1.00x), and under the
  SGLang backend, whose loops were not compared.
- Running limit. A fixed 64 left an H200 running a quarter of a 256-request burst while
  the rest queued (NV256: 13.9k output tok/s against 37.0k with 256 running). On CUDA the
  KV cache bounds how many requests decode together and the decode graphs' batch buckets
  are what a step replays, so the limit is the largest bucket whose requests the KV holds
  at ``TOKENS_PER_RUNNING_REQUEST`` each, within ``[CUDA_MIN_RUNNING, largest bucket]``.
  CPU keeps ``CPU_MAX_RUNNING``: its step time grows with the batch.
- Prefill budget on CUDA. An eager prefill forward costs the host ~12-15 ms whatever its
  size, so 512-token chunks left the GPU idle most of a prefill phase (W256 on the H200:
  13-15k output tok/s against 67-71k with 8192-token chunks). CPU keeps 4096 / 512.
- Decode tiers on CUDA (``decode_steps=None``): 4 forwards per step below 64 decoding
  requests, 8 from 64 (at most ``page_size``). NV256 on the H200 (tools/
  nv256_profile.py): one forward per step below 64 rows spent 0.89 s of a 3.8 s run on
  its tail, 4 or 8 forwards 0.50 s (34.9k -> 39.1-39.9k tok/s); from 64 rows 4 and 8 take
  the same device time and 8 half the host's. One forward elsewhere.
- CPU dtype and kernels. A CPU with native bfloat16 instructions runs a checkpoint stored
  in 16 bits or fewer faster in bfloat16 once several requests share a step, and the C++
  kernels add to it at every batch size; float32 (the exact reference path) otherwise.
  The kernels are on by default only in bfloat16 or int8 (paths that are not bit-exact
  anyway) and only where they build.
- CPU threads (``cpu_threads=None``): the CPUs the load average leaves idle (at least one,
  at most torch's own). Threads past the idle cores wait at each parallel region's barrier
  for a core another process holds: 8-35x slower on a busy 2-core VM (bench/cpu_threads.py).
- Optimistic grammar rows on CUDA only (``optimistic_grammar=None``). A grammar mask costs
  ~45 us of host time a row on the H200's host, so 256 constrained rows' masks take
  longer than the step's forward; sampling first skips ~94% of them for a real model asked
  for JSON (SmolLM2 on the dev VM, 7166a36:bench/optimistic_grammar.py). On CPU the forward of a
  step is ~100x its masks: the same run there showed no gain (CPU time per token +3%, the
  refused positions' extra steps), so CPU masks first.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from ..config import SchedulerConfig
from ..errors import ConfigError, InvalidRequestError, ModelLoadError
from ..memory_budget import MemoryPlan, activation_reserve_bytes, plan_memory
from .cpu_choices import LoadPlan, cpu_threads, kernel_options, plan_load
from .facts import CheckpointFacts, DeviceFacts, dtype_name
from ..structured.optimistic import enabled as optimistic_enabled
from .core_state import DecodeSteps


CUDA_LOOP = "overlap"  # the loops when SchedulerConfig.loop is None (module docstring)
CPU_LOOP = "normal"
CPU_MAX_RUNNING = 64
CUDA_MIN_RUNNING = 64
# The KV each running request is budgeted (prompt plus answer, tokens): a request of
# this size per slot fits without retraction; longer ones share the room of shorter ones.
TOKENS_PER_RUNNING_REQUEST = 1024
# (max_prefill_tokens, chunked_prefill_size) for fields the config leaves open.
CPU_PREFILL_BUDGET = (4096, 512)
CUDA_PREFILL_BUDGET = (16384, 8192)
# decode_steps=None on CUDA: (fewest decoding requests, forwards per step).
AUTO_TIERS = ((1, 4), (64, 8))
# CPU KV when kv_capacity_tokens is not given: this fraction of the memory available
# once the weights are loaded, within [CPU_KV_MIN_TOKENS, CPU_KV_MAX_TOKENS] (the cap
# keeps start-up and tests quick; give kv_capacity_tokens for more);
# DEFAULT_CPU_KV_TOKENS when the available memory cannot be read.
DEFAULT_CPU_KV_TOKENS = 32768
CPU_KV_MEMORY_FRACTION = 0.1
CPU_KV_MIN_TOKENS = 2048
CPU_KV_MAX_TOKENS = 65536
# SGLang on CPU when kv_capacity_tokens is not given (on CUDA SGLang sizes its pools).
SGLANG_CPU_KV_TOKENS = 32768



@dataclass(frozen=True)
class StagePlan:
    """Every decision for one stage. ``config`` is the caller's config with each field it
    left open decided (what the scheduler, intake and batch core read)."""

    backend: str
    device: str
    loop: str  # the stage's loop (:func:`resolve_loop`)
    dtype: str  # the weights' (the loader is asked for :func:`.cpu_choices.plan_load`'s choice)
    quantization: str | None
    cpu_attention_kernel: bool
    cpu_fused_ops: bool
    max_prefill_tokens: int
    chunked_prefill_size: int
    context_length: int | None
    max_running_requests: int
    decode_steps: DecodeSteps
    fuse_decode_steps: bool
    optimistic_grammar: bool  # constrained rows sample first, the grammar checks after
    kv_pages: int | None  # None: the backend sizes its own pools (SGLang on CUDA)
    kv_tokens: int | None
    page_size: int
    graph_max_len: int | None  # decode graphs span this many positions; None: no graphs
    graph_max_batch: int
    own_stream: bool
    memory: MemoryPlan | None
    event_wait: str
    step_launch: str
    tensor_parallel_size: int
    config: SchedulerConfig
    cpu_threads: int | None = None  # the intra-op threads a CPU stage sets; None: left as they are
    cpu_threads_reason: str = ""  # why that many (info()["cpu_threads_reason"])

    @property
    def decode_tiers(self) -> tuple[tuple[int, int], ...]:
        """``(fewest decoding requests, forwards per step)`` pairs; none: one forward."""
        return self.decode_steps.tiers

    def made_from(self, config: SchedulerConfig) -> bool:
        """Whether ``config`` is the one this plan settled (its open fields aside)."""
        opened = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(config) if getattr(config, f.name) is None}
        return dataclasses.replace(config, **opened) == self.config

    @property
    def prefill_chunk(self) -> int:
        """The most prompt tokens one prefill step runs."""
        return _chunk(self.max_prefill_tokens, self.chunked_prefill_size)

    def as_dict(self) -> dict[str, Any]:
        """The plan as plain values (``info()["plan"]``, ``/get_server_info``)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("config", "decode_steps", "memory")}
        out["decode_tiers"] = [list(t) for t in self.decode_tiers]
        out["memory"] = None if self.memory is None else self.memory.as_dict()
        return out


# ---------------------------------------------------------------- single decisions


def resolve_loop(configured: str | None, device_type: str, backend: str = "native") -> str:
    """``SchedulerConfig.loop`` on this device: as given, or (None) the fastest measured
    there: ``overlap`` on CUDA with the native backend, ``normal`` elsewhere."""
    if configured is not None:
        return configured
    return CUDA_LOOP if device_type == "cuda" and backend == "native" else CPU_LOOP


def resolve_decode_steps(configured: int | None, device_type: str, tensor_parallel_size: int = 1,
                         page_size: int = 16) -> DecodeSteps:
    """``SchedulerConfig.decode_steps`` on this device: a fixed k for every batch, or
    (None) the automatic tiers on CUDA, at most ``page_size`` (a step then adds at most
    one page per row), and one forward elsewhere."""
    if configured is not None:
        return DecodeSteps(((1, configured),) if configured > 1 else ())
    if device_type == "cuda" and tensor_parallel_size == 1:
        return DecodeSteps(tuple((least, min(k, page_size)) for least, k in AUTO_TIERS if min(k, page_size) > 1))
    return DecodeSteps()


def cuda_running_limit(kv_capacity_tokens: int, graph_buckets: Sequence[int],
                       tokens_per_request: int = TOKENS_PER_RUNNING_REQUEST) -> int:
    """The largest graph bucket of requests that ``kv_capacity_tokens`` holds at
    ``tokens_per_request`` each; at least ``CUDA_MIN_RUNNING`` (or the largest bucket
    when that is smaller), at most the largest bucket (a larger decode step would run
    without a graph)."""
    if not graph_buckets:
        raise ValueError("graph_buckets is empty")
    largest = max(graph_buckets)
    fits = kv_capacity_tokens // max(1, tokens_per_request)
    held = [b for b in graph_buckets if b <= fits]
    return min(largest, max(max(held, default=0), CUDA_MIN_RUNNING))


def running_limit(device_type: str, kv_capacity_tokens: int, graph_buckets: Sequence[int] | None) -> int:
    """``max_running_requests`` when not given: derived on CUDA from the KV capacity and
    the decode graphs' buckets, ``CPU_MAX_RUNNING`` elsewhere."""
    if device_type == "cuda" and graph_buckets:
        return cuda_running_limit(kv_capacity_tokens, graph_buckets)
    return CPU_MAX_RUNNING


def cuda_defaults(kv_capacity_tokens: int, graph_buckets: Sequence[int]) -> StagePlan:
    """The limits a CUDA engine gets unless given, as its plan (a 0.5B-like checkpoint
    with ``kv_capacity_tokens`` of KV)."""
    config = SchedulerConfig(kv_capacity_tokens=kv_capacity_tokens)
    checkpoint = CheckpointFacts(num_layers=24, num_kv_heads=2, head_dim=64, max_position_embeddings=32768, dtype="bfloat16")
    return plan_stage(config, DeviceFacts(type="cuda", graph_buckets=tuple(graph_buckets)), checkpoint)


def prefill_budget(config: SchedulerConfig, device_type: str) -> tuple[int, int]:
    """``(max_prefill_tokens, chunked_prefill_size)``: as given, open ones per device."""
    default = CUDA_PREFILL_BUDGET if device_type == "cuda" else CPU_PREFILL_BUDGET
    given = (config.max_prefill_tokens, config.chunked_prefill_size)
    return tuple(d if g is None else g for g, d in zip(given, default))  # type: ignore[return-value]


def settle(config: SchedulerConfig, device_type: str = "cpu") -> SchedulerConfig:
    """``config`` with the prefill budget and the loop decided for ``device_type`` where
    they are open (a stage assembled by hand, without a plan, runs as on CPU)."""
    mp, cp = prefill_budget(config, device_type)
    loop = resolve_loop(config.loop, device_type)
    if (mp, cp, loop) == (config.max_prefill_tokens, config.chunked_prefill_size, config.loop):
        return config
    return dataclasses.replace(config, max_prefill_tokens=mp, chunked_prefill_size=cp, loop=loop)


def _chunk(max_prefill: int, chunked: int) -> int:
    return chunked if chunked > 0 else max_prefill


def memory_plan(config: SchedulerConfig, device: DeviceFacts, checkpoint: CheckpointFacts) -> MemoryPlan:
    """How ``config.memory_budget`` is spent on this checkpoint (ConfigError when it
    cannot hold the weights, the reserve and a minimum KV)."""
    if device.total_bytes is None:
        raise ConfigError("memory_budget needs the device's total memory, which could not be read")
    graphs = device.type == "cuda" and config.cuda_graphs
    # Unset, the running limit is derived from the KV this plan sizes: reserve for the most
    # it can become (the largest graph batch).
    running = config.max_running_requests or config.cuda_graph_max_batch
    reserve = activation_reserve_bytes(
        hidden_size=checkpoint.hidden_size,
        intermediate_size=checkpoint.intermediate_size,
        vocab_size=checkpoint.vocab_size,
        prefill_tokens=_chunk(*prefill_budget(config, device.type)),
        max_batch=running,
        dtype_bytes=checkpoint.itemsize,
        cuda_graph_batch=min(config.cuda_graph_max_batch, running) if graphs else 0,
        device_type=device.type,
    )
    return plan_memory(
        config.memory_budget,  # type: ignore[arg-type]
        total_bytes=device.total_bytes,
        weights_bytes=checkpoint.weights_bytes,
        reserve_bytes=reserve,
        kv_bytes_per_token=checkpoint.kv_bytes_per_token,
        page_size=config.page_size,
        kv_tokens=config.kv_capacity_tokens,
    )


def kv_pages(config: SchedulerConfig, device: DeviceFacts, checkpoint: CheckpointFacts,
             memory: MemoryPlan | None = None) -> int:
    """KV pages of one native stage (or rank): what the memory budget leaves, else
    ``kv_capacity_tokens``, else ``kv_memory_fraction`` of the free device memory on
    CUDA, else a share of the available RAM on CPU."""
    per_token = max(1, checkpoint.kv_bytes_per_token)
    if config.memory_budget is not None:
        tokens = (memory or memory_plan(config, device, checkpoint)).kv_tokens
    elif config.kv_capacity_tokens is not None:
        tokens = config.kv_capacity_tokens
    elif device.type == "cuda":
        tokens = int((device.free_bytes or 0) * config.kv_memory_fraction) // per_token
    elif device.free_bytes is None:
        tokens = DEFAULT_CPU_KV_TOKENS
    else:
        tokens = int(device.free_bytes * CPU_KV_MEMORY_FRACTION) // per_token
        tokens = max(CPU_KV_MIN_TOKENS, min(CPU_KV_MAX_TOKENS, tokens))
    return max(1, tokens // config.page_size)


def context_length(config: SchedulerConfig, checkpoint: CheckpointFacts) -> int:
    """The positions a request may use: the model's, or fewer when asked."""
    if config.context_length is None:
        return checkpoint.max_position_embeddings
    if config.context_length > checkpoint.max_position_embeddings:
        raise ConfigError(
            f"context_length {config.context_length} exceeds the model's "
            f"max_position_embeddings {checkpoint.max_position_embeddings}"
        )
    return config.context_length


# ---------------------------------------------------------------- the plan


def plan_stage(
    config: SchedulerConfig,
    device: DeviceFacts,
    checkpoint: CheckpointFacts,
    *,
    dtype: Any = None,
    backend: str = "native",
    agreed_kv_pages: int | None = None,
    load: LoadPlan | None = None,
) -> StagePlan:
    """Every choice for one stage (see the module docstring). ``dtype`` is the caller's
    (None: open); ``agreed_kv_pages``: the pages tensor-parallel ranks agreed on (the
    fewest any rank holds), in place of this rank's sizing; ``load``: the decisions made
    before loading (:func:`.cpu_choices.plan_load`), taken as made (decided here when
    None)."""
    if backend == "sglang":
        return _plan_sglang(config, device, checkpoint, dtype)
    if load is None:
        load = plan_load(config, device, checkpoint, dtype)
    config, chosen = load.config, load.dtype
    kernels = kernel_options(config, device, chosen)
    max_prefill, chunked = prefill_budget(config, device.type)
    budget = memory_plan(config, device, checkpoint) if config.memory_budget is not None else None
    pages = agreed_kv_pages if agreed_kv_pages is not None else kv_pages(config, device, checkpoint, budget)
    context = context_length(config, checkpoint)
    running = config.max_running_requests
    if running is None:
        buckets = [b for b in device.graph_buckets if b <= config.cuda_graph_max_batch] or [config.cuda_graph_max_batch]
        running = running_limit(device.type, pages * config.page_size, buckets)
    graphs = device.type == "cuda" and config.cuda_graphs
    optimistic = device.type == "cuda" if config.optimistic_grammar is None else config.optimistic_grammar
    loop = resolve_loop(config.loop, device.type, backend)
    threads, threads_reason = cpu_threads(config, device)
    settled = dataclasses.replace(
        config, loop=loop, max_running_requests=running, max_prefill_tokens=max_prefill, chunked_prefill_size=chunked,
        optimistic_grammar=optimistic, cpu_threads=config.cpu_threads if threads is None else threads,
        **{name: on for name, on in kernels.items() if getattr(config, name) is None},
    )
    on_cpu = device.type == "cpu"
    return StagePlan(
        backend=backend,
        device=device.type,
        loop=loop,
        dtype=checkpoint.dtype if chosen is None else dtype_name(chosen),
        quantization=config.quantization,
        cpu_attention_kernel=kernels["cpu_attention_kernel"] and on_cpu,
        cpu_fused_ops=kernels["cpu_fused_ops"] and on_cpu,
        max_prefill_tokens=max_prefill,
        chunked_prefill_size=chunked,
        context_length=context,
        max_running_requests=running,
        decode_steps=resolve_decode_steps(config.decode_steps, device.type, config.tensor_parallel_size, config.page_size),
        fuse_decode_steps=config.fuse_decode_steps,
        optimistic_grammar=optimistic_enabled(settled),
        kv_pages=pages,
        kv_tokens=pages * config.page_size,
        page_size=config.page_size,
        # With the paged kernel, attention costs what each sequence really holds, so
        # graphs can span the whole context; without it they span cuda_graph_max_len.
        graph_max_len=(context if device.paged_kernel else min(config.cuda_graph_max_len, context)) if graphs else None,
        graph_max_batch=min(config.cuda_graph_max_batch, running),
        own_stream=device.type == "cuda" and config.own_cuda_stream and config.tensor_parallel_size == 1,
        memory=budget,
        event_wait=config.event_wait,
        step_launch=config.step_launch,
        tensor_parallel_size=config.tensor_parallel_size,
        config=settled,
        cpu_threads=threads,
        cpu_threads_reason=threads_reason,
    )


def _plan_sglang(config: SchedulerConfig, device: DeviceFacts, checkpoint: CheckpointFacts, dtype: Any) -> StagePlan:
    """SGLang sizes its own KV pools (``kv_capacity_tokens`` when given; a fixed CPU
    default) and runs its own kernels; the running limit defaults to the CPU one."""
    if dtype is None:
        dtype = "float32" if device.type == "cpu" else "auto"
    name = dtype_name(dtype)
    if name not in ("float32", "bfloat16", "float16", "auto"):
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")
    max_prefill, chunked = prefill_budget(config, device.type)
    running = config.max_running_requests or CPU_MAX_RUNNING
    kv_tokens = config.kv_capacity_tokens
    if kv_tokens is None and device.type == "cpu":
        kv_tokens = SGLANG_CPU_KV_TOKENS
    if config.context_length is not None and config.context_length > checkpoint.max_position_embeddings:
        raise InvalidRequestError(
            f"context_length {config.context_length} exceeds the model's "
            f"max_position_embeddings {checkpoint.max_position_embeddings}"
        )
    loop = resolve_loop(config.loop, device.type, "sglang")
    settled = dataclasses.replace(config, loop=loop, max_running_requests=running, max_prefill_tokens=max_prefill,
                                  chunked_prefill_size=chunked)
    return StagePlan(
        backend="sglang",
        device=device.type,
        loop=loop,
        dtype=name,
        quantization=config.quantization,
        cpu_attention_kernel=False,
        cpu_fused_ops=False,
        max_prefill_tokens=max_prefill,
        chunked_prefill_size=chunked,
        context_length=config.context_length,  # SGLang's own limit applies when None
        max_running_requests=running,
        decode_steps=DecodeSteps(),
        fuse_decode_steps=False,
        optimistic_grammar=False,  # (SGLang's grammar backend masks every token)
        kv_pages=None if kv_tokens is None else kv_tokens // config.page_size,
        kv_tokens=kv_tokens,
        page_size=config.page_size,
        graph_max_len=None,
        graph_max_batch=0,
        own_stream=False,
        memory=None,
        event_wait=config.event_wait,
        step_launch="thread",
        tensor_parallel_size=1,
        config=settled,
    )

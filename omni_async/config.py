"""User-facing configuration: sampling parameters and scheduler limits.

Both are validated on construction so that bad input becomes an
:class:`~omni_async.errors.InvalidRequestError` before anything reaches the loop.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from .errors import ConfigError, InvalidRequestError
from .memory_budget import check_budget
from .stage.watchdog import check_step_timeout
from .sampling_controls import check_grammar_fields, check_penalties, normalize_json_schema, normalize_logit_bias, validate_if_changed  # noqa: F401

LoopKind = Literal["normal", "overlap", "async_decode"]
LOOP_KINDS: tuple[str, ...] = ("normal", "overlap", "async_decode")

# Seeds are masked into this range, as the reference does for SGLang's seeded sampler.
SAMPLING_SEED_MASK = (1 << 63) - 1
MAX_N = 128  # parallel samples per request
MAX_TOP_LOGPROBS = 64
MAX_PROMPT_LOGPROBS = 20  # as vLLM's default max_logprobs


def _fields_of(cls: type) -> set[str]:
    """The fields a caller may set (not the class's own bookkeeping: private, init=False)."""
    return {f.name for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}


def _check_unknown(cls: type, data: Mapping[str, Any], error: type[Exception] = InvalidRequestError) -> None:
    known = _fields_of(cls)
    unknown = sorted(str(k) for k in set(data) - known)
    if unknown:
        close = [m for name in unknown for m in difflib.get_close_matches(name, known, n=1)]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise error(f"unknown {cls.__name__} field(s): {', '.join(unknown)}{hint}; known fields are {', '.join(sorted(known))}")


@dataclass
class SamplingParams:
    """How to pick each next token. ``temperature=0`` is greedy.

    ``repetition_penalty`` applies to the request's *output* tokens only (as in the
    reference), unlike transformers' processor which also penalises the prompt.
    """

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    suppress_tokens: list[int] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    return_logprob: bool = False
    # "processed": logprobs of the distribution sampled from (after penalties,
    # temperature and filters); "raw": log_softmax of the model's logits.
    logprobs_mode: Literal["processed", "raw"] = "processed"
    # The decoder's final hidden state (after its final norm, or the stage's chosen
    # layer's) at the position that produced each output token, one row per token
    # (``result.hidden_states``, ``delta.hidden_states``), on the stage's device; and of
    # every prompt position (``result.prompt_hidden_states``). hidden_states_layer: that
    # layer, transformers' hidden_states[i]; None the stage's (docs/omni-data-path.md).
    return_hidden_states: bool = False
    return_prompt_hidden_states: bool = False
    hidden_states_layer: int | None = None
    # Text-level options, applied by the Engine (the scheduler ignores them).
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    n: int = 1
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    # Constrained decoding: at most one grammar per request. ``json_schema`` is a dict or
    # a JSON string; the request ends ("stop") when its grammar is complete.
    json_schema: dict[str, Any] | str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # OpenAI's controls over the generated tokens, after repetition_penalty:
    # logit -= presence_penalty * (count > 0) + frequency_penalty * count; then logit_bias.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Score the prompt: at every prompt position but the first, the log-probability of
    # the prompt's own token and of the ``prompt_logprobs`` most likely ones
    # (``result.prompt_logprobs``). Such a request computes every prompt position (the
    # prefix cache is not reused for it) and may set ``max_new_tokens=0``: it then ends
    # after its prefill, with no generated token.
    prompt_logprobs: int | None = None
    # json_schema as compact JSON, serialised once by validate() (a large schema takes
    # a noticeable time to serialise, and ``grammar`` is read several times per request).
    _schema_text: str | None = field(default=None, init=False, repr=False, compare=False)
    _schema_of: Any = field(default=None, init=False, repr=False, compare=False)  # the object it was made from
    _valid_as: Any = field(default=None, init=False, repr=False, compare=False)  # see validate_if_changed

    def __post_init__(self) -> None:
        validate_if_changed(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "SamplingParams":
        data = dict(data or {})
        _check_unknown(cls, data)
        return cls(**data)

    def validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid sampling: {msg}")

        self._validate_prompt_logprobs(bad)
        least = 0 if self.prompt_logprobs is not None else 1  # 0: score the prompt only
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < least:
            raise bad(f"max_new_tokens must be an integer >= {least}, got {self.max_new_tokens!r}"
                      + ("" if least == 0 else " (0 only with prompt_logprobs)"))
        if not _is_int(self.min_new_tokens) or self.min_new_tokens < 0:
            raise bad(f"min_new_tokens must be an integer >= 0, got {self.min_new_tokens!r}")
        if self.min_new_tokens > self.max_new_tokens:
            raise bad(
                f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens "
                f"({self.max_new_tokens})"
            )
        if not _is_finite(self.temperature) or self.temperature < 0 or self.temperature > 100:
            raise bad(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if not _is_finite(self.top_p) or not (0 < self.top_p <= 1):
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_finite(self.min_p) or not (0 <= self.min_p < 1):
            raise bad(f"min_p must be in [0, 1), got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise bad(f"seed must be an integer or None, got {self.seed!r}")
        # Penalties outside [0.01, 100] push float32 logits to infinity (NaN after
        # softmax) without changing which tokens are likely any further.
        if not _is_finite(self.repetition_penalty) or not (0.01 <= self.repetition_penalty <= 100):
            raise bad(f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty!r}")
        for name in ("suppress_tokens", "stop_token_ids"):
            values = getattr(self, name)
            if not isinstance(values, (list, tuple, set, frozenset)):
                raise bad(f"{name} must be a list of token ids, got {type(values).__name__}")
            if any(not _is_int(t) or t < 0 for t in values):
                raise bad(f"{name} must hold non-negative integer token ids, got {list(values)!r}")
            setattr(self, name, [int(t) for t in values])
        if not isinstance(self.ignore_eos, bool):
            raise bad(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name in ("return_logprob", "return_hidden_states", "return_prompt_hidden_states"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.logprobs_mode not in ("processed", "raw"):
            raise bad(f"logprobs_mode must be 'processed' or 'raw', got {self.logprobs_mode!r}")
        self._validate_text_options(bad)
        self._schema_text = check_grammar_fields(self, bad)
        self._schema_of = self.json_schema
        check_penalties(self, bad)
        self.logit_bias = normalize_logit_bias(self.logit_bias, bad)

    def _validate_prompt_logprobs(self, bad: Any) -> None:
        k = self.prompt_logprobs
        if k is not None and (not _is_int(k) or not (0 <= k <= MAX_PROMPT_LOGPROBS)):
            raise bad(f"prompt_logprobs must be None or an integer in [0, {MAX_PROMPT_LOGPROBS}], got {k!r}")

    def _validate_text_options(self, bad: Any) -> None:
        """The engine-side fields: stop strings, parallel samples, top logprobs."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in self.stop):
            raise bad(f"stop must be a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not _is_int(self.n) or not (1 <= self.n <= MAX_N):
            raise bad(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not _is_int(self.top_logprobs) or not (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise bad(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.top_logprobs and not self.return_logprob:
            raise bad("top_logprobs needs return_logprob=True")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def grammar(self) -> tuple[str, str] | None:
        """``(kind, text)`` of the request's grammar, the schema as compact JSON (the
        compile cache's key); None when the request is unconstrained."""
        if self.json_schema is not None:
            if self.json_schema is not self._schema_of:  # assigned after validation
                self._schema_text = normalize_json_schema(self.json_schema, InvalidRequestError)
                self._schema_of = self.json_schema
            return ("json_schema", self._schema_text or "")
        if self.regex is not None:
            return ("regex", self.regex)
        if self.ebnf is not None:
            return ("ebnf", self.ebnf)
        return None

    @property
    def has_logit_controls(self) -> bool:
        """Whether the OpenAI penalties or a logit bias change this request's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    @property
    def resolved_seed(self) -> int | None:
        """The seed masked into the sampler's valid range (None when unseeded)."""
        if self.seed is None:
            return None
        return int(self.seed) & SAMPLING_SEED_MASK


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# Weight formats the native CPU path can run its projections in (SchedulerConfig.quantization).
QUANTIZATION_MODES = ("q4", "q8", "int8")


@dataclass
class SchedulerConfig:
    """Limits and loop choice of one :class:`~omni_async.scheduler.AsyncOmniScheduler`.

    KV sizing: on CPU the capacity is ``kv_capacity_tokens``; on CUDA it is
    ``kv_memory_fraction`` of free device memory unless ``kv_capacity_tokens`` is set.
    With ``memory_budget`` the KV gets what the budget leaves after the weights and a
    reserve (or, with ``kv_capacity_tokens`` too, that KV is checked to fit).
    """

    loop: LoopKind | None = None  # None: the plan picks the fastest measured for the device (core/plan.py)
    async_decode_min_batch_size: int = 2
    # None: 64 on CPU; on CUDA derived from the KV capacity and the decode graphs'
    # batch buckets (omni_async/core/plan.py): 512 on an H200 for a 0.5B model.
    max_running_requests: int | None = None
    max_queued_requests: int = 4096
    # Prompt tokens per prefill step and the chunk a long prompt is split into (<= 0:
    # whole). None: 4096 / 512 on CPU, 16384 / 8192 on CUDA (omni_async/core/plan.py).
    max_prefill_tokens: int | None = None
    chunked_prefill_size: int | None = None
    page_size: int = 16
    kv_capacity_tokens: int | None = None
    kv_memory_fraction: float = 0.8
    # This engine's share of the device, whatever else is loaded: a float in (0, 1] of
    # the device's total memory (RAM on CPU) or an int number of bytes, covering the
    # weights, an activation/graph reserve and the KV cache, which gets what remains
    # (omni_async/memory_budget.py). None sizes the KV as above.
    memory_budget: float | int | None = None
    context_length: int | None = None
    request_build_max_workers: int = 1
    request_build_max_pending: int | None = None
    aborted_id_cap: int = 10_000
    aborted_id_keep: int = 5_000
    admin_timeout_s: float = 300.0
    # CUDA only: decode steps replay CUDA graphs (per batch-size bucket) when every row
    # fits in ``cuda_graph_max_len`` positions; completion is awaited by ``event_wait``.
    cuda_graphs: bool = True
    cuda_graph_max_len: int = 2048
    cuda_graph_max_batch: int = 512
    event_wait: str = "auto"
    # CUDA only: the stage launches its steps on a CUDA stream of its own, so stages that
    # share a GPU queue their work independently (see ModelRunner.use_own_stream).
    own_cuda_stream: bool = True
    # CUDA with Triton only: the decoder's elementwise work runs through fused kernels
    # (residual add + RMSNorm, rotary + KV write, SiLU-and-multiply) and greedy sampling
    # is captured in the decode graphs. False keeps the torch reference path (as on CPU).
    fused_kernels: bool = True
    # Where steps are launched: "thread" (a worker thread), "inline" (the loop thread;
    # CUDA only) or "auto" (inline on CUDA, the worker thread on CPU).
    step_launch: str = "auto"
    # A step that has not completed after this many seconds fails its requests with
    # DeviceTimeoutError (CPU and CUDA). "auto": a deadline per step that a healthy step
    # never reaches, scaled to the device and the step's size (the formula is in
    # omni_async/stage/watchdog.py); None waits for ever (an explicit opt-out; the CUDA
    # event watchdog still applies). Closing waits at most this long for a hung step.
    step_timeout_s: float | str | None = "auto"
    # Native backend: requests reuse the KV pages of cached whole-page prompt prefixes
    # (pages of finished requests stay cached until their room is needed).
    enable_prefix_cache: bool = True
    # Native backend: split the model over this many ranks (one process and device
    # each; Megatron-style tensor parallelism). 1 runs in this process only.
    tensor_parallel_size: int = 1
    # Engine.from_pretrained / load: once the model is built, collect and then freeze
    # what exists (gc.freeze), so the cyclic GC's full passes while serving scan only
    # the objects serving made, not torch's and the model's (a full pass over those
    # stalls the loop for tens to hundreds of ms). Process-wide, hence opt-in.
    gc_freeze: bool = False
    # Engine.from_pretrained / load: the cyclic GC's first threshold (gc.set_threshold),
    # None leaves Python's 700. Serving allocates a few container objects per token that
    # live until the readers run, so at 700 a young-generation pass runs every step or
    # two; 10_000 cuts that to a few per run (tools/host_overhead.py). Process-wide.
    gc_gen0_threshold: int | None = None
    # Native backend on CPU: "int8" runs every projection and the output head through
    # int8 GEMMs (weights per channel, activations per step; float32 elsewhere): faster,
    # not exact (see omni_async/models/quantized.py). None keeps the exact float path.
    quantization: str | None = None
    # Native backend: decode steps per launch. With k > 1 one scheduled decode step runs
    # k forwards back to back on the device, each reading the tokens the one before
    # sampled there; the host schedules, collects, checks finishes and streams once per
    # k tokens, so its per-token cost falls about k-fold. Tokens are the same as k=1
    # (tokens after a stop are discarded); a stop or abort is seen up to k-1 forwards
    # late, and stream deltas carry up to k tokens. At most page_size. None (the
    # default) chooses by how many requests decode: on CUDA 4 below 64 and 8 from 64
    # (capped at page_size; one Python thread cannot keep up with one forward per step,
    # and a batch-1 step's host work is as long as its forward); 1 on CPU, with tensor
    # parallelism and on the SGLang backend.
    decode_steps: int | None = None
    # Native backend, decode_steps > 1: a multi-step decode runs its forwards, their
    # inputs and their sampling (filters, seeds, repetition penalty, bans) as one launch
    # (one CUDA graph per batch bucket, k and sampling mode; eagerly on CPU) instead of
    # forward by forward from the host; rows asking for logprobs run forward by forward
    # beside it. Same tokens; False keeps the forward-by-forward path (for comparison).
    fuse_decode_steps: bool = True
    # Native backend on CPU: decode attention through a C++ kernel that reads the KV
    # pages in place instead of gathering them (omni_async/kernels/cpu_paged.py; built
    # with the system compiler on first use). Close to the reference, not bit-equal.
    # None (the default) decides per machine and dtype (omni_async/core/plan.py).
    cpu_attention_kernel: bool | None = None
    # Native backend on CPU: the work between the GEMMs (residual add + RMSNorm, rotary +
    # KV write, SiLU-and-multiply, and an extend step's attention) through fused C++
    # kernels, one call each and no parallel region at decode sizes
    # (omni_async/kernels/cpu_fused.py; built with the system compiler on first use).
    # Close to the reference, not bit-equal. None: as cpu_attention_kernel.
    cpu_fused_ops: bool | None = None
    # Native backend: a prefill step also carries every running request's next decode
    # token (one-token rows, vLLM's and SGLang's mixed batches). Off by default: the
    # running requests then keep their fused multi-step decode launches, and prefill and
    # decode steps alternate while prompts wait, so a running stream waits for one prefill
    # step at most (core.mixed_prefill.prefill_turn). Same tokens either way.
    mixed_prefill: bool = False
    # Native backend, requests under a grammar: where the grammar admits one token, it is
    # appended at once and its KV computed in the request's next step, with the tokens
    # after it (omni_async/structured/jump.py). Same tokens. Off by default: finding a
    # forced run reads each next mask on the loop thread (~100-200 us a token, waiting on
    # the mask worker), which cost more than the steps it saved (7166a36:bench/
    # probes/constrained_host.py: 32 rows, 26.8 s against 15.6 s on CPU; on the H200 the
    # constrained arms ran 2-5x slower with it on).
    jump_forward: bool = False
    # Native backend, grammar rows greedy or at temperature alone, without logprobs: sample
    # as free rows (fused launch, lookahead), the grammar checking each token after (~2 us;
    # a mask ~20-60); a refused token is sampled again under the mask (structured/
    # optimistic.py). Greedy tokens as masking first, sampled ones the same distribution.
    optimistic_grammar: bool | None = None  # None: on CUDA (core/plan.py); off with jump_forward
    # Stream deltas every this many tokens per request (and at its finish): fewer,
    # larger deltas for callers that do not need every token at once (SGLang's
    # stream_interval). 1 (the default) sends each step's tokens as they come.
    stream_interval: int = 1
    # CPU: a step's intra-op threads (torch's, process-wide). None: the CPUs the load
    # average leaves idle, one when oversubscribed; OMP_NUM_THREADS, when set, is kept
    # (core/cpu_choices.py; bench/cpu_threads.py).
    cpu_threads: int | None = None
    hidden_states_layer: int | None = None  # the hidden_states[i] rows handed out (None: the final norm's)

    def __post_init__(self) -> None:
        if self.loop is not None and self.loop not in LOOP_KINDS:
            raise ConfigError(
                f"unknown loop {self.loop!r}; choose one of {', '.join(LOOP_KINDS)} (or None: the stage plan picks)"
            )
        for name in ("max_running_requests", "max_prefill_tokens", "cpu_threads"):
            if getattr(self, name) is not None and (not _is_int(getattr(self, name)) or getattr(self, name) < 1):
                raise ConfigError(f"{name} must be None or an integer >= 1, got {getattr(self, name)!r}")
        positive = ("async_decode_min_batch_size", "max_queued_requests", "page_size", "request_build_max_workers",
                    "aborted_id_cap", "tensor_parallel_size", "stream_interval")
        for name in positive:
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.decode_steps is not None:
            if not _is_int(self.decode_steps) or not 1 <= self.decode_steps <= self.page_size:
                raise ConfigError(f"decode_steps must be None or an integer in [1, page_size={self.page_size}], got {self.decode_steps!r}")
            if self.decode_steps > 1 and self.tensor_parallel_size > 1:
                raise ConfigError("decode_steps > 1 is not supported with tensor_parallel_size > 1 yet")
        for name in ("cpu_attention_kernel", "cpu_fused_ops"):
            if getattr(self, name) and self.tensor_parallel_size > 1:
                raise ConfigError(f"{name} is not supported with tensor_parallel_size > 1 yet")
        if self.chunked_prefill_size is not None and not _is_int(self.chunked_prefill_size):
            raise ConfigError("chunked_prefill_size must be None or an integer (<= 0 disables)")
        if self.kv_capacity_tokens is not None and (
            not _is_int(self.kv_capacity_tokens) or self.kv_capacity_tokens < self.page_size
        ):
            raise ConfigError(
                f"kv_capacity_tokens must be an integer >= page_size ({self.page_size}), "
                f"got {self.kv_capacity_tokens!r}"
            )
        check_step_timeout(self.step_timeout_s)
        for name in ("enable_prefix_cache", "gc_freeze", "fuse_decode_steps", "own_cuda_stream", "mixed_prefill", "jump_forward"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("cpu_attention_kernel", "cpu_fused_ops", "optimistic_grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool or None, got {getattr(self, name)!r}")
        if self.gc_gen0_threshold is not None and (not _is_int(self.gc_gen0_threshold) or self.gc_gen0_threshold < 1):
            raise ConfigError(f"gc_gen0_threshold must be an integer >= 1 or None, got {self.gc_gen0_threshold!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_MODES:
            raise ConfigError(f"unknown quantization {self.quantization!r}; choose None or one of {', '.join(QUANTIZATION_MODES)}")
        if self.memory_budget is not None:
            check_budget(self.memory_budget)
        if not (0 < self.kv_memory_fraction <= 1):
            raise ConfigError("kv_memory_fraction must be in (0, 1]")
        if not (0 <= self.aborted_id_keep <= self.aborted_id_cap):
            raise ConfigError("aborted_id_keep must be in [0, aborted_id_cap]")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "SchedulerConfig":
        _check_unknown(cls, kwargs, ConfigError)
        return cls(**kwargs)

    @property
    def chunk_size(self) -> int | None:
        """The prefill chunk; None when prompts are not chunked (or the size is still
        open: the stage's plan decides it)."""
        size = self.chunked_prefill_size
        return size if size is not None and size > 0 else None

"""SGLang's own next-batch planning, composed in-process: a ``Scheduler`` whose planning
methods run unchanged, set up without ``Scheduler.__init__``.

``Scheduler.__init__`` opens IPC channels, a tokenizer, watchdogs and the model worker;
none of that belongs in an omni-async stage, which has its own loop and already holds
SGLang's model worker and memory pools (see builder.py). The planning path needs only
part of the Scheduler's state, so :class:`SGLangPlanner` sets that part: the pools
and radix cache the builder made, the features omni-async does not enable switched off
(LoRA, hierarchical/storage cache, hisparse, disaggregation, DP attention, speculative
decoding, diffusion LLMs, priorities, grammars), and SGLang's own initialisers where
they stand alone (``init_running_status``, ``init_chunked_prefill``,
``init_schedule_policy``, ``init_beam_coordinator``, the DP-attention adapter, the load
inquirer). Then ``get_next_batch_to_run`` is SGLang's: merging the last prefill batch
into the running batch, ``PrefillAdder`` admission with the new-token-ratio reserve,
chunked prefill, ``prepare_for_extend`` / ``prepare_for_decode``, decode-memory checks
and ``retract_decode``.

Two outlets leave SGLang's path, because they are where its Scheduler talks to its own
request queue and to the tokenizer process: a request retracted under KV pressure goes
to ``on_retracted`` (``_add_request_to_queue``), one aborted because even alone it no
longer fits goes to ``on_oom_abort`` (``send_abort_output``). The omni-async core
(core.py) owns both.

``planning_attributes_missing`` lists what the planning methods read from ``self`` that
this object lacks (a test keeps it empty, so an SGLang upgrade that reads more fails
there, not in a step).
"""

from __future__ import annotations

import inspect
import re
from types import SimpleNamespace
from typing import Any, Callable

from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers.schedule_batch import NextBatchPlan, Req, ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.scheduler_components.dp_attn import SchedulerDPAttnAdapter
from sglang.srt.managers.scheduler_components.load_inquirer import SchedulerLoadInquirer
from sglang.srt.runtime_context import get_context, get_parallel, get_schedule
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

# The Scheduler methods the planning path runs (get_next_batch_to_run and its callees).
PLANNING_METHODS = (
    "get_next_batch_to_run",
    "get_new_batch_prefill",
    "_get_new_batch_prefill_raw",
    "update_running_batch",
    "get_num_allocatable_reqs",
    "_reqs_finishing_inflight",
    "stash_chunked_request",
    "process_pending_chunked_abort",
    "_process_hicache_events",
    "_should_defer_prefill",
    "_arm_prefill_decode_interval",
    "get_prefill_adder_class",
)


class _NoGrammars:
    """Grammar-constrained decoding is not enabled: no request waits on a grammar."""

    def has_waiting_grammars(self) -> bool:
        return False


def _unused(*_args: Any, **_kwargs: Any) -> None:
    return None


class SGLangPlanner(Scheduler):
    """SGLang's scheduling state (waiting queue, running batch, last batch, chunked
    request, policy, new-token ratio) and its planning methods, for one stage."""

    def __init__(  # deliberately not Scheduler.__init__ (see the module docstring)
        self,
        *,
        server_args: Any,
        tp_worker: Any,
        model_config: Any,
        req_to_token_pool: Any,
        token_to_kv_pool_allocator: Any,
        tree_cache: Any,
        future_map: Any,
        max_running_requests: int,
        max_prefill_tokens: int,
        max_total_num_tokens: int,
        max_req_len: int,
        on_retracted: Callable[[Req], None],
        on_oom_abort: Callable[[Req], None],
    ) -> None:
        self.on_retracted = on_retracted
        self.on_oom_abort = on_oom_abort
        self.server_args = server_args
        self.tp_worker = tp_worker
        self.model_config = model_config
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.tree_cache = tree_cache
        self.future_map = future_map
        self.device = tp_worker.device
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.max_total_num_tokens = max_total_num_tokens
        self.max_req_len = max_req_len
        self.page_size = get_schedule().page_size
        self.schedule_policy = get_schedule().schedule_policy
        self.priority_scheduling_preemption_threshold = get_schedule().priority_scheduling_preemption_threshold
        self._switch_off_unused_features()
        # SGLang's own initialisers, where they stand alone.
        self.init_running_status()
        self.init_chunked_prefill()
        self.dynamic_chunk_sizer = None  # pipeline-parallel only
        self.init_schedule_policy()
        self.maybe_init_ngram_embedding()
        self.init_beam_coordinator()
        self.dp_attn_adapter = SchedulerDPAttnAdapter(
            model_runner=tp_worker.model_runner,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
            tree_cache=tree_cache,
            offload_tags=set(),
            model_config=model_config,
            enable_overlap=self.enable_overlap,
            spec_algorithm=self.spec_algorithm,
            get_require_mlp_sync=lambda: self.require_mlp_sync,
        )
        self.load_inquirer = self._load_inquirer()
        # Scheduler.init_model_worker's default, set for this stage every time: the
        # process-wide value bounds admission (get_num_allocatable_reqs).
        get_context().override(
            "scheduler.pp_max_micro_batch_size_default",
            pp_max_micro_batch_size=max(self.max_running_requests // get_parallel().pp_size, 1),
        )

    def _switch_off_unused_features(self) -> None:
        self.enable_priority_scheduling = False
        self.schedule_low_priority_values_first = False
        self.enable_lora = False
        self.lora_drainer = None
        # Results may be processed a step late (omni-async's lookahead loops).
        self.enable_overlap = True
        self.spec_algorithm = SpeculativeAlgorithm.NONE
        self.enable_hierarchical_cache = False
        self.enable_lmcache = False
        self.enable_hicache_storage = False
        self.enable_unified_cache_external_linker = False
        self.enable_hisparse = False
        self.hisparse_coordinator = None
        self.disaggregation_mode = DisaggregationMode.NULL
        self.req_to_metadata_buffer_idx_allocator = None
        self.decode_offload_manager = None
        self.require_mlp_sync = False
        self.dllm_config = None
        self.dllm_manager = None
        self.is_hybrid_swa = False
        self.min_free_slots_delayer = None
        self.truncation_align_size = None
        self.processed_tokens_counter = 0
        self.scheduler_stage_metrics = None
        self.grammar_manager = _NoGrammars()
        self.metrics_reporter = SimpleNamespace(enable_metrics=False, num_retracted_reqs=0)
        self.pool_stats_observer = None  # read only with the prefill delayer, which stays off

    def _load_inquirer(self) -> SchedulerLoadInquirer:
        """SGLang's load inquirer; planning asks it for the tokens pending prefill."""
        return SchedulerLoadInquirer(
            disaggregation_mode=self.disaggregation_mode,
            server_args=self.server_args,
            max_total_num_tokens=self.max_total_num_tokens,
            max_running_requests=self.max_running_requests,
            pool_stats_observer=self.pool_stats_observer,
            tp_worker=self.tp_worker,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            spec_algorithm=self.spec_algorithm,
            get_running_batch=lambda: self.running_batch,
            get_waiting_queue=lambda: self.waiting_queue,
            waiting_queue_prefix_matched=lambda: self.policy.waiting_queue_prefix_matched(self.waiting_queue),
            get_recent_cache_hit_rate=lambda: 0.0,
            get_stats=_unused,
            get_chunked_req=lambda: self.chunked_req,
            get_disagg_prefill_bootstrap_queue=_unused,
            get_disagg_prefill_inflight_queue=_unused,
            get_disagg_decode_prealloc_queue=_unused,
            get_disagg_decode_transfer_queue=_unused,
            get_spec_total_num_accept_tokens=_unused,
            get_spec_total_num_forward_ct=_unused,
            get_total_prefill_uncached_tokens=_unused,
            get_total_prefill_busy_us=_unused,
            get_decode_moment_totals=_unused,
        )

    # ------------------------------------------------------------ the outlets

    def _add_request_to_queue(self, req: Req, is_retracted: bool = False) -> None:
        """Planning sends only retracted requests here (priority preemption and
        grammars are off): the omni-async core requeues them."""
        self.on_retracted(req)

    def send_abort_output(self, abort_req: Any, req: Req) -> None:
        """A request aborted by ``retract_decode`` (it no longer fits even alone)."""
        self.on_oom_abort(req)

    # ------------------------------------------------------------ planning

    def plan(self) -> ScheduleBatch | None:
        """One planning pass: SGLang's ``get_next_batch_to_run`` over the running and
        last batches, which then become the plan's running batch and its batch."""
        result: NextBatchPlan = self.get_next_batch_to_run(self.running_batch, self.last_batch)
        self.running_batch = result.running_batch
        self.last_batch = result.batch_to_run
        return result.batch_to_run


def planning_attributes_missing(planner: SGLangPlanner) -> list[str]:
    """Names the planning methods read from ``self`` that ``planner`` does not have."""
    missing = set()
    for name in PLANNING_METHODS:
        source = inspect.getsource(inspect.unwrap(getattr(Scheduler, name)))
        for attr in re.findall(r"self\.(\w+)", source):
            if not hasattr(planner, attr):
                missing.add(attr)
    return sorted(missing)

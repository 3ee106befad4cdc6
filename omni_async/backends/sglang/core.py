"""The SGLang batch core: omni-async's BatchCore protocol over SGLang's scheduling state.

The state is SGLang's own: ``Req`` objects in a waiting queue, a running
``ScheduleBatch``, a chunked request, the ``SchedulePolicy``, ``PrefillAdder``
admission with its token budget and new-token-ratio reservation, ``ScheduleBatch``
extend/decode preparation (``prepare_for_extend`` / ``prepare_for_decode``), decode
memory checks and retraction (``check_decode_mem`` / ``retract_decode`` /
``retract_all``), finish checks (``Req.update_finish_state``), and KV bookkeeping
through the radix cache (``checkpoint_kv_cache`` / ``release_kv_cache``) over SGLang's
``ReqToTokenPool`` and token allocator. The steps follow SGLang's
``Scheduler.get_next_batch_to_run`` / ``update_running_batch`` /
``process_batch_result_{prefill,decode}`` and ``abort_request``, called function by
function (no delegation to SGLang's Scheduler class).

Each omni-async :class:`~omni_async.core.request.Request` is mirrored by one SGLang
``Req``; the omni request carries what the scheduler reads (output ids, finish reason,
epoch) and the SGLang one carries the scheduling and KV state.

Lag. The overlap and async-decode loops schedule step N+1 before step N's result is
processed, as SGLang's overlap scheduler does: decode inputs come from SGLang's
FutureMap on the device, a request that finishes in step N still rides step N+1 (its
row is skipped when N+1 is processed), and its KV is released only once no scheduled
step that has not yet executed still reads it (``_release``): the worker thread may be
running step N+1 while the loop thread schedules step N+2.
"""

from __future__ import annotations

import copy
import math
from array import array
from typing import Any, Callable, Sequence

from ...config import SchedulerConfig
from ...core.batch import ForwardMode
from ...core.protocol import BatchCore, StepOutcome
from ...core.request import Request

from sglang.srt.managers.schedule_batch import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_MATCHED_STR,
    FINISH_MATCHED_TOKEN,
    Req,
    ScheduleBatch,
    retract_all as sglang_retract_all,
)
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy
from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome, EvictParams
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm


class SGLangScheduledBatch:
    """One scheduled step, with the attributes the loops and runners read from a
    :class:`~omni_async.core.batch.ScheduledBatch`, over a snapshot of SGLang's
    ``ScheduleBatch`` (the scheduler's own object keeps changing while the step runs
    on the worker thread)."""

    def __init__(
        self,
        mode: ForwardMode,
        reqs: list[Request],
        sreqs: list[Req],
        samples_kept: list[bool],
        sample_indices: list[int],
        output_snapshots: list[list[int] | None],
        schedule_batch: ScheduleBatch,
        step_id: int,
    ) -> None:
        self.mode = mode
        self.reqs = reqs
        self.sreqs = sreqs
        self.epochs = [r.epoch for r in reqs]
        self.samples_kept = samples_kept
        self.sample_indices = sample_indices
        # Output tokens known to the host at scheduling, for rows whose sampling reads
        # them (repetition penalty); None for the others.
        self.output_snapshots = output_snapshots
        self.schedule_batch = schedule_batch
        self.step_id = step_id
        self.executed = False  # set by the step executor once the step ran (or failed) on the worker
        self.processed = False

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE

    @property
    def forward_mode(self) -> ForwardMode:
        return self.mode

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        sb = self.schedule_batch
        return int(sb.extend_num_tokens) if self.mode.is_extend() else len(self.reqs)

    def row_is_live(self, i: int) -> bool:
        """False when the row's request finished or was retracted after scheduling."""
        req = self.reqs[i]
        return not req.finished() and req.epoch == self.epochs[i]

    def runnable_after_drain(self) -> "SGLangScheduledBatch":
        """The batch to run after a drain finished or retracted some of its requests.

        Unlike the native core, the stale rows stay in the forward (SGLang's overlap
        'overshoot'): their KV slots were allocated with the step, the radix cache may
        already count the slot a finished request's last token is written to, and
        their release waits for this step to execute. Processing skips them."""
        return self


def _finish_reason_name(reason: Any) -> str | None:
    if reason is None:
        return None
    if isinstance(reason, FINISH_LENGTH):
        return "length"
    if isinstance(reason, (FINISH_MATCHED_TOKEN, FINISH_MATCHED_STR)):
        return "stop"
    if isinstance(reason, FINISH_ABORT):
        return "abort"
    return "stop"


class SGLangBatchCore(BatchCore):
    """BatchCore over SGLang's scheduling machinery (see the module docstring)."""

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        req_to_token_pool: Any,
        token_to_kv_pool_allocator: Any,
        tree_cache: Any,
        model_config: Any,
        page_size: int,
        max_running_requests: int,
        context_length: int,
    ) -> None:
        self.config = config
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.tree_cache = tree_cache
        self.model_config = model_config
        self.page_size = page_size
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = config.max_prefill_tokens
        self.chunked_prefill_size = config.chunk_size
        self.context_length = context_length
        self.vocab_size = int(model_config.vocab_size)
        self.spec_algorithm = SpeculativeAlgorithm.NONE
        self.policy = SchedulePolicy(
            "fcfs",
            tree_cache,
            enable_hierarchical_cache=False,
            enable_priority_scheduling=False,
            schedule_low_priority_values_first=False,
        )
        self.new_token_ratio_tracker = NewTokenRatioTracker.from_config()
        self.waiting_queue: list[Req] = []
        self.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
        self.chunked_req: Req | None = None
        self.last_batch: ScheduleBatch | None = None
        self.num_retractions = 0
        self.stack: Any = None
        self.wake: Callable[[], None] | None = None  # the scheduler's wake (set by the builder)
        self._omni: dict[int, Request] = {}  # id(SGLang Req) -> omni request
        self._sreq: dict[str, Req] = {}  # rid -> SGLang Req, while the request is active
        self._last_step: dict[int, SGLangScheduledBatch] = {}  # id(Req) -> newest step it rides
        self._deferred: list[tuple[Req, bool]] = []  # finished, KV release waits for a step
        self._aborted_now: list[Request] = []  # finished by scheduling (OOM), reaped next
        self._step_id = 0
        self._arrivals = 0

    # ------------------------------------------------------------------ requests

    def _omni_of(self, sreq: Req) -> Request:
        return self._omni[id(sreq)]

    def add_request(self, req: Request) -> None:
        self._arrivals += 1
        req.arrival = self._arrivals
        s = req.sampling
        n_in = len(req.prompt_ids)
        # Scheduler.init_req_max_new_tokens: keep input + output within max_req_len.
        max_new = max(1, min(s.max_new_tokens, self.context_length - n_in))
        # omni-async's stop set: stop_token_ids, plus EOS unless ignore_eos. SGLang's
        # finish check then stops on exactly these (its ignore_eos would also silence
        # stop_token_ids). Sampling itself (filters, seeds, penalties, min_new_tokens) is
        # omni-async's shared sampler; the knobs below only describe the request.
        finish = dict(max_new_tokens=max_new, stop_token_ids=set(req.stop_ids()) or None, ignore_eos=False)
        try:
            params = SGLangSamplingParams(
                temperature=float(s.temperature),
                top_p=float(s.top_p),
                top_k=int(s.top_k) if s.top_k > 0 else -1,
                min_p=float(s.min_p),
                **finish,
            )
            params.verify(self.vocab_size)
        except Exception:  # SGLang's own range checks are stricter in places
            params = SGLangSamplingParams(**finish)
        params.normalize(None)
        sreq = Req(
            req.rid,
            "",
            array("q", req.prompt_ids),
            params,
            vocab_size=self.vocab_size,
        )
        sreq.logprob_start_len = -1
        self._omni[id(sreq)] = req
        self._sreq[req.rid] = sreq
        self.waiting_queue.append(sreq)

    def has_work(self) -> bool:
        return bool(self.waiting_queue or self.running_batch.reqs or self.chunked_req is not None)

    def on_idle(self) -> None:
        """SGLang's idle self-check: the new-token ratio back to its initial value."""
        self.new_token_ratio_tracker = NewTokenRatioTracker.from_config()

    def num_waiting(self) -> int:
        return len(self.waiting_queue)

    def active_requests(self) -> list[Request]:
        return [self._omni[id(s)] for s in self._sreq.values() if not s.finished()]

    def find(self, rid: str) -> Request | None:
        sreq = self._sreq.get(rid)
        return None if sreq is None or sreq.finished() else self._omni_of(sreq)

    # ------------------------------------------------------------------ KV release

    def _release(self, sreq: Req, *, checkpoint: bool) -> None:
        """SGLang's ``release_kv_cache``, once no unexecuted step reads the request."""
        step = self._last_step.get(id(sreq))
        if step is not None and not step.executed:
            self._deferred.append((sreq, checkpoint))
            return
        self._release_now(sreq, checkpoint)

    def _release_now(self, sreq: Req, checkpoint: bool) -> None:
        self._last_step.pop(id(sreq), None)
        if sreq.kv.holds_kv:
            release_kv_cache(sreq, self.tree_cache, checkpoint=checkpoint)
        self._omni.pop(id(sreq), None)

    def _flush_deferred(self, force: bool = False) -> None:
        if not self._deferred:
            return
        keep = []
        for sreq, checkpoint in self._deferred:
            step = self._last_step.get(id(sreq))
            if force or step is None or step.executed:
                self._release_now(sreq, checkpoint)
            else:
                keep.append((sreq, checkpoint))
        released = len(keep) < len(self._deferred)
        self._deferred = keep
        if released:
            self._wake_if_waiting()

    def _wake_if_waiting(self) -> None:
        """KV came back after this iteration's scheduling (a lookahead loop processes a
        step after scheduling the next one): let the loop schedule again rather than
        idle until the next arrival."""
        if self.wake is not None and (self.waiting_queue or self.chunked_req is not None):
            self.wake()

    @property
    def num_deferred_releases(self) -> int:
        return len(self._deferred)

    def _finish(self, sreq: Req, reason: Any, *, checkpoint: bool) -> Request:
        """End a request now with ``reason`` (an SGLang finish reason)."""
        req = self._omni_of(sreq)
        if not sreq.finished():
            sreq.to_finish = reason
            sreq.update_finish_state(0)  # to_finish -> finished_reason
        self._sreq.pop(sreq.rid, None)
        req.finish_reason = _finish_reason_name(sreq.finished_reason)
        req.num_inflight = 0
        if isinstance(sreq.finished_reason, FINISH_ABORT):
            self.tree_cache.finish(sreq.cache_request_handle, CacheRequestOutcome.ABORT)
        self._release(sreq, checkpoint=checkpoint)
        return req

    # ------------------------------------------------------------------ scheduling

    def get_next_batch(self) -> SGLangScheduledBatch | None:
        """Scheduler.get_next_batch_to_run: merge the last prefill batch into the
        running batch, then a prefill batch when requests wait and fit, else a decode
        step of the running batch (retracting under KV pressure)."""
        self._flush_deferred()
        running = self.running_batch
        exclude: list[Req] = []
        if self.chunked_req is not None:
            exclude.append(self.chunked_req)
            if self.chunked_req.extend_end > self.chunked_req.prefix_len:
                checkpoint_kv_cache(self.chunked_req, self.tree_cache)  # stash_chunked_request
        last = self.last_batch
        if last is not None and last.forward_mode.is_extend():
            if last.chunked_req is not None:
                exclude.append(last.chunked_req)
            last_bs = last.batch_size()
            last.filter_batch(reqs_to_exclude=exclude)
            if last.batch_size() < last_bs:
                running.batch_is_full = False
            if not last.is_empty() and last is not running:
                if running.is_empty():
                    running = last
                else:
                    running.merge_batch(last)
        running_bs = running.batch_size()
        running.filter_batch()
        if running.batch_size() < running_bs:
            running.batch_is_full = False

        batch = self._get_new_batch_prefill(running)
        if batch is None and not running.is_empty():
            batch = self._update_running_batch(running)
            if batch is not None and batch.is_empty():
                batch = None
        self.running_batch = running
        self.last_batch = batch
        if batch is None:
            return None
        return self._wrap(batch)

    def _num_allocatable_reqs(self, running_bs: int, num_held_rows: int = 0) -> int:
        row_budget = max(self.req_to_token_pool.available_size() + num_held_rows, 0)
        return min(self.max_running_requests - running_bs, row_budget)

    def _get_new_batch_prefill(self, running: ScheduleBatch) -> ScheduleBatch | None:
        """Scheduler._get_new_batch_prefill_raw, without the features omni-async does
        not enable (LoRA, hierarchical cache, priorities, grammars, mixed chunks)."""
        if running.is_empty():
            running.batch_is_full = False
        if (running.batch_is_full or not self.waiting_queue) and self.chunked_req is None:
            return None
        running_bs = len(running.reqs)
        if self._num_allocatable_reqs(running_bs) <= 0 and self.chunked_req is None:
            running.batch_is_full = True
            return None
        self.policy.calc_priority(self.waiting_queue, running)
        adder = PrefillAdder(
            self.page_size,
            self.tree_cache,
            self.token_to_kv_pool_allocator,
            running,
            self.new_token_ratio_tracker.current,
            self.max_prefill_tokens,
            self.chunked_prefill_size,
            0,
            max_running_requests=self.max_running_requests,
            waiting_queue_len=len(self.waiting_queue),
        )
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            adder.chunked_req_limit = self.policy.shortest_prefill_chunk_limit(
                self.chunked_req, self.waiting_queue, adder.rem_chunk_tokens or 0, self.page_size
            )
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for sreq in self.waiting_queue:
            if adder.budget_state() == AddReqResult.OTHER:
                break
            running_bs = len(running.reqs)
            held = sum(r.kv.holds_kv for r in adder.can_run_list)
            if len(adder.can_run_list) >= self._num_allocatable_reqs(running_bs, held):
                running.batch_is_full = True
            if running.batch_is_full:
                break
            sreq.init_next_round_input(self.tree_cache)
            res = adder.add_one_req(sreq, has_chunked_req=self.chunked_req is not None, truncation_align_size=None)
            if res != AddReqResult.CONTINUE:
                if res == AddReqResult.NO_TOKEN:
                    running.batch_is_full = len(adder.can_run_list) > 0 or not running.is_empty()
                break
        can_run: list[Req] = adder.can_run_list
        if not can_run:
            for sreq in adder.preempt_list:
                self.waiting_queue.append(sreq)
            return None
        chosen = set(map(id, can_run))
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in chosen]
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.inflight_middle_chunks += 1
        batch = ScheduleBatch.init_new(
            can_run,
            self.req_to_token_pool,
            self.token_to_kv_pool_allocator,
            self.tree_cache,
            self.model_config,
            True,  # results may be processed a step late (omni-async's lookahead loops)
            self.spec_algorithm,
            chunked_req=self.chunked_req,
        )
        batch.contains_last_prefill_chunk = self.chunked_req is None or len(can_run) != 1
        batch.prepare_for_extend()
        batch.decoding_reqs = None
        return batch

    def _update_running_batch(self, batch: ScheduleBatch) -> ScheduleBatch | None:
        """Scheduler.update_running_batch: retract under KV pressure, then prepare the
        decode step (one KV slot per request)."""
        initial_bs = batch.batch_size()
        if not batch.check_decode_mem():
            retracted, new_ratio, to_abort = batch.retract_decode()
            self.new_token_ratio_tracker.current = new_ratio
            for sreq in retracted:
                req = self._omni_of(sreq)
                req.epoch += 1
                req.num_retractions += 1
                req.num_inflight = 0
                self.num_retractions += 1
                self.waiting_queue.append(sreq)  # Scheduler._add_request_to_queue
            for sreq in to_abort:  # KV already released by retract_decode
                self._last_step.pop(id(sreq), None)
                sreq.update_finish_state(0)
                req = self._omni_of(sreq)
                self._sreq.pop(sreq.rid, None)
                self._omni.pop(id(sreq), None)
                req.finish_reason = "abort"
                req.epoch += 1
                self._aborted_now.append(req)
        else:
            self.new_token_ratio_tracker.decay_step()
        if batch.batch_size() < initial_bs:
            batch.batch_is_full = False
        if batch.is_empty():
            return None
        batch.prepare_for_decode()
        return batch

    def _wrap(self, batch: ScheduleBatch) -> SGLangScheduledBatch:
        """Snapshot the batch for the worker thread and describe its rows."""
        self._step_id += 1
        snap = copy.copy(batch)
        snap.reqs = list(batch.reqs)
        if batch.sampling_info is not None:
            snap.sampling_info = copy.copy(batch.sampling_info)
        # The step consumes its staged inputs (Scheduler.run_batch): a decode step of
        # the scheduler's batch reads its inputs from the FutureMap from now on.
        batch.prefill_input_ids_cpu = None
        batch.input_ids = None
        is_extend = batch.forward_mode.is_extend()
        mode = ForwardMode.EXTEND if is_extend else ForwardMode.DECODE
        reqs, kept, indices, snapshots = [], [], [], []
        for sreq in snap.reqs:
            req = self._omni_of(sreq)
            reqs.append(req)
            snapshots.append(list(req.output_ids) if req.sampling.repetition_penalty != 1.0 else None)
            keep = not (is_extend and sreq is self.chunked_req)
            kept.append(keep)
            generated = sreq.kv.kv_committed_len - len(sreq.origin_input_ids)
            indices.append(max(0, generated))
            if keep:
                req.num_inflight += 1
        step = SGLangScheduledBatch(mode, reqs, snap.reqs, kept, indices, snapshots, snap, self._step_id)
        for sreq in snap.reqs:
            self._last_step[id(sreq)] = step
        return step

    # ------------------------------------------------------------------ results

    def process_result(
        self,
        batch: SGLangScheduledBatch,
        tokens: Sequence[int],
        logprobs: Sequence[float] | None = None,
    ) -> list[StepOutcome]:
        """SchedulerBatchResultProcessor.process_batch_result_{prefill,decode}: append
        each live row's token, SGLang's finish check, KV release or radix checkpoint."""
        batch.processed = True
        outcomes: list[StepOutcome] = []
        is_extend = batch.mode.is_extend()
        self.token_to_kv_pool_allocator.free_group_begin()
        try:
            for i, sreq in enumerate(batch.sreqs):
                req = batch.reqs[i]
                live = batch.row_is_live(i) and not sreq.finished() and not sreq.is_retracted
                if is_extend and sreq.inflight_middle_chunks > 0 and not batch.samples_kept[i]:
                    # A middle chunk of a chunked prefill: nothing sampled to keep.
                    sreq.inflight_middle_chunks -= 1
                    if live:
                        outcomes.append(StepOutcome(req, None))
                    continue
                if not live:
                    continue  # finished or retracted after this step was scheduled
                req.num_inflight = max(0, req.num_inflight - 1)
                if sreq.to_finish is not None:  # aborted while the step ran: no token
                    outcomes.append(StepOutcome(self._finish(sreq, sreq.to_finish, checkpoint=False), None, finished=True))
                    continue
                token = int(tokens[i])
                logprob = float(logprobs[i]) if logprobs is not None else None
                sreq.output_ids.append(token)
                sreq.update_finish_state()
                req.output_ids.append(token)
                if logprob is not None:
                    req.output_logprobs.append(logprob)
                finished = sreq.finished()
                if finished:
                    self._sreq.pop(sreq.rid, None)
                    req.finish_reason = _finish_reason_name(sreq.finished_reason)
                    req.num_inflight = 0
                    self._release(sreq, checkpoint=True)
                elif is_extend:
                    checkpoint_kv_cache(sreq, self.tree_cache)
                outcomes.append(StepOutcome(req, token, logprob, finished=finished))
        finally:
            self.token_to_kv_pool_allocator.free_group_end()
        self._flush_deferred()
        if any(oc.finished for oc in outcomes):
            self._wake_if_waiting()
        return outcomes

    # ------------------------------------------------------------------ aborts

    def abort(self, rid: str) -> Request | None:
        """Scheduler.abort_request: a waiting request ends now (returned); a running or
        chunked one is marked (``to_finish``) and ends at the next step boundary."""
        sreq = self._sreq.get(rid)
        if sreq is None or sreq.finished():
            return None
        for i, waiting in enumerate(self.waiting_queue):
            if waiting is sreq:
                self.waiting_queue.pop(i)
                return self._finish(sreq, FINISH_ABORT("aborted"), checkpoint=False)
        sreq.to_finish = FINISH_ABORT("aborted")
        self._omni_of(sreq).to_finish = "abort"
        return None

    def reap_aborted(self) -> list[Request]:
        """End every marked request now; called between steps."""
        reaped, self._aborted_now = self._aborted_now, []
        marked = [s for s in self._sreq.values() if s.to_finish is not None and not s.finished()]
        for sreq in marked:
            if sreq is self.chunked_req:  # Scheduler.process_pending_chunked_abort
                self.chunked_req = None
            reaped.append(self._finish(sreq, sreq.to_finish, checkpoint=False))
        if marked:
            self.running_batch.filter_batch()
            # Marked while running, then retracted before the step boundary.
            self.waiting_queue = [r for r in self.waiting_queue if not r.finished()]
        return reaped

    def abort_all(self) -> list[Request]:
        """End every active request now (close, pause in abort mode). Nothing is in
        flight at these points, so every deferred release happens too."""
        victims: list[Request] = []
        for sreq in list(self._sreq.values()):
            if sreq.finished():
                continue
            victims.append(self._finish(sreq, FINISH_ABORT("aborted"), checkpoint=False))
        self.waiting_queue = []
        self.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
        self.chunked_req = None
        self.last_batch = None
        self._flush_deferred(force=True)
        victims = self._aborted_now + victims
        self._aborted_now = []
        return victims

    def fail_requests(self, reqs: Sequence[Request]) -> list[Request]:
        """End the given requests now because their step failed."""
        failed = []
        for req in reqs:
            sreq = self._sreq.get(req.rid)
            if sreq is None or sreq.finished():
                continue
            self.waiting_queue = [r for r in self.waiting_queue if r is not sreq]
            if self.chunked_req is sreq:
                self.chunked_req = None
            self._finish(sreq, FINISH_ABORT("model step failed"), checkpoint=False)
            req.finish_reason = "error"
            failed.append(req)
        if failed:
            self.running_batch.filter_batch()
        return failed

    def retract_requests(self, reqs: Sequence[Request]) -> list[Request]:
        """A failed step's retry: these requests leave the running batch, the prefill
        batch not yet merged and the chunk slot, their KV is released through SGLang's
        ``retract_all`` (which takes the requests to retract), and they go back to the
        waiting queue in arrival order, to be prefilled again with the tokens they have.
        As with SGLang's decode retraction, a step still queued on the worker that reads
        them runs on stale rows, which processing skips (the epoch moved)."""
        victims = []
        for req in reqs:
            sreq = self._sreq.get(req.rid)
            if sreq is None or sreq.finished() or not sreq.kv.holds_kv:
                continue
            if any(w is sreq for w in self.waiting_queue):
                continue
            victims.append(sreq)
        if not victims:
            return []
        self.running_batch.filter_batch(reqs_to_exclude=victims)
        self.running_batch.batch_is_full = False
        last = self.last_batch
        if last is not None and last.forward_mode.is_extend() and last is not self.running_batch:
            last.filter_batch(reqs_to_exclude=victims)
        if self.chunked_req is not None and any(v is self.chunked_req for v in victims):
            self.chunked_req = None
        return self._requeue_retracted(victims)

    def _requeue_retracted(self, victims: list[Req]) -> list[Request]:
        """SGLang's ``retract_all`` on ``victims`` (KV released, request reset), then
        back to the waiting queue ahead of later arrivals, in arrival order."""
        for sreq in victims:
            self._last_step.pop(id(sreq), None)
        sglang_retract_all(
            reqs=victims,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            tree_cache=self.tree_cache,
            hisparse_coordinator=None,
            offload_kv=False,
        )
        ordered = sorted(victims, key=lambda s: self._omni_of(s).arrival)
        out = []
        for sreq in ordered:
            req = self._omni_of(sreq)
            req.epoch += 1
            req.num_retractions += 1
            req.num_inflight = 0
            self.num_retractions += 1
            out.append(req)
        merged = sorted(ordered + self.waiting_queue, key=lambda s: self._omni_of(s).arrival)
        self.waiting_queue = merged
        return out

    def retract_all(self) -> list[Request]:
        """Scheduler.pause_generation(mode="retract"): every running, just-prefilled and
        chunked request back to the waiting queue, its KV released."""
        self._flush_deferred(force=True)  # called after the loop drained its step
        victims = [r for r in self.running_batch.reqs if not r.finished()]
        last = self.last_batch
        if last is not None and last.forward_mode.is_extend() and last is not self.running_batch:
            victims += [r for r in last.reqs if not r.finished() and r not in victims]
        if self.chunked_req is not None and not self.chunked_req.finished() and self.chunked_req not in victims:
            victims.append(self.chunked_req)
        victims = [r for r in victims if r.kv.holds_kv]
        self.last_batch = None
        self.running_batch.reqs = []
        self.running_batch.batch_is_full = False
        self.chunked_req = None
        return self._requeue_retracted(victims) if victims else []

    # ------------------------------------------------------------------ pools

    def kv_is_fully_free(self) -> bool:
        """No request holds KV: everything is free or kept (unlocked) by the radix cache."""
        self._flush_deferred()
        allocator = self.token_to_kv_pool_allocator
        total = self.stack.kv_total_tokens if self.stack is not None else allocator.size
        slots = self.stack.req_slots_total if self.stack is not None else self.req_to_token_pool.size
        return (
            not self._deferred
            and self.tree_cache.protected_size() == 0
            and allocator.available_size() + self.tree_cache.evictable_size() == total
            and self.req_to_token_pool.available_size() == slots
        )

    def flush_cache(self) -> bool:
        """Drop the radix cache (e.g. after a weight update) when no request holds KV,
        as Scheduler.flush_cache does; the cached KV goes back to the allocator."""
        if self.active_requests() or self.waiting_queue or self.chunked_req is not None:
            return False
        self._flush_deferred()
        if self._deferred or self.tree_cache.protected_size() != 0:
            return False
        evictable = int(self.tree_cache.evictable_size())
        if evictable:
            self.tree_cache.evict(EvictParams(num_tokens=evictable))
        self.tree_cache.reset()
        self.last_batch = None
        self.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
        return True

    def stats(self) -> dict[str, int]:
        allocator = self.token_to_kv_pool_allocator
        return {
            "waiting_queue_size": len(self.waiting_queue),
            "running_batch_size": len([r for r in self.running_batch.reqs if not r.finished()]),
            "chunked_requests": int(self.chunked_req is not None),
            "kv_free_tokens": int(allocator.available_size()),
            "kv_cached_tokens": int(self.tree_cache.evictable_size()),
            "kv_locked_tokens": int(self.tree_cache.protected_size()),
            "kv_free_pages": int(allocator.available_size()) // max(1, self.page_size),
            "page_size": self.page_size,
            "req_slots_free": int(self.req_to_token_pool.available_size()),
            "num_retractions": self.num_retractions,
            "new_token_ratio_permille": int(math.floor(self.new_token_ratio_tracker.current * 1000)),
        }

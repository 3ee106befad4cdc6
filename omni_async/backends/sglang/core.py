"""The SGLang batch core: omni-async's BatchCore protocol over SGLang's scheduling state.

Planning is SGLang's own: ``get_next_batch`` runs ``Scheduler.get_next_batch_to_run``
(merging the last prefill batch, ``PrefillAdder`` admission with the new-token-ratio
reserve, chunked prefill, radix prefix matching, ``prepare_for_extend`` /
``prepare_for_decode``, ``check_decode_mem`` / ``retract_decode``) on an in-process
``Scheduler`` set up without its IPC and model loading (planner.py), which also holds
the waiting queue, running batch, last batch and chunked request. SGLang's ``Req``
carries the scheduling and KV state of each omni-async request; the omni request
carries what the stage reads (output ids, finish reason, epoch).

Hand-written here, and why:

- ``add_request``: builds the SGLang ``Req`` from an admitted omni request (omni-async's
  stop set; the context clamp). SGLang's ``handle_generate_request`` parses what its
  tokenizer process sends and runs its own validation, sessions and multimodal setup.
- ``process_result``: per row it is SGLang's result processing (``output_ids``,
  ``update_finish_state``, ``checkpoint_kv_cache`` / ``release_kv_cache``), but
  SGLang's ``SchedulerBatchResultProcessor`` releases a finished request's KV at once
  and streams through its output streamer to the detokenizer process. Here outputs go
  to omni-async's emission, and the release waits (``_release``) until no scheduled
  step that reads the request is still to run: on CPU the worker thread may be running
  step N+1 while the loop thread schedules step N+2 and rewrites ``req_to_token`` rows,
  which CUDA would order after N+1 on its stream.
- aborts (``abort``, ``reap_aborted``, ``abort_all``, ``fail_requests``): omni-async's
  protocol (a waiting request ends now, a running one is marked and ends at the step
  boundary). SGLang's ``abort_request`` answers through its tokenizer process.
- ``retract_requests`` (a failed step's retry) and ``retract_all`` (pause in retract
  mode): SGLang's ``retract_all`` on the chosen requests; SGLang has no per-request
  retry (a failed step stops its scheduler).
- ``flush_cache``, ``kv_is_fully_free``, ``stats``: pool accounting.

Lag. The overlap and async-decode loops schedule step N+1 before step N's result is
processed, as SGLang's overlap scheduler does: decode inputs come from SGLang's
FutureMap on the device, and a request that finishes in step N still rides step N+1
(its row is skipped when N+1 is processed).
"""

from __future__ import annotations

import copy
import math
from array import array
from typing import Any, Sequence

from ...config import SchedulerConfig
from ...core.batch import ForwardMode
from ...core.protocol import BatchCore, StepOutcome
from ...core.request import Request

from sglang.srt.managers.schedule_batch import (
    FINISH_ABORT,
    Req,
    ScheduleBatch,
    retract_all as sglang_retract_all,
)
from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome, EvictParams
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

from .batch import SGLangScheduledBatch, finish_reason_name
from .planner import SGLangPlanner


class SGLangBatchCore(BatchCore):
    """BatchCore over SGLang's scheduling machinery (see the module docstring)."""

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        server_args: Any,
        tp_worker: Any,
        future_map: Any,
        req_to_token_pool: Any,
        token_to_kv_pool_allocator: Any,
        tree_cache: Any,
        model_config: Any,
        page_size: int,
        max_running_requests: int,
        max_total_num_tokens: int,
        max_req_len: int,
        context_length: int,
    ) -> None:
        self.config = config
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.tree_cache = tree_cache
        self.page_size = page_size
        self.context_length = context_length
        self.vocab_size = int(model_config.vocab_size)
        self.planner = SGLangPlanner(
            server_args=server_args,
            tp_worker=tp_worker,
            model_config=model_config,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
            tree_cache=tree_cache,
            future_map=future_map,
            max_running_requests=max_running_requests,
            max_prefill_tokens=config.max_prefill_tokens,
            max_total_num_tokens=max_total_num_tokens,
            max_req_len=max_req_len,
            on_retracted=self._on_retracted,
            on_oom_abort=self._on_oom_abort,
        )
        self.num_retractions = 0
        self.stack: Any = None
        self._omni: dict[int, Request] = {}  # id(SGLang Req) -> omni request
        self._sreq: dict[str, Req] = {}  # rid -> SGLang Req, while the request is active
        self._last_step: dict[int, SGLangScheduledBatch] = {}  # id(Req) -> newest step it rides
        self._deferred: list[tuple[Req, bool]] = []  # finished, KV release waits for a step
        self._aborted_now: list[Request] = []  # finished by scheduling (OOM), reaped next
        self._step_id = 0
        self._arrivals = 0

    @property
    def waiting_queue(self) -> list[Req]:
        """SGLang's waiting queue, which lives on the planner (read-only, for callers
        inspecting the core; the core itself uses ``self.planner``'s state)."""
        return self.planner.waiting_queue

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
        self.planner.waiting_queue.append(sreq)

    def has_work(self) -> bool:
        return bool(self.planner.waiting_queue or self.planner.running_batch.reqs or self.planner.chunked_req is not None)

    def on_idle(self) -> None:
        """SGLang's idle self-check: the new-token ratio back to its initial value."""
        self.planner.new_token_ratio_tracker = NewTokenRatioTracker.from_config()

    def num_waiting(self) -> int:
        return len(self.planner.waiting_queue)

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
        self._deferred = keep

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
        req.finish_reason = finish_reason_name(sreq.finished_reason)
        req.num_inflight = 0
        if isinstance(sreq.finished_reason, FINISH_ABORT):
            self.tree_cache.finish(sreq.cache_request_handle, CacheRequestOutcome.ABORT)
        self._release(sreq, checkpoint=checkpoint)
        return req

    # ------------------------------------------------------------------ scheduling

    def get_next_batch(self) -> SGLangScheduledBatch | None:
        """SGLang's ``Scheduler.get_next_batch_to_run`` (the planner), after the KV
        releases that waited for an executed step."""
        self._flush_deferred()
        batch = self.planner.plan()
        return None if batch is None else self._wrap(batch)

    def _on_retracted(self, sreq: Req) -> None:
        """``retract_decode`` released this request's KV under memory pressure: back to
        the waiting queue (``Scheduler._add_request_to_queue``), a new epoch."""
        req = self._omni_of(sreq)
        req.epoch += 1
        req.num_retractions += 1
        req.num_inflight = 0
        self.num_retractions += 1
        self.planner.waiting_queue.append(sreq)

    def _on_oom_abort(self, sreq: Req) -> None:
        """``retract_decode`` aborted this request (alone it no longer fits; its KV is
        already released): it ends at the next ``reap_aborted``."""
        self._last_step.pop(id(sreq), None)
        sreq.update_finish_state(0)
        req = self._omni_of(sreq)
        self._sreq.pop(sreq.rid, None)
        self._omni.pop(id(sreq), None)
        req.finish_reason = "abort"
        req.epoch += 1
        self._aborted_now.append(req)

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
            keep = not (is_extend and sreq is self.planner.chunked_req)
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
                    req.finish_reason = finish_reason_name(sreq.finished_reason)
                    req.num_inflight = 0
                    self._release(sreq, checkpoint=True)
                elif is_extend:
                    checkpoint_kv_cache(sreq, self.tree_cache)
                outcomes.append(StepOutcome(req, token, logprob, finished=finished))
        finally:
            self.token_to_kv_pool_allocator.free_group_end()
        self._flush_deferred()
        return outcomes

    # ------------------------------------------------------------------ aborts

    def abort(self, rid: str) -> Request | None:
        """Scheduler.abort_request: a waiting request ends now (returned); a running or
        chunked one is marked (``to_finish``) and ends at the next step boundary."""
        sreq = self._sreq.get(rid)
        if sreq is None or sreq.finished():
            return None
        for i, waiting in enumerate(self.planner.waiting_queue):
            if waiting is sreq:
                self.planner.waiting_queue.pop(i)
                return self._finish(sreq, FINISH_ABORT("aborted"), checkpoint=False)
        sreq.to_finish = FINISH_ABORT("aborted")
        self._omni_of(sreq).to_finish = "abort"
        return None

    def reap_aborted(self) -> list[Request]:
        """End every marked request now; called between steps."""
        reaped, self._aborted_now = self._aborted_now, []
        marked = [s for s in self._sreq.values() if s.to_finish is not None and not s.finished()]
        for sreq in marked:
            if sreq is self.planner.chunked_req:  # Scheduler.process_pending_chunked_abort
                self.planner.chunked_req = None
            reaped.append(self._finish(sreq, sreq.to_finish, checkpoint=False))
        if marked:
            self.planner.running_batch.filter_batch()
            # Marked while running, then retracted before the step boundary.
            self.planner.waiting_queue = [r for r in self.planner.waiting_queue if not r.finished()]
        return reaped

    def abort_all(self) -> list[Request]:
        """End every active request now (close, pause in abort mode). Nothing is in
        flight at these points, so every deferred release happens too."""
        victims: list[Request] = []
        for sreq in list(self._sreq.values()):
            if sreq.finished():
                continue
            victims.append(self._finish(sreq, FINISH_ABORT("aborted"), checkpoint=False))
        self.planner.waiting_queue = []
        self.planner.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
        self.planner.chunked_req = None
        self.planner.last_batch = None
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
            self.planner.waiting_queue = [r for r in self.planner.waiting_queue if r is not sreq]
            if self.planner.chunked_req is sreq:
                self.planner.chunked_req = None
            self._finish(sreq, FINISH_ABORT("model step failed"), checkpoint=False)
            req.finish_reason = "error"
            failed.append(req)
        if failed:
            self.planner.running_batch.filter_batch()
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
            if any(w is sreq for w in self.planner.waiting_queue):
                continue
            victims.append(sreq)
        if not victims:
            return []
        self.planner.running_batch.filter_batch(reqs_to_exclude=victims)
        self.planner.running_batch.batch_is_full = False
        last = self.planner.last_batch
        if last is not None and last.forward_mode.is_extend() and last is not self.planner.running_batch:
            last.filter_batch(reqs_to_exclude=victims)
        if self.planner.chunked_req is not None and any(v is self.planner.chunked_req for v in victims):
            self.planner.chunked_req = None
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
        merged = sorted(ordered + self.planner.waiting_queue, key=lambda s: self._omni_of(s).arrival)
        self.planner.waiting_queue = merged
        return out

    def retract_all(self) -> list[Request]:
        """Scheduler.pause_generation(mode="retract"): every running, just-prefilled and
        chunked request back to the waiting queue, its KV released."""
        self._flush_deferred(force=True)  # called after the loop drained its step
        victims = [r for r in self.planner.running_batch.reqs if not r.finished()]
        last = self.planner.last_batch
        if last is not None and last.forward_mode.is_extend() and last is not self.planner.running_batch:
            victims += [r for r in last.reqs if not r.finished() and r not in victims]
        if self.planner.chunked_req is not None and not self.planner.chunked_req.finished() and self.planner.chunked_req not in victims:
            victims.append(self.planner.chunked_req)
        victims = [r for r in victims if r.kv.holds_kv]
        self.planner.last_batch = None
        self.planner.running_batch.reqs = []
        self.planner.running_batch.batch_is_full = False
        self.planner.chunked_req = None
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
        if self.active_requests() or self.planner.waiting_queue or self.planner.chunked_req is not None:
            return False
        self._flush_deferred()
        if self._deferred or self.tree_cache.protected_size() != 0:
            return False
        evictable = int(self.tree_cache.evictable_size())
        if evictable:
            self.tree_cache.evict(EvictParams(num_tokens=evictable))
        self.tree_cache.reset()
        self.planner.last_batch = None
        self.planner.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
        return True

    def stats(self) -> dict[str, int]:
        allocator = self.token_to_kv_pool_allocator
        return {
            "waiting_queue_size": len(self.planner.waiting_queue),
            "running_batch_size": len([r for r in self.planner.running_batch.reqs if not r.finished()]),
            "chunked_requests": int(self.planner.chunked_req is not None),
            "kv_free_tokens": int(allocator.available_size()),
            "kv_cached_tokens": int(self.tree_cache.evictable_size()),
            "kv_locked_tokens": int(self.tree_cache.protected_size()),
            "kv_free_pages": int(allocator.available_size()) // max(1, self.page_size),
            "page_size": self.page_size,
            "req_slots_free": int(self.req_to_token_pool.available_size()),
            "num_retractions": self.num_retractions,
            "new_token_ratio_permille": int(math.floor(self.planner.new_token_ratio_tracker.current * 1000)),
        }

"""The native batch core: FCFS waiting queue, token-budgeted and chunked prefill,
continuous batching, retraction under KV pressure, finish checks, KV release.

State is advanced when a step is *scheduled* (KV pages, cached-token counts, in-flight
token counts), and completed when its result is *processed* (tokens appended, finish
checks). Between the two the step may execute elsewhere; rows whose request finished
or was retracted meanwhile are skipped at processing (see ``ScheduledBatch.row_is_live``),
which is what lets the overlap and async-decode loops run a step ahead safely.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from ..config import SchedulerConfig
from ..kv.allocator import PageAllocator
from .batch import ForwardMode, ScheduledBatch
from .core_state import CoreState, DecodeSteps
from .jump_steps import feed_rows, jump_most, jump_rows, take_due
from .multi_step import count_ahead, decoding_rows, late_mask_rows, masks_between, most_forwards, process_multi_step
from .mixed_prefill import add_decode_rows, jump_step, mixed_decodes, prefill_turn
from .step_results import end_unsampled, process_one_forward, rewind
from .conditioning import ready_positions
from .decode_slots import DecodeSlots
from .early_launch import schedule_early
from .policy import FCFSPolicy, SchedulingPolicy
from .prefix_reuse import computing_key, drop_prefix, index_pages, reuse_prefix
from .protocol import BatchCore, StepOutcome
from .request import INIT_NEW_TOKEN_RATIO, Request, all_free, decayed_ratio, reserved_tokens

__all__ = ["BatchCore", "NativeBatchCore", "StepOutcome"]


class NativeBatchCore(CoreState, BatchCore):
    """The scheduling state (:class:`.core_state.CoreState`, which its steps read) and the
    policy over it: admission, retraction, processing, aborts."""

    def __init__(
        self,
        config: SchedulerConfig,
        allocator: PageAllocator,
        context_length: int,
        decode_steps: DecodeSteps = DecodeSteps(),
        multi_step_allowed: Callable[[], bool] = lambda: True,
        mixed_allowed: Callable[[], bool] = lambda: True, hidden_for_all: bool = False,
    ) -> None:
        super().__init__(config, allocator, context_length, decode_steps, multi_step_allowed, mixed_allowed, hidden_for_all)
        self._arrivals = 0
        self.slots = DecodeSlots()  # the running rows' columns while they stay free (.decode_slots)
        self.policy: SchedulingPolicy = FCFSPolicy()  # who goes first when a step cannot take everyone (.policy)
        self.rows_left_out = 0  # running rows a capped decode step left out (stats)

    def set_policy(self, policy: SchedulingPolicy) -> None:
        """Order admission, retraction and capped decode steps by ``policy`` from the next step on."""
        self.policy = policy
        self.express_tokens = policy.express_tokens
        self.slots.drop()

    # ------------------------------------------------------------------ queues

    def add_request(self, req: Request) -> None:
        self._arrivals += 1
        req.arrival = self._arrivals
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def on_idle(self) -> None:  # nothing runs: admission may be optimistic again
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO

    def num_waiting(self) -> int:
        return len(self.waiting)

    def active_requests(self) -> list[Request]:
        reqs = list(self.waiting) + self.running + ([self.chunked] if self.chunked is not None else [])
        return [r for r in reqs if not r.finished()]

    def find(self, rid: str) -> Request | None:
        return next((req for req in self.active_requests() if req.rid == rid), None)

    def kv_is_fully_free(self) -> bool:  # no request holds KV (cached prefixes nobody holds do not count)
        return self.kv.held_pages == 0

    def flush_cache(self) -> bool:  # drop the cached prefixes; refused (False) while any request holds KV
        return self.kv.flush()

    def invalidate_cache(self) -> None:  # (new weights: no old prefix is shared again)
        self.kv.invalidate()

    def stats(self) -> dict[str, int]:
        return {
            "waiting_queue_size": len(self.waiting),
            "running_batch_size": len([r for r in self.running if not r.finished()]),
            "chunked_requests": int(self.chunked is not None),
            "kv_free_pages": self.kv.available_pages,
            "kv_total_pages": self.allocator.num_pages,
            "page_size": self.allocator.page_size,
            "num_retractions": self.num_retractions,
            "mixed_decode_rows": self.mixed_decode_rows,
            "grammar_jump_steps": self.jump_steps,
            "prefill_tokens": self.prefill_tokens,
            "scheduling_policy": self.policy.name,
            "decode_rows_left_out": self.rows_left_out,
            **self.kv.stats(),
        }

    # ------------------------------------------------------------------ scheduling

    def get_next_batch(self) -> ScheduledBatch | None:
        """A prefill batch when requests wait and fit, else a decode step of the running set;
        running requests wait for at most one prefill step (:func:`.mixed_prefill.prefill_turn`)."""
        mixed, batch = self.mixed_decode_rows, (self._schedule_prefill() if prefill_turn(self) else None)
        if batch is not None:
            self.decodes_waited = self.mixed_decode_rows == mixed and bool(self.running)
            return batch
        self.decodes_waited = False
        return self._schedule_decode() or (self._schedule_prefill() if self.waiting or self.chunked else None)

    def _schedule_prefill(self) -> ScheduledBatch | None:
        cfg = self.config
        budget = cfg.max_prefill_tokens
        if cfg.chunk_size is not None:
            budget = min(budget, cfg.chunk_size)
        rows: list[tuple[Request, int]] = []
        reserved = reserved_tokens(self.running, self.new_token_ratio)
        kv = self.kv
        candidates: list[Request] = ([self.chunked] if self.chunked is not None else []) + self.policy.admission_order(self.waiting)
        slots = cfg.max_running_requests - len(self.running)
        computing: set = set()  # index keys of the first page each row computes
        waiting_chunked = False  # the chunked request waits for conditioning rows
        for req in candidates:
            if budget <= 0 or slots <= 0:
                break
            if req.step_failures and rows:
                break  # a request retried after a failed step runs in a prefill of its own
            fresh = not req.pages
            if fresh and not reuse_prefix(kv, req, computing):
                break  # its prefix is being computed by this step: it reuses it next step
            remaining = req.seq_len - req.num_cached
            n = ready_positions(req, min(remaining, budget))
            if n == 0:  # a conditioned request whose next rows have not arrived
                waiting_chunked = waiting_chunked or req is self.chunked
                continue
            if n < remaining and waiting_chunked:
                if fresh:
                    drop_prefix(kv, req)
                break  # one request at a time may be partway through its prefill
            pages_needed = self.allocator.pages_for(req.num_cached + n) - len(req.pages)
            future = 0.0
            if n == remaining:
                future = (req.sampling.max_new_tokens - req.num_generated) * self.new_token_ratio
            available = kv.available_pages
            fits_now = pages_needed <= available
            lonely = not self.running and not rows
            if not fits_now or (not lonely and pages_needed * self.page_size + future > available * self.page_size - reserved):
                if fresh:
                    drop_prefix(kv, req)
                break
            req.pages.extend(kv.allocate(pages_needed))
            reserved += int(math.ceil(future))
            if (key := computing_key(kv, req)) is not None:
                computing.add(key)
            rows.append((req, n))
            budget -= n
            if req.step_failures:
                break
            if n < remaining:
                break  # this request continues as the chunked one
            slots -= 1
        if not rows:
            return None
        return self._build_extend(rows, mixed_decodes(self, rows))

    def _build_extend(self, rows: list[tuple[Request, int]], decoding: Sequence[Request] = ()) -> ScheduledBatch:
        batch = self.new_batch(ForwardMode.EXTEND)
        if decoding:
            add_decode_rows(self, batch, list(decoding))
            self.new_token_ratio = decayed_ratio(self.new_token_ratio)
        for req, n in rows:
            if req is self.chunked:
                self.chunked = None
            else:
                self.waiting.remove(req)
            fill = req.fill_ids()
            start = req.num_cached
            batch.input_ids.extend(fill[start : start + n])
            kept = start + n == req.seq_len
            unsampled = kept and req.sampling.max_new_tokens == 0  # scores its prompt only
            if kept and req.matcher is not None:  # a prefill's token samples under the mask (structured.optimistic)
                req.matcher.mask_first(req.num_generated)
            self.add_row(batch, req, n, kept and not unsampled)
            self.prefill_tokens += n
            req.num_cached += n
            index_pages(self.kv, req)
            if kept:
                if unsampled:
                    batch.ends_unsampled.append((req, req.epoch))
                else:
                    req.num_inflight += 1
                self.running.append(req)
            else:
                self.chunked = req
        return batch

    def _schedule_decode(self) -> ScheduledBatch | None:
        """A decode step of every running request that still needs one: from the running
        rows' columns when they can follow it (.decode_slots), else from the requests."""
        self.running = [r for r in self.running if r.finish_reason is None]
        capped = self.policy.caps(len(self.running))
        batch = (None if capped else self.slots.schedule(self)) or self._schedule_decode_rows()
        if batch is not None and batch.mode is ForwardMode.DECODE:
            self.new_token_ratio = decayed_ratio(self.new_token_ratio)
        return batch

    def schedule_early(self, batch: ScheduledBatch, tokens: Sequence[int]) -> ScheduledBatch | None:
        if self.policy.caps(len(self.running)):
            return None  # the next step's rows are the policy's choice, made after processing
        return schedule_early(self, self.slots, batch, tokens)  # (BatchCore.schedule_early; the rules: .early_launch)

    def _schedule_decode_rows(self) -> ScheduledBatch | None:  # (any running set; it seeds the columns)
        free = all_free(self.running)  # (then no per-row check beyond the length limit, request.all_free)
        decoding, limits = self._retract_until_decode_fits(*decoding_rows(self.running, self.context_length, True, free), late=True, free=free)
        if self.policy.caps(len(decoding)):
            before = len(decoding)
            decoding, limits = self.policy.decode_rows(decoding, limits)
            self.rows_left_out += before - len(decoding)
        decoding, limits, steps, grammar_rows, late = late_mask_rows(self, decoding, limits, free)
        if not decoding:
            return None
        due = take_due(self, decoding)
        if due and steps is None:  # forced tokens to compute in a step of one forward per row
            return jump_step(self, decoding, due)
        batch = self.new_batch(ForwardMode.DECODE)
        batch.grammar_rows, batch.late_masks = grammar_rows, late
        batch.masks_between = masks_between(self, steps, grammar_rows)
        batch.fill_decode(decoding, steps, self.page_size, self.kv.allocate)
        count_ahead(batch)
        if steps is not None and grammar_rows and not batch.masks_between:
            feed_rows(batch)
        self.slots.remember(self, batch, limits, free)
        return batch

    def _decode_fits(self, decoding: list[Request]) -> bool:
        """A request holds the pages of its cached tokens, so one more token needs at most
        one more page: the per-request count runs only when that bound does not fit."""
        free, ps = self.kv.available_pages, self.page_size
        k = most_forwards(self)  # <= page_size: still at most one more page per row
        return len(decoding) <= free or sum(max(0, -(-(r.num_cached + k) // ps) - len(r.pages)) for r in decoding) <= free

    def _retract_until_decode_fits(self, decoding: list[Request], limits: list[int], late: bool = False,
                                   free: bool = False) -> tuple[list[Request], list[int]]:
        """Retract the newest requests until the next decode step of ``decoding`` fits in
        KV; the requests that still decode, with their ``limits``. Empty when nothing
        decodes, or when only requests about to finish hold the KV it needs, or when a row's
        matcher took tokens of a step in flight (``num_ahead``, ``multi_step.count_ahead``):
        retracted now, it would resume with them taken; the loop drains that step first."""
        while decoding and not self._decode_fits(decoding):
            if self.chunked is not None:
                victim = self.chunked
                self.chunked = None
            elif any(r.num_ahead for r in decoding):
                return [], []
            elif len(decoding) > 1:
                victim = self.policy.retract_victim(decoding)
                self.running.remove(victim)
            elif len(decoding) < len(self.running):
                return [], []
            else:
                raise RuntimeError(
                    "KV cache cannot hold the single running request; admission should have refused it"
                )
            self._retract(victim)
            self.new_token_ratio = 1.0
            decoding, limits = decoding_rows(self.running, self.context_length, late, free)
        return decoding, limits

    def _retract(self, req: Request) -> None:
        self._release(req)
        req.num_cached = 0
        req.num_inflight = req.num_ahead = 0
        req.epoch += 1
        req.num_retractions += 1
        self.num_retractions += 1
        # Back to the waiting queue in arrival order, so FCFS holds on resume.
        later = (i for i, r in enumerate(self.waiting) if r.arrival >= req.arrival)
        self.waiting.insert(next(later, len(self.waiting)), req)

    def retract_requests(self, reqs: Sequence[Request]) -> list[Request]:
        """Back to waiting with their KV freed (a failed step's retry)."""
        out = []
        for req in reqs:
            if req.finished():
                continue
            if req in self.running:
                self.running.remove(req)
            elif self.chunked is req:
                self.chunked = None
            else:
                continue
            self._retract(req)
            out.append(req)
        return out

    def retract_all(self) -> list[Request]:
        """Send every running and chunked request back to waiting, freeing its KV."""
        victims = [r for r in self.running if not r.finished()] + ([self.chunked] if self.chunked else [])
        self.running, self.chunked = [], None
        for req in sorted(victims, key=lambda r: r.arrival):
            self._retract(req)
        return victims

    # ------------------------------------------------------------------ results

    def process_result(
        self, batch: ScheduledBatch, tokens: Sequence[int], logprobs: Sequence[float] | None = None
    ) -> Sequence[StepOutcome]:
        """Complete a step: each live row's tokens appended and its finish checked (one
        flat pass, :mod:`.step_results`), then the rows that ended are finished here,
        where their KV is freed. A multi-step decode's plain rows come as columns."""
        process = process_one_forward if batch.row_steps is None else process_multi_step
        accepted: list[Any] = []  # constrained rows that run on: their next masks, queued as one
        rewound: list[Request] = []  # rows whose grammar refused a token sampled before its mask
        outcomes, finishes = process(batch, tokens, logprobs, self.context_length, accepted, rewound)
        self.slots.landed(batch, tokens)
        for req in rewound:  # (structured.optimistic)
            rewind(req)
        if self.config.jump_forward and (batch.grammar_rows or batch.row_steps is None):  # before the masks are queued:
            jump_rows(outcomes, finishes, self.context_length, jump_most(self.decode_plan, self.page_size), self.jump_due, self.hidden_for_all)
        if accepted:  # (a row that jumped is queued at the end of its run; a finished one is not queued)
            from ..structured.grammar import prefetch_all  # here: a core without grammars imports no tokenizer
            prefetch_all([m for m in accepted if not m.complete] if self.config.jump_forward else accepted)
        if batch.ends_unsampled:
            end_unsampled(batch, outcomes, finishes)
        for req, reason in finishes:
            self.finish_request(req, reason)
        if finishes:
            self.running = [r for r in self.running if r.finish_reason is None]
        return outcomes

    def finish_request(self, req: Request, reason: str) -> None:
        req.finish_reason, req.num_inflight, req.num_ahead = reason, 0, 0
        self._release(req)

    def _release(self, req: Request) -> None:
        """Free the request's KV once; its computed full pages stay cached for reuse."""
        if req.pages:
            if req.finish_reason != "error":
                index_pages(self.kv, req)
            pages, req.pages = req.pages, []
            req.prefix_pages = 0
            self.kv.release(pages)

    # ------------------------------------------------------------------ aborts

    def abort(self, rid: str) -> Request | None:
        """Abort a request. A waiting one is removed and finished now (returned); a
        running or chunked one is marked and finished at the next step boundary."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self.finish_request(req, "abort")
                return req
        for req in self.running + ([self.chunked] if self.chunked else []):
            if req.rid == rid and not req.finished():
                req.to_finish = "abort"
        return None

    def reap_aborted(self) -> list[Request]:
        """Finish every marked request now; called between steps. Rows of these requests
        in a step still in flight are skipped when that step is processed."""
        reaped = [r for r in self.running if r.to_finish is not None and not r.finished()]
        if self.chunked is not None and self.chunked.to_finish is not None:
            reaped.append(self.chunked)
            self.chunked = None
        for req in reaped:
            self.finish_request(req, req.to_finish or "abort")
        self.running = [r for r in self.running if r.finish_reason is None]  # runs every step: no call per row
        return reaped

    def abort_all(self) -> list[Request]:
        """Finish every active request now (close, pause in abort mode, failures)."""
        victims = self.active_requests()
        self.waiting.clear()
        self.running, self.chunked = [], None
        for req in victims:
            self.finish_request(req, "abort")
        return victims

    def fail_requests(self, reqs: Sequence[Request]) -> list[Request]:
        """Finish the given requests now because their step failed."""
        failed = []
        for req in reqs:
            if req.finished():
                continue
            if req in self.waiting:
                self.waiting.remove(req)
            if self.chunked is req:
                self.chunked = None
            self.finish_request(req, "error")
            failed.append(req)
        self.running = [r for r in self.running if not r.finished()]
        return failed


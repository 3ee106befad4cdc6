"""The native batch core's scheduling state, and the two ways a step's batch is built.

The core's scheduling steps live in modules of their own (:mod:`.decode_slots`,
:mod:`.early_launch`, :mod:`.mixed_prefill`, :mod:`.multi_step`); each takes a
:class:`CoreState`, reads and advances the state named here, and builds batches through
:meth:`CoreState.new_batch` and :meth:`CoreState.add_row`. ``NativeBatchCore`` is a
``CoreState`` with the queues' policy on top (admission, retraction, processing, aborts),
so the step modules never import the core, and the core imports them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from ..config import SchedulerConfig
from ..kv.allocator import PageAllocator
from ..kv.prefix_cache import PrefixCache
from .batch import ForwardMode, ScheduledBatch
from .request import INIT_NEW_TOKEN_RATIO, Request


@dataclass(frozen=True)
class DecodeSteps:
    """Forwards per decode step by the number of decoding requests: ``tiers`` are
    ``(fewest requests, forwards)`` pairs in ascending order; below the first, one."""

    tiers: tuple[tuple[int, int], ...] = ()

    def for_batch(self, decoding: int) -> int:
        k = 1
        for least, steps in self.tiers:
            if decoding >= least:
                k = steps
        return k

    @property
    def most(self) -> int:
        return max((k for _, k in self.tiers), default=1)


class CoreState:
    """What the batch core's scheduling steps share: the queues, the KV, the plan's
    limits and the counters the steps advance."""

    def __init__(
        self,
        config: SchedulerConfig,
        allocator: PageAllocator,
        context_length: int,
        decode_steps: DecodeSteps = DecodeSteps(),
        multi_step_allowed: Callable[[], bool] = lambda: True,
        mixed_allowed: Callable[[], bool] = lambda: True,
        hidden_for_all: bool = False,
    ) -> None:
        """``decode_steps``: forwards per decode step by batch size (the stage's plan);
        ``multi_step_allowed`` / ``mixed_allowed``: the runner's say, asked before each
        multi-step decode / each prefill step that would carry the running decodes;
        ``hidden_for_all``: every row's hidden states go out (``capture_hidden``): no jump-forward."""
        self.config, self.hidden_for_all = config, hidden_for_all
        self.allocator = allocator
        self.kv = PrefixCache(allocator, enabled=config.enable_prefix_cache)
        self.page_size = allocator.page_size
        self.context_length = context_length
        self.decode_plan = decode_steps
        self.multi_step_allowed = multi_step_allowed
        self.express_tokens: int | None = None  # (the policy's: see forwards_for)
        self.mixed_allowed = mixed_allowed
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.chunked: Request | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_retractions = 0
        self.prefill_tokens = 0  # positions prefill steps computed (not those from the prefix cache)
        self.mixed_decode_rows = 0  # decode rows carried by prefill steps (mixed_prefill)
        self.decodes_waited = False  # the last step was a prefill step without the running decodes
        self.prefill_deferrals = 0  # decode steps run since a prefill turn was deferred (.mixed_prefill.prefill_turn)
        # Requests whose grammar's forced tokens wait for their KV (structured.jump), with
        # their epochs; the next decode step computes them. And the one-forward steps that did.
        self.jump_due: list[tuple[Request, int]] = []
        self.jump_steps = 0
        self._step_id = 0

    @property
    def step_id(self) -> int:
        """The id of the last batch built (each :meth:`new_batch` takes the next)."""
        return self._step_id

    def forwards_for(self, rows: int, generated: Iterable[int]) -> int:
        """Forwards of the next decode step of ``rows`` rows: the plan's for the batch,
        cut short while a row is new when the policy asks for the first chunk's express
        (``express_tokens``, set with the policy; ``generated``: the rows' sampled tokens,
        in flight included, read only then). A row short of ``express_tokens`` gets only
        the forwards it needs (a talker row's first chunk needs its first frames, and a
        step of k forwards delivers them only at its end); after that the step runs at
        most as many forwards as that row has tokens (a talker row's frames and one), so
        its steps grow 2, 3, 6, ... up to the plan's while the audio it was sent covers
        them (a step of g frames takes less than their playing time at any real-time
        factor below 1): a new stream's second chunk does not wait for a whole k-forward
        launch after a short first one."""
        k = self.decode_plan.for_batch(rows)
        first = self.express_tokens
        if first is None:
            return k
        fewest = int(min(generated, default=first))
        if fewest < first:
            return max(1, min(k, first - fewest))
        return min(k, fewest)

    def new_batch(self, mode: ForwardMode) -> ScheduledBatch:
        """An empty batch with the next step id."""
        self._step_id += 1
        return ScheduledBatch(
            mode=mode, reqs=[], epochs=[], prefix_lens=[], extend_lens=[], samples_kept=[],
            input_ids=[], step_id=self._step_id,
        )

    @staticmethod
    def add_row(batch: ScheduledBatch, req: Request, n: int, kept: bool) -> None:
        """``req`` as a row of ``batch`` computing ``n`` positions from its cached ones;
        ``kept``: the row's sample is a token of the request."""
        batch.reqs.append(req)
        batch.epochs.append(req.epoch)
        batch.prefix_lens.append(req.num_cached)
        batch.extend_lens.append(n)
        batch.samples_kept.append(kept)
        batch.sample_indices.append(req.num_generated)
        batch.page_tables.append(req.pages)  # shared: see ScheduledBatch.page_tables
        batch.page_counts.append(len(req.pages))

"""One scheduled step: which requests, which new tokens, where their KV goes.

Everything the runner needs is fixed here on the loop thread when the step is
scheduled, so that the step can execute on another thread (or later, under the
lookahead loops) while the loop keeps mutating request state. Per-row work stays O(1):
page lists are shared (append-only) with a count, not copied.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable

from .request import Request


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill, chunked prefill, or re-prefill after retraction
    DECODE = "decode"

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


class StepShape:
    """What every backend's scheduled step says about itself, derived from its ``mode``
    and ``reqs`` (the native batch below and the SGLang backend's snapshot share it)."""

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE  # type: ignore[attr-defined]

    @property
    def forward_mode(self) -> ForwardMode:
        return self.mode  # type: ignore[attr-defined]

    @property
    def size(self) -> int:
        return len(self.reqs)  # type: ignore[attr-defined]


@dataclass(eq=False)
class ScheduledBatch(StepShape):
    mode: ForwardMode
    reqs: list[Request]
    epochs: list[int]
    prefix_lens: list[int]  # tokens already in KV before this step, per row
    extend_lens: list[int]  # new tokens this step, per row
    # True when this step completes the row's fill, so its sampled token is kept.
    samples_kept: list[bool]
    input_ids: list[int]  # flat new tokens; -1 where the token is still in flight
    # Rows whose decode input is the last token of a step not yet processed on the
    # host: (position in input_ids, request). The runner fills them from the device.
    inflight_inputs: list[tuple[int, Request]] = field(default_factory=list)
    # Generation index of the token each row samples (seeds are keyed by it).
    sample_indices: list[int] = field(default_factory=list)
    # Each row's page list, shared with its request rather than copied: pages are only
    # appended within an epoch (a release swaps in a new list), so the first
    # ``page_counts[i]`` entries are the row's pages as scheduled, whatever happens
    # later. The runner keeps its own page tables and reads only the new entries.
    page_tables: list[list[int]] = field(default_factory=list)
    page_counts: list[int] = field(default_factory=list)
    # Decode only, with decode_steps > 1: the forwards each row runs in this launch
    # (fewer than decode_steps where its length limit comes first). None: one.
    row_steps: list[int] | None = None
    # With row_steps: the rows under a grammar (they run one forward, apart from the
    # fused launch of the others, and sample under their masks).
    grammar_rows: list[int] = field(default_factory=list)
    # Its constrained rows' masks wait for the step before it to be processed: the runner
    # launches the forward, the stepper has it sample later (core.multi_step.late_mask_rows).
    late_masks: bool = False
    # With row_steps: its grammar rows run several forwards, each sampled under a mask the
    # runner computes between the forwards (core.multi_step.between_steps); the runner
    # records how many of each row's tokens its matcher took during the step
    # (``taken_ahead``) and the rows whose grammar ended at the last of them.
    masks_between: bool = False
    taken_ahead: list[int] | None = None
    ended_ahead: set[int] = field(default_factory=set)
    step_id: int = 0
    # A decode step whose rows are those of step ``carried[0]`` at ``carried[1]`` (an
    # index array, in order), in the same epochs: the running set's columns say so
    # (.decode_slots), so the runner takes their slots from that step's by one mask.
    carried: tuple[int, Any] | None = None
    # Rows that complete the prefill of a request scoring its prompt with
    # max_new_tokens=0 (their ``samples_kept`` is False): (request, epoch). They end
    # when this step is processed, with no token.
    ends_unsampled: list[tuple[Request, int]] = field(default_factory=list)

    def fill_decode(self, decoding: list[Request], steps: list[int] | None, page_size: int,
                    allocate: Callable[[int], list[int]]) -> None:
        """The columns of a decode step over ``decoding`` (``steps``: each row's forwards,
        None for one), each built by one comprehension; each row's KV grown for its
        tokens (the rows that cross a page boundary, about one in ``page_size / k`` and
        every row at ``k = page_size``, take their pages from one allocation) and the
        tokens counted in flight, since the core's state advances when
        a step is scheduled. A decode input still in flight (-1) is read on the device
        from the step before."""
        n = len(decoding)
        ks = steps or [1] * n
        self.reqs, self.extend_lens, self.samples_kept = decoding, [1] * n, [True] * n
        self.epochs = [r.epoch for r in decoding]
        cached = self.prefix_lens = [r.num_cached for r in decoding]
        pending = [r.num_inflight for r in decoding]
        self.sample_indices = [len(r.output_ids) + p for r, p in zip(decoding, pending)]
        decode_inputs(self, decoding, pending)
        tables = self.page_tables = [r.pages for r in decoding]  # shared: see page_tables
        counts = self.page_counts = list(map(len, tables))
        grow = [i for i, (c, k, m) in enumerate(zip(cached, ks, counts)) if c + k > m * page_size]  # crossing a page
        if grow:  # one allocation for the step, handed out in row order (the same pages as one per row)
            needs = [-(-(cached[i] + ks[i]) // page_size) - counts[i] for i in grow]
            fresh, at = allocate(sum(needs)), 0
            for i, need in zip(grow, needs):
                tables[i].extend(fresh[at : at + need])
                counts[i] += need
                at += need
        for r, c, p, k in zip(decoding, cached, pending, ks):
            r.num_cached = c + k
            r.num_inflight = p + k
        self.row_steps = steps

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def row_page_count(self, i: int) -> int:
        """Pages row ``i``'s request held when the step was scheduled."""
        return self.page_counts[i] if self.page_counts else len(self.page_tables[i])

    def row_is_live(self, i: int) -> bool:
        """False when the row's request finished or was retracted after scheduling."""
        req = self.reqs[i]
        return not req.finished() and req.epoch == self.epochs[i]

    def runnable_after_drain(self) -> "ScheduledBatch | None":
        """This batch less the rows whose request finished or was retracted since it was
        scheduled: their KV was released, so they must not be forwarded again; None
        when no row is left."""
        keep = [i for i in range(self.size) if self.row_is_live(i)]
        if len(keep) == self.size:
            return self
        if not keep:
            return None
        starts = [0]
        for n in self.extend_lens:
            starts.append(starts[-1] + n)
        inflight_at = {pos: req for pos, req in self.inflight_inputs}
        out = ScheduledBatch(
            mode=self.mode, reqs=[], epochs=[], prefix_lens=[], extend_lens=[], samples_kept=[],
            input_ids=[], step_id=self.step_id, late_masks=self.late_masks, masks_between=self.masks_between,
        )
        for i in keep:
            for pos in range(starts[i], starts[i + 1]):
                if pos in inflight_at:
                    out.inflight_inputs.append((len(out.input_ids), inflight_at[pos]))
                out.input_ids.append(self.input_ids[pos])
            out.reqs.append(self.reqs[i])
            out.epochs.append(self.epochs[i])
            out.prefix_lens.append(self.prefix_lens[i])
            out.extend_lens.append(self.extend_lens[i])
            out.samples_kept.append(self.samples_kept[i])
            out.sample_indices.append(self.sample_indices[i])
            out.page_tables.append(self.page_tables[i])
            out.page_counts.append(self.row_page_count(i))
        if self.row_steps is not None:  # a multi-step decode stays one: its rows' in-flight counts hold k
            out.row_steps = [self.row_steps[i] for i in keep]
            grammar = set(self.grammar_rows)
            out.grammar_rows = [j for j, i in enumerate(keep) if i in grammar]
        out.ends_unsampled = [(r, e) for r, e in self.ends_unsampled if not r.finished() and r.epoch == e]
        return out


def decode_inputs(batch: ScheduledBatch, decoding: list[Request], pending: list[int]) -> None:
    """A decode step's inputs: each row's last token, or -1 where it is still in flight
    (``pending``: the rows' in-flight counts), read on the device from the step before."""
    n = len(decoding)
    if 0 not in pending:  # every input still in flight (the lookahead loops' usual step)
        batch.input_ids, batch.inflight_inputs = [-1] * n, list(enumerate(decoding))
    elif not any(pending):  # none (the normal loop's)
        batch.input_ids = [(r.output_ids or r.prompt_ids)[-1] for r in decoding]
    else:
        batch.input_ids = [-1 if p else (r.output_ids or r.prompt_ids)[-1] for r, p in zip(decoding, pending)]
        batch.inflight_inputs = [(i, r) for i, (r, p) in enumerate(zip(decoding, pending)) if p]

"""A multi-step decode run forward by forward (no fused launch: a runner without one, a
batch no fused graph fits, or a step whose masked rows sample every forward under masks
computed between the forwards, :mod:`omni_async.structured.between`).

Each forward reads the tokens the one before sampled (on the device, published to the
rows' slots so penalties see them) and is sampled on its own; a forward's outputs are
copied out at once (a graph's outputs are views of its static buffers, which the next
replay overwrites). With masks between forwards, forward ``j`` is enqueued before the
host reads forward ``j - 1``'s tokens, and its sampling after the host filled its masks:
the device runs the forward while the host computes them.
"""

from __future__ import annotations

from typing import Any

import torch

from ..structured.between import StepMasks
from .forward_batch import ForwardBatch
from .types import BatchResult


def forward_by_forward(runner: Any, fb: ForwardBatch, batch: Any, requests: list,
                       lookahead: bool) -> tuple[BatchResult, torch.Tensor | None]:
    """The step's result, holding every forward's tokens forward-major (``[k, B]``), and
    the lookahead's launch buffer (the tokens; None without lookahead). ``runner``: the
    native runner (its forward, sampling and slots; typed loosely, since it imports this)."""
    return Forwards(runner, fb, batch, requests, lookahead).finish()


class Forwards:
    """One multi-step decode run forward by forward, in two halves: its first forward
    enqueued (:meth:`__init__`), then the rest (:meth:`finish`): that forward's sampling and
    the forwards after it. A step sampling under late masks
    (``core.multi_step.late_between``) ends its launch after the first half
    (``ModelRunner._enqueue_forward``): its input tokens are the step in flight's, on the
    device, and its masks need that step processed; ``sample_pending`` runs the rest."""

    def __init__(self, runner: Any, fb: ForwardBatch, batch: Any, requests: list, lookahead: bool) -> None:
        self.runner, self.fb, self.batch, self.requests, self.lookahead = runner, fb, batch, requests, lookahead
        self.k, size, device = max(batch.row_steps), batch.size, runner.device
        self.tokens = torch.empty((self.k, size), dtype=torch.long, device=device)
        self.ok = torch.empty((self.k, size), dtype=torch.bool, device=device)
        self.first = runner._forward(fb, batch, requests, False, lookahead)

    def finish(self) -> tuple[BatchResult, torch.Tensor | None]:
        """The step's result and launch buffer (:func:`forward_by_forward`); the masks
        between the forwards are those of the rows live now (``StepMasks``)."""
        runner, fb, batch, requests, lookahead, k = self.runner, self.fb, self.batch, self.requests, self.lookahead, self.k
        tokens, ok, device = self.tokens, self.ok, runner.device
        logprobs: torch.Tensor | None = None
        hidden: torch.Tensor | None = None
        between = StepMasks(batch, runner.inputs.vocab, device, runner.grammar_masks) if batch.masks_between else None
        sub, last = fb, self.first
        for j in range(k):
            if j:
                sub = next_forward(runner, fb, j, tokens[j - 1])
                last = runner._forward(sub, batch, requests, False, lookahead)
            if between is not None and j:  # the forward is enqueued: its masks now, from the tokens before
                runner.grammar_masks.given = between.next_mask(j)
            try:
                launch_buf = runner._after_forward(last, sub, batch, requests, False, lookahead)
            finally:
                runner.grammar_masks.given = None  # taken by the sampling's fill, or left by a failure
            tokens[j].copy_(launch_buf if launch_buf is not None else last.next_token_ids)
            if last.sample_ok is not None:
                ok[j].copy_(last.sample_ok)
            else:
                ok[j].fill_(True)
            if last.next_token_logprobs is not None:
                if logprobs is None:
                    logprobs = torch.zeros((k, batch.size), dtype=torch.float32, device=device)
                logprobs[j].copy_(last.next_token_logprobs)
            if last.hidden_states is not None:
                if hidden is None:
                    hidden = last.hidden_states.new_empty((k,) + tuple(last.hidden_states.shape))
                hidden[j].copy_(last.hidden_states)
            runner.inputs.publish_forward(fb.rows.slots_dev, tokens, j, batch.row_steps)
            if between is not None and j < k - 1:
                between.send(tokens[j])
        merged = BatchResult(
            logits=last.logits, next_token_ids=tokens, next_token_logprobs=logprobs, hidden_states=hidden,
            can_run_cuda_graph=last.can_run_cuda_graph, sample_ok=ok,
        )
        return merged, (tokens if lookahead else None)


def next_forward(runner: Any, fb: ForwardBatch, j: int, tokens: torch.Tensor) -> ForwardBatch:
    """Forward ``j`` of a multi-step decode: one position further for every row that
    still runs (the others repeat their last position and write to scratch)."""
    assert fb.all_positions is not None and fb.all_slots is not None and fb.tables is not None
    assert fb.all_kv_lens is not None and fb.all_sample_indices is not None
    positions = fb.all_positions[j]
    if fb.feed is not None:
        tokens = torch.where(fb.feed[j] >= 0, fb.feed[j], tokens)
    ctx = runner._decode_ctx(fb.tables, positions, fb.all_slots[j], fb.block_tables, fb.span + j, rows=fb.ctx.logits_rows,
                             kv_lens=fb.all_kv_lens[j])
    return ForwardBatch(
        tokens, positions, ctx, fb.batch, fb.rows, fb.sample_indices + j, fb.all_sample_indices[j],
        block_tables=fb.block_tables, capture_hidden=fb.capture_hidden, sampling=fb.sampling,
        cond=None if fb.all_cond is None else (fb.all_cond[0][j], fb.all_cond[1][j]),
    )

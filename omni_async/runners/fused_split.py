"""Which rows of a multi-step decode run as one fused launch, and the rest beside it.

Why split: a row that needs what the fused launch cannot give (its logprobs, read from
each forward's logits; presence/frequency penalties or a logit bias) would otherwise
take the whole step forward by forward, so one
such request among hundreds cost every row the fused launch. Here the step's other
rows still run fused, and the few that cannot run forward by forward as a step of their
own; the two write disjoint KV pages and slots, so either's tokens are those it would
have had alone. (Rows under a grammar run in the launch itself, see :mod:`.fused_decode`,
unless they need one of those.) Their tokens (and ``ok`` flags, and the fallback rows' logprobs) are
merged back into the step's ``[k, B]`` forward-major layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..core.batch import ScheduledBatch
from .fused_decode import FusedBatch, FusedDecode
from .fused_sampling import fallback_rows, sampling_mode
from .input_batch import InputBatch, SlotRows
from .types import BatchResult


@dataclass
class Split:
    """A step whose ``fused_rows`` run fused and ``rest_rows`` forward by forward
    (``rest``: their forward batch, as the runner builds it)."""

    whole: ScheduledBatch
    fused_rows: np.ndarray
    rest_rows: np.ndarray
    rest: Any


# build_rest(batch, rows, sample_indices) -> the runner's forward-by-forward batch
RestBuilder = Callable[[ScheduledBatch, SlotRows, np.ndarray], Any]


def plan_fused(fused: FusedDecode, inputs: InputBatch, batch: ScheduledBatch, rows: SlotRows, sidx: np.ndarray,
               graphs_on: bool, build_rest: RestBuilder) -> FusedBatch | None:
    """The step as a fused launch, split when some rows cannot run fused; None when
    none can (or, with CUDA graphs, no fused graph fits the fused rows)."""
    # Rows under OpenAI penalties or a logit bias sample through the per-forward path,
    # which applies them from the running token counts.
    # Rows under a grammar run in the launch (one forward of theirs kept, sampled under
    # their masks), unless they need one of those too.
    flags = inputs.flags[rows.slots]
    fall = fallback_rows(flags) | inputs.controls.active[rows.slots]
    if not fall.any():
        return _fused(fused, inputs, batch, rows, sidx, graphs_on, flags)
    if fall.all():
        return None
    keep, other = np.flatnonzero(~fall), np.flatnonzero(fall)
    sub = sub_batch(batch, keep)
    fb = _fused(fused, inputs, sub, sub_rows(rows, keep, sub, inputs.device), sidx[keep], graphs_on)
    if fb is None:
        return None
    rest = sub_batch(batch, other)
    fb.split = Split(batch, keep, other, build_rest(rest, sub_rows(rows, other, rest, inputs.device), sidx[other]))
    fused.beside_grammar += bool(rest.grammar_rows)
    return fb


def _fused(fused: FusedDecode, inputs: InputBatch, batch: ScheduledBatch, rows: SlotRows, sidx: np.ndarray,
           graphs_on: bool, flags: np.ndarray | None = None) -> FusedBatch | None:
    """``flags``: the rows' host flags when the caller has them."""
    steps = max(batch.row_steps or (1,))
    bucket = None
    if graphs_on:
        if batch.grammar_rows:
            bucket = fused.grammar_bucket(batch.size, rows.widest, steps)
        else:
            bucket = fused.graph_for(batch.size, rows.widest, steps)
        if bucket is None:
            return None
    s = rows.slots
    mode = sampling_mode(inputs.flags[s] if flags is None else flags, inputs.ip, s, sidx, grammar=bool(batch.grammar_rows))
    return fused.batch(batch, rows, sidx, steps, bucket, mode)


def sub_batch(batch: ScheduledBatch, idx: np.ndarray) -> ScheduledBatch:
    """The decode step of rows ``idx`` only (one input token per row)."""
    pick = idx.tolist()

    def take(values: list) -> list:
        return [values[i] for i in pick]

    return dataclasses.replace(
        batch, reqs=take(batch.reqs), epochs=take(batch.epochs), prefix_lens=take(batch.prefix_lens),
        extend_lens=take(batch.extend_lens), samples_kept=take(batch.samples_kept), input_ids=take(batch.input_ids),
        inflight_inputs=[], sample_indices=take(batch.sample_indices), page_tables=take(batch.page_tables),
        page_counts=[batch.row_page_count(i) for i in pick], row_steps=take(batch.row_steps) if batch.row_steps else None,
        grammar_rows=_picked(pick, batch.grammar_rows), carried=None,
    )


def _picked(pick: list[int], rows: list[int]) -> list[int]:
    """Where ``rows`` (indices of the whole step) sit among the picked rows."""
    if not rows:
        return []
    wanted = set(rows)
    return [j for j, i in enumerate(pick) if i in wanted]


def sub_rows(rows: SlotRows, idx: np.ndarray, sub: ScheduledBatch, device: torch.device) -> SlotRows:
    slots = rows.slots[idx]
    return SlotRows(slots=slots, slots_dev=torch.from_numpy(slots).to(device, non_blocking=True),
                    widest=max(max(sub.page_counts), 1))


def merge_fused(split: Split, fused_out: torch.Tensor, hidden: torch.Tensor | None = None) -> BatchResult:
    """The step's ``[k, B]`` tokens and ``ok`` flags with the fused rows' taken from the
    launch's ``[2, k', B']`` now: its output buffer may be a graph's, in the memory pool
    the rest's forward graphs share, so it is read before they replay. Forwards past a
    part's own count hold token 0 (its rows ran fewer)."""
    whole = split.whole
    k, n, device = max(whole.row_steps or (1,)), whole.size, fused_out.device
    fi = torch.from_numpy(split.fused_rows).to(device, non_blocking=True)
    tokens = torch.zeros((k, n), dtype=torch.long, device=device)
    ok = torch.ones((k, n), dtype=torch.bool, device=device)
    kf, nf = fused_out.shape[1], len(split.fused_rows)
    tokens[:kf].index_copy_(1, fi, fused_out[0, :, :nf])
    ok[:kf].index_copy_(1, fi, fused_out[1, :, :nf].bool())
    merged_hidden = None
    if hidden is not None:  # the fused rows' hidden states ([k', nf, H], already copied out)
        merged_hidden = hidden.new_zeros((k, n, hidden.shape[-1]))
        merged_hidden[:kf].index_copy_(1, fi, hidden)
    return BatchResult(logits=None, next_token_ids=tokens, sample_ok=ok, hidden_states=merged_hidden)


def merge_rest(split: Split, merged: BatchResult, rest: BatchResult) -> BatchResult:
    """``merged`` with the other rows' tokens, ``ok`` flags and (when asked) logprobs."""
    tokens, ok = merged.next_token_ids, merged.sample_ok
    assert tokens is not None and ok is not None
    ri = torch.from_numpy(split.rest_rows).to(tokens.device, non_blocking=True)
    kr = rest.next_token_ids.shape[0]
    tokens[:kr].index_copy_(1, ri, rest.next_token_ids)
    if rest.sample_ok is not None:
        ok[:kr].index_copy_(1, ri, rest.sample_ok)
    if rest.next_token_logprobs is not None:
        merged.next_token_logprobs = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        merged.next_token_logprobs[:kr].index_copy_(1, ri, rest.next_token_logprobs.to(torch.float32))
    if merged.hidden_states is not None and rest.hidden_states is not None:
        rest_hidden = rest.hidden_states if rest.hidden_states.dim() == 3 else rest.hidden_states[None]
        merged.hidden_states[: rest_hidden.shape[0]].index_copy_(1, ri, rest_hidden)
    merged.can_run_cuda_graph = rest.can_run_cuda_graph
    return merged

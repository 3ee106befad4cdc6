"""Short prefills through the decode graphs: a prompt's positions as decode rows.

An eager prefill forward costs the host a launch per kernel of every layer whatever its
length: 12-15 ms for the 0.5B shape on the H200 (``core/plan.py``), so a short prompt's
first token waits for the launches, not the device. A prefill needs nothing a decode step
lacks: paged attention writes every row's key and value before any row attends, in each
layer, so the positions of a step's prompts, each run as a decode row at its position
attending to ``position + 1`` keys over its request's page table, compute exactly the
prefill's causal attention (a mixed step's decode rows are such rows already). A step of
up to :data:`PREFILL_ROWS_MAX` rows then replays the decode graph of its bucket, and the
prefill keeps the logits and hidden states of the rows it samples.

Not for prefills that need more than the graph gives: a prompt's hidden states or scores
(every row's), rows given as embeddings, a talker's conditioning rows. The speech talker
has its own graphs for its embedded prompts (:mod:`omni_async.speech.prefill_graphs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .forward_batch import token_tables
from .types import BatchResult

if TYPE_CHECKING:
    from .cuda_graphs import DecodeGraphs
    from .forward_batch import ForwardBatch
    from .input_batch import InputBatch

__all__ = ["PREFILL_ROWS_MAX", "prefill_as_rows"]

# The most rows a prefill step may have to replay a decode graph. A graph's attention is
# proportional to each row's context, so a short prompt's rows cost about a decode step of
# as many rows; past a few dozen the extend kernel's tiles (a block of queries per page
# read) are the better deal, and longer prompts do not wait on launches anyway.
PREFILL_ROWS_MAX = 64


def prefill_as_rows(graphs: "DecodeGraphs | None", inputs: "InputBatch", fb: "ForwardBatch") -> BatchResult | None:
    """The prefill ``fb`` replayed as decode rows of ``graphs`` (see the module; ``inputs``:
    the runner's slot state, whose page tables the rows read), or None when it does not
    qualify (no graphs, too many rows or pages, or a need the graph cannot serve)."""
    n = int(fb.input_ids.shape[0])
    if (graphs is None or n > PREFILL_ROWS_MAX or fb.prompt_rows is not None or fb.input_embeds is not None
            or fb.cond is not None or not graphs.fits(n, fb.rows.widest)):
        return None
    out = graphs.replay(fb.input_ids, fb.positions, fb.ctx.slot_mapping, token_tables(inputs, fb), fb.positions + 1)
    graphs.prefill_replays += 1
    last = fb.ctx.logits_rows
    greedy = None if out.greedy_tokens is None else (out.greedy_tokens[last], out.greedy_ok[last])
    # Gathers, not views: the graph's buffers are overwritten by its next replay. Not
    # ``can_run_cuda_graph``: the sampling graphs read a decode bucket's own logits buffer.
    return BatchResult(logits=out.logits[last], graph_greedy=greedy, hidden_states=out.hidden[last] if fb.capture_hidden else None)

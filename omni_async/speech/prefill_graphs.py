"""The talker's short prefills as CUDA graphs: a prompt's positions run as decode rows.

An eager prefill forward costs the host a launch per kernel of every layer whatever the
prompt's length (12-15 ms for a 24-layer 0.5B shape on the H200, ``core/plan.py``), and
the talker's prefills are short (a sentence: tens of rows) and come one per stream: a
new stream's first audio waits for one, and with streams starting all the time they
take the launching thread from the frame steps. A prompt's positions run as decode rows
compute exactly its prefill (the argument: :mod:`omni_async.runners.prefill_rows`, which
does the same for text prompts through the decode graphs), so one graph per row bucket
replays a prefill of up to that many rows, several requests' together, in one launch.

The rows' embeddings are inputs (the talker's prompt is given as embeddings: every row of
a graphed prefill must have one); the outputs are every row's logits and final hidden
state, of which the prefill keeps each request's last position. A prefill of more rows
than the largest bucket runs as several replays of it, in order. Prefills outside those
limits (attending past the span, without embeddings, scoring their prompt) run eagerly.
On a CPU the same rows run eagerly through :meth:`PrefillGraphs.forward` (what the tests
hold equal to the extend path).
"""

from __future__ import annotations

from typing import Any

import torch

from ..kv.attention import AttentionContext
from ..runners.forward_batch import token_tables
from ..runners.streams import STREAMS

__all__ = ["PrefillGraphs", "PREFILL_BUCKETS"]

# Row buckets: a one-sentence prompt is 20-60 rows; several streams starting together
# share a prefill step.
PREFILL_BUCKETS = (16, 32, 64, 96, 128, 192, 256)
# Positions a graphed prefill's rows may attend to (its attention spans all of them).
PREFILL_SPAN = 1024


class PrefillGraphs:
    def __init__(self, runner: Any, *, scratch_page: int, max_pages: int, buckets: tuple[int, ...] = PREFILL_BUCKETS,
                 pool: Any = None) -> None:
        """``pool``: a CUDA graph memory pool to share (the frame graphs')."""
        self.runner = runner
        self.model, self.kv, self.page_size = runner.model, runner.kv, runner.kv.page_size
        self.scratch_page, self.max_pages = scratch_page, max_pages
        self.buckets = buckets
        n, device = buckets[-1], runner.device
        hidden = runner.speech.config.talker.hidden_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.long, device=device)
        self.block_tables = torch.full((n, max_pages), scratch_page, dtype=torch.long, device=device)
        self.embeds = torch.zeros((n, hidden), dtype=runner.speech.dtype, device=device)
        self.rows = torch.arange(n, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.pool = pool
        self.runs = 0  # prefills run as rows (eagerly where nothing is captured)
        self.pieced = 0  # of them, those past the largest bucket (run in pieces)
        self.replays = 0

    def fits(self, fb: Any) -> bool:
        """Whether the prefill ``fb`` runs as graphed decode rows: every row given as an
        embedding, no prompt scored, pages within the graphs' span (rows past the largest
        bucket run as several replays)."""
        n, embeds = int(fb.input_ids.shape[0]), fb.input_embeds
        return (embeds is not None and int(embeds[0].shape[0]) == n and fb.prompt_rows is None
                and fb.cond is None and fb.rows.widest <= self.max_pages)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's float32 logits and final hidden state, ``tables`` ``[rows, pages]``
        each row's page table (what a graph captures; eager on a CPU)."""
        ctx = AttentionContext(is_decode=True, slot_mapping=slots, logits_rows=self.rows[: ids.shape[0]], kv_lens=positions + 1,
                               block_tables=tables, page_size=self.page_size, use_kernel=self.runner.use_kernel)
        logits, hidden = self.model(ids, positions, self.kv, ctx, return_hidden=True,
                                    input_embeds=(self.rows[: ids.shape[0]], embeds))
        return logits.float(), hidden

    def run(self, fb: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill ``fb`` (:meth:`fits`): the logits and hidden states of each
        request's last row. Past the largest bucket the rows run as pieces of it, in order
        (a burst of streams starting together: 64 prompts are ~2,500 rows): a piece's keys
        and values are in the cache before a later piece's rows attend to them, the same
        argument that makes a piece's own rows causal."""
        n = int(fb.input_ids.shape[0])
        tables = token_tables(self.runner.inputs, fb)
        embeds = torch.empty((n, self.embeds.shape[1]), dtype=self.embeds.dtype, device=self.embeds.device)
        embeds.index_copy_(0, fb.input_embeds[0], fb.input_embeds[1].to(embeds.dtype))
        last = fb.ctx.logits_rows
        self.runs += 1
        width = self.buckets[-1]
        if n <= width:
            logits, hidden = self._rows(fb.input_ids, fb.positions, fb.ctx.slot_mapping, tables, embeds)
            return logits[last], hidden[last]  # (gathers: the graph's buffers are not handed out)
        self.pieced += 1
        kept: tuple[torch.Tensor, torch.Tensor] | None = None
        for start in range(0, n, width):
            end = min(n, start + width)
            logits, hidden = self._rows(fb.input_ids[start:end], fb.positions[start:end], fb.ctx.slot_mapping[start:end],
                                        tables[start:end], embeds[start:end])
            # Each request's last row, where it is in this piece (a gather of the piece's
            # outputs, taken before the next replay overwrites them; no host read).
            here = ((last >= start) & (last < end))[:, None]
            at = (last - start).clamp(0, end - start - 1)
            piece = (logits[at], hidden[at])
            kept = piece if kept is None else (torch.where(here, piece[0], kept[0]), torch.where(here, piece[1], kept[1]))
        assert kept is not None
        return kept

    def _rows(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
              embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """At most the largest bucket's rows: the graph's outputs (replayed), or eager ones."""
        n = int(ids.shape[0])
        if not self.graphs:
            return self.forward(ids, positions, slots, tables, embeds)
        b = next(b for b in self.buckets if b >= n)
        graph, (logits, hidden) = self.graphs[b]
        self.input_ids[:n].copy_(ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slots, non_blocking=True)
        self.block_tables[:n, : tables.shape[1]].copy_(tables, non_blocking=True)
        self.block_tables[:n, tables.shape[1]:].fill_(self.scratch_page)
        self.embeds[:n].copy_(embeds, non_blocking=True)
        self._pad(n, b)
        graph.replay()
        self.replays += 1
        return logits[:n], hidden[:n]

    def _pad(self, start: int, end: int) -> None:
        """Rows past a prefill's own: position 0 of the scratch page."""
        self.positions[start:end].zero_()
        self.slot_mapping[start:end].fill_(self.scratch_page * self.page_size)
        self.block_tables[start:end].fill_(self.scratch_page)

    @torch.inference_mode()
    def capture_all(self) -> None:
        self._pad(0, self.buckets[-1])
        device = self.runner.device
        with STREAMS.borrowed(device) as stream, torch.cuda.stream(stream):
            for b in reversed(self.buckets):  # the largest first, so the pool fits all
                args = (self.input_ids[:b], self.positions[:b], self.slot_mapping[:b], self.block_tables[:b], self.embeds[:b])
                for _ in range(2):  # warm up (and compile) outside the graph
                    self.forward(*args)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                    out = self.forward(*args)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[b] = (graph, out)
        torch.cuda.synchronize(device)

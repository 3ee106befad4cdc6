"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed from the loop.

Captured over static device buffers: token ids, positions, the KV slot of each new token,
page tables and sequence lengths. Attention spans a fixed ``max_pages * page_size``
positions (masked past each row's length), so one graph serves every step of its bucket.
Rows past the real batch write their KV into a scratch page that no request owns.
Prefill and anything larger than the biggest bucket run eagerly.

With ``greedy_in_graph`` the graph also ends with greedy sampling (the row maximum and
whether it is finite), so a step whose rows are all plain greedy needs no kernel after
the replay; other steps sample from the graph's logits as before.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kv.attention import AttentionContext
from ..kv.cache import PagedKVCache
from ..models.decoder import DecoderModel
from .sampling import greedy
from .streams import STREAMS

class GraphOutputs(NamedTuple):
    """A replay's static outputs: logits, each row's final hidden state (computed
    anyway before the head; kept as an output so capturing it costs nothing), and with
    greedy in the graph each row's greedy token and whether its logits had a finite
    maximum."""

    logits: torch.Tensor
    hidden: torch.Tensor
    greedy_tokens: torch.Tensor | None = None
    greedy_ok: torch.Tensor | None = None

    def rows(self, n: int) -> "GraphOutputs":
        if self.greedy_tokens is None:
            return GraphOutputs(self.logits[:n], self.hidden[:n])
        return GraphOutputs(self.logits[:n], self.hidden[:n], self.greedy_tokens[:n], self.greedy_ok[:n])


DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(
        self,
        model: DecoderModel,
        kv: PagedKVCache,
        *,
        scratch_page: int,
        max_pages_per_seq: int,
        max_batch: int,
        device: torch.device,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        use_kernel: bool = False,
        greedy_in_graph: bool = False,
    ) -> None:
        self.use_kernel = use_kernel
        self.greedy_in_graph = greedy_in_graph
        self.model = model
        self.kv = kv
        self.page_size = kv.page_size
        self.scratch_page = scratch_page
        self.max_pages = max_pages_per_seq
        self.buckets = tuple(b for b in buckets if b <= max_batch) or (max_batch,)
        self.max_batch = self.buckets[-1]
        self.device = device
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.long, device=device)
        self.block_tables = torch.full((n, self.max_pages), scratch_page, dtype=torch.long, device=device)
        self.kv_lens = torch.ones(n, dtype=torch.long, device=device)
        self.rows = torch.arange(n, device=device)
        # A talker's conditioning rows and their mask (:mod:`omni_async.core.conditioning`),
        # inputs of the graph when the model has a projection for them.
        proj = model.thinker_to_talker_proj
        self.cond_rows = None if proj is None else torch.zeros((n, proj.in_features), dtype=proj.weight.dtype, device=device)
        self.cond_mask = None if proj is None else torch.zeros(n, dtype=proj.weight.dtype, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, GraphOutputs]] = {}
        self.pool = None
        self.replays = 0
        self.prefill_replays = 0  # of those, short prefills run as decode rows (.prefill_rows)
        self._last_tables: torch.Tensor | None = None  # the page tables of the last replay

    def bucket_for(self, bs: int) -> int | None:
        for b in self.buckets:
            if b >= bs:
                return b
        return None

    def fits(self, bs: int, max_pages_needed: int) -> bool:
        return bs <= self.max_batch and max_pages_needed <= self.max_pages

    def _ctx(self, b: int) -> AttentionContext:
        return AttentionContext(
            is_decode=True,
            slot_mapping=self.slot_mapping[:b],
            logits_rows=self.rows[:b],
            kv_lens=self.kv_lens[:b],
            block_tables=self.block_tables[:b],
            page_size=self.page_size,
            use_kernel=self.use_kernel,
        )

    @torch.inference_mode()
    def capture_all(self) -> None:
        self._reset_padding(0, self.max_batch)
        self._last_tables = None
        with STREAMS.borrowed(self.device) as stream, torch.cuda.stream(stream):
            for b in reversed(self.buckets):  # the largest first, so the pool fits all
                for _ in range(2):  # warm up outside the graph
                    self._captured(b)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                    out = self._captured(b)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[b] = (graph, out)
        torch.cuda.synchronize(self.device)

    def _captured(self, b: int) -> GraphOutputs:
        # Logits stay in the head's dtype: their float32 copy cost ~110 us of a 1.6 ms
        # replay at batch 256 on the H200 and greedy needs none (the argmax of bf16 values
        # is the argmax of their exact float32 conversion); sampling converts them.
        cond = None if self.cond_rows is None else (self.cond_rows[:b], self.cond_mask[:b])
        logits, hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv, self._ctx(b), return_hidden=True,
                                    float_logits=False, cond=cond)
        if not self.greedy_in_graph:
            return GraphOutputs(logits, hidden)
        tokens, ok = greedy(logits)
        return GraphOutputs(logits, hidden, tokens, ok)

    def _reset_padding(self, start: int, end: int) -> None:
        scratch_slot = self.scratch_page * self.page_size
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = scratch_slot
        self.block_tables[start:end] = self.scratch_page
        self.kv_lens[start:end] = 1
        if self.cond_mask is not None:
            self.cond_mask[start:end] = 0

    def replay(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        kv_lens: torch.Tensor,
        cond: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> GraphOutputs:
        bs = input_ids.shape[0]
        b = self.bucket_for(bs)
        assert b is not None
        graph, out = self.graphs[b]
        # The forwards of a multi-step decode share their page tables: after the first,
        # the tables and the padding rows are already in place.
        again = block_tables is self._last_tables
        self.input_ids[:bs].copy_(input_ids, non_blocking=True)
        self.positions[:bs].copy_(positions, non_blocking=True)
        self.slot_mapping[:bs].copy_(slot_mapping, non_blocking=True)
        if not again:
            self.block_tables[:bs, : block_tables.shape[1]].copy_(block_tables, non_blocking=True)
            self.block_tables[:bs, block_tables.shape[1] :] = self.scratch_page
        self.kv_lens[:bs].copy_(kv_lens, non_blocking=True)
        if self.cond_mask is not None:
            if cond is None:
                self.cond_mask[:bs] = 0
            else:
                self.cond_rows[:bs].copy_(cond[0], non_blocking=True)
                self.cond_mask[:bs].copy_(cond[1], non_blocking=True)
        if b > bs and not again:
            self._reset_padding(bs, b)
        self._last_tables = block_tables
        graph.replay()
        self.replays += 1
        return out.rows(bs)

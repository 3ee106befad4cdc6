"""CUDA graphs of whole frame steps: one per (batch bucket, predictor draw: greedy, sampled
over the top-k cap, or sampled over the vocabulary).

Eagerly a frame step is launch-bound: the talker's forward, then 15 predictor
forwards and draws of a few small kernels each, hundreds of launches for a few
milliseconds of arithmetic. Captured, a frame is one replay. The graph reads static
buffers (the rows' input codes, positions, KV slots, page tables and lengths as the text
decode graphs do, plus each row's previous hidden state and predictor settings) and
writes static outputs (the talker's logits and hidden states, the frame's codes); a
talker that adds a text row of its own to each frame (Qwen3-Omni's) has them copied in
too; the
runner copies the rows in before and the hidden states back to their slots after, so
the graph does not depend on which slot a request holds. Padding rows of a bucket write
their KV to the scratch page.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..kv.attention import AttentionContext
from ..runners.cuda_graphs import DEFAULT_BUCKETS
from ..runners.streams import STREAMS
from .sampling import TOP_K_CAP, PredictorSampling

__all__ = ["FrameGraphs", "FrameOutputs"]


class FrameOutputs(NamedTuple):
    logits: torch.Tensor  # [b, V] float32
    hidden: torch.Tensor  # [b, H]
    codes: torch.Tensor  # [b, 16] long


class FrameGraphs:
    def __init__(self, runner: Any, *, scratch_page: int, max_pages_per_seq: int, max_batch: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        self.runner = runner
        self.kv, self.page_size = runner.kv, runner.kv.page_size
        self.scratch_page, self.max_pages = scratch_page, max_pages_per_seq
        self.buckets = tuple(b for b in buckets if b <= max_batch) or (max_batch,)
        self.max_batch = self.buckets[-1]
        device = runner.device
        n, h = self.max_batch, runner.speech.config.talker.hidden_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.long, device=device)
        self.block_tables = torch.full((n, self.max_pages), scratch_page, dtype=torch.long, device=device)
        self.kv_lens = torch.ones(n, dtype=torch.long, device=device)
        self.past = torch.zeros((n, h), dtype=runner.speech.dtype, device=device)
        self.temperature = torch.zeros(n, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(n, dtype=torch.long, device=device)
        self.top_p = torch.ones(n, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(n, dtype=torch.long, device=device)
        # Each row's own text row for its frame (a runner whose frame_text gives them: the
        # Qwen3-Omni talker's), gathered outside the graph and copied in like the codes.
        self.text = torch.zeros((n, h), dtype=runner.speech.dtype, device=device) if runner.frame_text_rows else None
        self.rows = torch.arange(n, device=device)
        self.graphs: dict[tuple[int, str], tuple[torch.cuda.CUDAGraph, FrameOutputs]] = {}
        self.pool = None
        self.replays = 0

    def bucket_for(self, bs: int) -> int | None:
        return next((b for b in self.buckets if b >= bs), None)

    def fits(self, bs: int, pages: int) -> bool:
        return bs <= self.max_batch and pages <= self.max_pages

    def _ctx(self, b: int) -> AttentionContext:
        return AttentionContext(is_decode=True, slot_mapping=self.slot_mapping[:b], logits_rows=self.rows[:b],
                                kv_lens=self.kv_lens[:b], block_tables=self.block_tables[:b], page_size=self.page_size,
                                use_kernel=True)

    def _captured(self, b: int, kind: str) -> FrameOutputs:
        s = PredictorSampling(self.temperature[:b], self.top_k[:b], self.top_p[:b], self.seeds[:b], kind != "greedy",
                              TOP_K_CAP if kind == "sampled-topk" else 0)
        text = None if self.text is None else self.text[:b]
        logits, hidden, codes = self.runner.frame_forward(self.input_ids[:b], self.past[:b], self.positions[:b], self._ctx(b), s, text)
        return FrameOutputs(logits, hidden, codes)

    @torch.inference_mode()
    def capture_all(self) -> None:
        self._pad(0, self.max_batch)
        device = self.runner.device
        with STREAMS.borrowed(device) as stream, torch.cuda.stream(stream):
            for b in reversed(self.buckets):  # the largest first, so the pool fits all
                for kind in ("sampled", "sampled-topk", "greedy"):
                    for _ in range(2):  # warm up outside the graph
                        self._captured(b, kind)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                        out = self._captured(b, kind)
                    if self.pool is None:
                        self.pool = graph.pool()
                    self.graphs[(b, kind)] = (graph, out)
        torch.cuda.synchronize(device)

    def _pad(self, start: int, end: int) -> None:
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = self.scratch_page * self.page_size
        self.block_tables[start:end] = self.scratch_page
        self.kv_lens[start:end] = 1
        self.temperature[start:end] = 0

    def replay(self, g0: torch.Tensor, past: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
               tables: torch.Tensor, s: PredictorSampling, text: torch.Tensor | None = None) -> FrameOutputs:
        """One frame for the first ``bs`` rows; ``text``: their text rows ``[bs, H]``
        (given exactly when the graphs were captured with them)."""
        bs = g0.shape[0]
        if (text is None) != (self.text is None):
            raise ValueError("frame graphs replay text rows exactly when they were captured with them")
        b = self.bucket_for(bs)
        assert b is not None
        graph, out = self.graphs[(b, s.kind)]
        self.input_ids[:bs].copy_(g0, non_blocking=True)
        self.positions[:bs].copy_(positions, non_blocking=True)
        self.slot_mapping[:bs].copy_(ctx.slot_mapping, non_blocking=True)
        self.block_tables[:bs, : tables.shape[1]].copy_(tables, non_blocking=True)
        self.block_tables[:bs, tables.shape[1]:] = self.scratch_page
        self.kv_lens[:bs].copy_(ctx.kv_lens, non_blocking=True)
        self.past[:bs].copy_(past, non_blocking=True)
        self.temperature[:bs].copy_(s.temperature, non_blocking=True)
        self.top_k[:bs].copy_(s.top_k, non_blocking=True)
        self.top_p[:bs].copy_(s.top_p, non_blocking=True)
        self.seeds[:bs].copy_(s.seeds, non_blocking=True)
        if self.text is not None:
            self.text[:bs].copy_(text, non_blocking=True)
        if b > bs:
            self._pad(bs, b)
        graph.replay()
        self.replays += 1
        return FrameOutputs(out.logits[:bs], out.hidden[:bs], out.codes[:bs])

"""Filtered sampling (temperature, top-k, top-p, min-p) replayed from CUDA graphs.

Why: eager sampling of a step with filters is a few dozen small kernels enqueued after
the forward's graph; at small batch they cost about as much as the forward's own
elementwise work. Replayed from a graph they are one launch.

A graph runs every row of its bucket through the filters the step needs; a row whose
setting is off passes through unchanged (``top_k`` 0 keeps the whole vocabulary,
``top_p`` 1 and ``min_p`` 0 drop nothing), and greedy rows take the row maximum, so the
tokens equal :func:`~omni_async.runners.sampling.sample`'s for the same inputs. One graph per
(bucket, filters in use), captured the first time a step needs it, for buckets up to
``max_batch`` (the sort over the vocabulary needs memory that grows with the batch).
Steps with penalties, bans or logprobs sample eagerly.
"""

from __future__ import annotations

from typing import Callable

import torch

from .sampling import SamplingBatch, greedy, sample
from .streams import STREAMS


class SamplingGraphs:
    def __init__(
        self,
        logits_for: Callable[[int], torch.Tensor],
        bucket_for: Callable[[int], int | None],
        *,
        max_batch: int,
        device: torch.device,
    ) -> None:
        """``logits_for(bucket)`` is the static logits buffer a bucket's forward graph
        writes; ``bucket_for(size)`` the bucket a batch of that size replays."""
        self.logits_for = logits_for
        self.bucket_for = bucket_for
        self.max_batch = max_batch
        self.device = device
        n = max_batch
        self.temperature = torch.zeros(n, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(n, dtype=torch.long, device=device)
        self.top_p = torch.ones(n, dtype=torch.float32, device=device)
        self.min_p = torch.zeros(n, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(n, dtype=torch.long, device=device)
        self.sample_indices = torch.zeros(n, dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, bool, bool, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.replays = 0

    def eligible(self, sb: SamplingBatch, top_k_logprobs: int) -> bool:
        return (
            0 < sb.num_sampled
            and sb.size <= self.max_batch
            and sb.penalty is None
            and sb.ban is None
            and sb.controls is None
            and sb.allowed is None
            and not sb.want_logprobs
            and not top_k_logprobs
        )

    def sample(self, sb: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, ok)`` for the step whose forward graph has just been replayed."""
        bs = sb.size
        b = self.bucket_for(bs)
        assert b is not None and b <= self.max_batch
        self._stage(sb, bs, b)
        key = (b, sb.use_top_k, sb.use_top_p, sb.use_min_p)
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        graph, tokens, ok = self.graphs[key]
        graph.replay()
        self.replays += 1
        return tokens[:bs], ok[:bs]

    def _stage(self, sb: SamplingBatch, bs: int, b: int) -> None:
        for dst, src in (
            (self.temperature, sb.temperature),
            (self.top_k, sb.top_k),
            (self.top_p, sb.top_p),
            (self.min_p, sb.min_p),
            (self.seeds, sb.seeds),
            (self.sample_indices, sb.sample_indices),
        ):
            dst[:bs].copy_(src, non_blocking=True)
        if b > bs:
            self.temperature[bs:b] = 0  # padded rows: greedy, whatever else they hold

    def _run(self, b: int, use_top_k: bool, use_top_p: bool, use_min_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits_for(b)
        sb = SamplingBatch(
            temperature=self.temperature[:b], top_k=self.top_k[:b], top_p=self.top_p[:b], min_p=self.min_p[:b],
            seeds=self.seeds[:b], sample_indices=self.sample_indices[:b], num_sampled=b,
            use_top_k=use_top_k, use_top_p=use_top_p, use_min_p=use_min_p,
        )
        drawn = sample(logits, sb)
        best, _ = greedy(logits)
        return torch.where(sb.temperature == 0, best, drawn.tokens), drawn.ok

    @torch.inference_mode()
    def _capture(self, b: int, use_top_k: bool, use_top_p: bool, use_min_p: bool):
        with STREAMS.borrowed(self.device) as stream, torch.cuda.stream(stream):
            for _ in range(2):  # warm up outside the graph (out of place: nothing changes)
                self._run(b, use_top_k, use_top_p, use_min_p)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                tokens, ok = self._run(b, use_top_k, use_top_p, use_min_p)
        return graph, tokens, ok

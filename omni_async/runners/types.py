"""What a forward leaves on the device for sampling and collection (torch tensors; the
host-side hand-offs between the stage and a runner are in
:mod:`omni_async.core.runner_io`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BatchResult:
    """A forward's product on the device: logits of the sampled rows (float32; in the
    model's dtype from a replayed decode graph), and after sampling the next token ids
    (and, when asked, their log-probabilities)."""

    logits: torch.Tensor | None
    next_token_ids: torch.Tensor | None = None
    next_token_logprobs: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None  # [B, H], or [k, B, H] for a multi-step decode
    can_run_cuda_graph: bool = False
    # [B] bool from the sampler: False where a row had no admissible token.
    sample_ok: torch.Tensor | None = None
    # [B, K] the K most likely tokens of each row and their logprobs, when a row asked.
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    # Greedy tokens and ok flags computed inside a replayed CUDA graph, when it has them.
    graph_greedy: tuple[torch.Tensor, torch.Tensor] | None = None
    # A fused multi-step decode: ``[2, k, B]`` int64 tokens and ok flags (B padded to its
    # graph's bucket), copied to the host as it is (the reader drops the padding rows).
    packed: torch.Tensor | None = None
    # A prefill's final hidden states at every input row, and where each batch row's
    # tokens sit in them (``ModelRunnerOutput.prompt_hidden``), when a row asked.
    prompt_hidden: tuple[torch.Tensor, list[tuple[int, int, int]]] | None = None
    # Per batch row, the scored prompt tokens of a row that asked for prompt logprobs
    # (:func:`.prompt_scores.score_prompts`); None when no row asked.
    prompt_logprobs: list[tuple[int, torch.Tensor] | None] | None = None

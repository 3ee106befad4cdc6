"""Token sampling shared by every runner.

Processing order follows transformers' logits processors: penalties and suppression on
the raw logits, then temperature, top-k, top-p, min-p. Randomness is keyed by
``(seed, generation index)`` per row, so a request's draws do not depend on what else
is in the batch, which loop runs it, or whether it was retracted and resumed.
Unseeded rows get a seed derived from the request id (identical on every
tensor-parallel rank, as in the reference).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch

from .config import SAMPLING_SEED_MASK, SamplingParams


def derive_seed(*parts: object) -> int:
    digest = hashlib.blake2b("\x1f".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & SAMPLING_SEED_MASK


@dataclass
class RowSampling:
    """What one row needs to be sampled."""

    params: SamplingParams
    request_id: str
    sample_index: int  # index of the token being generated within the request
    output_ids: Sequence[int]  # tokens generated so far (repetition penalty)
    stop_ids: Sequence[int]  # suppressed until min_new_tokens is reached

    def seed(self) -> int:
        base = self.params.resolved_seed
        if base is None:
            base = derive_seed("omni-async-unseeded-row", self.request_id)
        return derive_seed(base, self.sample_index)


def apply_penalties(logits: torch.Tensor, rows: Sequence[RowSampling]) -> None:
    """In place: repetition penalty over output tokens, suppressed tokens, and stop ids
    before ``min_new_tokens``."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0 and row.output_ids:
            toks = torch.tensor(sorted({t for t in row.output_ids if 0 <= t < vocab}), dtype=torch.long)
            if toks.numel():
                toks = toks.to(logits.device)
                scores = logits[i, toks]
                logits[i, toks] = torch.where(
                    scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty
                )
        banned = [t for t in p.suppress_tokens if t < vocab]
        if row.sample_index < p.min_new_tokens:
            banned.extend(t for t in row.stop_ids if t < vocab)
        if banned:
            logits[i, torch.tensor(banned, dtype=torch.long, device=logits.device)] = float("-inf")


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p, min-p on one row (``[V]``, float32)."""
    x = logits / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1 - params.top_p)
        remove_sorted[-1] = False  # keep at least one token
        remove = torch.zeros_like(remove_sorted).scatter(0, order, remove_sorted)
        x = x.masked_fill(remove, float("-inf"))
    if params.min_p > 0.0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return x


def sample_rows(
    logits: torch.Tensor, rows: Sequence[RowSampling], want_logprobs: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample one token per row. ``logits``: ``[B, V]`` float32 (modified in place by
    penalties). Returns token ids ``[B]`` and, when asked, the log-probability of each
    sampled token under the model's unprocessed distribution."""
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    apply_penalties(logits, rows)
    tokens = torch.argmax(logits, dim=-1)
    sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    for i in sampled:
        row = rows[i]
        probs = filter_logits(logits[i], row.params).softmax(-1)
        gen = torch.Generator(device=probs.device).manual_seed(row.seed())
        tokens[i] = torch.multinomial(probs, 1, generator=gen)[0]
    logprobs = None
    if raw_logprobs is not None:
        logprobs = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
    return tokens, logprobs

"""Log-probabilities of a prompt's own tokens (``SamplingParams.prompt_logprobs``), from a
prefill's final hidden states at every position.

The prefill normally computes logits at each row's last position only. For a row that
scores its prompt, the head runs over all of its positions, a bounded number of rows at
a time (a full-vocabulary float32 block per row), and only what the result needs is kept:
for each position, the log-probability and rank of the next prompt token and the ``k``
most likely tokens. Position ``p`` scores prompt token ``p + 1``, so a chunk of positions
``[start, start + n)`` scores tokens ``start + 1 .. start + n`` (the last prompt position
scores none: it predicts the first generated token)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

# Positions through the head at once: [rows, vocab] float32 stays within a few hundred MB
# for vocabularies up to ~200k.
SCORE_CHUNK_ROWS = 256


def score_prompts(
    head: Callable[[torch.Tensor], torch.Tensor], every: torch.Tensor, reqs: Sequence[Any],
    spans: Sequence[tuple[int, int, int]],
) -> list[tuple[int, torch.Tensor] | None] | None:
    """Per batch row: None, or ``(first token index, host rows [m, 2 + 2k] float64)`` where each
    row is ``[logprob, rank, top ids (k), top logprobs (k)]`` of one scored prompt token
    (rank 1 is the most likely token). ``spans``: each row's (first flat row, count, first
    position) in ``every``. None when no row asked."""
    out: list[tuple[int, torch.Tensor] | None] = []
    asked = False
    for req, (flat, count, first_pos) in zip(reqs, spans):
        k = req.sampling.prompt_logprobs
        prompt = req.prompt_ids
        hi = min(first_pos + count, len(prompt) - 1)  # positions [first_pos, hi) score a prompt token
        if k is None or hi <= first_pos:
            out.append(None)
            continue
        asked = True
        rows = every[flat : flat + hi - first_pos]
        targets = torch.tensor(prompt[first_pos + 1 : hi + 1], dtype=torch.int64).to(every.device, non_blocking=True)
        parts = [_score_rows(head, rows[i : i + SCORE_CHUNK_ROWS], targets[i : i + SCORE_CHUNK_ROWS], k)
                 for i in range(0, rows.shape[0], SCORE_CHUNK_ROWS)]
        out.append((first_pos + 1, _to_host(parts[0] if len(parts) == 1 else torch.cat(parts))))
    return out if asked else None


def scored_rows(reqs: Sequence[Any], spans: Sequence[tuple[int, int, int]], total: int, device: torch.device) -> torch.Tensor | None:
    """A bool mask over a prefill's ``total`` token rows: the rows of the requests that
    score their prompt (``spans`` as in :func:`score_prompts`); None when none does."""
    scored = [(flat, count) for req, (flat, count, _) in zip(reqs, spans) if req.sampling.prompt_logprobs is not None and count]
    if not scored:
        return None
    mask = torch.zeros(total, dtype=torch.bool)
    for flat, count in scored:
        mask[flat : flat + count] = True
    return mask.to(device, non_blocking=True)


def _to_host(rows: torch.Tensor) -> torch.Tensor:
    """On CUDA, copied into pinned host memory behind the step's kernels: the stage reads
    the rows once the step has completed, so reading them needs no synchronisation (a
    plain ``.tolist()`` there would wait for the steps launched since)."""
    if rows.device.type != "cuda":
        return rows
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    host.copy_(rows, non_blocking=True)
    return host


def _score_rows(head: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """One chunk: log_softmax of the float32 logits (as the sampler's raw logprobs)."""
    logprobs = torch.log_softmax(head(rows).to(torch.float32), dim=-1)
    chosen = logprobs.gather(1, targets[:, None])
    rank = (logprobs > chosen).sum(dim=1, keepdim=True) + 1
    cols = [chosen.double(), rank.double()]
    if k:
        top = logprobs.topk(k, dim=-1)
        cols += [top.indices.double(), top.values.double()]
    return torch.cat(cols, dim=1)

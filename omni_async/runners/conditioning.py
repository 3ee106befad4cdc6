"""A talker's conditioning rows gathered for one forward's inputs.

Each conditioned request holds the rows that arrived for its positions
(:class:`omni_async.core.conditioning.StepConditioning`); a step computes some positions
of each row, and the model adds ``thinker_to_talker_proj(rows) * mask`` to their input
embeddings. Here those rows are laid out flat, one per input of the step, with mask 0
where a position has none (no row arrived for it and none will, or the request is not
conditioned). The layout is the same for a prefill (its flat tokens), a one-forward
decode and a multi-step decode (``[k, B]``, forward-major), so a position gets the same
row whatever the loop and whichever path computes it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

Rows = tuple[torch.Tensor, torch.Tensor]


def gather_rows(proj: Any, reqs: Sequence[Any], spans: Sequence[tuple[int, int, int, int]], total: int,
                device: torch.device) -> Rows:
    """Rows and mask for ``total`` flat inputs: request ``i`` computes ``count``
    positions from ``first``, the j-th at flat index ``base + j * stride`` (``spans[i] =
    (first, count, base, stride)``). One gather of the arrived pieces per step."""
    pieces, dst = [], []
    for req, (first, count, base, stride) in zip(reqs, spans):
        cond = req.conditioning
        if cond is None:
            continue
        for offset, part in cond.pieces(first, count):
            pieces.append(part)
            dst.extend(base + (offset + j) * stride for j in range(part.shape[0]))
    dtype = proj.weight.dtype
    rows = torch.zeros((total, proj.in_features), dtype=dtype, device=device)
    mask = torch.zeros(total, dtype=dtype, device=device)
    if pieces:
        idx = torch.tensor(dst, dtype=torch.long).to(device, non_blocking=True)
        rows.index_copy_(0, idx, torch.cat([p.to(device=device, dtype=dtype) for p in pieces]))
        mask.index_fill_(0, idx, 1.0)
    return rows, mask


def decode_rows(proj: Any, reqs: Sequence[Any], prefix_lens: Sequence[int], steps: int, size: int,
                device: torch.device) -> Rows:
    """A decode step's ``steps`` forwards, ``([steps, size, Hc], [steps, size])``: forward
    j of row i computes position ``prefix_lens[i] + j`` (``size`` may exceed the rows: a
    graph bucket's padding, mask 0)."""
    spans = [(p, steps, i, size) for i, p in enumerate(prefix_lens)]
    rows, mask = gather_rows(proj, reqs, spans, steps * size, device)
    return rows.view(steps, size, -1), mask.view(steps, size)

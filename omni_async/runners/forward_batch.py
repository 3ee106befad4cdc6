"""One forward's inputs on the device, as the native runner builds them from the
persistent slot state (and the tensor-parallel runner sends them to the other ranks)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.batch import ScheduledBatch
from ..kv.attention import AttentionContext
from .input_batch import InputBatch, SlotRows
from .sampling import SamplingBatch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    ctx: AttentionContext
    batch: ScheduledBatch
    rows: SlotRows
    sample_indices: np.ndarray  # [B] generation index of each row's token
    sample_indices_dev: torch.Tensor
    block_tables: torch.Tensor | None = None  # set when the step replays a CUDA graph
    capture_hidden: bool = False  # the step hands out each sampled row's hidden state
    # Prefill rows of prompts given as embeddings: (flat row indices, their rows), on the device.
    input_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # A multi-step decode (decode_steps > 1): forwards per row on the device, the rows'
    # page tables, and the widest context of the first forward.
    row_steps: torch.Tensor | None = None
    tables: torch.Tensor | None = None
    span: int = 0
    all_positions: torch.Tensor | None = None  # [k, B]: each forward's positions
    all_slots: torch.Tensor | None = None  # [k, B]: each forward's KV slots (scratch past a row's end)
    all_kv_lens: torch.Tensor | None = None  # [k, B]: each forward's attended length
    all_sample_indices: torch.Tensor | None = None  # [k, B]: each forward's generation indices
    feed: torch.Tensor | None = None  # [k, B]: forced tokens fed as inputs (-1: the one sampled before)
    sampling: SamplingBatch | None = None  # the first forward's, for the later ones to reuse
    # A talker's conditioning (:mod:`omni_async.core.conditioning`): this forward's
    # ``(rows [B, Hc], mask [B])``; a multi-step decode's every forward's in ``all_cond``.
    cond: tuple[torch.Tensor, torch.Tensor] | None = None
    all_cond: tuple[torch.Tensor, torch.Tensor] | None = None
    # A prefill whose rows asked for their prompt's hidden states: each row's
    # ``(first flat token, tokens, first position)``.
    prompt_rows: list[tuple[int, int, int]] | None = None


def prompt_embeds(
    batch: ScheduledBatch, starts: np.ndarray, prefix: np.ndarray, n: np.ndarray, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An extend's flat rows that lie in a prompt given as embeddings, and those rows on
    ``device`` (row ``i`` covers positions ``[prefix[i], prefix[i] + n[i])`` from flat
    row ``starts[i]``: a chunk takes its slice, a re-prefill after retraction the prompt
    part again, and tokens generated after the prompt keep their ids); None when no
    row has any. The model casts them to its dtype."""
    flat, values = [], []
    for i, req in enumerate(batch.reqs):
        embeds = getattr(req.data, "input_embeds", None)
        if embeds is None:
            continue
        lo, hi = int(prefix[i]), min(int(prefix[i] + n[i]), int(embeds.shape[0]))
        if hi > lo:
            flat.append(np.arange(starts[i], starts[i] + hi - lo))
            values.append(embeds[lo:hi])
    if not flat:
        return None
    rows = torch.from_numpy(np.concatenate(flat)).to(device, non_blocking=True)
    return rows, torch.cat([v.to(device, non_blocking=True) for v in values])


def token_tables(inputs: InputBatch, fb: ForwardBatch) -> torch.Tensor:
    """Each token row of the prefill ``fb``: its request's page table ``[rows, pages]``, on
    the device (a prefill's positions run as decode rows read them: runners/prefill_rows.py)."""
    row_of = np.repeat(np.arange(fb.batch.size), np.asarray(fb.batch.extend_lens, dtype=np.int64))
    return inputs.block_tables(fb.rows).index_select(0, torch.from_numpy(row_of).to(fb.input_ids.device, non_blocking=True))

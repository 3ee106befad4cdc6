"""A step's forward inputs, packed on rank 0 into one header and one int64 tensor, and
unpacked by the workers into the same call.

Rank 0 builds its forward batch as it always does (page tables, KV slots, decode
inputs still in flight resolved from its own slot state); what the model call reads
then goes out as one broadcast: the token ids and positions, every tensor field of the
attention context, the per-sequence slices of the CPU reference path, and the page
tables of a CUDA graph replay. The header carries the scalar fields and each tensor's
shape and dtype, so workers allocate the receive buffer without a second message and
need no scheduling state of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ....kv.attention import AttentionContext
from .comm import OP_FORWARD

# Tensor fields, by id (the order they are packed in).
_CTX_FIELDS = ("slot_mapping", "logits_rows", "kv_slots", "kv_lens", "block_tables", "q_starts", "q_lens", "prefix_lens")
FIELDS = ("input_ids", "positions", *_CTX_FIELDS, "seq_slices", "seq_kv_slots", "graph_tables")
_DTYPES = (torch.int64, torch.int32)
_FIXED = 6  # op, is_decode, page_size, use_kernel, max_q_len, field count
_PER_FIELD = 4  # id, dtype, rows, cols (cols 0 for a 1-d tensor)


@dataclass
class ForwardInputs:
    """What a worker calls its model (or its CUDA graph) with."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    ctx: AttentionContext
    graph_tables: torch.Tensor | None


def pack(input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext, graph_tables: torch.Tensor | None) -> tuple[list[int], torch.Tensor]:
    """The header (ints) and the payload (one flat int64 tensor on the inputs' device)."""
    named: list[tuple[int, torch.Tensor]] = [(0, input_ids), (1, positions)]
    for i, name in enumerate(_CTX_FIELDS, start=2):
        value = getattr(ctx, name)
        if value is not None:
            named.append((i, value))
    if ctx.seq_slices is not None:
        named.append((FIELDS.index("seq_slices"), torch.tensor(ctx.seq_slices, dtype=torch.int64).to(input_ids.device)))
        named.append((FIELDS.index("seq_kv_slots"), torch.cat(ctx.seq_kv_slots or [])))
    if graph_tables is not None:
        named.append((FIELDS.index("graph_tables"), graph_tables))
    header = [OP_FORWARD, int(ctx.is_decode), int(ctx.page_size), int(ctx.use_kernel), int(ctx.max_q_len), len(named)]
    for fid, t in named:
        header += [fid, _DTYPES.index(t.dtype), t.shape[0], t.shape[1] if t.ndim == 2 else 0]
    payload = torch.cat([t.reshape(-1).to(torch.int64) for _fid, t in named])
    return header, payload


def payload_numel(header: list[int]) -> int:
    total = 0
    for k in range(header[5]):
        _fid, _dt, rows, cols = header[_FIXED + _PER_FIELD * k : _FIXED + _PER_FIELD * (k + 1)]
        total += rows * max(cols, 1)
    return total


def unpack(header: list[int], payload: torch.Tensor) -> ForwardInputs:
    fields: dict[str, torch.Tensor] = {}
    offset = 0
    for k in range(header[5]):
        fid, dt, rows, cols = header[_FIXED + _PER_FIELD * k : _FIXED + _PER_FIELD * (k + 1)]
        n = rows * max(cols, 1)
        t = payload[offset : offset + n].to(_DTYPES[dt])
        fields[FIELDS[fid]] = t.view(rows, cols) if cols else t
        offset += n
    ctx = AttentionContext(
        is_decode=bool(header[1]),
        slot_mapping=fields["slot_mapping"],
        logits_rows=fields["logits_rows"],
        page_size=header[2],
        use_kernel=bool(header[3]),
        max_q_len=header[4],
        **{name: fields[name] for name in _CTX_FIELDS[2:] if name in fields},
    )
    if "seq_slices" in fields:
        slices = [tuple(s) for s in fields["seq_slices"].tolist()]
        ctx.seq_slices = slices  # type: ignore[assignment]
        ctx.seq_kv_slots = list(fields["seq_kv_slots"].split([p + n for _s, n, p in slices]))
    return ForwardInputs(fields["input_ids"], fields["positions"], ctx, fields.get("graph_tables"))

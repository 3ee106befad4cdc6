"""The native runner: our decoder over the paged KV cache, on CPU or CUDA."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.batch import ScheduledBatch
from ..kv.attention import AttentionContext, slots_from_tables
from ..kv.cache import PagedKVCache
from ..models.decoder import DecoderModel
from .base import ModelRunner
from ..kernels import triton_available
from .cuda_graphs import DecodeGraphs
from .types import BatchResult, SchedulerOutput


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    ctx: AttentionContext
    batch: ScheduledBatch
    block_tables: torch.Tensor | None = None  # set when the step replays a CUDA graph


class NativeModelRunner(ModelRunner):
    def __init__(self, model: DecoderModel, kv: PagedKVCache, device: torch.device, *, capture_hidden: bool = False) -> None:
        super().__init__()
        # When set, each sampled row's final hidden state goes out with its step output
        # (``RequestOutput.extra["hidden_state"]``), e.g. for a downstream talker stage.
        self.capture_hidden = capture_hidden
        self.graphs: DecodeGraphs | None = None
        # Decode attention through the Triton paged kernel (CUDA with Triton).
        self.use_kernel = triton_available(device)
        self.model = model
        self.kv = kv
        self.device = device
        self.page_size = kv.page_size

    def _slots(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        ps = self.page_size
        table = torch.tensor(pages, dtype=torch.long)
        pos = torch.arange(start, end, dtype=torch.long)
        return table[pos // ps] * ps + pos % ps

    def build_forward_batch(self, scheduler_output: SchedulerOutput) -> ForwardBatch:
        batch = scheduler_output.batch_data
        assert batch is not None
        return self._build_decode(batch) if batch.is_decode else self._build_extend(batch)

    def _build_decode(self, batch: ScheduledBatch) -> ForwardBatch:
        """One host tensor, one copy: token ids, positions, KV slots and lengths are
        computed in plain Python per row and moved together."""
        ps = self.page_size
        pos = batch.prefix_lens  # the new token's position = tokens already cached
        slots = [t[p // ps] * ps + p % ps for t, p in zip(batch.page_tables, pos)]
        host = torch.tensor([batch.input_ids, pos, slots, [p + 1 for p in pos]], dtype=torch.long)
        input_ids, positions, slot_mapping, kv_lens = host.to(self.device, non_blocking=True).unbind(0)
        rows = torch.arange(batch.size, device=self.device)
        graphed = self._graph_tables(batch)
        if graphed is not None:
            ctx = AttentionContext(is_decode=True, slot_mapping=slot_mapping, logits_rows=rows, kv_lens=kv_lens)
        elif self.use_kernel:
            ctx = AttentionContext(
                is_decode=True, slot_mapping=slot_mapping, logits_rows=rows, kv_lens=kv_lens,
                block_tables=self._page_tables(batch, scratch=0), page_size=ps, use_kernel=True,
            )
        else:  # the torch reference: pages gathered into a padded [B, L] view
            tables = self._page_tables(batch, scratch=0)
            kv_slots = slots_from_tables(tables, ps)[:, : max(pos) + 1]
            ctx = AttentionContext(is_decode=True, slot_mapping=slot_mapping, logits_rows=rows, kv_lens=kv_lens, kv_slots=kv_slots)
        self._fill_inflight_inputs(input_ids, batch)
        return ForwardBatch(input_ids=input_ids, positions=positions, ctx=ctx, batch=batch, block_tables=graphed)

    def _build_extend(self, batch: ScheduledBatch) -> ForwardBatch:
        if self.use_kernel:
            return self._build_extend_for_kernel(batch)
        dev = self.device
        input_ids = torch.tensor(batch.input_ids, dtype=torch.long)
        positions = torch.cat(
            [torch.arange(p, p + n, dtype=torch.long) for p, n in zip(batch.prefix_lens, batch.extend_lens)]
        )
        seq_slots = [self._slots(t, 0, p + n) for t, p, n in zip(batch.page_tables, batch.prefix_lens, batch.extend_lens)]
        slot_mapping = torch.cat([sl[p:] for sl, p in zip(seq_slots, batch.prefix_lens)])
        ends = torch.tensor(batch.extend_lens, dtype=torch.long).cumsum(0)
        starts = (ends - torch.tensor(batch.extend_lens)).tolist()
        ctx = AttentionContext(
            is_decode=False,
            slot_mapping=slot_mapping.to(dev),
            logits_rows=(ends - 1).to(dev),
            seq_slices=[(st, n, p) for st, n, p in zip(starts, batch.extend_lens, batch.prefix_lens)],
            seq_kv_slots=[sl.to(dev) for sl in seq_slots],
        )
        input_ids = input_ids.to(dev, non_blocking=True)
        self._fill_inflight_inputs(input_ids, batch)
        return ForwardBatch(input_ids=input_ids, positions=positions.to(dev, non_blocking=True), ctx=ctx, batch=batch)

    def _build_extend_for_kernel(self, batch: ScheduledBatch) -> ForwardBatch:
        """Extend inputs for the Triton kernel: flat token ids, positions and KV slots, and
        per-sequence starts, lengths and prefixes, computed in Python and copied once."""
        ps = self.page_size
        positions: list[int] = []
        slots: list[int] = []
        starts: list[int] = []
        at = 0
        for table, p, n in zip(batch.page_tables, batch.prefix_lens, batch.extend_lens):
            starts.append(at)
            at += n
            for pos in range(p, p + n):
                positions.append(pos)
                slots.append(table[pos // ps] * ps + pos % ps)
        flat = torch.tensor([batch.input_ids, positions, slots], dtype=torch.long).to(self.device, non_blocking=True)
        input_ids, pos_t, slot_mapping = flat.unbind(0)
        seqs = torch.tensor(
            [starts, batch.extend_lens, batch.prefix_lens, [s + n - 1 for s, n in zip(starts, batch.extend_lens)]],
            dtype=torch.long,
        ).to(self.device, non_blocking=True)
        q_starts, q_lens, prefix_lens, logits_rows = seqs.unbind(0)
        ctx = AttentionContext(
            is_decode=False,
            slot_mapping=slot_mapping,
            logits_rows=logits_rows,
            block_tables=self._page_tables(batch, scratch=0),
            page_size=ps,
            use_kernel=True,
            q_starts=q_starts,
            q_lens=q_lens,
            prefix_lens=prefix_lens,
            max_q_len=max(batch.extend_lens),
        )
        self._fill_inflight_inputs(input_ids, batch)
        return ForwardBatch(input_ids=input_ids, positions=pos_t, ctx=ctx, batch=batch)

    @staticmethod
    def _fill_inflight_inputs(input_ids: torch.Tensor, batch: ScheduledBatch) -> None:
        """Decode inputs still in flight come from the previous step's sampled tokens on
        the device: one gather per source tensor, no host round trip."""
        groups: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        for pos, req in batch.inflight_inputs:
            ref = req.last_token_ref
            if ref is None:
                raise RuntimeError(f"request {req.rid}: decode input is in flight but no token was published")
            tokens, row = ref
            entry = groups.setdefault(id(tokens), (tokens, [], []))
            entry[1].append(pos)
            entry[2].append(row)
        for tokens, positions, rows in groups.values():
            dst = torch.tensor(positions, dtype=torch.long).to(input_ids.device, non_blocking=True)
            src = torch.tensor(rows, dtype=torch.long).to(tokens.device, non_blocking=True)
            input_ids[dst] = tokens[src].to(input_ids.dtype)

    def _graph_tables(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """Page tables for a decode step that fits a captured graph, else None."""
        graphs = self.graphs
        if graphs is None or not batch.is_decode or self.capture_hidden:
            return None
        widest = max(len(t) for t in batch.page_tables)
        if not graphs.fits(batch.size, widest):
            return None
        return self._page_tables(batch, scratch=graphs.scratch_page)

    def _page_tables(self, batch: ScheduledBatch, scratch: int) -> torch.Tensor:
        widest = max(len(t) for t in batch.page_tables)
        rows = [t + [scratch] * (widest - len(t)) for t in batch.page_tables]
        return torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)

    def enable_cuda_graphs(self, *, scratch_page: int, max_len: int, max_batch: int) -> None:
        """Capture decode graphs (CUDA only)."""
        self.graphs = DecodeGraphs(
            self.model,
            self.kv,
            scratch_page=scratch_page,
            max_pages_per_seq=-(-max_len // self.page_size),
            max_batch=max_batch,
            device=self.device,
            use_kernel=self.use_kernel,
        )
        self.graphs.capture_all()

    def row_output_ids(self, forward_batch: ForwardBatch, schedule_batch, row: int) -> list[int]:
        ids = super().row_output_ids(forward_batch, schedule_batch, row)
        if schedule_batch.output_snapshots[row] is None:
            return ids
        # A decode input still in flight is the newest output token: read it here.
        for pos, req in schedule_batch.inflight_inputs:
            if req is schedule_batch.reqs[row]:
                ids.append(int(forward_batch.input_ids[pos]))
        return ids

    def forward(self, forward_batch: ForwardBatch) -> BatchResult:
        if forward_batch.block_tables is not None and self.graphs is not None:
            ctx = forward_batch.ctx
            logits = self.graphs.replay(
                forward_batch.input_ids, forward_batch.positions, ctx.slot_mapping, forward_batch.block_tables, ctx.kv_lens
            )
            return BatchResult(logits=logits, can_run_cuda_graph=True)
        if self.capture_hidden:
            logits, hidden = self.model(
                forward_batch.input_ids, forward_batch.positions, self.kv, forward_batch.ctx, return_hidden=True
            )
            return BatchResult(logits=logits, hidden_states=hidden)
        logits = self.model(forward_batch.input_ids, forward_batch.positions, self.kv, forward_batch.ctx)
        return BatchResult(logits=logits)

    def post_process_outputs(self, result, scheduler_output, outputs) -> None:
        if result.hidden_states is None:
            return
        hidden = result.hidden_states.detach().to("cpu", torch.float32)
        for i, sched_req in enumerate(scheduler_output.requests):
            out = outputs[sched_req.request_id]
            if out.data is not None:
                out.extra["hidden_state"] = hidden[i].clone()

    # The native decode collect has nothing model-specific: the launch publishes the
    # sampled ids (already on the device), the resolve has nothing left to read.
    def post_decode_launch(self, result, forward_batch, requests):
        return result.next_token_ids

    def post_decode_resolve(self, launch_buf, result, forward_batch, schedule_batch, requests) -> None:
        result.next_token_ids = launch_buf

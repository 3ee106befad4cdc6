"""The native runner: our decoder over the paged KV cache, on CPU or CUDA.

Inputs come from the persistent slot state (``InputBatch``): a step hands the device
its rows' slot indices, positions, host-known token ids and generation indices in one
small copy, and everything else (page tables, KV slots, decode inputs still in flight,
sampling settings) is gathered there by slot.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..core.batch import ScheduledBatch
from ..core.core_state import DecodeSteps
from ..kernels import cpu_decode_stack, model_ops, triton_available
from ..kv.attention import AttentionContext, slots_from_tables
from ..kv.cache import PagedKVCache
from ..models.decoder import DecoderModel
from ..models.quantized import float_head, float_rows
from .sampling import SampleResult, SamplingBatch, kernel_serves, sample
from .base import ModelRunner
from .hooks import attach_hidden_extras, hidden_states_only
from .cuda_graphs import DecodeGraphs
from .conditioning import decode_rows, gather_rows
from .forward_batch import ForwardBatch, prompt_embeds
from .fused_decode import FusedBatch, FusedDecode, fed_tokens, fused_counters, leaves_hooks, own_tokens
from .fused_split import merge_fused, merge_rest, plan_fused
from .graph_sampling import SamplingGraphs
from .input_batch import InputBatch, SlotRows
from .multi_forward import Forwards, forward_by_forward
from .prefill_rows import prefill_as_rows
from .prompt_scores import score_prompts, scored_rows
from ..core.runner_io import SchedulerOutput
from .types import BatchResult


# Filtered sampling replays graphs for decode buckets up to this size (their sort over
# the vocabulary needs memory that grows with the batch); larger steps sample eagerly.
SAMPLING_GRAPH_MAX_BATCH = 16


class NativeModelRunner(ModelRunner):
    def __init__(self, model: DecoderModel, kv: PagedKVCache, device: torch.device, *, capture_hidden: bool = False,
                 seed: int = 0, fused_kernels: bool = True, cpu_attention_kernel: bool = False, cpu_fused_ops: bool = False,
                 decode_steps: DecodeSteps = DecodeSteps(), fuse_decode_steps: bool = True) -> None:
        """``cpu_attention_kernel`` / ``cpu_fused_ops``: the C++ CPU kernels (loaded by the builder)."""
        super().__init__(seed=seed)
        self.capture_hidden = capture_hidden  # every request's hidden states go out (a thinker feeding a talker)
        self.graphs: DecodeGraphs | None = None
        self.fused_decode: FusedDecode | None = None  # multi-step decodes in one launch
        self.decode_plan = DecodeSteps()
        self._later_cols: dict[int, torch.Tensor] = {}  # a multi-step decode's forward offsets
        self.sampling_graphs: SamplingGraphs | None = None
        # Decode attention through the Triton paged kernel (CUDA with Triton).
        self.use_kernel = triton_available(device)
        # Fused elementwise kernels need the Triton attention path (the rotated keys go
        # straight to the cache); elsewhere the model keeps its reference ops.
        self.fused = fused_kernels and self.use_kernel
        model.ops = model_ops(triton=self.fused, cpu=cpu_fused_ops)
        model.cpu_stack = cpu_decode_stack(model) if cpu_fused_ops and cpu_attention_kernel else None
        self.model, self.kv, self.device, self.page_size = model, kv, device, kv.page_size
        self.inputs = InputBatch(kv.page_size, model.config.vocab_size, device)
        self.cpu_attention_kernel = cpu_attention_kernel
        self.cpu_fused_ops = cpu_fused_ops
        self.configure_decode_steps(decode_steps, fused=fuse_decode_steps)

    def build_forward_batch(self, scheduler_output: SchedulerOutput, capture_hidden_mode=None) -> ForwardBatch:
        batch = scheduler_output.batch_data
        assert batch is not None
        counts = batch.page_counts or [len(t) for t in batch.page_tables]
        rows = self.inputs.assign(batch.reqs, batch.epochs, batch.page_tables, counts, self.base_seed, (batch.step_id, batch.carried))
        sidx = np.asarray(batch.sample_indices, dtype=np.int64)
        capture = self.capture_hidden or capture_hidden_mode is not None or self.inputs.wants_hidden(rows)
        if batch.is_decode:
            return self._build_decode(batch, rows, sidx, capture)
        prompt = any(r.sampling.return_prompt_hidden_states or r.sampling.prompt_logprobs is not None for r in batch.reqs)
        fb = self._build_extend(batch, rows, sidx, prompt)
        fb.capture_hidden = capture or prompt
        return fb

    def _build_decode(self, batch: ScheduledBatch, rows: SlotRows, sidx: np.ndarray, capture: bool) -> ForwardBatch | FusedBatch:
        """One small host array, one copy; the rest is gathered on the device."""
        # (a step masking between its forwards runs them one by one: .multi_forward)
        fused = self._fused_batch(batch, rows, sidx, capture) if batch.row_steps is not None and not batch.masks_between else None
        if fused is None:
            return self._unfused_decode(batch, rows, sidx, capture)
        fused.capture_hidden = capture
        fused.cond = self._decode_cond(fused.batch, fused.steps, fused.host.shape[0])
        return fused

    def _decode_cond(self, batch: ScheduledBatch, steps: int, size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A talker's conditioning of a decode step (:func:`.conditioning.decode_rows`)."""
        proj = self.model.thinker_to_talker_proj
        return None if proj is None else decode_rows(proj, batch.reqs, batch.prefix_lens, steps, size, self.device)

    def _unfused_decode(self, batch: ScheduledBatch, rows: SlotRows, sidx: np.ndarray, capture: bool = False) -> ForwardBatch:
        multi = batch.row_steps is not None
        host = np.array([batch.prefix_lens, batch.input_ids, sidx] + ([batch.row_steps] if multi else []), dtype=np.int64)
        positions, host_ids, sidx_dev, *rest = torch.from_numpy(host).to(self.device, non_blocking=True).unbind(0)
        # A decode input still in flight (-1 on the host) is the slot's newest token.
        input_ids = torch.where(host_ids >= 0, host_ids, self.inputs.last_token.index_select(0, rows.slots_dev))
        tables = self.inputs.block_tables(rows)
        graphed = self._graph_tables(batch, rows, tables)
        span = max(batch.prefix_lens) + 1
        all_cond = self._decode_cond(batch, max(batch.row_steps) if multi else 1, batch.size)
        cond = None if all_cond is None else (all_cond[0][0], all_cond[1][0])
        if not multi:
            ctx = self._decode_ctx(tables, positions, self._slots(tables, positions), graphed, span)
            return ForwardBatch(input_ids, positions, ctx, batch, rows, sidx, sidx_dev, block_tables=graphed, capture_hidden=capture,
                                cond=cond)
        # A multi-step decode: every forward's inputs in one go, [k, B] (each torch call
        # costs the H200's host 10-100 us: per-forward arithmetic would be paid k times).
        (steps,) = rest
        later = self._later(max(batch.row_steps))
        all_positions = positions + torch.minimum(steps - 1, later)  # rows past their end repeat it
        all_slots = self._slots(tables, all_positions.T).T
        all_slots = torch.where(steps > later, all_slots, (self.kv.num_pages - 1) * self.page_size)  # ... writing to scratch
        all_kv_lens = all_positions + 1
        ctx = self._decode_ctx(tables, positions, all_slots[0], graphed, span, kv_lens=all_kv_lens[0])
        fb = ForwardBatch(input_ids, positions, ctx, batch, rows, sidx, sidx_dev, block_tables=graphed, capture_hidden=capture,
                          cond=cond, all_cond=all_cond)
        fb.row_steps, fb.tables, fb.span, fb.all_positions, fb.all_slots = steps, tables, span, all_positions, all_slots
        fb.all_kv_lens, fb.all_sample_indices = all_kv_lens, sidx_dev + later
        fb.feed = fed_tokens(batch, self.device)
        return fb

    def configure_decode_steps(self, plan: DecodeSteps, *, fused: bool = True) -> None:
        """Forwards per decode step by batch size (the stage plan's ``decode_steps``); ``fused``:
        multi-step decodes run as one launch (a graph per bucket, k and sampling mode
        when CUDA graphs are captured after this, else eagerly)."""
        self.decode_plan = plan
        self.fused_decode = FusedDecode(self.model, self.kv) if plan.most > 1 and fused else None

    def _fused_batch(self, batch: ScheduledBatch, rows: SlotRows, sidx: np.ndarray, capture: bool = False) -> FusedBatch | None:
        """A multi-step decode as one fused launch (sampling included), its logprob rows
        split off to run forward by forward (:mod:`.fused_split`); None (every forward
        replays the one-forward graphs) when this runner overrides a hook the fused
        launch skips, no row can run fused, or (with CUDA graphs) no fused graph fits."""
        if self.fused_decode is None or not leaves_hooks(self, NativeModelRunner):
            return None
        def rest(sub: ScheduledBatch, sub_rows: SlotRows, sub_sidx: np.ndarray) -> ForwardBatch:
            return self._unfused_decode(sub, sub_rows, sub_sidx, capture)

        return plan_fused(self.fused_decode, self.inputs, batch, rows, sidx, self.graphs is not None, rest)

    def _fused_step(self, fb: FusedBatch, requests: list, lookahead: bool) -> tuple[BatchResult, torch.Tensor | None]:
        """Replay (or run) the fused forwards and publish the rows' newest tokens; then
        the split-off rows, forward by forward, and the two merged."""
        fused = self.fused_decode
        assert fused is not None

        def eager_ctx(tables, positions, slots, kv_lens, j):
            return self._decode_ctx(tables, positions, slots, None, fb.span + j, kv_lens=kv_lens)

        if fb.mode.grammar:  # its rows under a grammar sample their one token under their masks
            fb.allowed = self.grammar_masks.fill(fb.batch, self.inputs.vocab, self.device, fused=True)
        out, hidden = fused.run(fb, self.inputs, eager_ctx)
        size = fb.batch.size
        self.inputs.publish_steps(fb.rows.slots_dev, own_tokens(fb, out))
        # A graph's hidden states are its static buffer: copied out before the next replay.
        hidden = hidden[:, :size].clone() if fb.capture_hidden and hidden is not None else None
        result = BatchResult(logits=None, next_token_ids=out[0], sample_ok=out[1], can_run_cuda_graph=fb.bucket is not None, packed=out,
                             hidden_states=hidden)
        if fb.split is not None:
            split, merged = fb.split, merge_fused(fb.split, out, hidden)
            rest, _ = self._forward_and_sample(split.rest, split.rest.batch, requests, False, lookahead)
            result = merge_rest(split, merged, rest)
        return result, (result.next_token_ids if lookahead else None)

    def stats(self) -> dict[str, int]:
        grows = 0 if self.inputs is None else self.inputs.grows  # (None once the stage released its memory)
        return {**fused_counters(self.fused_decode), "slot_table_grows": grows, **super().stats()}

    def _later(self, k: int) -> torch.Tensor:
        """``[[0], [1], ..., [k-1]]`` on the device, made once per k."""
        col = self._later_cols.get(k)
        if col is None:
            col = self._later_cols[k] = torch.arange(k, device=self.device)[:, None]
        return col

    def _slots(self, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """KV slots of ``positions`` (``[B]`` or ``[B, k]``) through the rows' page tables."""
        ps = self.page_size
        pages = tables.gather(1, (positions // ps).reshape(positions.shape[0], -1)).reshape(positions.shape)
        return pages * ps + positions % ps

    def _decode_ctx(self, tables: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                    graphed: torch.Tensor | None, span: int, rows: torch.Tensor | None = None,
                    kv_lens: torch.Tensor | None = None) -> AttentionContext:
        """Where each row's new KV goes and what it attends to."""
        ps = self.page_size
        logits_rows = torch.arange(positions.shape[0], device=self.device) if rows is None else rows
        kv_lens = positions + 1 if kv_lens is None else kv_lens
        ctx = AttentionContext(is_decode=True, slot_mapping=slot_mapping, logits_rows=logits_rows, kv_lens=kv_lens)
        if graphed is None and self.use_kernel:
            ctx.block_tables, ctx.page_size, ctx.use_kernel = tables, ps, True
        elif graphed is None:  # the torch reference: pages gathered into a padded [B, L] view
            ctx.kv_slots = slots_from_tables(tables, ps)[:, :span]
            ctx.cpu_kernel = self.cpu_attention_kernel
        return ctx

    def multi_step_allowed(self) -> bool:
        """Several forwards per decode step hand out a hidden state per forward; a runner
        whose capture hook decides per step (a subclass) gets one forward per step."""
        return type(self).requested_capture_hidden_mode_decode is ModelRunner.requested_capture_hidden_mode_decode

    def _forward_and_sample(self, fb: ForwardBatch, batch: ScheduledBatch, requests: list, is_prefill: bool, lookahead: bool):
        """A multi-step decode runs its forwards back to back, each on the tokens the one
        before sampled (published to the slots, so penalties see them); the step's
        result holds every forward's tokens, forward-major ``[k, B]``."""
        if isinstance(fb, FusedBatch):
            return self._fused_step(fb, requests, lookahead)
        if fb.row_steps is None:
            return super()._forward_and_sample(fb, batch, requests, is_prefill, lookahead)
        return forward_by_forward(self, fb, batch, requests, lookahead)

    def _enqueue_forward(self, fb: ForwardBatch, batch: ScheduledBatch, requests: list, lookahead: bool):
        """A late-mask step of several forwards (``core.multi_step.late_between``) enqueues its first."""
        if fb.row_steps is None:
            return super()._enqueue_forward(fb, batch, requests, lookahead)
        return Forwards(self, fb, batch, requests, lookahead)

    def _sample_started(self, started, fb: ForwardBatch, batch: ScheduledBatch, requests: list, lookahead: bool):
        if isinstance(started, Forwards):
            return started.finish()
        return super()._sample_started(started, fb, batch, requests, lookahead)

    def _build_extend(self, batch: ScheduledBatch, rows: SlotRows, sidx: np.ndarray, prompt_hidden: bool = False) -> ForwardBatch:
        """Flat token positions and KV slots computed with numpy from the host page
        tables, then copied once."""
        ps, dev = self.page_size, self.device
        n = np.asarray(batch.extend_lens, dtype=np.int64)
        prefix = np.asarray(batch.prefix_lens, dtype=np.int64)
        ends = np.cumsum(n)
        starts = ends - n
        row_of = np.repeat(np.arange(batch.size), n)
        pos = prefix[row_of] + np.arange(int(ends[-1])) - starts[row_of]
        slot_mapping = self.inputs.table[rows.slots[row_of], pos // ps] * ps + pos % ps
        ids = np.asarray(batch.input_ids, dtype=np.int64)
        flat = torch.from_numpy(np.stack([ids, pos, slot_mapping])).to(dev, non_blocking=True)
        input_ids, positions, slot_mapping_dev = flat.unbind(0)
        if (ids < 0).any():  # in-flight inputs come from the slots' newest tokens
            src = self.inputs.last_token.index_select(0, rows.slots_dev[torch.from_numpy(row_of).to(dev, non_blocking=True)])
            input_ids = torch.where(input_ids >= 0, input_ids, src)
        seqs = torch.from_numpy(np.stack([starts, n, prefix, ends - 1, sidx])).to(dev, non_blocking=True)
        q_starts, q_lens, prefix_lens, logits_rows, sidx_dev = seqs.unbind(0)
        ctx = AttentionContext(is_decode=False, slot_mapping=slot_mapping_dev, logits_rows=logits_rows)
        if self.use_kernel:
            ctx.block_tables, ctx.page_size, ctx.use_kernel = self.inputs.block_tables(rows), ps, True
            ctx.q_starts, ctx.q_lens, ctx.prefix_lens = q_starts, q_lens, prefix_lens
            ctx.max_q_len = int(n.max())
        else:
            ctx.seq_slices = list(zip(starts.tolist(), n.tolist(), prefix.tolist()))
            ctx.seq_kv_slots = [self._seq_slots(int(s), int(p + k)) for s, p, k in zip(rows.slots, prefix, n)]
            ctx.cpu_prefill = self.cpu_fused_ops
        fb = ForwardBatch(input_ids, positions, ctx, batch, rows, sidx, sidx_dev)
        if self.model.thinker_to_talker_proj is not None:
            spans = [(int(p), int(c), int(s), 1) for p, c, s in zip(prefix, n, starts)]
            fb.cond = gather_rows(self.model.thinker_to_talker_proj, batch.reqs, spans, int(ends[-1]), dev)
        if prompt_hidden:
            fb.prompt_rows = [(int(s), int(c), int(p)) for s, c, p in zip(starts, n, prefix)]
        fb.input_embeds = prompt_embeds(batch, starts, prefix, n, dev)
        return fb

    def _seq_slots(self, slot: int, length: int) -> torch.Tensor:
        ps = self.page_size
        pages = self.inputs.host_pages(slot, -(-length // ps))
        slots = (pages[:, None] * ps + np.arange(ps)).reshape(-1)[:length]
        return torch.from_numpy(slots).to(self.device, non_blocking=True)

    def _graph_tables(self, batch: ScheduledBatch, rows: SlotRows, tables: torch.Tensor) -> torch.Tensor | None:
        """Page tables for a decode step that fits a captured graph, else None."""
        graphs = self.graphs
        if graphs is None or not graphs.fits(batch.size, rows.widest):
            return None
        if self.model.thinker_to_talker_proj is not None and graphs.cond_rows is None:
            return None  # captured before the projection was attached: they ignore it
        return tables

    def enable_cuda_graphs(self, *, scratch_page: int, max_len: int, max_batch: int) -> None:
        """Capture decode graphs (CUDA only). Unused page-table entries then point at the
        scratch page, which padded graph rows write to."""
        self.inputs.set_pad_page(scratch_page)
        max_pages = -(-max_len // self.page_size)
        if self.fused_decode is not None:
            self.inputs.reserve(pages=max_pages)  # the fused graphs gather whole table rows
        self.graphs = DecodeGraphs(self.model, self.kv, scratch_page=scratch_page, max_pages_per_seq=max_pages,
                                   max_batch=max_batch, device=self.device, use_kernel=self.use_kernel, greedy_in_graph=self.fused)
        self.graphs.capture_all()
        graphs = self.graphs
        if self.fused_decode is not None:
            lows = (0,) + graphs.buckets[:-1]
            plan = self.decode_plan
            wanted = {b: {plan.for_batch(n) for n in range(low + 1, b + 1)} - {1} for low, b in zip(lows, graphs.buckets)}
            self.fused_decode.capture(wanted, graphs.max_pages, scratch_page, self.use_kernel, graphs.pool, self.device)
        if self.fused:
            self.sampling_graphs = SamplingGraphs(lambda b: graphs.graphs[b][1].logits, graphs.bucket_for,
                                                  max_batch=min(SAMPLING_GRAPH_MAX_BATCH, graphs.max_batch), device=self.device)

    def forward(self, forward_batch: ForwardBatch) -> BatchResult:
        if not forward_batch.ctx.is_decode and (rows := prefill_as_rows(self.graphs, self.inputs, forward_batch)) is not None:
            return rows  # a short prefill replays a decode graph (.prefill_rows)
        if forward_batch.block_tables is not None and self.graphs is not None:
            ctx = forward_batch.ctx
            out = self.graphs.replay(
                forward_batch.input_ids, forward_batch.positions, ctx.slot_mapping, forward_batch.block_tables, ctx.kv_lens,
                forward_batch.cond,
            )
            greedy = None if out.greedy_tokens is None else (out.greedy_tokens, out.greedy_ok)
            # The graph's hidden states are its static buffer: copied out before the next replay.
            hidden = out.hidden.clone() if forward_batch.capture_hidden else None
            return BatchResult(logits=out.logits, can_run_cuda_graph=True, graph_greedy=greedy, hidden_states=hidden)
        fb = forward_batch
        inputs = dict(cond=fb.cond, input_embeds=fb.input_embeds)
        if fb.prompt_rows is not None:
            # A scored prompt's rows run in float32 on a quantised model (models/quantized.py).
            with float_rows(scored_rows(fb.batch.reqs, fb.prompt_rows, fb.input_ids.shape[0], self.device)):
                logits, every = self.model(fb.input_ids, fb.positions, self.kv, fb.ctx, return_hidden="all", **inputs)
            return BatchResult(logits=logits, hidden_states=every[fb.ctx.logits_rows], prompt_hidden=(every, fb.prompt_rows),
                               prompt_logprobs=score_prompts(float_head(self.model.lm_head), every, fb.batch.reqs, fb.prompt_rows))
        if fb.capture_hidden:
            logits, hidden = self.model(fb.input_ids, fb.positions, self.kv, fb.ctx, return_hidden=True, **inputs)
            return BatchResult(logits=logits, hidden_states=hidden)
        return BatchResult(logits=self.model(fb.input_ids, fb.positions, self.kv, fb.ctx, **inputs))

    # ------------------------------------------------------------ sampling state

    def sample_logits(self, result: BatchResult, sb: SamplingBatch, top_k_logprobs: int) -> SampleResult:
        """A plain greedy step takes the tokens its graph already sampled; a filtered one
        at small batch replays a sampling graph."""
        if result.graph_greedy is not None and sb.plain_greedy and not top_k_logprobs:
            tokens, ok = result.graph_greedy
            return SampleResult(tokens=tokens, logprobs=None, ok=ok)
        sampler = self.sampling_graphs
        if kernel_serves(result.logits, sb, top_k_logprobs):
            sampler = None  # the sampling kernels, eagerly: ``sample`` routes it
        if result.can_run_cuda_graph and sampler is not None and sampler.eligible(sb, top_k_logprobs):
            tokens, ok = sampler.sample(sb)
            return SampleResult(tokens=tokens, logprobs=None, ok=ok)
        return sample(result.logits, sb, top_k_logprobs)

    def sampling_batch(self, forward_batch: ForwardBatch, schedule_batch, requests, vocab: int) -> SamplingBatch:
        """The later forwards of a multi-step decode reuse the first one's settings with
        their own generation indices, unless a penalty or a ban (which read the tokens
        sampled so far) has to be gathered again."""
        first = forward_batch.sampling
        if first is not None and first.penalty is None and first.ban is None and first.controls is None:
            return dataclasses.replace(first, sample_indices=forward_batch.sample_indices_dev)
        sb = self.inputs.sampling_batch(forward_batch.rows, forward_batch.sample_indices, forward_batch.sample_indices_dev)
        if forward_batch.row_steps is not None:
            forward_batch.sampling = sb
        return sb

    def publish_tokens(self, result: BatchResult, forward_batch: ForwardBatch, schedule_batch) -> None:
        """Rows that keep their token record it in their slot: the next decode step
        reads it there even before the host has seen it."""
        if isinstance(forward_batch, FusedBatch) or forward_batch.row_steps is not None:
            return  # a multi-step decode published its tokens as it went
        tokens = result.next_token_ids
        slots = forward_batch.rows.slots_dev
        if not schedule_batch.is_decode and not all(schedule_batch.samples_kept):
            kept = np.flatnonzero(np.asarray(schedule_batch.samples_kept))
            if not len(kept):
                return
            kept_dev = torch.from_numpy(kept).to(self.device, non_blocking=True)
            slots, tokens = slots.index_select(0, kept_dev), tokens.index_select(0, kept_dev)
        self.inputs.publish(slots, tokens)

    @hidden_states_only
    def post_process_outputs(self, result, scheduler_output, outputs) -> None:
        """The reference's contract for a runner whose capture hook asked for a step's
        hidden states (requests asking through ``SamplingParams`` get theirs in deltas)."""
        if self.capture_hooked():
            attach_hidden_extras(result.hidden_states, scheduler_output, outputs)

    # The native decode collect has nothing model-specific: the launch publishes the
    # sampled ids (already on the device), the resolve has nothing left to read.
    def post_decode_launch(self, result, forward_batch, requests):
        return result.next_token_ids

    def post_decode_resolve(self, launch_buf, result, forward_batch, schedule_batch, requests) -> None:
        result.next_token_ids = launch_buf


"""A multi-step decode as one launch: k forwards, their inputs and their sampling.

Why: a multi-step decode run forward by forward costs the host about 25 torch calls per
forward (input arithmetic, static-buffer copies, the replay, sampling, copying the
tokens out), and each call costs the H200's host 10-100 us: at 256 rows the launch took
longer than the device needed for the forwards. Everything between the step's inputs
and its tokens is fixed-shape device work (sampling too, see :mod:`.fused_sampling`),
so it can be one CUDA graph per batch bucket, k and sampling mode: the host copies one
small ``[B, 5]`` array in, gathers the rows' page tables, newest tokens and sampling
settings into the graph's input buffers, replays, and copies ``[2, k, B]`` out. Rows
that need logprobs run forward by forward beside it (:mod:`.fused_split`).

The graph body computes what the forward-by-forward path computes on the host's
behalf: forward ``j`` of a row that runs ``s`` forwards sits at position ``p + min(j, s -
1)``, writes its KV to the row's page there while ``j < s`` and to the scratch slot after
(a row past its length limit, or a padding row with ``s = 0``), and reads as input the
token forward ``j - 1`` sampled. Without graphs (CPU, or a batch no graph fits) the
same body runs eagerly; the tokens are those of the forward-by-forward path.

Rows under a grammar run in the same launch and sample one token, at their last forward
``s - 1``, under the step's bitmask (one more input, every bit set for the free rows; a
static buffer of the graph, filled in place before the replay). ``s`` is 1, or one more
than the forced tokens a jump-forward appended (:mod:`omni_async.structured.jump`): those
are fed in as the inputs of forwards 1 .. s-1 (a ``[k, B]`` input, -1 where the sampled
token is the input), so the launch computes their KV, and what those forwards sample is
not read. Their forwards after ``s - 1``, whose masks the host has not computed, are
discarded like those of a row past its length limit: they repeat the row's position,
attend to its first position only, write their KV to the scratch slot and never to the
row's pages (which the batch core
sized for ``s`` tokens), and their tokens are never read (the slots' newest token is the
row's own, see :func:`own_tokens`). One launch reads the weights once per forward for
every row of the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..core.batch import ScheduledBatch
from ..core.jump_steps import fed_inputs
from ..kv.attention import AttentionContext
from ..kv.cache import PagedKVCache
from ..models.decoder import DecoderModel
from .fused_sampling import GREEDY, TEMPERATURE, RowSettings, SamplingMode, sample_forward
from .input_batch import InputBatch, SlotRows
from .streams import STREAMS

# Columns of the step's host array: the row's position before this step, its input token
# (-1: still in flight, read from its slot's newest token), the forwards it runs, its
# slot, and the generation index of its first token (the seeds' counter).
POSITION, TOKEN, STEPS, SLOT, INDEX = range(5)
COLUMNS = 5


@dataclass
class FusedBatch:
    """A multi-step decode run as one launch (:mod:`.fused_decode`): its rows, their
    ``[B, 5]`` host inputs, its sampling mode, and the graph bucket it replays (None:
    eagerly). ``split``: the step's other rows, run forward by forward beside it."""

    batch: ScheduledBatch
    rows: SlotRows
    host: np.ndarray
    steps: int  # forwards (the most any row runs)
    bucket: int | None
    span: int  # the widest context of the first forward (the eager path's attention span)
    mode: SamplingMode = GREEDY
    capture_hidden: bool = False
    split: object | None = None  # a fused_split.Split: the whole step and its other rows
    # A talker's conditioning of each forward: ``[k, B, Hc]`` rows and ``[k, B]`` mask.
    cond: tuple[torch.Tensor, torch.Tensor] | None = None
    # The grammar bitmask of the rows' sampling forwards (``[B', ceil(V/32)]`` int32 on
    # the device, every bit set for free rows), and the ``[k, B]`` host array of tokens
    # fed as forward inputs (-1: the token sampled before), when ``mode.grammar``.
    allowed: torch.Tensor | None = None
    feed: np.ndarray | None = None
    # The launch's ``[B, 5]`` inputs on the device (set by the run): the rows' forward counts.
    inputs_dev: torch.Tensor | None = None


# Runner hooks a fused multi-step decode skips (it runs no per-forward Python): it is
# taken only while a runner leaves all of them as they are here.
FUSED_SKIPS = (
    "before_decode", "custom_decode_forward", "post_decode", "post_decode_launch", "post_decode_resolve",
    "sample_before_post_decode", "sample_logits", "sampling_batch", "forward", "post_process_outputs",
    "on_generation_steps_advanced", "on_generation_step_advanced", "finalize_skip_rids",
)


def leaves_hooks(runner: object, base: type) -> bool:
    """Whether ``runner`` leaves every hook in FUSED_SKIPS as ``base`` has it (on its
    class and on the instance)."""
    cls, own = type(runner), runner.__dict__
    return all(getattr(cls, name) is getattr(base, name) and name not in own for name in FUSED_SKIPS)


# ctx_for(tables, positions, slots, kv_lens, j) -> the attention context of forward j.
ContextFactory = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], AttentionContext]


def fused_forwards(
    model: DecoderModel,
    kv: PagedKVCache,
    steps: int,
    inputs: torch.Tensor,
    newest: torch.Tensor,
    tables: torch.Tensor,
    scratch_slot: int,
    ctx_for: ContextFactory,
    out: torch.Tensor,
    mode: SamplingMode = GREEDY,
    settings: RowSettings | None = None,
    hidden_out: torch.Tensor | None = None,
    cond: tuple[torch.Tensor, torch.Tensor] | None = None,
    allowed: torch.Tensor | None = None,
    feed: torch.Tensor | None = None,
) -> None:
    """``steps`` forwards of the rows in ``inputs`` (``[B, 5]``, columns above),
    ``newest`` their slots' newest tokens and ``tables`` their page tables, each
    sampled in ``mode`` from ``settings`` (greedy: none needed); writes each forward's
    tokens and ``ok`` flags into ``out`` (``[2, steps, B]`` int64) and, when given, its
    final hidden states into ``hidden_out`` (``[steps, B, H]``). ``cond``: each
    forward's conditioning rows and mask (``[steps, B, Hc]``, ``[steps, B]``);
    ``allowed`` and ``feed``: the rows' grammar bitmask, applied at each row's last
    forward, and the ``[steps, B]`` tokens fed as inputs (-1: the one sampled before),
    when ``mode.grammar``."""
    ps = kv.page_size
    start, row_steps = inputs[:, POSITION], inputs[:, STEPS]
    ids = torch.where(inputs[:, TOKEN] >= 0, inputs[:, TOKEN], newest)
    last_forward = row_steps - 1
    for j in range(steps):
        if feed is not None and j:
            ids = torch.where(feed[j] >= 0, feed[j], ids)
        positions = start + last_forward.clamp(0, j)
        pages = tables.gather(1, (positions // ps)[:, None])[:, 0]
        runs = row_steps > j
        slots = torch.where(runs, pages * ps + positions % ps, scratch_slot)
        # A discarded forward attends to one position, not the row's whole context: its
        # outputs are never read, and a constrained row beside free rows would otherwise
        # re-read its context in each of the launch's k - 1 later forwards.
        kv_lens = torch.where(runs, positions + 1, 1)
        ctx = ctx_for(tables, positions, slots, kv_lens, j)
        step_cond = None if cond is None else (cond[0][j], cond[1][j])
        logits, hidden = model(ids, positions, kv, ctx, return_hidden=True, float_logits=False, cond=step_cond)
        if hidden_out is not None:
            hidden_out[j].copy_(hidden)
        mask = None
        if allowed is not None:  # every bit set (-1) in the rows that do not sample here under it
            mask = allowed | (last_forward != j).to(allowed.dtype).neg()[:, None]
        ids, ok = sample_forward(logits, mode, settings, j, mask)
        out[0, j].copy_(ids)
        out[1, j].copy_(ok)


def own_tokens(fb: FusedBatch, out: torch.Tensor) -> torch.Tensor:
    """The launch's ``[k, B]`` tokens with each row's forwards past its own count
    holding its last own token: what the slots record as the rows' newest (and seen)
    tokens. A row under a grammar, or one at its length limit, ran fewer forwards than
    the launch; the tokens its discarded forwards sampled are no one's."""
    size = fb.batch.size
    tokens = out[0, :, :size]
    steps = fb.host[:size, STEPS]
    if int(steps.min()) >= fb.steps:
        return tokens
    # Which forward's token each slot keeps, from the host's copy of the forward counts:
    # one small copy and a gather rather than half a dozen device ops.
    keep = np.minimum(np.arange(fb.steps)[:, None], np.maximum(steps - 1, 0)[None, :])
    return tokens.gather(0, torch.from_numpy(keep).to(tokens.device, non_blocking=True))


class FusedDecode:
    """Runs :func:`fused_forwards` for a step: replaying the captured graph of its bucket,
    forward count and sampling mode when CUDA graphs are on, else eagerly (any count)."""

    def __init__(self, model: DecoderModel, kv: PagedKVCache) -> None:
        self.model = model
        self.kv = kv
        self.scratch_slot = (kv.num_pages - 1) * kv.page_size
        self.max_pages = 0  # the graphs' page-table width (0: no graphs)
        # (bucket, k, mode) -> the graph and its output buffers (tokens and ok; hidden states)
        self.graphs: dict[tuple[int, int, SamplingMode], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.cond: tuple[torch.Tensor, torch.Tensor] | None = None  # the graphs' conditioning inputs
        self.wanted: dict[int, set[int]] = {}  # bucket -> the forward counts its steps use
        self.buckets: tuple[int, ...] = ()
        self.masks: dict[str, torch.Tensor] = {}  # the graphs' static [n, V] slot-mask copies
        self.launches = 0
        self.replays = 0
        self.sampled = 0  # launches that sampled (a mode other than plain greedy)
        self.captures_later = 0  # graphs captured on a step's first need of their mode
        self.beside_grammar = 0  # launches beside rows under a grammar split off (they asked for what a launch lacks)
        self.with_grammar = 0  # launches holding rows under a grammar (sampled under the launch's bitmask)
        self.allowed: torch.Tensor | None = None  # the graphs' static [n, ceil(V/32)] bitmask input
        self.feed: torch.Tensor | None = None  # and their [k, n] fed tokens

    # ------------------------------------------------------------ graphs

    @torch.inference_mode()
    def capture(self, wanted: dict[int, set[int]], max_pages: int, scratch_page: int, use_kernel: bool, pool,
                device: torch.device, modes: tuple[SamplingMode, ...] = (GREEDY, TEMPERATURE)) -> None:
        """A graph per bucket and forward count in ``wanted`` (bucket -> the counts its
        batches use) for each of ``modes`` now, other modes the first time a step needs
        them; over static input buffers sized for the largest bucket, whose tables'
        unused columns hold the scratch page. ``pool``: the decode graphs' memory pool,
        shared (steps replay one at a time on one stream)."""
        wanted = {b: ks for b, ks in wanted.items() if ks}
        if not wanted:
            return
        n = max(wanted)
        self.inputs = torch.zeros((n, COLUMNS), dtype=torch.long, device=device)
        self.newest = torch.zeros(n, dtype=torch.long, device=device)
        self.tables = torch.full((n, max_pages), scratch_page, dtype=torch.long, device=device)
        self.fp = torch.ones((n, 5), dtype=torch.float32, device=device)  # InputBatch's columns
        self.ip = torch.zeros((n, 3), dtype=torch.long, device=device)
        self.rows = torch.arange(n, device=device)
        k_most = max(max(ks) for ks in wanted.values())
        proj = self.model.thinker_to_talker_proj
        self.cond = None if proj is None else (
            torch.zeros((k_most, n, proj.in_features), dtype=proj.weight.dtype, device=device),
            torch.zeros((k_most, n), dtype=proj.weight.dtype, device=device),
        )
        self.max_pages, self.pool, self.use_kernel, self.device = max_pages, pool, use_kernel, device
        self.wanted = wanted
        self.buckets = tuple(sorted(wanted))
        for mode in modes:
            for b in sorted(wanted, reverse=True):
                for k in sorted(wanted[b], reverse=True):
                    self._capture(b, k, mode)
        torch.cuda.synchronize(device)

    def _capture(self, b: int, k: int, mode: SamplingMode) -> None:
        """Capture one graph. Its warm-up runs read the static inputs, which are zeroed
        first: every row then runs no forward of its own and writes only the scratch slot."""
        device, ps = self.device, self.kv.page_size
        for name in mode.masks:
            if name not in self.masks:
                self.masks[name] = torch.zeros((self.inputs.shape[0], self.model.config.vocab_size), dtype=torch.bool,
                                               device=device)
        if mode.grammar and self.allowed is None:
            words, n = (self.model.config.vocab_size + 31) // 32, self.inputs.shape[0]
            self.allowed = torch.full((n, words), -1, dtype=torch.int32, device=device)
            self.feed = torch.full((max(max(ks) for ks in self.wanted.values()), n), -1, dtype=torch.long, device=device)
        self.inputs.zero_()
        allowed = feed = None
        if mode.grammar:
            assert self.allowed is not None and self.feed is not None
            allowed, feed = self.allowed[:b], self.feed[:k, :b]
            feed.fill_(-1)

        def ctx_for(tables, positions, slots, kv_lens, j):
            return AttentionContext(is_decode=True, slot_mapping=slots, logits_rows=self.rows[:b], kv_lens=kv_lens,
                                    block_tables=tables, page_size=ps, use_kernel=self.use_kernel)

        def body(out: torch.Tensor, hidden_out: torch.Tensor) -> None:
            settings = RowSettings(self.fp[:b], self.ip[:b], self.inputs[:b, INDEX],
                                   {name: self.masks[name][:b] for name in mode.masks})
            cond = None if self.cond is None else (self.cond[0][:k, :b], self.cond[1][:k, :b])
            fused_forwards(self.model, self.kv, k, self.inputs[:b], self.newest[:b], self.tables[:b],
                           self.scratch_slot, ctx_for, out, mode, settings, hidden_out, cond, allowed, feed)

        hidden_size = self.model.config.hidden_size
        dtype = self.model.model.embed_tokens.weight.dtype
        with STREAMS.borrowed(device) as stream, torch.cuda.stream(stream):
            scratch_out = torch.empty((2, k, b), dtype=torch.long, device=device)
            hidden_out = torch.empty((k, b, hidden_size), dtype=dtype, device=device)
            for _ in range(2):  # warm up outside the graph
                body(scratch_out, hidden_out)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                out = torch.empty((2, k, b), dtype=torch.long, device=device)
                # Every forward's final hidden states are kept (a [k, b, H] copy, small
                # beside the forwards' weight reads), so a step that hands them out
                # replays the same graph as one that does not.
                hidden_out = torch.empty((k, b, hidden_size), dtype=dtype, device=device)
                body(out, hidden_out)
        self.graphs[(b, k, mode)] = (graph, out, hidden_out)

    def graph_for(self, rows: int, widest: int, steps: int) -> int | None:
        """The bucket whose graphs of ``steps`` forwards a step of ``rows`` rows replays,
        or None (none captured for that count)."""
        if widest > self.max_pages:
            return None
        if self.model.thinker_to_talker_proj is not None and self.cond is None:
            return None  # captured before the projection was attached: they ignore it
        bucket = next((b for b in self.buckets if b >= rows), None)
        return bucket if bucket is not None and steps in self.wanted[bucket] else None

    def grammar_bucket(self, rows: int, widest: int, steps: int) -> int | None:
        """The bucket a step holding rows under a grammar replays with ``steps``
        forwards, any count up to the bucket's most (rows fed forced tokens make counts
        the plan does not: each such graph is captured on its first need, so a step runs
        only the forwards its rows use); None when none fits."""
        if widest > self.max_pages or (self.model.thinker_to_talker_proj is not None and self.cond is None):
            return None
        bucket = next((b for b in self.buckets if b >= rows), None)
        return bucket if bucket is not None and steps <= max(self.wanted[bucket]) else None

    # ------------------------------------------------------------ a step

    def batch(self, batch: ScheduledBatch, rows: SlotRows, sidx: np.ndarray, steps: int, bucket: int | None,
              mode: SamplingMode) -> FusedBatch:
        """The step's ``[B, 5]`` host array, padded to its graph's bucket (padding rows
        run no forward: 0 steps, position 0, token 0, slot 0)."""
        size = batch.size
        arr = np.zeros((bucket or size, COLUMNS), dtype=np.int64)
        arr[:size, POSITION] = batch.prefix_lens
        arr[:size, TOKEN] = batch.input_ids
        arr[:size, STEPS] = batch.row_steps
        arr[:size, SLOT] = rows.slots
        arr[:size, INDEX] = sidx
        feed = None
        if mode.grammar:
            feed = np.full((steps, bucket or size), -1, dtype=np.int64)
            for i, tokens in fed_inputs(batch):
                feed[1 : 1 + len(tokens), i] = tokens
        return FusedBatch(batch, rows, arr, steps, bucket, max(batch.prefix_lens) + 1, mode, feed=feed)

    @torch.inference_mode()
    def run(self, fb: FusedBatch, slots: InputBatch, eager_ctx: ContextFactory) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[2, steps, B]`` tokens and ``ok`` flags of the step (B: the bucket when a
        graph ran, whose padding rows the reader skips), read from the slots' page
        tables, newest tokens and sampling settings in ``slots``; and ``[steps, B, H]``
        final hidden states (a graph's static buffer, overwritten by its next replay;
        eagerly only when ``fb.capture_hidden``, else None). Enqueued, not waited for."""
        self.launches += 1
        self.sampled += not fb.mode.greedy
        self.with_grammar += fb.mode.grammar
        src = torch.from_numpy(fb.host)
        bucket, steps, mode = fb.bucket, fb.steps, fb.mode
        if bucket is not None:
            if (bucket, steps, mode) not in self.graphs:
                self._capture(bucket, steps, mode)
                self.captures_later += 1
            graph, out, hidden = self.graphs[(bucket, steps, mode)]
            self.inputs[:bucket].copy_(src, non_blocking=True)
            idx = self.inputs[:bucket, SLOT]
            table_dev = slots.table_dev
            if table_dev.shape[1] != self.max_pages:
                table_dev = table_dev[:, : self.max_pages]
            torch.index_select(table_dev, 0, idx, out=self.tables[:bucket])
            torch.index_select(slots.last_token, 0, idx, out=self.newest[:bucket])
            if not mode.greedy:
                torch.index_select(slots.fp_dev, 0, idx, out=self.fp[:bucket])
                torch.index_select(slots.ip_dev, 0, idx, out=self.ip[:bucket])
                for name in mode.masks:
                    torch.index_select(slots.masks[name], 0, idx, out=self.masks[name][:bucket])
            if mode.grammar:
                assert self.allowed is not None and fb.allowed is not None
                # In place: the graph reads this buffer. Padding rows keep what they held
                # (their tokens are never read).
                self.allowed[: fb.allowed.shape[0]].copy_(fb.allowed, non_blocking=True)
                assert self.feed is not None and fb.feed is not None
                self.feed[:steps, :bucket].copy_(torch.from_numpy(fb.feed), non_blocking=True)
            if self.cond is not None:
                if fb.cond is None:
                    self.cond[1][:steps, :bucket].zero_()
                else:
                    self.cond[0][:steps, :bucket].copy_(fb.cond[0], non_blocking=True)
                    self.cond[1][:steps, :bucket].copy_(fb.cond[1], non_blocking=True)
            graph.replay()
            self.replays += 1
            fb.inputs_dev = self.inputs[:bucket]
            return out, hidden
        device = slots.table_dev.device
        inputs = src.to(device, non_blocking=True)
        idx = inputs[:, SLOT]
        out = torch.empty((2, steps, fb.host.shape[0]), dtype=torch.long, device=device)
        hidden = None
        if fb.capture_hidden:
            dtype = self.model.model.embed_tokens.weight.dtype
            hidden = torch.empty((steps, fb.host.shape[0], self.model.config.hidden_size), dtype=dtype, device=device)
        tables = slots.table_dev.index_select(0, idx)[:, : fb.rows.widest]
        settings = None
        if not mode.greedy:
            settings = RowSettings(slots.fp_dev.index_select(0, idx), slots.ip_dev.index_select(0, idx), inputs[:, INDEX],
                                   {name: slots.masks[name].index_select(0, idx) for name in mode.masks})
        fused_forwards(self.model, self.kv, steps, inputs, slots.last_token.index_select(0, idx), tables,
                       self.scratch_slot, eager_ctx, out, mode, settings, hidden, fb.cond, fb.allowed,
                       None if fb.feed is None else torch.from_numpy(fb.feed).to(device, non_blocking=True))
        fb.inputs_dev = inputs
        return out, hidden


def fed_tokens(batch: ScheduledBatch, device: torch.device) -> torch.Tensor | None:
    """The launch's ``[k, B]`` feed input: a jump-forward's forced tokens, fed to the
    forwards after a row's first (-1 elsewhere); None when no row has any."""
    fed = fed_inputs(batch)
    if not fed:
        return None
    feed = np.full((max(batch.row_steps or (1,)), batch.size), -1, dtype=np.int64)
    for i, tokens in fed:
        feed[1 : 1 + len(tokens), i] = tokens
    return torch.from_numpy(feed).to(device, non_blocking=True)


def fused_counters(f: "FusedDecode | None") -> dict[str, int]:
    """``info()``'s fused multi-step counters: launches, graph replays, sampled launches,
    graphs captured after start-up, launches beside split-off grammar rows and with
    grammar rows inside."""
    return {"fused_decode_launches": f.launches if f else 0, "fused_decode_replays": f.replays if f else 0,
            "fused_decode_sampled": f.sampled if f else 0, "fused_decode_late_captures": f.captures_later if f else 0,
            "fused_decode_beside_grammar": f.beside_grammar if f else 0,
            "fused_decode_with_grammar": f.with_grammar if f else 0}

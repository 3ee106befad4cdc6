"""A multi-step greedy decode as one launch: k forwards, their inputs and their sampling.

Why: a multi-step decode run forward by forward costs the host about 25 torch calls per
forward (input arithmetic, static-buffer copies, the replay, sampling, copying the
tokens out), and each call costs the H200's host 10-100 us: at 256 rows the launch took
longer than the device needed for the forwards. When every row is plain greedy (no
sampling filters, penalties, bans or logprobs), everything between the step's inputs
and its tokens is fixed-shape device work, so it can be one CUDA graph per batch bucket and k:
the host copies one small ``[B, 4]`` array in, gathers the rows' page tables and newest
tokens into the graph's input buffers, replays, and copies ``[2, k, B]`` out.

The graph body computes what the forward-by-forward path computes on the host's
behalf: forward ``j`` of a row that runs ``s`` forwards sits at position ``p + min(j, s -
1)``, writes its KV to the row's page there while ``j < s`` and to the scratch slot after
(a row past its length limit, or a padding row with ``s = 0``), and reads as input the
greedy token of forward ``j - 1``. Without graphs (CPU, or a batch no graph fits) the
same body runs eagerly; the tokens are those of the forward-by-forward path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..core.batch import ScheduledBatch
from ..kv.attention import AttentionContext
from ..kv.cache import PagedKVCache
from ..models.decoder import DecoderModel
from .sampling import greedy
from .input_batch import SlotRows

# Columns of the step's host array: the row's position before this step, its input token
# (-1: still in flight, read from its slot's newest token), the forwards it runs, its slot.
POSITION, TOKEN, STEPS, SLOT = range(4)


@dataclass
class FusedBatch:
    """A multi-step greedy decode run as one launch (:mod:`.fused_decode`): its rows,
    their ``[B, 4]`` host inputs, and the graph bucket it replays (None: eagerly)."""

    batch: ScheduledBatch
    rows: SlotRows
    host: np.ndarray
    steps: int  # forwards (the most any row runs)
    bucket: int | None
    span: int  # the widest context of the first forward (the eager path's attention span)
    capture_hidden: bool = False


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
) -> None:
    """``steps`` greedy forwards of the rows in ``inputs`` (``[B, 4]``, columns above),
    ``newest`` their slots' newest tokens and ``tables`` their page tables; writes each
    forward's tokens and ``ok`` flags into ``out`` (``[2, steps, B]`` int64)."""
    ps = kv.page_size
    start, row_steps = inputs[:, POSITION], inputs[:, STEPS]
    ids = torch.where(inputs[:, TOKEN] >= 0, inputs[:, TOKEN], newest)
    last_forward = row_steps - 1
    for j in range(steps):
        positions = start + last_forward.clamp(0, j)
        pages = tables.gather(1, (positions // ps)[:, None])[:, 0]
        slots = torch.where(row_steps > j, pages * ps + positions % ps, scratch_slot)
        kv_lens = positions + 1
        logits = model(ids, positions, kv, ctx_for(tables, positions, slots, kv_lens, j), float_logits=False)
        ids, ok = greedy(logits)
        out[0, j].copy_(ids)
        out[1, j].copy_(ok)


class FusedDecode:
    """Runs :func:`fused_forwards` for a step: replaying the captured graph of its bucket
    and forward count when CUDA graphs are on, else eagerly (any forward count)."""

    def __init__(self, model: DecoderModel, kv: PagedKVCache) -> None:
        self.model = model
        self.kv = kv
        self.scratch_slot = (kv.num_pages - 1) * kv.page_size
        self.max_pages = 0  # the graphs' page-table width (0: no graphs)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (bucket, k)
        self.buckets: tuple[int, ...] = ()
        self.launches = 0
        self.replays = 0

    # ------------------------------------------------------------ graphs

    @torch.inference_mode()
    def capture(self, wanted: dict[int, set[int]], max_pages: int, scratch_page: int, use_kernel: bool, pool,
                device: torch.device) -> None:
        """A graph per bucket and forward count in ``wanted`` (bucket -> the counts its
        batches use), over static input buffers sized for the largest bucket; the tables'
        unused columns hold the scratch page. ``pool``: the decode graphs' memory pool,
        shared (steps replay one at a time on one stream)."""
        wanted = {b: ks for b, ks in wanted.items() if ks}
        if not wanted:
            return
        n, ps = max(wanted), self.kv.page_size
        self.inputs = torch.zeros((n, 4), dtype=torch.long, device=device)
        self.newest = torch.zeros(n, dtype=torch.long, device=device)
        self.tables = torch.full((n, max_pages), scratch_page, dtype=torch.long, device=device)
        self.rows = torch.arange(n, device=device)
        self.max_pages = max_pages

        def ctx_for(b: int) -> ContextFactory:
            def make(tables, positions, slots, kv_lens, j):
                return AttentionContext(is_decode=True, slot_mapping=slots, logits_rows=self.rows[:b], kv_lens=kv_lens,
                                        block_tables=tables, page_size=ps, use_kernel=use_kernel)
            return make

        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for b in sorted(wanted, reverse=True):
                args = (self.inputs[:b], self.newest[:b], self.tables[:b], self.scratch_slot, ctx_for(b))
                for k in sorted(wanted[b], reverse=True):
                    scratch_out = torch.empty((2, k, b), dtype=torch.long, device=device)
                    for _ in range(2):  # warm up outside the graph
                        fused_forwards(self.model, self.kv, k, *args, scratch_out)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        out = torch.empty((2, k, b), dtype=torch.long, device=device)
                        fused_forwards(self.model, self.kv, k, *args, out)
                    self.graphs[(b, k)] = (graph, out)
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        self.buckets = tuple(sorted(wanted))

    def graph_for(self, rows: int, widest: int, steps: int) -> int | None:
        """The bucket whose graph of ``steps`` forwards a step of ``rows`` rows replays,
        or None (none captured)."""
        if widest > self.max_pages:
            return None
        bucket = next((b for b in self.buckets if b >= rows), None)
        return bucket if (bucket, steps) in self.graphs else None

    # ------------------------------------------------------------ a step

    def batch(self, batch: ScheduledBatch, rows: SlotRows, steps: int, bucket: int | None) -> FusedBatch:
        """The step's ``[B, 4]`` host array, padded to its graph's bucket (padding rows
        run no forward: 0 steps, position 0, token 0, slot 0)."""
        size = batch.size
        arr = np.zeros((bucket or size, 4), dtype=np.int64)
        arr[:size, POSITION] = batch.prefix_lens
        arr[:size, TOKEN] = batch.input_ids
        arr[:size, STEPS] = batch.row_steps
        arr[:size, SLOT] = rows.slots
        return FusedBatch(batch, rows, arr, steps, bucket, max(batch.prefix_lens) + 1)

    @torch.inference_mode()
    def run(self, host: np.ndarray, steps: int, bucket: int | None, table_dev: torch.Tensor, last_token: torch.Tensor,
            widest: int, eager_ctx: ContextFactory) -> torch.Tensor:
        """``[2, steps, B]`` tokens and ``ok`` flags of the step (B: the bucket when a
        graph ran, whose padding rows the reader skips). ``table_dev`` and ``last_token``:
        the slots' page tables (at least as wide as the graphs') and newest tokens.
        Enqueued, not waited for."""
        self.launches += 1
        src = torch.from_numpy(host)
        if bucket is not None:
            graph, out = self.graphs[(bucket, steps)]
            self.inputs[:bucket].copy_(src, non_blocking=True)
            slots = self.inputs[:bucket, SLOT]
            if table_dev.shape[1] != self.max_pages:
                table_dev = table_dev[:, : self.max_pages]
            torch.index_select(table_dev, 0, slots, out=self.tables[:bucket])
            torch.index_select(last_token, 0, slots, out=self.newest[:bucket])
            graph.replay()
            self.replays += 1
            return out
        inputs = src.to(table_dev.device, non_blocking=True)
        slots = inputs[:, SLOT]
        out = torch.empty((2, steps, host.shape[0]), dtype=torch.long, device=table_dev.device)
        tables = table_dev.index_select(0, slots)[:, :widest]
        fused_forwards(self.model, self.kv, steps, inputs, last_token.index_select(0, slots), tables,
                       self.scratch_slot, eager_ctx, out)
        return out

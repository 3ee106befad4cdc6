"""Every Triton kernel a request can launch, compiled while the stage starts.

Why: Triton compiles a kernel for each specialisation at the launch that first meets it
(:mod:`omni_async.kernels.triton_cache`); met inside a request, a compile holds the step
for hundreds of milliseconds (a fresh process's first NV256 run: first token 1.18 s
instead of 0.23 s). The CUDA graphs compile what they capture (decode at each bucket,
the multi-step launches, sampling in graphs); the rest is run here once, eagerly, on
the scratch page (which no request owns), with inputs laid out as the runner lays
them out:

- extend (prefill) forwards: one token (the small-M GEMMs), an odd and an even number
  of tokens, and two sequences, one of them behind a cached prefix (the paged extend
  kernel, the add + norm, rotary + KV-write and SiLU kernels);
- eager decode forwards at the smallest batch of each distinct launch of the paged
  decode kernel (split or not, and the merge's width, which follow the batch size), up
  to the stage's running limit: decodes that no graph fits (longer contexts, larger
  batches) launch those;
- prefill forwards the size of the stage's prefill chunk, a quarter and a sixteenth of
  it (sequences of up to 1,024 tokens each): these compile nothing new, but cuBLAS picks
  and loads a GEMM kernel at the first call of each class of row counts, and the caching
  allocator grows to a prefill's working set, both once; inside the first requests they
  were what was left of a fresh process's slower first run (NV256 on an H100: 5.6-6.3%
  slower, first token 74-138 ms later, with no Triton compile in a request);
- sampling: the temperature kernels over float32 logits (eager forwards) and the
  head's dtype (graphs), with greedy and sampled rows, the filtered path's torch ops,
  and the grammar bitmask kernel over both dtypes;
- the pinned host blocks of the steps' copies to the host (:func:`warm_host_copies`):
  each step copies its tokens into a pinned tensor made for it
  (:func:`omni_async.runners.host_copy.to_host`), and torch's pinned allocator makes a
  block with ``cudaHostAlloc`` whenever none of the size is free, so the first steps made
  them; made here, the first requests find them cached.

What varies with the inputs at run time (row counts, table widths, strides, the
alignment of per-row scalars) is kept out of the kernels' compile keys where they are
declared (``unspecialized`` in :mod:`omni_async.kernels.attention_block`), so these
runs cover the specialisations a request meets. Compiles after this are counted and
logged by :data:`omni_async.kernels.triton_cache.WATCH`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..kv.attention import AttentionContext, slots_from_tables
from .input_batch import MIN_P, SEED, TEMP, TOP_K, TOP_P
from .logit_controls import apply_token_bitmask
from .sampling import SamplingBatch, sample

# Extend forwards: (new tokens, cached prefix) per sequence.
EXTEND_SHAPES: tuple[tuple[tuple[int, int], ...], ...] = (
    ((1, 0),),
    ((2, 0),),
    ((3, 0),),
    ((5, 0), (2, 19)),
)


# The longest sequence of a warm-up prefill (its page table spans that many positions).
PREFILL_SEQUENCE = 1024


def prefill_shapes(prefill_tokens: int, longest: int = PREFILL_SEQUENCE) -> list[tuple[tuple[int, int], ...]]:
    """Extend shapes of ``prefill_tokens``, a quarter and a sixteenth of them (those
    beyond the small shapes above), each as sequences of up to ``longest`` tokens."""
    small = max(sum(n for n, _ in seqs) for seqs in EXTEND_SHAPES)
    out = []
    for total in sorted({prefill_tokens, prefill_tokens // 4, prefill_tokens // 16}, reverse=True):
        if total > small:
            full, rest = divmod(total, longest)
            out.append(((longest, 0),) * full + (((rest, 0),) if rest else ()))
    return out


# A step's copy to the host: int64 rows (tokens, ok flags, logprob bits) of each sampled
# row and forward ([2 or 3, B], [2 or 3, k * B] or [2, k, bucket]; runners/host_copy.py).
HOST_COPY_ROWS = 3
# Pinned blocks made of each size: a step's copy lives until it is collected, and the
# lookahead loops hold two or three steps' copies at once.
HOST_BLOCKS_PER_SIZE = 4


def host_copy_sizes(max_rows: int, max_steps: int) -> list[int]:
    """Every block size (bytes) torch's pinned allocator can make for a step's host copy
    of up to ``max_rows`` rows of ``max_steps`` forwards each: it rounds a request up to
    a power of two, from the 16 bytes of one row's token and flag."""
    most = 8 * HOST_COPY_ROWS * max(1, max_steps) * max(1, max_rows)
    return [1 << e for e in range(4, (most - 1).bit_length() + 1)]


def warm_host_copies(max_rows: int, max_steps: int, blocks: int = HOST_BLOCKS_PER_SIZE) -> int:
    """Make ``blocks`` pinned blocks of each of :func:`host_copy_sizes` and hand them back
    to torch's pinned allocator's cache (CUDA only); how many were made."""
    held = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for size in host_copy_sizes(max_rows, max_steps)
            for _ in range(blocks)]
    return len(held)


def decode_batches(max_batch: int, kv_heads: int, sm_count: int) -> list[int]:
    """The smallest batch of each distinct eager decode launch up to ``max_batch``: the
    fused small-M GEMMs or not, the decode kernel split or not, the merge's width."""
    from ..kernels.paged_decode import decode_splits
    from ..kernels.small_m import SMALL_M_MAX

    seen: dict[tuple, int] = {}
    for b in range(1, max(1, max_batch) + 1):
        splits = decode_splits(b, kv_heads, sm_count)
        key = (b <= SMALL_M_MAX, splits > 1, 1 << max(1, (splits - 1).bit_length()) if splits > 1 else 0)
        seen.setdefault(key, b)
    return sorted(seen.values())


class KernelWarmup:
    """Runs the forwards and samplers above on ``model`` over ``kv``'s last page, with
    attention through the Triton kernels (``use_kernel``, a CUDA stage's) or the torch
    path (which compiles nothing: how the CPU tests check that the warm-up writes the
    scratch page alone)."""

    def __init__(self, model: Any, kv: Any, device: torch.device, use_kernel: bool = True) -> None:
        self.model, self.kv, self.device, self.use_kernel = model, kv, device, use_kernel
        self.page_size = kv.page_size
        self.scratch = kv.num_pages - 1
        self.vocab = model.config.vocab_size

    def run(self, max_batch: int, prefill_tokens: int = 0, context_length: int | None = None) -> dict[str, Any]:
        """Everything once, the large prefills for a chunk of ``prefill_tokens`` (their
        sequences within ``context_length``); what ran (for the log)."""
        large = prefill_shapes(prefill_tokens, min(PREFILL_SEQUENCE, context_length or PREFILL_SEQUENCE))
        with torch.inference_mode():
            logits = [self.extend(seqs) for seqs in (*EXTEND_SHAPES, *large)]
            if self.use_kernel:
                sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 1
                batches = decode_batches(max_batch, self.kv.k[0].shape[1], sms)
            else:  # nothing to compile: one row and the most
                batches = sorted({1, max(1, max_batch)})
            for b in batches:
                logits.append(self.decode(b))
            two = logits[len(EXTEND_SHAPES) - 1]  # two sequences: two rows of float32 logits
            for x in (two, two.to(self.model.lm_head.weight.dtype)):
                for rows in (1, 2):
                    self.sample(x[:rows].contiguous())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"extend_shapes": len(EXTEND_SHAPES), "prefill_tokens": [sum(n for n, _ in seqs) for seqs in large],
                "decode_batches": batches}

    def _tables(self, rows: int, positions: int) -> torch.Tensor:
        pages = -(-positions // self.page_size)
        return torch.full((rows, pages), self.scratch, dtype=torch.long, device=self.device)

    def _slots(self, positions: np.ndarray) -> np.ndarray:
        return self.scratch * self.page_size + positions % self.page_size

    def extend(self, seqs: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """One extend forward, its flat inputs and per-sequence scalars stacked and split
        as the runner's ``_build_extend`` does (rows of one array: their alignment
        follows the token and sequence counts)."""
        n = np.array([s[0] for s in seqs], dtype=np.int64)
        prefix = np.array([s[1] for s in seqs], dtype=np.int64)
        ends = np.cumsum(n)
        starts = ends - n
        row_of = np.repeat(np.arange(len(seqs)), n)
        pos = prefix[row_of] + np.arange(int(ends[-1])) - starts[row_of]
        ids = np.arange(int(ends[-1]), dtype=np.int64) % self.vocab
        flat = torch.from_numpy(np.stack([ids, pos, self._slots(pos)])).to(self.device)
        input_ids, positions, slots = flat.unbind(0)
        scalars = torch.from_numpy(np.stack([starts, n, prefix, ends - 1, np.arange(len(seqs))])).to(self.device)
        q_starts, q_lens, prefix_lens, logits_rows, _ = scalars.unbind(0)
        ctx = AttentionContext(is_decode=False, slot_mapping=slots, logits_rows=logits_rows)
        if self.use_kernel:
            ctx.block_tables, ctx.page_size, ctx.use_kernel = self._tables(len(seqs), int((prefix + n).max())), self.page_size, True
            ctx.q_starts, ctx.q_lens, ctx.prefix_lens, ctx.max_q_len = q_starts, q_lens, prefix_lens, int(n.max())
        else:
            ctx.seq_slices = list(zip(starts.tolist(), n.tolist(), prefix.tolist()))
            ctx.seq_kv_slots = [torch.from_numpy(self._slots(np.arange(int(p + k)))).to(self.device) for p, k in zip(prefix, n)]
        return self.model(input_ids, positions, self.kv, ctx)

    def decode(self, batch: int) -> torch.Tensor:
        """One eager decode forward of ``batch`` rows, each at a context of a few pages."""
        length = 3 * self.page_size + 1
        positions = torch.full((batch,), length - 1, dtype=torch.long, device=self.device)
        slots = torch.from_numpy(self._slots(np.full(batch, length - 1, dtype=np.int64))).to(self.device)
        ctx = AttentionContext(is_decode=True, slot_mapping=slots, logits_rows=torch.arange(batch, device=self.device),
                               kv_lens=positions + 1)
        if self.use_kernel:
            ctx.block_tables, ctx.page_size, ctx.use_kernel = self._tables(batch, length), self.page_size, True
        else:
            ctx.kv_slots = slots_from_tables(self._tables(batch, length), self.page_size)[:, :length]
        ids = torch.arange(batch, device=self.device) % self.vocab
        return self.model(ids, positions, self.kv, ctx)

    def sample(self, logits: torch.Tensor) -> None:
        """Temperature-only rows (the Triton sampler; the first row greedy), rows with
        top-k, top-p and min-p (torch's sort path), and a grammar's bitmask."""
        rows = logits.shape[0]
        fp = torch.zeros((rows, 5), dtype=torch.float32, device=self.device)
        ip = torch.zeros((rows, 3), dtype=torch.long, device=self.device)
        fp[:, TEMP], fp[:, TOP_P] = 0.7, 1.0
        greedy = 1 if rows > 1 else 0  # a greedy row beside sampled ones where there are two
        fp[:greedy, TEMP] = 0.0
        ip[:, SEED] = 7
        index = torch.zeros(rows, dtype=torch.long, device=self.device)
        sampled = torch.arange(greedy, rows, device=self.device) if greedy else None

        def batch(**flags: Any) -> SamplingBatch:
            return SamplingBatch(temperature=fp[:, TEMP], top_k=ip[:, TOP_K], top_p=fp[:, TOP_P], min_p=fp[:, MIN_P],
                                 seeds=ip[:, SEED], sample_indices=index, sampled_rows=sampled, num_sampled=rows - greedy,
                                 **flags)

        sample(logits, batch())
        fp[:, TOP_P], fp[:, MIN_P], ip[:, TOP_K] = 0.9, 0.05, 20
        sample(logits, batch(use_top_k=True, use_top_p=True, use_min_p=True, want_logprobs=True))
        apply_token_bitmask(logits, torch.full((rows, -(-self.vocab // 32)), -1, dtype=torch.int32, device=self.device))

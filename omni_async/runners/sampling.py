"""Token sampling for a whole batch on the device, shared by every runner.

Why one vectorised pass: a step's sampling costs a fixed handful of tensor operations
whatever the batch size, with no per-row Python and no host synchronisation, so it can
be enqueued behind the forward while the host prepares the next step.

Processing order follows transformers' logits processors: repetition penalty,
suppressed tokens and stop ids before ``min_new_tokens`` on the raw logits; then
temperature, top-k, top-p, min-p.

Randomness is counter-based: a row's uniform draw is an integer hash of its base seed
and the generation index of the token being sampled, computed in torch; the token is
then picked by inverse CDF over the row's filtered distribution. A row's draw therefore
does not depend on what else is in the batch, which loop runs it, or whether it was
retracted and resumed. Unseeded requests get a base seed from the runner's own RNG
(see ``SeedSource``), so a reused request id gets fresh draws.

Safety: a row whose logits leave no admissible token (everything banned, or non-finite
logits) is reported in ``SampleResult.ok`` and sampled as token 0, so the other rows of
the batch are unaffected and no NaN leaves the sampler.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
from dataclasses import dataclass
from typing import Sequence

import torch

from ..config import SAMPLING_SEED_MASK, SamplingParams
from .logit_controls import LogitControls, apply_logit_controls, apply_token_bitmask, controls_from_rows

MASK32 = 0xFFFFFFFF
# Multipliers below 2**31, so every product of a 32-bit value stays below 2**63.
_MUL1 = 0x7FEB352D
_MUL2 = 0x5BD1E995
_SALT = 0x3C6EF372
# Temperatures below this are clamped to it: the distribution is then a point mass on
# the argmax (up to ties) instead of a division by zero.
MIN_TEMPERATURE = 1e-30


def derive_seed(*parts: object) -> int:
    digest = hashlib.blake2b("\x1f".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & SAMPLING_SEED_MASK


class SeedSource:
    """Base seeds for unseeded requests, drawn from an RNG seeded by the engine's
    ``seed``: the same engine seed reproduces a run, a reused request id does not
    repeat its samples."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(derive_seed("omni-async-sampler", seed))

    def draw(self) -> int:
        return self._rng.getrandbits(63)


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit xorshift-multiply finaliser written in int64 arithmetic."""
    h = h & MASK32
    h = h ^ (h >> 16)
    h = (h * _MUL1) & MASK32
    h = h ^ (h >> 15)
    h = (h * _MUL2) & MASK32
    return h ^ (h >> 16)


def row_uniforms(seeds: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """One uniform in ``(0, 1)`` per row from its 63-bit base seed and the generation
    index: ``float64`` so that every one of the 2**32 hash values maps to a distinct
    point."""
    h = _mix32(seeds & MASK32)
    h = _mix32(h ^ ((seeds >> 32) & MASK32) ^ _SALT)
    h = _mix32(h ^ (indices & MASK32))
    h = _mix32(h + ((indices >> 32) & MASK32))
    return (h.to(torch.float64) + 0.5) / float(1 << 32)


@dataclass
class SamplingBatch:
    """Per-row sampling inputs of one step, on the device, and host-side facts that
    choose which operations run (so choosing never reads the device)."""

    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] float32; 1 = off
    min_p: torch.Tensor  # [B] float32; 0 = off
    seeds: torch.Tensor  # [B] int64 base seeds
    sample_indices: torch.Tensor  # [B] int64 generation index of the token sampled
    penalty: torch.Tensor | None = None  # [B] float32 repetition penalty, when any row has one
    seen: torch.Tensor | None = None  # [B, V] bool: tokens the row generated so far
    ban: torch.Tensor | None = None  # [B, V] bool: tokens the row may not sample now
    raw_logprobs: torch.Tensor | None = None  # [B] bool rows asking for raw logprobs
    sampled_rows: torch.Tensor | None = None  # device index of the non-greedy rows
    controls: LogitControls | None = None  # OpenAI penalties and logit bias, when any row has them
    allowed: torch.Tensor | None = None  # [B, ceil(V/32)] int32 grammar bitmask, when any row has a grammar
    num_sampled: int = 0
    use_top_k: bool = False
    use_top_p: bool = False
    use_min_p: bool = False
    want_logprobs: bool = False

    @property
    def size(self) -> int:
        return int(self.temperature.shape[0])

    @property
    def plain_greedy(self) -> bool:
        """Every row greedy, nothing banned or penalised, no logprobs: :func:`greedy` alone."""
        return (
            not self.num_sampled and self.penalty is None and self.ban is None and not self.want_logprobs
            and self.controls is None and self.allowed is None
        )


@dataclass
class SampleResult:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, when any row asked
    ok: torch.Tensor  # [B] bool: False where the row had no admissible token
    top_ids: torch.Tensor | None = None  # [B, K] most likely tokens, when ``top_k_logprobs``
    top_logprobs: torch.Tensor | None = None  # [B, K] their logprobs


def _penalised(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Repetition penalty over generated tokens, OpenAI's penalties and logit bias, bans,
    then the grammar mask; out of place, so that the raw logits stay available for raw
    logprobs."""
    x = logits
    if sb.penalty is not None and sb.seen is not None:
        p = sb.penalty[:, None]
        scaled = torch.where(x > 0, x / p, x * p).clamp(max=torch.finfo(x.dtype).max)
        x = torch.where(sb.seen, scaled, x)
    if sb.controls is not None:
        x = apply_logit_controls(x, sb.controls)
    if sb.ban is not None:
        x = x.masked_fill(sb.ban, float("-inf"))
    if sb.allowed is not None:
        x = apply_token_bitmask(x, sb.allowed)
    return x


def _filtered(x: torch.Tensor, sb: SamplingBatch, rows: torch.Tensor | None,
              row_max: torch.Tensor | None = None) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p for the sampled rows (``x`` already selected).
    ``row_max``: each row's maximum after ``nan_to_num`` when the caller has it (a
    second reduction over the vocabulary saved)."""
    def pick(t: torch.Tensor) -> torch.Tensor:
        return t if rows is None else t.index_select(0, rows)

    temp = pick(sb.temperature).clamp_min(MIN_TEMPERATURE)[:, None]
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(x.dtype).max)
    if row_max is None:
        row_max = x.max(dim=-1).values
    x = (x - row_max[:, None]) / temp
    vocab = x.shape[-1]
    if sb.use_top_k or sb.use_top_p:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        if sb.use_top_k:
            k = pick(sb.top_k)
            k = torch.where((k > 0) & (k < vocab), k, torch.full_like(k, vocab))
            kth = sorted_x.gather(1, (k - 1)[:, None])
            sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        if sb.use_top_p:
            # Drop the tokens whose cumulative mass, counted from the least likely,
            # stays within 1 - top_p (transformers' rule): in descending order, those
            # whose exclusive prefix mass already reaches top_p. The most likely token
            # always stays (a top_p below float32's range would otherwise drop it too).
            probs = sorted_x.softmax(-1)
            before = probs.cumsum(-1) - probs
            top_p = pick(sb.top_p)[:, None]
            drop = (before >= top_p) & (top_p < 1)
            drop[:, 0] = False
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)
    if sb.use_min_p:
        probs = x.softmax(-1)
        floor = pick(sb.min_p)[:, None] * probs.max(dim=-1, keepdim=True).values
        x = x.masked_fill(probs < floor, float("-inf"))
    return x


def _draw(x: torch.Tensor, sb: SamplingBatch, rows: torch.Tensor | None) -> torch.Tensor:
    """Inverse-CDF draw per row from ``softmax(x)`` with the row's own uniform."""
    seeds = sb.seeds if rows is None else sb.seeds.index_select(0, rows)
    idx = sb.sample_indices if rows is None else sb.sample_indices.index_select(0, rows)
    u = row_uniforms(seeds, idx)
    cdf = x.softmax(-1).to(torch.float64).cumsum(-1)
    target = (u * cdf[:, -1])[:, None]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # ``u`` is at most 1 - 2**-33, so the target stays below the last cumulative value
    # and the search below the vocabulary size for every row with an admissible token;
    # the clamp keeps the others (whose token is replaced by 0) in range.
    return tokens.clamp_max(x.shape[-1] - 1)


def temperature_only(sb: SamplingBatch, top_k_logprobs: int = 0) -> bool:
    """Some row samples and nothing but a temperature and a grammar's bitmask shapes any
    row's distribution: no filter, penalty, bias or ban, no logprobs (see
    :mod:`..kernels.sample`, which reads the bitmask beside the logits). A new
    ``SamplingBatch`` field that shapes a distribution must be refused here."""
    return (
        sb.num_sampled > 0 and not (sb.use_top_k or sb.use_top_p or sb.use_min_p)
        and sb.penalty is None and sb.ban is None and sb.controls is None
        and not sb.want_logprobs and not top_k_logprobs
    )


# Whether CUDA batches of temperature-only rows go to the Triton kernels; False keeps the
# torch path everywhere (benchmarks compare the two; ``OMNI_ASYNC_SAMPLE_KERNEL=0`` sets it
# for a process). Graphs keep what they captured.
SAMPLE_KERNEL = os.environ.get("OMNI_ASYNC_SAMPLE_KERNEL", "").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def _kernel_on(device: torch.device) -> bool:
    from ..kernels import triton_available

    return triton_available(device)


def kernel_serves(logits: torch.Tensor, sb: SamplingBatch, top_k_logprobs: int = 0) -> bool:
    """The one routing decision: a temperature-only batch on CUDA goes to the Triton
    kernels; another device (CPU's torch path is the reference) or a row needing more
    keeps the torch path."""
    return SAMPLE_KERNEL and logits.is_cuda and temperature_only(sb, top_k_logprobs) and _kernel_on(logits.device)


def kernel_sample(
    logits: torch.Tensor, sb: SamplingBatch, top_k_logprobs: int = 0
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Tokens and ``ok`` from the Triton kernels (:mod:`..kernels.sample`) where
    :func:`kernel_serves` (greedy rows take their argmax there too), else None. Fixed
    shapes and no host reads: it runs inside graphs too."""
    if not kernel_serves(logits, sb, top_k_logprobs):
        return None
    from ..kernels.sample import sample_temperature

    return sample_temperature(logits, sb.temperature, sb.seeds, sb.sample_indices, allowed=sb.allowed)


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens and ``ok`` exactly as :func:`sample` gives them for a batch of plain
    greedy rows (no penalty, bans or logprobs): fixed shapes, so it can live in a graph."""
    best, tokens = logits.max(dim=-1)
    ok = best > float("-inf")
    return tokens * ok, ok  # token 0 where nothing is admissible, as in ``sample``


def sample(logits: torch.Tensor, sb: SamplingBatch, top_k_logprobs: int = 0) -> SampleResult:
    """Sample one token per row of ``logits`` (``[B, V]``, not modified; float32, or a
    graph's bfloat16/float16 logits, converted first); with ``top_k_logprobs``, also
    each row's most likely tokens in the distribution its logprobs come from (processed,
    or raw where the row asked)."""
    fast = kernel_sample(logits, sb, top_k_logprobs)
    if fast is not None:
        return SampleResult(tokens=fast[0], logprobs=None, ok=fast[1])
    if logits.dtype != torch.float32:
        logits = logits.to(torch.float32)
    x = _penalised(logits, sb)
    rows = None if sb.num_sampled == sb.size else sb.sampled_rows
    if sb.num_sampled and rows is None:
        best, tokens = x.amax(dim=-1), None  # every row draws: no argmax needed
    else:
        best, tokens = x.max(dim=-1)
    ok = best > float("-inf")  # False when every token is banned, or on NaN
    processed = x
    if sb.num_sampled:
        row_ok = ok if rows is None else ok.index_select(0, rows)
        xs = x if rows is None else x.index_select(0, rows)
        xs = torch.where(row_ok[:, None], xs, 0.0)
        # The maximum of the admissible rows after ``nan_to_num`` is their maximum
        # clamped to the finite range (they hold no NaN); rows set to 0 above have 0.
        row_best = best if rows is None else best.index_select(0, rows)
        row_max = torch.where(row_ok, row_best.clamp(max=torch.finfo(x.dtype).max), 0.0)
        fx = _filtered(xs, sb, rows, row_max)
        drawn = _draw(fx, sb, rows)
        if rows is None:
            tokens, processed = drawn, fx
        else:
            tokens = tokens.index_copy(0, rows, drawn)
            if sb.want_logprobs:
                processed = x.index_copy(0, rows, fx)
    tokens = torch.where(ok, tokens, torch.zeros_like(tokens))
    logprobs = None
    if sb.want_logprobs:
        logprobs = _logprobs(logits, processed, tokens, sb)
        logprobs = torch.where(ok, logprobs, torch.zeros_like(logprobs))
    top_ids = top_lp = None
    if top_k_logprobs:
        dist = torch.log_softmax(processed, dim=-1)
        if sb.raw_logprobs is not None:
            dist = torch.where(sb.raw_logprobs[:, None], torch.log_softmax(logits, dim=-1), dist)
        top_lp, top_ids = dist.topk(min(top_k_logprobs, dist.shape[-1]), dim=-1)
    return SampleResult(tokens=tokens, logprobs=logprobs, ok=ok, top_ids=top_ids, top_logprobs=top_lp)


def _logprobs(raw: torch.Tensor, processed: torch.Tensor, tokens: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Log-probability of each sampled token under the distribution sampled from
    (penalties, temperature, filters applied), or under the raw logits for rows that
    ask for ``logprobs_mode="raw"``."""
    at = tokens[:, None]
    out = torch.log_softmax(processed, dim=-1).gather(1, at).squeeze(1)
    if sb.raw_logprobs is not None:
        raw_lp = torch.log_softmax(raw, dim=-1).gather(1, at).squeeze(1)
        out = torch.where(sb.raw_logprobs, raw_lp, out)
    return out


# ---------------------------------------------------------------- from plain rows


@dataclass
class RowSampling:
    """What one row needs to be sampled, for callers without persistent slot state."""

    params: SamplingParams
    request_id: str
    sample_index: int  # index of the token being generated within the request
    output_ids: Sequence[int]  # tokens generated so far (repetition penalty)
    stop_ids: Sequence[int]  # banned until min_new_tokens is reached
    base_seed: int | None = None  # for unseeded rows: drawn by the runner's SeedSource
    rewinds: int = 0  # the request's ``num_rewinds``

    def seed(self) -> int:
        if self.params.resolved_seed is not None:
            return stream_seed(self.params.resolved_seed, self.rewinds)
        if self.base_seed is not None:
            return stream_seed(self.base_seed & SAMPLING_SEED_MASK, self.rewinds)
        return stream_seed(derive_seed("omni-async-unseeded-row", self.request_id), self.rewinds)


def stream_seed(seed: int, rewinds: int) -> int:
    """A row's seed after ``rewinds`` rewinds (``structured.optimistic``): the draws that
    follow a refused token must not repeat the one that drew it, or the redrawn token
    would not follow the masked distribution; the request's own history decides it, so
    every loop draws the same."""
    return seed if not rewinds else derive_seed(seed, "rewind", rewinds)


def batch_from_rows(rows: Sequence[RowSampling], vocab: int, device: torch.device, want_logprobs: bool) -> SamplingBatch:
    """A ``SamplingBatch`` built from per-row Python values (one pass over the rows)."""
    ps = [r.params for r in rows]

    def vec(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    sampled = [i for i, p in enumerate(ps) if not p.is_greedy]
    sb = SamplingBatch(
        temperature=vec([p.temperature for p in ps], torch.float32),
        top_k=vec([p.top_k for p in ps], torch.long),
        top_p=vec([p.top_p for p in ps], torch.float32),
        min_p=vec([p.min_p for p in ps], torch.float32),
        seeds=vec([r.seed() for r in rows], torch.long),
        sample_indices=vec([r.sample_index for r in rows], torch.long),
        sampled_rows=vec(sampled, torch.long) if 0 < len(sampled) < len(rows) else None,
        num_sampled=len(sampled),
        use_top_k=any(0 < ps[i].top_k < vocab for i in sampled),
        use_top_p=any(ps[i].top_p < 1 for i in sampled),
        use_min_p=any(ps[i].min_p > 0 for i in sampled),
        want_logprobs=want_logprobs,
    )
    if any(p.repetition_penalty != 1.0 for p in ps):
        sb.penalty = vec([p.repetition_penalty for p in ps], torch.float32)
        sb.seen = _row_mask([r.output_ids if r.params.repetition_penalty != 1.0 else () for r in rows], vocab, device)
    banned = [
        list(r.params.suppress_tokens) + (list(r.stop_ids) if r.sample_index < r.params.min_new_tokens else [])
        for r in rows
    ]
    if any(banned):
        sb.ban = _row_mask(banned, vocab, device)
    sb.controls = controls_from_rows(ps, [r.output_ids for r in rows], vocab, device)
    if want_logprobs and any(p.logprobs_mode == "raw" for p in ps):
        sb.raw_logprobs = vec([p.logprobs_mode == "raw" for p in ps], torch.bool)
    return sb


def _row_mask(ids_per_row: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    rows = [i for i, ids in enumerate(ids_per_row) for t in ids if 0 <= t < vocab]
    cols = [t for ids in ids_per_row for t in ids if 0 <= t < vocab]
    mask = torch.zeros(len(ids_per_row), vocab, dtype=torch.bool, device=device)
    if cols:
        # index_put_ of a device scalar: ``mask[...] = True`` copies a host True with a
        # blocking copy (the stream drains first); the indices travel in one async copy.
        rc = torch.tensor([rows, cols], dtype=torch.long).to(device, non_blocking=True)
        mask.index_put_((rc[0], rc[1]), torch.ones((), dtype=torch.bool, device=device))
    return mask


def sample_rows(
    logits: torch.Tensor, rows: Sequence[RowSampling], want_logprobs: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample one token per row from plain rows: token ids ``[B]`` and, when asked,
    their log-probabilities (see ``SamplingParams.logprobs_mode``)."""
    sb = batch_from_rows(rows, logits.shape[1], logits.device, want_logprobs)
    res = sample(logits, sb)
    return res.tokens, res.logprobs

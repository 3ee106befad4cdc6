"""Sampling inside a fused multi-step decode (:mod:`.fused_decode`): fixed shapes, no host reads.

Why: a sampled step that leaves the fused launch pays one replay and one eager sampling
pass per forward, about a fifth of the throughput at 256 rows. Everything sampling needs
per row (temperature, top-k, top-p, min-p, the base seed, the repetition penalty and the
token masks) already lives in the slots' device tables (:class:`.input_batch.InputBatch`),
so a fused launch gathers it once and samples every forward on the device; the tokens
each forward samples are marked seen there, before the next forward reads them.

Equal tokens: every row goes through the same operations as
:func:`omni_async.runners.sampling.sample` gives it in a forward-by-forward step. A filter a row
does not use is a no-op on its values (``top_k`` 0 keeps the vocabulary, ``top_p`` 1
and ``min_p`` 0 drop nothing, a penalty of 1 and an empty mask change nothing), so a
step applies the union of what its rows use; greedy rows take the argmax of their
penalised logits. Draws come from :func:`omni_async.runners.sampling.row_uniforms` with the
row's base seed and the token's generation index: the same stream as the unfused path.

A :class:`SamplingMode` names the operations a launch runs (a CUDA graph per mode): the
host picks it from its mirror of the slots' settings, never from the device. Penalties
other than the repetition penalty slot in as further per-row columns and masks (or
counts) gathered here and applied in :func:`omni_async.runners.sampling._penalised`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .logit_controls import apply_token_bitmask
from .sampling import SamplingBatch, _draw, _filtered, _penalised, greedy, kernel_sample
from .input_batch import (HAS_STOP, HAS_SUPPRESS, MIN_NEW, MIN_P, MIN_P_ON, PENALISED, PENALTY, SAMPLED, SEED, SORTS, TEMP, TOP_K,
                          TOP_P, WANT_LP)


@dataclass(frozen=True)
class SamplingMode:
    """The sampling operations of one fused launch: its graph's key beside the bucket and k."""

    sampled: bool = False  # some row has a temperature: filters and a draw
    sort: bool = False  # top-k or top-p (a sort over the vocabulary)
    min_p: bool = False
    penalty: bool = False  # repetition penalty over the tokens seen so far
    suppress: bool = False  # suppressed tokens
    stop: bool = False  # stop ids banned before min_new_tokens
    # Some row samples its first token under a grammar's bitmask (the launch's ``allowed``
    # input; its later forwards are discarded, see :mod:`.fused_decode`).
    grammar: bool = False

    @property
    def greedy(self) -> bool:
        """Only the argmax runs (after a grammar's mask, where the mode has one): no
        per-row settings are gathered."""
        return not (self.sampled or self.sort or self.min_p or self.penalty or self.suppress or self.stop)

    @property
    def masks(self) -> tuple[str, ...]:
        """The slot masks (``InputBatch.masks``) this mode reads."""
        return tuple(name for name, on in (("seen", self.penalty), ("suppress", self.suppress), ("stop", self.stop)) if on)


GREEDY = SamplingMode()
TEMPERATURE = SamplingMode(sampled=True)  # the common sampled mode, captured up front


def fallback_rows(flags: np.ndarray) -> np.ndarray:
    """Rows (by their host flags) that a fused launch cannot serve: logprobs are read
    per forward from the logits."""
    return flags[:, WANT_LP]


def sampling_mode(flags: np.ndarray, ip: np.ndarray, slots: np.ndarray, sample_indices: np.ndarray,
                  grammar: bool = False) -> SamplingMode:
    """The mode serving every row of a launch: the union of what its rows' slots ask
    (``flags``, their host flags, see ``InputBatch``: one reduction), and the stop-id ban
    where a row with stop ids is still short of ``min_new_tokens`` (``ip``: the slots' int
    settings, ``slots``: the rows'); ``grammar``: some row samples under a grammar's mask."""
    on = flags.any(axis=0)
    stop = bool(on[HAS_STOP]) and bool((flags[:, HAS_STOP] & (sample_indices < ip[slots, MIN_NEW])).any())
    return SamplingMode(sampled=bool(on[SAMPLED]), sort=bool(on[SORTS]), min_p=bool(on[MIN_P_ON]), penalty=bool(on[PENALISED]),
                        suppress=bool(on[HAS_SUPPRESS]), stop=stop, grammar=grammar)


@dataclass
class RowSettings:
    """A launch's per-row sampling inputs on the device: the slots' ``[B, 5]`` float and
    ``[B, 3]`` int settings, the generation index of each row's first token, and the
    masks its mode reads (``seen`` is updated in place as forwards sample)."""

    fp: torch.Tensor
    ip: torch.Tensor
    first_index: torch.Tensor
    masks: dict[str, torch.Tensor]


def sample_forward(logits: torch.Tensor, mode: SamplingMode, rs: RowSettings | None, j: int,
                   allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and ``ok`` of forward ``j`` (0-based) of a fused launch; marks the tokens
    seen when the mode penalises repeats. ``allowed``: this forward's ``[B, ceil(V/32)]``
    int32 grammar bitmask (every bit set for free rows and for a grammar row's forwards
    other than the one it keeps), when ``mode.grammar``."""
    if mode.greedy:
        # Masked before the argmax (one kernel on CUDA, :mod:`..kernels.token_bitmask`).
        return greedy(apply_token_bitmask(logits, allowed) if mode.grammar and allowed is not None else logits)
    assert rs is not None
    index = rs.first_index + j
    ban = rs.masks["suppress"] if mode.suppress else None
    if mode.stop:
        early = rs.masks["stop"] & (index < rs.ip[:, MIN_NEW])[:, None]
        ban = early if ban is None else ban | early
    sb = SamplingBatch(
        temperature=rs.fp[:, TEMP], top_k=rs.ip[:, TOP_K], top_p=rs.fp[:, TOP_P], min_p=rs.fp[:, MIN_P],
        seeds=rs.ip[:, SEED], sample_indices=index,
        penalty=rs.fp[:, PENALTY] if mode.penalty else None, seen=rs.masks.get("seen") if mode.penalty else None,
        ban=ban, num_sampled=rs.fp.shape[0] if mode.sampled else 0,
        use_top_k=mode.sort, use_top_p=mode.sort, use_min_p=mode.min_p,
        # The sampling kernel reads it beside the logits (no masked copy); the torch path
        # masks in ``_penalised``.
        allowed=allowed if mode.grammar else None,
    )
    tokens, ok = sample_all_rows(logits, sb)
    if mode.penalty:
        rs.masks["seen"].scatter_(1, tokens[:, None], True)
    return tokens, ok


def sample_all_rows(logits: torch.Tensor, sb: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`omni_async.runners.sampling.sample`'s tokens and ``ok`` (no logprobs) with every
    row through the same fixed-shape operations: sampled rows draw, greedy rows
    (temperature 0) take the argmax of their penalised logits."""
    fast = kernel_sample(logits, sb)
    if fast is not None:
        return fast
    x = _penalised(logits.to(torch.float32), sb)
    best, tokens = x.max(dim=-1)
    ok = best > float("-inf")
    if sb.num_sampled:
        # ``sample`` zeroes the rows without an admissible token before filtering; their
        # token is 0 whatever they draw, and rows do not mix, so a pass is saved here
        # (and the maximum is reused: the others hold no NaN).
        drawn = _draw(_filtered(x, sb, None, best.clamp(max=torch.finfo(x.dtype).max)), sb, None)
        tokens = torch.where(sb.temperature == 0, tokens, drawn)
    return torch.where(ok, tokens, torch.zeros_like(tokens)), ok

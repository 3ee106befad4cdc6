"""Request validation shared by the stage's default builder and the engine's early
checks: token ids against the vocabulary, sampling values against it."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import errors
from .config import SamplingParams


def validate_input_ids(input_ids: Any, vocab_size: int) -> list[int]:
    """A list of ints inside ``[0, vocab_size)``, checked in one vectorised pass (a
    prompt of millions of tokens costs milliseconds, not a Python loop per token)."""
    if hasattr(input_ids, "tolist") and not isinstance(input_ids, (list, tuple)):
        input_ids = input_ids.flatten().tolist() if hasattr(input_ids, "flatten") else input_ids.tolist()
    if not isinstance(input_ids, (list, tuple)):
        raise errors.InvalidRequestError(f"input_ids must be a list of ints, got {type(input_ids).__name__}")
    if len(input_ids) == 0:
        raise errors.InvalidRequestError("empty prompt: input_ids has no tokens")
    try:
        arr = np.asarray(input_ids)
    except Exception:
        arr = np.asarray(input_ids, dtype=object)
    if arr.dtype.kind not in "iu" or arr.ndim != 1 or bool in set(map(type, input_ids)):
        for i, t in enumerate(input_ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise errors.InvalidRequestError(f"input_ids[{i}] is {t!r}, not an int")
        arr = np.asarray(input_ids, dtype=object)
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise errors.InvalidRequestError(f"input_ids[{i}] = {input_ids[i]} is outside the vocabulary [0, {vocab_size})")
    return arr.astype(np.int64).tolist() if arr.dtype != object else [int(t) for t in input_ids]


def check_sampling_against_vocab(sampling: SamplingParams, vocab_size: int) -> None:
    for name in ("suppress_tokens", "stop_token_ids"):
        bad = [t for t in getattr(sampling, name) if t >= vocab_size]
        if bad:
            raise errors.InvalidRequestError(f"{name} {bad} outside the vocabulary [0, {vocab_size})")
    if len(set(sampling.suppress_tokens)) >= vocab_size:
        raise errors.InvalidRequestError("suppress_tokens covers the whole vocabulary: nothing could be sampled")

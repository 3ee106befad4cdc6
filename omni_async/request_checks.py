"""Early request checks, run by ``Engine.submit`` before it returns a handle.

An HTTP front end must know whether to answer 400/429 before it sends its headers, so the
vocabulary, context and KV-capacity checks happen here, against the stage's
``ModelLimits``, and raise the typed error to the caller. The stage checks again at
admission (stage-level callers skip the engine); the messages are the same.
"""

from __future__ import annotations

from typing import Any

from . import errors
from .config import SamplingParams


def check_input_ids(input_ids: Any, vocab_size: int) -> list[int]:
    """A list of in-vocabulary ints; the first bad position is named."""
    if hasattr(input_ids, "tolist") and not isinstance(input_ids, (list, tuple)):
        input_ids = input_ids.tolist()  # a tensor or array
    if not isinstance(input_ids, (list, tuple)):
        raise errors.InvalidRequestError(f"input_ids must be a list of ints, got {type(input_ids).__name__}")
    if len(input_ids) == 0:
        raise errors.InvalidRequestError("empty prompt: input_ids has no tokens")
    ids = list(input_ids)
    # Fast path, C speed for long prompts: every element an int and all in range.
    if set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size:
        return ids
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise errors.InvalidRequestError(f"input_ids[{i}] is {t!r}, not an int")
        if not 0 <= t < vocab_size:
            raise errors.InvalidRequestError(f"input_ids[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
    return [int(t) for t in ids]


def check_sampling_vocab(sampling: SamplingParams, vocab_size: int) -> None:
    for name in ("suppress_tokens", "stop_token_ids"):
        bad = [t for t in getattr(sampling, name) if t >= vocab_size]
        if bad:
            raise errors.InvalidRequestError(f"{name} {bad} outside the vocabulary [0, {vocab_size})")
    if len(set(sampling.suppress_tokens)) >= vocab_size:
        raise errors.InvalidRequestError("suppress_tokens covers the whole vocabulary: nothing could be sampled")


def check_capacity(n_in: int, n_new: int, context_length: int, kv_capacity_tokens: int) -> None:
    """Refuse what can never be served: say which limit and by how much."""
    need = n_in + n_new
    if need > context_length:
        raise errors.RequestRejectedError(
            f"request needs {need} tokens (input {n_in} + max_new_tokens {n_new}), over the context length "
            f"{context_length} by {need - context_length}; shorten the input or lower max_new_tokens"
        )
    if need > kv_capacity_tokens:
        raise errors.RequestRejectedError(
            f"request needs {need} tokens of KV (input {n_in} + max_new_tokens {n_new}), over the KV cache "
            f"capacity {kv_capacity_tokens} by {need - kv_capacity_tokens}; raise kv_capacity_tokens "
            "(or kv_memory_fraction on CUDA) or lower max_new_tokens"
        )


def check_request(ids: Any, sampling: SamplingParams, limits: Any) -> list[int]:
    """Everything the stage would refuse at admission, refused now."""
    ids = check_input_ids(ids, limits.vocab_size)
    check_sampling_vocab(sampling, limits.vocab_size)
    check_capacity(len(ids), sampling.max_new_tokens, limits.context_length, limits.kv_capacity_tokens)
    return ids

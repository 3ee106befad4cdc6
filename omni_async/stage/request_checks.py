"""Early request checks, run by ``Engine.submit`` before it returns a handle.

An HTTP front end must know whether to answer 400/429 before it sends its headers, so the
vocabulary, context and KV-capacity checks happen here, against the stage's
``ModelLimits``, and raise the typed error to the caller. The stage checks again at
admission (stage-level callers skip the engine); the messages are the same.
"""

from __future__ import annotations

from typing import Any

from .. import errors
from ..config import SamplingParams


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
    bad_bias = sorted(t for t in sampling.logit_bias if t >= vocab_size)
    if bad_bias:
        raise errors.InvalidRequestError(f"logit_bias token(s) {bad_bias} outside the vocabulary [0, {vocab_size})")
    if len(set(sampling.suppress_tokens)) >= vocab_size:
        raise errors.InvalidRequestError("suppress_tokens covers the whole vocabulary: nothing could be sampled")


def check_capacity(n_in: int, n_new: int, context_length: int, kv_capacity_tokens: int, *, enforce: bool = True) -> int:
    """Refuse what can never be served, saying which limit and by how much; return the
    ``max_new_tokens`` that will be served.

    A request that cannot fit in the whole KV cache is refused whatever ``enforce``
    says: it would hold the KV for ever and starve every request behind it. With
    ``enforce``, a prompt that leaves no room in the context is refused and
    ``max_new_tokens`` is clamped to the room left (generation would stop there anyway)."""
    if enforce:
        if n_in >= context_length:
            raise errors.RequestRejectedError(
                f"prompt has {n_in} tokens, the context length is {context_length}: it leaves no room for "
                f"a new token (over by {n_in - context_length + 1}); shorten the input"
            )
        n_new = min(n_new, context_length - n_in)
    need = min(n_in + n_new, context_length)
    if need > kv_capacity_tokens:
        raise errors.RequestRejectedError(
            f"request needs {need} tokens of KV (input {n_in} + max_new_tokens {n_new}), over the KV cache "
            f"capacity {kv_capacity_tokens} by {need - kv_capacity_tokens}; raise kv_capacity_tokens "
            "(or kv_memory_fraction on CUDA) or lower max_new_tokens"
        )
    return n_new


def check_request(ids: Any, sampling: SamplingParams, limits: Any) -> list[int]:
    """Everything the stage would refuse at admission, refused now."""
    if hasattr(ids, "__len__") and len(ids) >= limits.context_length:  # O(1), before per-token checks
        check_capacity(len(ids), sampling.max_new_tokens, limits.context_length, limits.kv_capacity_tokens)
    ids = check_input_ids(ids, limits.vocab_size)
    check_sampling_vocab(sampling, limits.vocab_size)
    check_capacity(len(ids), sampling.max_new_tokens, limits.context_length, limits.kv_capacity_tokens)
    return ids

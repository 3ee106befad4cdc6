"""Prompts given as embeddings at the stage's door: what is accepted (a ``[L, hidden]``
float tensor with finite values, within the limits), and the request built from it.

The batch core sees ``L`` placeholder ids (:data:`EMBEDS_PLACEHOLDER_ID`), so lengths,
budgets, chunked prefill and retraction work on ids unchanged; the rows travel on
``RequestData.input_embeds`` to the runner's prefill, and the prefix cache leaves such a
request alone (``core.prefix_reuse.shares_kv``). See docs/omni-data-path.md.
"""

from __future__ import annotations

from typing import Any

from .. import errors


# The token id the batch core sees at each prompt position of a request given as embeddings.
EMBEDS_PLACEHOLDER_ID = 0


def check_input_embeds(embeds: Any, hidden_size: int | None) -> Any:
    """A ``[L, hidden_size]`` floating tensor with finite values, ``L >= 1`` (a numpy
    array or a nested list of numbers is converted; a list becomes float32). Anything
    else is an :class:`~omni_async.errors.InvalidRequestError` naming what is wrong.
    ``hidden_size`` None: this stage does not take prompts as embeddings."""
    if hidden_size is None:
        raise errors.InvalidRequestError(
            "this stage does not take input_embeds (supported on the native backend without tensor parallelism)"
        )
    import torch  # the stage checks run without torch until a request brings embeddings

    t = _as_tensor(embeds, torch)
    if t.ndim != 2:
        raise errors.InvalidRequestError(f"input_embeds must be 2-D [L, {hidden_size}], got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise errors.InvalidRequestError(f"input_embeds must have a floating dtype, got {t.dtype}")
    if t.shape[0] == 0:
        raise errors.InvalidRequestError("empty prompt: input_embeds has no rows")
    if t.shape[1] != hidden_size:
        raise errors.InvalidRequestError(
            f"input_embeds rows have {t.shape[1]} values, the model's hidden size is {hidden_size}"
        )
    finite = torch.isfinite(t).all(dim=1)
    if not bool(finite.all()):
        first = int((~finite).nonzero()[0, 0])
        raise errors.InvalidRequestError(f"input_embeds[{first}] holds a non-finite value (nan or inf)")
    return t.detach()


def _as_tensor(embeds: Any, torch: Any) -> Any:
    if isinstance(embeds, torch.Tensor):
        return embeds
    try:
        if isinstance(embeds, (list, tuple)):
            return torch.tensor(embeds, dtype=torch.float32)
        if type(embeds).__module__ == "numpy" and hasattr(embeds, "dtype"):
            return torch.from_numpy(embeds) if embeds.dtype.kind == "f" else torch.as_tensor(embeds)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise errors.InvalidRequestError(f"input_embeds could not be read as a [L, H] float tensor: {exc}") from None
    raise errors.InvalidRequestError(
        f"input_embeds must be a torch tensor, a numpy array or a nested list, got {type(embeds).__name__}"
    )


def payload_prompt_len(data: Any) -> int:
    """Prompt positions of a ``new_request`` payload (an ``[L, H]`` prompt has L), for
    the arrivals' budget; 0 when malformed (refused when built)."""
    get = data.get if isinstance(data, dict) else lambda name: getattr(data, name, None)
    embeds = get("input_embeds")
    ids = get("input_ids") if embeds is None else embeds
    try:
        return len(ids)
    except TypeError:
        return 0

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


def check_input_embeds(embeds: Any, hidden_size: int | None, dtype: Any = None) -> Any:
    """A dense ``[L, hidden_size]`` tensor of float16, bfloat16, float32 or float64 whose
    values are finite in ``dtype`` (the model's, when given: 1e5 is finite in float32 but
    inf in float16, and an inf row at the prefill leaves NaN in KV pages that later go
    to other requests), ``L >= 1``. A numpy array or a nested list of numbers is
    converted (a list becomes float32). Returned in ``dtype`` (as given when None).
    Anything else is an :class:`~omni_async.errors.InvalidRequestError` naming what is
    wrong. ``hidden_size`` None: this stage does not take prompts as embeddings."""
    if hidden_size is None:
        raise errors.InvalidRequestError(
            "this stage does not take input_embeds (supported on the native backend without tensor parallelism)"
        )
    import torch  # the stage checks run without torch until a request brings embeddings

    t = _as_tensor(embeds, torch)
    _check_storage(t, torch)
    if t.ndim != 2:
        raise errors.InvalidRequestError(f"input_embeds must be 2-D [L, {hidden_size}], got shape {tuple(t.shape)}")
    if t.dtype not in _readable_dtypes(torch):
        raise errors.InvalidRequestError(
            f"input_embeds must have dtype float32, float16, bfloat16 or float64, got {t.dtype}"
        )
    if t.shape[0] == 0:
        raise errors.InvalidRequestError("empty prompt: input_embeds has no rows")
    if t.shape[1] != hidden_size:
        raise errors.InvalidRequestError(
            f"input_embeds rows have {t.shape[1]} values, the model's hidden size is {hidden_size}"
        )
    t = t.detach()
    as_model = t if dtype is None else t.to(dtype)
    finite = torch.isfinite(as_model).all(dim=1)
    if not bool(finite.all()):
        first = int((~finite).nonzero()[0, 0])
        if bool(torch.isfinite(t[first]).all()):
            limit = torch.finfo(as_model.dtype).max
            raise errors.InvalidRequestError(
                f"input_embeds[{first}] holds a value past the range of the model's dtype "
                f"{str(as_model.dtype).replace('torch.', '')} (|x| > {limit:g})"
            )
        raise errors.InvalidRequestError(f"input_embeds[{first}] holds a non-finite value (nan or inf)")
    return as_model


def _readable_dtypes(torch: Any) -> tuple[Any, ...]:
    """The dtypes whose values the door can check and the model can take (float8 has no
    ``isfinite``)."""
    return (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_storage(t: Any, torch: Any) -> None:
    """A dense tensor with data: a sparse tensor has no dense rows to copy and a meta
    tensor has no values at all (both raise untyped errors further on)."""
    if t.layout != torch.strided:
        raise errors.InvalidRequestError(f"input_embeds must be a dense tensor, got layout {t.layout}")
    if t.device.type == "meta":
        raise errors.InvalidRequestError("input_embeds is a meta tensor: it holds no values")


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

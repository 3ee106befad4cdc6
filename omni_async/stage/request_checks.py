"""The stage's door: every rule a request is refused by, written once, and checked once.

:func:`check_request` is the one validation function: the prompt (token ids in the
vocabulary, or ``[L, hidden]`` embeddings), the sampling parameters, their token ids
against the vocabulary, and the room the request needs (context and KV capacity). Its
answer, a :class:`Verdict`, travels with the request, so nothing checks it again:

- ``Engine.submit`` calls it before it returns a handle (an HTTP front end must know
  whether to answer 400/429 before it sends its headers) and sends the stage a
  :class:`CheckedPayload`;
- :class:`RequestDoor` calls it in the default request builder for a payload that did not
  pass that door (a stage-level caller writing to the inbox), without the room: a custom
  builder wrapping the default one may still change the request's length or terms;
- at admission, :meth:`RequestDoor.fit` takes ``max_new_tokens`` from the verdict where it
  measured the room for this very request, and measures it otherwise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import errors
from ..config import SamplingParams
from ..sampling_controls import validate_if_changed
from ..core.request import Request, RequestData
from ..logs import debug_enabled, log
from ..messages import RequestPayload
from .state import call_user
from .prompt_embeds import EMBEDS_PLACEHOLDER_ID, check_input_embeds


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against at the door (vocabulary, context, KV capacity, EOS)."""

    vocab_size: int
    context_length: int
    kv_capacity_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    # Compiles the grammars of constrained requests (None: the model has no tokenizer).
    grammar_compiler: Any = None
    hidden_size: int | None = None  # the width of input_embeds rows; None: the stage takes none
    # The dtype input_embeds become at the prefill (a torch dtype): their values are checked
    # finite in it. None: checked as given.
    embeds_dtype: Any = None
    # The decoder's layer count and the hidden_states index its captured rows are
    # (SchedulerConfig.hidden_states_layer; num_layers: after the final norm). None: the
    # stage does not say, and SamplingParams.hidden_states_layer is refused.
    num_layers: int | None = None
    hidden_states_layer: int | None = None


@dataclass(frozen=True)
class Verdict:
    """What :func:`check_request` found: the prompt as the stage takes it, and the
    ``max_new_tokens`` that will be served for the one asked."""

    prompt_ids: list[int]
    input_embeds: Any
    max_new_tokens_asked: int
    max_new_tokens: int | None  # None: the room was not measured (the stage's admission does)

    def length_warning(self, context_length: int) -> errors.LengthLimitWarning | None:
        """The warning a caller gets when the context leaves less room than the
        ``max_new_tokens`` asked (the request is served shortened, not refused); None
        when it fits or the room was not measured."""
        if self.max_new_tokens is None or self.max_new_tokens >= self.max_new_tokens_asked:
            return None
        return errors.LengthLimitWarning(self.max_new_tokens_asked, self.max_new_tokens, len(self.prompt_ids), context_length)

    def served_max_new_tokens(self, req: Request, *, enforce: bool) -> int | None:
        """The measured ``max_new_tokens`` if ``req`` is the request it was measured for
        (a custom builder may have changed its prompt or length, or asked for limits not
        to be enforced); None otherwise."""
        if enforce and len(req.prompt_ids) == len(self.prompt_ids) and req.sampling.max_new_tokens == self.max_new_tokens_asked:
            return self.max_new_tokens
        return None


@dataclass
class CheckedPayload(RequestPayload):
    """A :class:`RequestPayload` that passed :func:`check_request` (``Engine.submit``)."""

    verdict: Verdict | None = None


def check_request(input_ids: Any, sampling: SamplingParams, limits: ModelLimits, *, input_embeds: Any = None, room: bool = True) -> Verdict:
    """Everything a request is refused by, each rule once, raising its typed error
    (``room`` False: all but the context and KV room, which admission then measures)."""
    if input_embeds is not None:
        if input_ids is not None and len(input_ids):
            raise errors.InvalidRequestError("give either input_ids or input_embeds, not both")
        embeds = check_input_embeds(input_embeds, getattr(limits, "hidden_size", None), getattr(limits, "embeds_dtype", None))
        ids = [EMBEDS_PLACEHOLDER_ID] * int(embeds.shape[0])
    else:
        if hasattr(input_ids, "__len__") and len(input_ids) >= limits.context_length:
            # O(1), before the per-token checks of a huge prompt (it is refused for its length)
            check_capacity(len(input_ids), sampling.max_new_tokens, limits.context_length, limits.kv_capacity_tokens)
        embeds = None
        ids = check_input_ids(input_ids, limits.vocab_size)
    validate_if_changed(sampling)  # validated when made: again only if changed since
    if embeds is not None and sampling.prompt_logprobs is not None:  # no token ids to score
        raise errors.InvalidRequestError("prompt_logprobs needs a prompt of token ids, not input_embeds")
    check_sampling_vocab(sampling, limits.vocab_size)
    check_hidden_layer(sampling.hidden_states_layer, limits)
    n_new = check_capacity(len(ids), sampling.max_new_tokens, limits.context_length, limits.kv_capacity_tokens) if room else None
    return Verdict(ids, embeds, sampling.max_new_tokens, n_new)


def check_hidden_layer(asked: int | None, limits: ModelLimits) -> None:
    """A request's ``hidden_states_layer`` must be the one the stage captures (one layer
    per stage keeps the rows on its fast path: the CUDA graphs hand out that layer's)."""
    if asked is None:
        return
    if isinstance(asked, bool) or not isinstance(asked, int) or asked < 0:
        raise errors.InvalidRequestError(f"hidden_states_layer must be None or an integer >= 0, got {asked!r}")
    layers, captured = getattr(limits, "num_layers", None), getattr(limits, "hidden_states_layer", None)
    if layers is None or captured is None:
        raise errors.InvalidRequestError("hidden_states_layer is not supported by this stage")
    if asked > layers:
        raise errors.InvalidRequestError(f"hidden_states_layer must be in [0, {layers}] (the model has {layers} layers), got {asked}")
    if asked != captured:
        raise errors.InvalidRequestError(
            f"hidden_states_layer={asked}: this stage captures layer {captured}; start it with "
            f"hidden_states_layer={asked} (a stage option) to read that layer"
        )


class RequestDoor:
    """Where a request enters the stage: the limits it is checked against, the default
    builder (:meth:`build_default`), and the fit at admission."""

    def __init__(self, limits: ModelLimits) -> None:
        self.limits = limits

    def build(self, payload: Any, request_builder: Callable[[Any], RequestData] | None) -> RequestData:
        """Build one request with the caller's builder, or the default one."""
        rid = payload.request_id
        if debug_enabled():
            log.debug("scheduler_request_build_start", request_id=rid)
        data = call_user("request builder", request_builder or self.build_default, payload)
        if debug_enabled():
            log.debug("scheduler_request_build_end", request_id=rid)
        return data

    def build_default(self, payload: Any) -> RequestData:
        """Build from a :class:`RequestPayload` (dicts are converted on arrival),
        checked here unless ``Engine.submit`` checked it."""
        if not isinstance(payload, RequestPayload):
            raise errors.InvalidRequestError(f"unsupported payload type {type(payload).__name__}")
        sampling = payload.sampling
        if not isinstance(sampling, SamplingParams):
            raise errors.InvalidRequestError("sampling must be a SamplingParams")
        verdict = payload.verdict if isinstance(payload, CheckedPayload) else None
        if verdict is None:
            verdict = check_request(payload.input_ids, sampling, self.limits, input_embeds=payload.input_embeds, room=False)
        req = Request(rid=payload.request_id, prompt_ids=list(verdict.prompt_ids), sampling=sampling, eos_token_ids=self.limits.eos_token_ids)
        return RequestData(req=req, payload=payload, input_embeds=verdict.input_embeds, checked=verdict)

    def fit(self, data: RequestData) -> None:
        """At admission, for every built request: ``max_new_tokens`` as served (the
        verdict's, or measured now for a request the door did not check; see
        :func:`check_capacity`: the KV guard always, the context when limits are enforced)."""
        req = data.req
        s = req.sampling
        verdict = data.checked
        n_new = None if verdict is None else verdict.served_max_new_tokens(req, enforce=data.enforce_request_limits)
        if n_new is None:
            lim = self.limits
            n_new = check_capacity(len(req.prompt_ids), s.max_new_tokens, lim.context_length, lim.kv_capacity_tokens, enforce=data.enforce_request_limits)
        if n_new < s.max_new_tokens:
            req.sampling = dataclasses.replace(s, max_new_tokens=n_new, min_new_tokens=min(s.min_new_tokens, n_new))
        data.checked = None  # used: its prompt copy and rows need not live as long as the request


# ---------------------------------------------------------------- the rules


def refuse_unknown_fields(names: Any) -> None:
    """A request field this version does not know is refused, never ignored."""
    unknown = sorted(str(k) for k in names)
    if unknown:
        raise errors.InvalidRequestError(f"unknown request field(s): {', '.join(unknown)}")


def sampling_of(sampling: Any) -> SamplingParams:
    """``SamplingParams``, a dict of its fields, or None (the defaults)."""
    if sampling is None or isinstance(sampling, dict):
        return SamplingParams.from_dict(sampling)
    if not isinstance(sampling, SamplingParams):
        raise errors.InvalidRequestError(f"sampling must be SamplingParams or a dict, got {type(sampling).__name__}")
    return sampling


def metadata_of(metadata: Any) -> dict[str, Any]:
    """A copy of the request's metadata dict (None: empty)."""
    if metadata is not None and not isinstance(metadata, dict):
        raise errors.InvalidRequestError(f"metadata must be a dict, got {type(metadata).__name__}")
    return dict(metadata or {})


def check_input_ids(input_ids: Any, vocab_size: int) -> list[int]:
    """A list of in-vocabulary ints; the first bad position is named."""
    if hasattr(input_ids, "tolist") and not isinstance(input_ids, (list, tuple)):
        input_ids = input_ids.tolist()  # a tensor or array
    if not isinstance(input_ids, (list, tuple)):
        raise errors.InvalidRequestError(f"input_ids must be a list of ints, got {type(input_ids).__name__}")
    if len(input_ids) == 0:
        raise errors.InvalidRequestError("empty prompt: input_ids has no tokens")
    ids = list(input_ids)
    # Fast path, C speed for long prompts: every element an int and all in range. The
    # types as a list counted (``count`` compares by identity first): ~0.6x a set of them.
    if list(map(type, ids)).count(int) == len(ids) and _in_range(ids, vocab_size):
        return ids
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise errors.InvalidRequestError(f"input_ids[{i}] is {t!r}, not an int")
        if not 0 <= t < vocab_size:
            raise errors.InvalidRequestError(f"input_ids[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
    return [int(t) for t in ids]


def _in_range(ids: list[int], vocab_size: int) -> bool:
    """Whether Python ints all lie in ``[0, vocab_size)``. From 256 ids on, numpy's min and
    max over one int64 copy beat two passes over the ints (~0.7x at 560 ids, 0.6x at
    1,024: a burst's submissions spend most of their check here); an int past int64 is
    out of every vocabulary."""
    if len(ids) < 256:
        return min(ids) >= 0 and max(ids) < vocab_size
    try:
        arr = np.fromiter(ids, np.int64, len(ids))
    except OverflowError:
        return False
    return bool(arr.min() >= 0) and bool(arr.max() < vocab_size)


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

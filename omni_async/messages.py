"""Messages on the scheduler's channels, and what the default builders produce."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .config import SamplingParams

IncomingType = Literal["new_request", "stream_chunk", "stream_done"]
OutgoingType = Literal["result", "stream", "error"]


@dataclass
class IncomingMessage:
    """Into the scheduler. ``data`` is a request payload for ``new_request`` and a
    chunk for ``stream_chunk``; unused for ``stream_done``."""

    request_id: str
    type: IncomingType
    data: Any = None


@dataclass
class OutgoingMessage:
    """Out of the scheduler. ``data`` is the adapted result, a stream delta, or the
    exception (one of :mod:`omni_async.errors`) for ``error``."""

    request_id: str
    type: OutgoingType
    data: Any = None


@dataclass
class RequestPayload:
    """The default ``new_request`` payload understood by the built-in request builder.

    ``prefetched_chunks`` / ``prefetched_stream_done`` are filled by the scheduler with
    stream input that arrived before the request was admitted.
    """

    request_id: str
    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    metadata: dict[str, Any] = field(default_factory=dict)
    prefetched_chunks: list[Any] = field(default_factory=list)
    prefetched_stream_done: bool = False
    # The prompt as embeddings instead (a ``[L, hidden_size]`` float tensor, numpy array
    # or nested list), with ``input_ids`` left empty; see docs/omni-data-path.md.
    input_embeds: Any = None


@dataclass
class StreamDelta:
    """New tokens of one request from one step."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    finished: bool = False
    finish_reason: str | None = None
    text: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # per-step model outputs (hidden states ...)
    index: int = 0  # which completion of the request (SamplingParams.n)
    # Per token: up to ``top_logprobs`` (token_id, logprob) pairs, most likely first.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # ``[len(token_ids), H]`` final hidden states of these tokens on the stage's device
    # (``SamplingParams.return_hidden_states``, or a stage capturing for every request);
    # the delta with the first token also carries the prompt's when asked.
    hidden_states: Any = None
    prompt_hidden_states: Any = None
    # ``SamplingParams.prompt_logprobs``: on the delta with the first token (or the last
    # delta when no token is generated), as ``GenerationResult.prompt_logprobs``.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request."""

    index: int
    output_ids: list[int]
    finish_reason: str | None
    text: str | None = None
    output_logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    hidden_states: Any = None  # [len(output_ids), H] when asked
    prompt_hidden_states: Any = None  # [len(prompt), H] when asked


@dataclass
class GenerationResult:
    """A finished request."""

    request_id: str
    output_ids: list[int]
    finish_reason: str | None
    prompt_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] | None = None
    text: str | None = None
    weight_version: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # The ``n`` completions (one for ``n=1``; the top-level fields equal ``outputs[0]``).
    outputs: list[CompletionOutput] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # Prompt tokens whose KV came from the prefix cache (summed over the completions).
    cached_tokens: int = 0
    # ``SamplingParams.return_hidden_states``: one row per output token, the decoder's
    # final hidden state (after its final norm; the stage's ``hidden_states_layer`` when
    # set) at the position that produced it, on the stage's device;
    # ``return_prompt_hidden_states``: one row per prompt position.
    hidden_states: Any = None
    prompt_hidden_states: Any = None
    # ``SamplingParams.prompt_logprobs=k``: one entry per prompt token, None for the first;
    # then {the prompt's token: its logprob, and the k most likely tokens: theirs} (the
    # prompt's token first, then most likely first), as vLLM's ``prompt_logprobs``.
    # ``prompt_logprob_ranks``: the rank of each prompt token (1 = most likely).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None


def join_rows(rows: list[Any]) -> Any:
    """Hidden-state rows gathered over several steps or deltas as one tensor (None for
    none): what a finished request and a finished completion hand out."""
    if not rows:
        return None
    if len(rows) == 1:
        return rows[0]
    import torch  # only requests that asked for hidden states get here

    return torch.cat(rows)


@dataclass(slots=True, eq=False)
class StepTokens:
    """A step's plain stream output as columns, in row order: request ``request_ids[j]``
    got ``token_ids[j]`` (with ``logprobs[j]`` when it asked), and ended with
    ``finish_reasons[j]`` (None: it runs on). What a columns sink receives instead of one
    ``OutgoingMessage`` and ``StreamDelta`` per row; rows with hidden states, extra
    outputs or a custom stream builder still go as messages."""

    request_ids: list[str]
    token_ids: list[list[int]]
    logprobs: list[list[float] | None]
    finish_reasons: list[str | None]

    def __len__(self) -> int:
        return len(self.request_ids)

    def messages(self) -> list[OutgoingMessage]:
        """The message form, for a sink that wants one message per row."""
        return [OutgoingMessage(rid, "stream", StreamDelta(rid, toks, lps, reason is not None, reason))
                for rid, toks, lps, reason in zip(self.request_ids, self.token_ids, self.logprobs, self.finish_reasons)]

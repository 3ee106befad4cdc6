"""One completion of a request as the engine assembles it from the stage's messages:
its tokens, logprobs, streamed text and stop strings."""

from __future__ import annotations

from typing import Any

from ..config import SamplingParams
from ..text.detokenize import finish_text
from ..messages import CompletionOutput, GenerationResult, StreamDelta, join_rows
from ..text.stops import StopMatcher
from ..text.tokenizer import Tokenizer


def _pairs(value: Any) -> list[tuple[int, float]]:
    return [(int(t), float(lp)) for t, lp in value]


class Completion:
    """Tokens arrive in stream deltas; ``on_delta`` turns each into the delta a reader
    sees (its text decoded incrementally, stop strings held back and cut), and says when
    a stop string ended the completion so the engine can end the stage's request."""

    def __init__(self, index: int, sub_id: str, sampling: SamplingParams, tokenizer: Tokenizer | None) -> None:
        self.index = index
        self.sub_id = sub_id
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] | None = [] if sampling.top_logprobs else None
        self.finish_reason: str | None = None
        self.done = False  # no more output: finished, stopped, or failed
        self._want_logprobs = sampling.return_logprob
        self._tokenizer = tokenizer
        self._skip_special = sampling.skip_special_tokens
        self._decoder = tokenizer.decode_stream(sampling.skip_special_tokens) if tokenizer is not None else None
        # No text and no stop strings: a plain row's delta needs only its ids and
        # logprobs appended (``RequestHandle.on_tokens`` does that itself).
        self.ids_only = self._decoder is None
        self._stops = StopMatcher(sampling.stop, sampling.include_stop_str_in_output)
        self._flushed = False
        self._want_hidden = sampling.return_hidden_states
        self._hidden: list[Any] = []  # each delta's rows, cut where a stop string cut its tokens
        self._prompt_hidden: Any = None

    @property
    def text(self) -> str | None:
        return self._stops.text if self._tokenizer is not None else None

    def on_delta(self, delta: StreamDelta) -> tuple[StreamDelta | None, bool]:
        """(the delta for the reader or None, whether a stop string just ended it)."""
        if self.done:
            return None, False
        if self._decoder is None:
            return self._on_ids(delta), False
        parts: list[str] = []
        kept, stopped = self._take_tokens(delta.token_ids, parts)
        self._take_scores(delta, kept)
        self._take_hidden(delta, kept)
        if kept < len(delta.token_ids):
            delta.token_ids = delta.token_ids[:kept]
        delta.index = self.index
        if stopped:
            self.done = True
            self.finish_reason = "stop"
            delta.finished, delta.finish_reason = True, "stop"
        elif delta.finished:
            parts.append(self._flush())
            self.finish_reason = "stop" if self._stops.stopped else delta.finish_reason
            delta.finish_reason = self.finish_reason
        delta.text = "".join(parts) if self._decoder is not None else None
        return delta, stopped

    def _on_ids(self, delta: StreamDelta) -> StreamDelta:
        """``on_delta`` without a tokenizer (no text, no stop strings): the token ids and
        scores are taken as they are."""
        ids = delta.token_ids
        self.output_ids.extend(ids)
        if delta.logprobs is not None or delta.extra:
            self._take_scores(delta, len(ids))
        if delta.hidden_states is not None or delta.prompt_hidden_states is not None:
            self._take_hidden(delta, len(ids))
        delta.index = self.index
        if delta.finished:
            self.finish_reason = delta.finish_reason
        delta.text = None
        return delta

    def on_result(self, result: Any) -> StreamDelta | None:
        """The stage's terminal result: tokens not seen in a delta are taken now, and a
        last delta goes out when no finished delta did (None when one already did)."""
        if self.done:
            return None
        already_final = self._flushed
        ids = list(getattr(result, "output_ids", None) or [])
        parts: list[str] = []
        stopped = False
        if ids[: len(self.output_ids)] == self.output_ids and len(ids) > len(self.output_ids):
            _, stopped = self._take_tokens(ids[len(self.output_ids):], parts)
        self.done = True
        if not stopped:
            parts.append(self._flush())
            if isinstance(result, GenerationResult) and result.output_logprobs is not None:
                self.logprobs = list(result.output_logprobs)
        self.finish_reason = "stop" if self._stops.stopped else getattr(result, "finish_reason", None)
        text = "".join(parts)
        # A request that scored its prompt and generated nothing: its scores (and prompt
        # hidden states, which otherwise ride on the first token's delta) go out here.
        scored = getattr(result, "prompt_logprobs", None) if not self.output_ids else None
        prompt_hidden = getattr(result, "prompt_hidden_states", None) if self._prompt_hidden is None else None
        if prompt_hidden is not None:
            self._prompt_hidden = prompt_hidden
        if already_final and not text and scored is None and prompt_hidden is None:
            return None
        return StreamDelta(
            request_id=self.sub_id, token_ids=[], finished=True, finish_reason=self.finish_reason,
            text=text if self._decoder is not None else None, index=self.index,
            prompt_logprobs=scored, prompt_logprob_ranks=getattr(result, "prompt_logprob_ranks", None) if scored else None,
            prompt_hidden_states=prompt_hidden,
        )

    def _take_tokens(self, tokens: list[int], parts: list[str]) -> tuple[int, bool]:
        """Append tokens; with a tokenizer, decode and check stops token by token."""
        if self._decoder is None:
            self.output_ids.extend(tokens)
            return len(tokens), False
        for k, tok in enumerate(tokens):
            self.output_ids.append(tok)
            emit, hit = self._stops.feed(self._decoder.step(tok))
            parts.append(emit)
            if hit:
                return k + 1, True
        return len(tokens), False

    def _take_scores(self, delta: StreamDelta, kept: int) -> None:
        if delta.logprobs is not None:
            if kept < len(delta.logprobs):
                delta.logprobs = delta.logprobs[:kept]
            self.logprobs.extend(delta.logprobs)
        top = delta.extra.pop("top_logprobs", None) if delta.extra else None
        if top is not None and kept:
            delta.top_logprobs = [_pairs(top)]
            if self.top_logprobs is not None:
                self.top_logprobs.extend(delta.top_logprobs)

    def _take_hidden(self, delta: StreamDelta, kept: int) -> None:
        """Keep the rows of the tokens kept (a stop string may cut a delta short)."""
        if delta.prompt_hidden_states is not None:
            self._prompt_hidden = delta.prompt_hidden_states
        rows = delta.hidden_states
        if rows is None:
            return
        if kept < rows.shape[0]:
            rows = delta.hidden_states = rows[:kept]
        if self._want_hidden and kept:
            self._hidden.append(rows)

    def _flush(self) -> str:
        """End of the token stream: reconcile with the full decode, release held text."""
        if self._flushed or self._decoder is None or self._tokenizer is None:
            return ""
        self._flushed = True
        full = self._tokenizer.decode(self.output_ids, skip_special_tokens=self._skip_special)
        rest = finish_text(self._stops.text, full, self.sub_id)
        emit, hit = self._stops.feed(rest)
        return emit if hit else emit + self._stops.release()

    def fail(self) -> None:
        self.done = True

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            output_ids=list(self.output_ids),
            finish_reason=self.finish_reason,
            text=self.text,
            output_logprobs=list(self.logprobs) if self._want_logprobs else None,
            top_logprobs=self.top_logprobs,
            hidden_states=join_rows(self._hidden) if self._want_hidden else None,
            prompt_hidden_states=self._prompt_hidden,
        )

"""OpenAI response objects (completions and chat, whole and streamed) from engine output."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..messages import CompletionOutput, GenerationResult, StreamDelta
from ..text.tokenizer import Tokenizer
from .reasoning import ReasoningSplitter, split_whole
from .scoring import PromptScores, legacy_prompt_part, vllm_prompt_logprobs
from .tool_parsers import ToolStream, parse_output
from .tools import ToolPlan


@dataclass
class ResponseContext:
    """What every object of one response shares."""

    kind: str  # "completion" | "chat"
    model: str
    tokenizer: Tokenizer | None
    logprobs: bool
    tools: ToolPlan | None = None  # chat with tools: calls are parsed out of the text
    tool_format: str = "hermes"  # how the model writes calls (server.tool_parsers)
    reasoning: bool = False  # chat on a <think> template: reasoning_content is split off
    reasoning_inside: bool = False  # the prompt opened the <think> block
    # Scoring prompts (server.scoring): each prompt of the request (choice i is prompt
    # i // n's), when ``echo`` (completions) or vLLM's ``prompt_logprobs`` (its top k) asks.
    prompts: list[PromptScores] | None = None
    n: int = 1
    echo: bool = False
    top_logprobs: int = 0  # completions' ``logprobs``: the top of each echoed prompt token
    prompt_logprobs: int | None = None
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    _parsers: dict[int, ToolStream] = field(default_factory=dict)
    _splitters: dict[int, ReasoningSplitter] = field(default_factory=dict)
    _called: set[int] = field(default_factory=set)  # streamed choices that made a call
    _echoed: set[int] = field(default_factory=set)  # streamed choices whose prompt went out

    def __post_init__(self) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def token_str(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ------------------------------------------------------------ logprobs

    def logprobs_of(self, ids: list[int], lps: list[float] | None, tops: list[Any] | None, text_offset: int = 0) -> Any:
        if not self.logprobs or lps is None:
            return None
        tops = tops or [[] for _ in ids]
        if self.kind == "chat":
            return {"content": [self._chat_token(t, lp, top) for t, lp, top in zip(ids, lps, tops)]}
        tokens = [self.token_str(t) for t in ids]
        offsets, at = [], text_offset
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": list(lps),
            "top_logprobs": [None if top is None else {self.token_str(t): lp for t, lp in top} for top in tops],
            "text_offset": offsets,
        }

    def _echoed_logprobs(self, prompt: PromptScores, ids: list[int], lps: list[float] | None, tops: list[Any] | None) -> Any:
        """The legacy logprobs object of an echoed choice: the prompt's tokens (the first
        null), then the generated ones."""
        if not self.logprobs or prompt.logprobs is None:
            return self.logprobs_of(ids, lps, tops)
        p_ids, p_lps, p_tops = legacy_prompt_part(prompt, self.top_logprobs)
        tops = tops or [[] for _ in ids]
        return self.logprobs_of(p_ids + list(ids), p_lps + list(lps or []), p_tops + list(tops))

    def prompt_of(self, index: int) -> PromptScores | None:
        return None if self.prompts is None else self.prompts[index // self.n]

    def take_scores(self, results: list[GenerationResult]) -> None:
        """Each prompt's scores, from its request's result."""
        for prompt, result in zip(self.prompts or [], results):
            prompt.take(result)

    def vllm_scores(self, prompt: PromptScores | None) -> Any:
        return None if prompt is None else vllm_prompt_logprobs(prompt, self.prompt_logprobs or 0, self.token_str)

    def _chat_token(self, token_id: int, lp: float, top: list[tuple[int, float]]) -> dict[str, Any]:
        def entry(t: int, v: float) -> dict[str, Any]:
            s = self.token_str(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

        return {**entry(token_id, lp), "top_logprobs": [entry(t, v) for t, v in top]}

    # ------------------------------------------------------------ whole responses

    def response(self, result: GenerationResult) -> dict[str, Any]:
        outputs = result.outputs or [
            CompletionOutput(0, result.output_ids, result.finish_reason, result.text, result.output_logprobs, result.top_logprobs)
        ]
        body = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [self._choice(o) for o in outputs],
            "usage": usage(result),
        }
        if self.kind == "chat" and self.prompt_logprobs is not None:  # vLLM's place for chat
            body["prompt_logprobs"] = self.vllm_scores(self.prompt_of(0))
        return body

    def _choice(self, out: CompletionOutput) -> dict[str, Any]:
        text = out.text or ""
        lp = self.logprobs_of(out.output_ids, out.output_logprobs, out.top_logprobs)
        if self.kind == "chat":
            reasoning = None
            if self.reasoning:
                reasoning, text = split_whole(text, self.reasoning_inside)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            reason = out.finish_reason
            if self.tools is not None and self.tools.parse:
                content, calls = parse_output(text, self.tools, self.tool_format)
                if calls:
                    message = {"role": "assistant", "content": content or None, "tool_calls": [c.openai() for c in calls]}
                    reason = _call_reason(reason)
            if self.reasoning:
                message["reasoning_content"] = reasoning
            return {"index": out.index, "message": message, "finish_reason": reason, "logprobs": lp}
        choice = {"index": out.index, "text": text, "finish_reason": out.finish_reason, "logprobs": lp}
        prompt = self.prompt_of(out.index)
        if prompt is not None and self.echo:
            choice["text"] = prompt.text + text
            choice["logprobs"] = self._echoed_logprobs(prompt, out.output_ids, out.output_logprobs, out.top_logprobs)
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.vllm_scores(prompt)
        return choice

    # ------------------------------------------------------------ stream chunks

    def chunk(self, choices: list[dict[str, Any]], usage_: dict[str, int] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model, "choices": choices}
        if usage_ is not None:
            body["usage"] = usage_
        return body

    def role_choice(self, index: int) -> dict[str, Any]:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}

    def delta_choice(self, delta: StreamDelta, text_offset: int = 0) -> dict[str, Any] | None:
        """The chunk's choice for ``delta``; None when a tool parser holds all of it."""
        text = delta.text or ""
        reason = delta.finish_reason if delta.finished else None
        lp = self.logprobs_of(delta.token_ids, delta.logprobs, delta.top_logprobs, text_offset)
        if self.kind == "chat":
            body = self._chat_delta(delta.index, text, finished=delta.finished)
            if delta.finished and delta.index in self._called:
                reason = _call_reason(reason)
            if not body and reason is None and lp is None:
                return None
            return {"index": delta.index, "delta": body, "finish_reason": reason, "logprobs": lp}
        prompt = self.prompt_of(delta.index)
        if prompt is not None and self.echo and delta.index not in self._echoed:  # the first chunk
            self._echoed.add(delta.index)
            prompt.take(delta)
            text = prompt.text + text
            lp = self._echoed_logprobs(prompt, delta.token_ids, delta.logprobs, delta.top_logprobs)
        return {"index": delta.index, "text": text, "finish_reason": reason, "logprobs": lp}

    def echo_pending(self, index: int) -> bool:
        """Whether a streamed choice still owes its echoed prompt (its first chunk)."""
        return self.echo and index not in self._echoed

    def _chat_delta(self, index: int, text: str, *, finished: bool) -> dict[str, Any]:
        reasoning = ""
        if self.reasoning:
            splitter = self._splitters.setdefault(index, ReasoningSplitter(self.reasoning_inside))
            reasoning, text = splitter.feed(text)
            if finished:
                more_r, more_c = splitter.flush()
                reasoning, text = reasoning + more_r, text + more_c
        body = self._tool_delta(index, text, finished=finished)
        if reasoning:
            body = {"reasoning_content": reasoning, **body}
        return body

    def _tool_delta(self, index: int, text: str, *, finished: bool) -> dict[str, Any]:
        if self.tools is None or not self.tools.parse:
            if not self.reasoning:
                return {"content": text}
            return {"content": text} if text else {}
        parser = self._parsers.setdefault(index, ToolStream(self.tools, self.tool_format))
        content, calls = parser.feed(text)
        if finished:
            rest, more = parser.finish()
            content, calls = content + rest, calls + more
        body: dict[str, Any] = {"content": content} if content else {}
        if calls:
            first = parser.calls - len(calls)
            body["tool_calls"] = [c.openai(first + i) for i, c in enumerate(calls)]
            self._called.add(index)
        return body

    def final_choice(self, index: int, reason: str | None) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if index in self._splitters:
                reasoning, text = self._splitters[index].flush()
                delta = self._tool_delta(index, text, finished=True)
                if reasoning:
                    delta["reasoning_content"] = reasoning
            elif index in self._parsers:
                rest, calls = self._parsers[index].finish()
                delta = {"content": rest} if rest else {}
                if calls:
                    first = self._parsers[index].calls - len(calls)
                    delta["tool_calls"] = [c.openai(first + i) for i, c in enumerate(calls)]
                    self._called.add(index)
            if index in self._called:
                reason = _call_reason(reason)
            return {"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}
        return {"index": index, "text": "", "finish_reason": reason, "logprobs": None}


def _call_reason(reason: str | None) -> str | None:
    """A choice that called a tool finishes with ``tool_calls`` (unless cut by length)."""
    return reason if reason == "length" else "tool_calls"


def usage(result: GenerationResult) -> dict[str, Any]:
    prompt = len(result.prompt_ids)
    outputs = result.outputs or []
    completion = sum(len(o.output_ids) for o in outputs) if outputs else len(result.output_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(result.cached_tokens)},
    }

"""Scoring prompts over HTTP, from the engine's ``SamplingParams.prompt_logprobs``:
``echo`` on ``/v1/completions`` (the prompt's text before the completion's and, with
``logprobs``, the prompt's tokens before the generated ones in the logprobs object, the
first with a null logprob, as OpenAI's legacy completions and vLLM answer it; what
lm-evaluation-harness's loglikelihood tasks read), and vLLM's ``prompt_logprobs`` field
(on completions and chat: one entry per prompt token, the first null, then
``{token id: {"logprob", "rank", "decoded_token"}}``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .. import errors


@dataclass
class PromptScores:
    """One prompt of a response: its text and ids, and the engine's scores of its tokens
    (``GenerationResult.prompt_logprobs`` / ``prompt_logprob_ranks``) once they arrive."""

    text: str
    ids: list[int]
    logprobs: list[dict[int, float] | None] | None = None
    ranks: list[int | None] | None = None

    def take(self, source: Any) -> None:
        """The scores a result or a stream delta carries (None: not this one)."""
        if getattr(source, "prompt_logprobs", None) is not None:
            self.logprobs, self.ranks = source.prompt_logprobs, source.prompt_logprob_ranks


def engine_prompt_logprobs(*, echo: bool, logprobs: int | None, prompt_logprobs: int | None, max_tokens: int) -> int | None:
    """The engine's ``prompt_logprobs`` for a completions or chat request: the top
    ``logprobs`` for an echo with logprobs, vLLM's field as asked (the larger when both),
    and 0 for an echo of a request that generates nothing (``max_tokens=0`` is a
    prefill-only request, which the engine takes only when it scores the prompt)."""
    wanted = [k for k in ((logprobs if echo else None), prompt_logprobs) if k is not None]
    if echo and max_tokens == 0 and not wanted:
        wanted = [0]
    return max(wanted) if wanted else None


def check_max_tokens(max_tokens: int, prompt_logprobs: int | None, field: str = "max_tokens") -> None:
    """``max_tokens=0`` only for a request that scores its prompt."""
    if max_tokens == 0 and prompt_logprobs is None:
        err = errors.InvalidRequestError(f"{field}=0 needs echo=true or prompt_logprobs (a request that only scores its prompt)")
        err.param = field  # type: ignore[attr-defined]
        raise err


def top_of(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens of one position (the engine keeps the prompt's own
    token beside its top tokens; it is dropped here unless it is one of them)."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def legacy_prompt_part(scores: PromptScores, k: int) -> tuple[list[int], list[float | None], list[list[tuple[int, float]] | None]]:
    """The prompt's tokens for the legacy logprobs object: the first without a logprob or
    top (null), the others with theirs and their top ``k`` plus the prompt's token (OpenAI
    returns up to ``logprobs + 1`` entries)."""
    ids = list(scores.ids)
    lps: list[float | None] = [None]
    tops: list[list[tuple[int, float]] | None] = [None]
    for token, entry in zip(ids[1:], (scores.logprobs or [])[1:]):
        assert entry is not None
        lps.append(entry[token])
        top = top_of(entry, k)
        if all(t != token for t, _ in top):
            top.append((token, entry[token]))
        tops.append(top)
    return ids[: len(lps)], lps, tops


def vllm_prompt_logprobs(scores: PromptScores, k: int, token_str: Callable[[int], str]) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs``: null, then per prompt token its own entry (its true rank)
    and the top ``k`` (ranks 1..k), keyed by token id."""
    if scores.logprobs is None:
        return None
    out: list[dict[str, Any] | None] = [None]
    ranks = scores.ranks or [None] * len(scores.logprobs)
    for token, entry, rank in zip(scores.ids[1:], scores.logprobs[1:], ranks[1:]):
        assert entry is not None
        row = {str(token): {"logprob": entry[token], "rank": rank, "decoded_token": token_str(token)}}
        for r, (t, lp) in enumerate(top_of(entry, k), 1):
            if t != token:
                row[str(t)] = {"logprob": lp, "rank": r, "decoded_token": token_str(t)}
        out.append(row)
    return out


def echoed_prompts(raw_inputs: list[dict[str, Any]], inputs: list[dict[str, Any]], tokenizer: Any) -> list[PromptScores]:
    """Each prompt as echoed: a text prompt as the client wrote it, token ids decoded."""
    prompts = []
    for raw, one in zip(raw_inputs, inputs):
        ids = list(one.get("input_ids") or [])
        if "prompt" in raw:
            text = raw["prompt"]
        else:
            text = tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else ""
        prompts.append(PromptScores(text, ids))
    return prompts

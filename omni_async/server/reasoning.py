"""The thinking of reasoning models, split from the answer into ``reasoning_content``.

Templates that think in ``<think>...</think>`` (Qwen3, DeepSeek-R1, QwQ) either let the
model open the block itself or open it in the generation prompt (then the output starts
inside it). The output before ``</think>`` is the reasoning, the rest the content, as vLLM's
and SGLang's reasoning parsers give them; an output still inside the block when it ends
(cut by ``max_tokens``) is all reasoning. Streamed text is split the same way, holding back
only what might be the start of a tag.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def thinks(template: str) -> bool:
    """Whether a chat template writes ``<think>`` blocks (then outputs are split)."""
    return OPEN in template or CLOSE in template


def starts_inside(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves a ``<think>`` block open (the output begins in it)."""
    at = prompt_text.rfind(OPEN)
    return at >= 0 and prompt_text.find(CLOSE, at) < 0


def split_whole(text: str, inside: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output."""
    splitter = ReasoningSplitter(inside)
    reasoning, content = splitter.feed(text)
    more_r, more_c = splitter.flush()
    reasoning, content = reasoning + more_r, content + more_c
    if not splitter.saw_block:
        return None, text
    return reasoning.strip("\n") or None, content.lstrip("\n")


class ReasoningSplitter:
    """Feeds text deltas; returns (reasoning, content) for each, holding a possible tag."""

    def __init__(self, inside: bool) -> None:
        self.inside = inside
        self.saw_block = inside
        self.opened = inside  # a block can open at most once (at the start of the output)
        self.buffer = ""
        self.started = False  # any non-blank text seen (only a leading <think> opens a block)

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning: list[str] = []
        content: list[str] = []
        while self.buffer:
            if self.inside:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    keep = _tag_prefix(self.buffer, CLOSE)
                    reasoning.append(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                reasoning.append(self.buffer[:end])
                self.buffer = self.buffer[end + len(CLOSE) :]
                self.inside = False
                continue
            if not self.opened and not self.started:
                stripped = self.buffer.lstrip()
                if stripped.startswith(OPEN):
                    self.buffer = stripped[len(OPEN) :]
                    self.inside = self.opened = self.saw_block = True
                    continue
                if OPEN.startswith(stripped):  # maybe the start of "<think>": wait
                    break
                self.started = True
            content.append(self.buffer)
            self.buffer = ""
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        return (rest, "") if self.inside else ("", rest)


def _tag_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0

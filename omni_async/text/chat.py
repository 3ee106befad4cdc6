"""Chat templates: render a checkpoint's Jinja template to prompt ids.

The environment matches what Hugging Face tokenizers render templates with (a sandbox,
``trim_blocks``/``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now``,
a ``tojson`` that keeps non-ASCII text), so the ids equal
``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``: the rendered
text is encoded without adding special tokens, since the template writes its own.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Sequence

from .. import errors
from .tokenizer import Tokenizer


def render_chat_ids(
    tokenizer: Tokenizer | None, messages: Any, *, add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """The prompt ids of a conversation, or InvalidRequestError saying what is wrong.
    ``tools`` (OpenAI tool definitions) reach the template as ``tools``, as transformers'
    ``apply_chat_template(tools=...)`` passes them; ``template_kwargs`` (e.g.
    ``enable_thinking``) are further template variables, as its ``**kwargs`` are."""
    if tokenizer is None:
        raise errors.InvalidRequestError(
            "this model has no tokenizer (no tokenizer.json in its folder): chat messages need one"
        )
    template = chat_template_of(tokenizer)
    text = render_chat_text(
        template, _checked(messages), add_generation_prompt, _special_tokens(tokenizer), tools=tools, template_kwargs=template_kwargs
    )
    if not text:
        raise errors.InvalidRequestError("the chat template rendered an empty prompt")
    return tokenizer.encode(text, add_special_tokens=False)


def chat_template_of(tokenizer: Tokenizer | None) -> str:
    """The tokenizer's chat template, or InvalidRequestError saying why there is none."""
    if tokenizer is None:
        raise errors.InvalidRequestError(
            "this model has no tokenizer (no tokenizer.json in its folder): chat messages need one"
        )
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise errors.InvalidRequestError(
            "this model has no chat template (no chat_template in tokenizer_config.json and no "
            "chat_template.jinja in its folder): pass prompt or input_ids instead of messages"
        )
    return template


def render_chat_text(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    special: Mapping[str, str],
    *,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    extra = dict(template_kwargs or {})
    taken = sorted(set(extra) & {"messages", "add_generation_prompt", "tools", "documents"})
    if taken:
        raise errors.InvalidRequestError(f"chat_template_kwargs cannot set {', '.join(taken)}")
    try:
        compiled = _compile(template)
    except Exception as exc:  # a template the environment cannot parse
        raise errors.InvalidRequestError(f"the model's chat template does not compile: {exc}") from exc
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools or None, documents=None, **{**special, **extra})
    except errors.InvalidRequestError:
        raise
    except Exception as exc:
        raise errors.InvalidRequestError(f"the chat template failed on these messages: {exc}") from exc


def _checked(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise errors.InvalidRequestError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str):
            raise errors.InvalidRequestError(f"messages[{i}] must be a dict with a string 'role', got {msg!r}")
        out.append(msg if isinstance(msg, dict) else dict(msg))  # a dict subclass may track reads
    return out


def _special_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    special = dict(getattr(tokenizer, "special_tokens", {}) or {})
    for name in ("bos_token", "eos_token"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            special[name] = value
    return special


def _raise_exception(message: str) -> None:
    raise errors.InvalidRequestError(f"the chat template refused the messages: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def template_names(template: str) -> frozenset[str]:
    """The names a template reads: its free variables (``tools``, ``messages``...) and
    every key or attribute it looks up (``message.tool_calls``, ``message['name']``).
    What the server asks before it hands a template an input it might ignore."""
    from jinja2 import nodes

    try:
        tree = _environment().parse(template)
    except Exception as exc:
        raise errors.InvalidRequestError(f"the model's chat template does not compile: {exc}") from exc
    names: set[str] = set()
    for node in tree.find_all((nodes.Name, nodes.Getattr, nodes.Getitem)):
        if isinstance(node, nodes.Name):
            names.add(node.name)
        elif isinstance(node, nodes.Getattr):
            names.add(node.attr)
        elif isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str):
            names.add(node.arg.value)
    return frozenset(names)


def _environment() -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    return _environment().from_string(template)

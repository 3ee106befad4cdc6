"""``response_format``: OpenAI's structured output as the engine's constrained decoding.

``{"type": "json_object"}`` constrains the output to a JSON object (the schema
``{"type": "object"}``); ``{"type": "json_schema", "json_schema": {"name", "schema",
"strict"}}`` to the given schema. The grammar always holds the output to the schema, so
``strict`` is accepted either way; ``text`` (the default) constrains nothing.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from .. import errors

ANY_OBJECT: dict[str, Any] = {"type": "object"}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def format_constraint(fmt: Union[ResponseFormat, None]) -> dict[str, Any]:
    """SamplingParams fields for ``fmt`` (empty when it constrains nothing)."""
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise errors.InvalidRequestError("response_format.json_schema needs type 'json_schema'")
        return {}
    if fmt.type == "json_object":
        return {"json_schema": ANY_OBJECT}
    if fmt.json_schema is None:
        raise errors.InvalidRequestError("response_format.json_schema is required with type 'json_schema'")
    return {"json_schema": fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else ANY_OBJECT}


# ---------------------------------------------------------------- other servers' fields


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one of ``json``, ``regex``, ``choice``, ``grammar``
    (``json_object: true`` for any object)."""

    model_config = ConfigDict(extra="ignore")
    json_: Union[str, dict[str, Any], None] = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of ``choices`` (vLLM's ``choice`` / ``guided_choice``)."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise errors.InvalidRequestError("choice must be a non-empty list of strings")
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def request_constraint(body: Any) -> dict[str, Any]:
    """The one grammar a request asks for, whichever spelling it used: OpenAI's
    ``response_format``, SGLang's ``regex``/``ebnf``/``json_schema``, vLLM's
    ``structured_outputs`` or its older ``guided_*`` fields. Two at once is a 400."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = format_constraint(body.response_format)
    if fmt:
        found.append(("response_format", fmt))
    for name, kind in (("regex", "regex"), ("ebnf", "ebnf"), ("json_schema", "json_schema"),
                       ("guided_regex", "regex"), ("guided_grammar", "ebnf"), ("guided_json", "json_schema")):
        value = getattr(body, name)
        if value is not None:
            found.append((name, {kind: value}))
    if body.guided_choice is not None:
        found.append(("guided_choice", {"regex": choice_regex(body.guided_choice)}))
    so = body.structured_outputs
    if so is not None:
        for name, value in (("json", so.json_), ("regex", so.regex), ("grammar", so.grammar)):
            if value is not None:
                found.append((f"structured_outputs.{name}", {"ebnf" if name == "grammar" else "json_schema" if name == "json" else name: value}))
        if so.choice is not None:
            found.append(("structured_outputs.choice", {"regex": choice_regex(so.choice)}))
        if so.json_object:
            found.append(("structured_outputs.json_object", {"json_schema": ANY_OBJECT}))
    if len(found) > 1:
        raise errors.InvalidRequestError(f"give one structured output constraint, not {' and '.join(n for n, _ in found)}")
    return found[0][1] if found else {}

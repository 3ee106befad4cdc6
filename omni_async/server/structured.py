"""``response_format``: OpenAI's structured output as the engine's constrained decoding.

``{"type": "json_object"}`` constrains the output to a JSON object (the schema
``{"type": "object"}``); ``{"type": "json_schema", "json_schema": {"name", "schema",
"strict"}}`` to the given schema. The grammar always holds the output to the schema, so
``strict`` is accepted either way; ``text`` (the default) constrains nothing.
"""

from __future__ import annotations

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

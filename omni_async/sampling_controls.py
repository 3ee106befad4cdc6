"""Validation of the structured-output and OpenAI sampling fields of ``SamplingParams``.

Kept apart from :mod:`omni_async.config` so that the grammar fields (``json_schema``,
``regex``, ``ebnf``) and the OpenAI controls (``presence_penalty``, ``frequency_penalty``,
``logit_bias``) are checked in one place, before anything reaches the loop: a bad value is an
:class:`~omni_async.errors.InvalidRequestError` on that request alone. Whether a grammar
*compiles* is only known to the grammar library; that check runs in the request-build pool.
:func:`validate_if_changed` is how params already validated are checked again at the door.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import math
import re
from collections.abc import Mapping
from typing import Any, Callable

GRAMMAR_FIELDS: tuple[str, ...] = ("json_schema", "regex", "ebnf")
# OpenAI's ranges: penalties in [-2, 2], a logit bias in [-100, 100].
PENALTY_LIMIT = 2.0
LOGIT_BIAS_LIMIT = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
# A token id as a JSON key: ASCII digits, no sign, space or leading zero, at most ten digits
# (no vocabulary reaches 2**31); whether it is inside *this* model's vocabulary is checked
# once the request reaches a stage (stage/request_checks.py).
_CANONICAL_ID = re.compile(r"(?:0|[1-9][0-9]{0,9})")
MAX_TOKEN_ID = 2**31 - 1

# Limits of a JSON schema, near OpenAI's documented ones for structured outputs (up to 5,000
# object properties in all and 10 levels of nesting, 2025), which vLLM and SGLang accept and
# clients send: a schema past them is refused before it is serialised or compiled, with the
# limit in the error. Compiling runs on the grammar gate's thread with the GIL released
# (llguidance reads the schema text itself, structured/grammar.py), so what such a schema
# costs the event loop is this walk and one serialisation: tools/loop_stalls.py --scenarios
# schema measures it (docs/serving-compat.md has the policy and the figures).
MAX_SCHEMA_PROPERTIES = 5_000  # object properties, summed over every "properties" of the schema (OpenAI's)
# Nesting, as objects and arrays deep in the schema's JSON: a level of OpenAI's (an object
# in another's "properties", an "items", an "anyOf" branch) takes two, so 64 holds OpenAI's
# 10 with room for "$defs", "allOf" and the like.
MAX_SCHEMA_DEPTH = 64
# A backstop on all nodes (objects, arrays, keys and values): enums and "anyOf" branches are
# not properties. 5,000 properties with a type and a description each, all required, are
# about 35,000 nodes.
MAX_SCHEMA_NODES = 100_000
MAX_SCHEMA_CHARS = 1 << 20  # of compact JSON text (a schema given as a string: its length)

Bad = Callable[[str], Exception]
_SCALARS = frozenset((str, int, float, bool, type(None)))  # what JSON's leaves are (a quick test before the ABCs')


def normalize_json_schema(value: Any, bad: Bad) -> str | None:
    """A schema given as a dict or a JSON string, as compact JSON text (the cache key).
    Key order is kept: the output writes properties in the schema's order.

    ``True`` (any JSON value) is accepted, as JSON Schema allows; anything that is not a
    JSON object or boolean is refused."""
    if value is None:
        return None
    if isinstance(value, str):
        if len(value) > MAX_SCHEMA_CHARS:
            raise bad(f"json_schema is too large: {len(value)} characters, at most {MAX_SCHEMA_CHARS} are allowed")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise bad(f"json_schema is not valid JSON: {exc.msg} at position {exc.pos}") from None
        except RecursionError:  # "[" * 60000 fits the character cap and exhausts the parser's stack
            raise bad("json_schema is nested too deeply to be read as JSON") from None
    elif isinstance(value, Mapping) or isinstance(value, bool):
        parsed = value
    else:
        raise bad(f"json_schema must be a dict or a JSON string, got {type(value).__name__}")
    if not isinstance(parsed, (dict, bool)):
        raise bad(f"json_schema must be a JSON object (or true), got {type(parsed).__name__}")
    _check_schema_size(parsed, bad)
    try:
        text = json.dumps(parsed, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise bad(f"json_schema cannot be serialised as JSON: {exc}") from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise bad(f"json_schema is too large: {len(text)} characters of JSON, at most {MAX_SCHEMA_CHARS} are allowed")
    return text


def _check_schema_size(schema: Any, bad: Bad) -> None:
    """Refuse a schema past MAX_SCHEMA_PROPERTIES, MAX_SCHEMA_DEPTH or MAX_SCHEMA_NODES. The
    walk stops as soon as a limit is passed, so refusing a huge schema costs no more than
    walking a legal one (and no recursion: a deeply nested schema is counted, not
    overflowed). Only containers are visited (a container's keys and scalar values are
    counted by its length): the walk runs on the event loop, twice a request (when the
    params are made and at the stage's door), so a 5,000-property schema's 5,000 objects
    are its cost, not their 30,000 nodes. A stacked entry is (container, depth, whether it
    is a "properties" mapping)."""
    if not isinstance(schema, (Mapping, list, tuple)):
        return
    stack: list[tuple[Any, int, bool]] = [(schema, 1, False)]
    nodes, properties = 1, 0
    while stack:
        node, depth, is_properties = stack.pop()
        nodes += len(node)
        if nodes > MAX_SCHEMA_NODES:  # before the node's children are stacked
            raise bad(f"json_schema is too large: more than {MAX_SCHEMA_NODES:,} nodes (objects, arrays, keys and values)")
        if isinstance(node, Mapping):
            nodes += len(node)  # its values (the keys were counted above)
            values = node.values()
            inner = None if is_properties else node.get("properties")
            if isinstance(inner, Mapping):
                properties += len(inner)
                if properties > MAX_SCHEMA_PROPERTIES:
                    raise bad(f"json_schema is too large: more than {MAX_SCHEMA_PROPERTIES:,} object properties in all "
                              f"(OpenAI's structured-output limit; a larger schema takes seconds to compile)")
        else:
            inner, values = None, node
        children = [v for v in values if type(v) not in _SCALARS and isinstance(v, (Mapping, list, tuple))]
        if not children:
            continue
        if depth + 1 > MAX_SCHEMA_DEPTH:
            raise bad(f"json_schema is too large: nested more than {MAX_SCHEMA_DEPTH} objects and arrays deep "
                      f"(OpenAI's structured outputs allow 10 levels of nesting)")
        stack.extend((v, depth + 1, v is inner) for v in children)


def check_grammar_fields(params: Any, bad: Bad) -> str | None:
    """At most one of the three grammar fields, each of the right type and non-empty;
    returns the schema as compact JSON (serialised here, once per validation)."""
    given = [name for name in GRAMMAR_FIELDS if getattr(params, name) is not None]
    if len(given) > 1:
        raise bad(f"at most one of json_schema, regex, ebnf per request; got {', '.join(given)}")
    schema_text = normalize_json_schema(params.json_schema, bad)
    for name in ("regex", "ebnf"):
        value = getattr(params, name)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise bad(f"{name} must be a non-empty string, got {value!r}")
    return schema_text


def check_penalties(params: Any, bad: Bad) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not _is_number(value) or not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
            raise bad(f"{name} must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], got {value!r}")
        setattr(params, name, float(value))


def normalize_logit_bias(value: Any, bad: Bad) -> dict[int, float]:
    """``{token id: bias}`` with int keys (JSON gives string keys) and biases in [-100, 100]."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise bad(f"logit_bias must be a mapping of token id to bias, got {type(value).__name__}")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad(f"logit_bias has {len(value)} entries, at most {MAX_LOGIT_BIAS_ENTRIES} are allowed")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = _token_id(key)
        if token is None:
            raise bad(f"logit_bias key {_show(key)} is not a token id (a non-negative integer in decimal digits)")
        if not _is_number(bias) or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise bad(f"logit_bias[{token}] must be in [-100, 100], got {_show(bias)}")
        out[token] = float(bias)
    return out


def _token_id(key: Any) -> int | None:
    """The token id a key names, or None. ``str.isdigit`` also holds for superscripts and
    other scripts' digits, and ``int()`` takes spaces, signs and underscores: the key must
    match the canonical form exactly instead."""
    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        return key if 0 <= key <= MAX_TOKEN_ID else None
    if isinstance(key, str) and _CANONICAL_ID.fullmatch(key):
        token = int(key)
        return token if token <= MAX_TOKEN_ID else None
    return None


def _show(value: Any, limit: int = 40) -> str:
    """``repr`` cut to ``limit`` characters: an error names the value without echoing a
    5,000-character key back."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ---------------------------------------------------------------- validated once

_SEP = object()  # between the containers' items in a state: where one ends is part of it
_FIELD_GETTERS: dict[type, Callable[[Any], tuple]] = {}


def _fields_getter(cls: type) -> Callable[[Any], tuple]:
    getter = _FIELD_GETTERS.get(cls)
    if getter is None:
        getter = _FIELD_GETTERS[cls] = operator.attrgetter(*(f.name for f in dataclasses.fields(cls) if f.init))
    return getter


def _state(params: Any) -> tuple | None:
    """Every object ``validate`` reads: each field's value and the items of its lists and
    dict, compared by identity (``True == 1`` and ``1.0 == 1``, so equality would let a
    bool or a float replace a valid int unseen). None where a field cannot be snapshot
    this way (a json_schema dict may change deep inside; a container of another type):
    such params are validated every time."""
    lists = (params.suppress_tokens, params.stop_token_ids, params.stop)
    bias = params.logit_bias
    if type(bias) is not dict or any(type(x) is not list for x in lists) or not isinstance(params.json_schema, (str, type(None))):
        return None
    return (*_fields_getter(type(params))(params), _SEP, *lists[0], _SEP, *lists[1], _SEP, *lists[2], _SEP, *bias, _SEP, *bias.values())


def validate_if_changed(params: Any) -> None:
    """``params.validate()`` unless every object it reads is the one it read at the last
    validation that passed. A request's params are validated when they are made and
    again at the stage's door (they may have been changed in between, to anything):
    for a burst of submissions that second pass was half of each one's host time, and
    the comparison costs a fraction of it. A validation that raises leaves no state,
    so invalid params are refused at every door they reach."""
    last = params._valid_as
    if last is not None:
        now = _state(params)
        if now is not None and len(now) == len(last) and all(map(operator.is_, now, last)):
            return
    params._valid_as = None
    params.validate()
    params._valid_as = _state(params)

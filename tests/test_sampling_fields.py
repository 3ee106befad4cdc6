"""Validation of the structured-output and OpenAI sampling fields of SamplingParams."""

from __future__ import annotations

import json

import pytest

from omni_async import SamplingParams
from omni_async.errors import InvalidRequestError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_schema_as_dict_or_string_gives_one_grammar_key():
    as_dict = SamplingParams(json_schema=SCHEMA)
    as_text = SamplingParams(json_schema=json.dumps(SCHEMA, indent=2))
    assert as_dict.grammar == as_text.grammar
    assert as_dict.grammar[0] == "json_schema" and json.loads(as_dict.grammar[1]) == SCHEMA
    assert SamplingParams(regex="[a-z]+").grammar == ("regex", "[a-z]+")
    assert SamplingParams(ebnf='root ::= "x"').grammar == ("ebnf", 'root ::= "x"')
    assert SamplingParams().grammar is None


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"json_schema": SCHEMA, "regex": "a"}, "at most one"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one"),
        ({"json_schema": "{not json"}, "not valid JSON"),
        ({"json_schema": "[1, 2]"}, "JSON object"),
        ({"json_schema": 3}, "dict or a JSON string"),
        ({"regex": ""}, "non-empty string"),
        ({"ebnf": 5}, "non-empty string"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"frequency_penalty": True}, "frequency_penalty"),
        ({"logit_bias": {5: 101}}, "[-100, 100]"),
        ({"logit_bias": {-1: 1.0}}, "token id"),
        ({"logit_bias": {"x": 1.0}}, "token id"),
        ({"logit_bias": [1, 2]}, "mapping"),
    ],
)
def test_bad_fields_are_typed_errors(kwargs, words):
    with pytest.raises(InvalidRequestError, match=words.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kwargs)


def test_logit_bias_keys_from_json_become_ints():
    params = SamplingParams.from_dict({"logit_bias": {"17": 5, "3": -100}, "presence_penalty": 1})
    assert params.logit_bias == {17: 5.0, 3: -100.0}
    assert params.presence_penalty == 1.0 and params.has_logit_controls
    assert not SamplingParams().has_logit_controls

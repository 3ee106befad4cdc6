"""A misspelt field is refused with the names a caller may set, never the classes' own
bookkeeping (``_schema_of`` ...), and with the closest name as a suggestion."""

from __future__ import annotations

import pytest

from omni_async import Engine, SamplingParams, SchedulerConfig
from omni_async.errors import ConfigError, InvalidRequestError


def test_a_sampling_typo_names_the_public_fields_and_suggests_one():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict({"temprature": 0.5})
    msg = str(info.value)
    assert "temprature" in msg and "did you mean temperature?" in msg
    assert "max_new_tokens" in msg
    assert "_schema_of" not in msg and "_schema_text" not in msg and "_valid_as" not in msg


def test_a_private_field_is_not_settable():
    with pytest.raises(InvalidRequestError, match="unknown SamplingParams field"):
        SamplingParams.from_dict({"_schema_of": {}})


def test_an_engine_limit_typo_suggests_the_limit():
    with pytest.raises(ConfigError, match=r"did you mean max_running_requests\?"):
        SchedulerConfig.from_kwargs(max_runing_requests=4)


async def test_a_typo_in_a_request_fails_that_request_only():
    async with await Engine.load("tiny", kv_capacity_tokens=1024) as engine:
        with pytest.raises(InvalidRequestError, match="did you mean top_p"):
            await engine.generate(input_ids=[1, 2], sampling={"top_pp": 0.9, "max_new_tokens": 2})
        ok = await engine.generate(input_ids=[1, 2], sampling={"max_new_tokens": 2, "ignore_eos": True})
    assert len(ok.output_ids) == 2

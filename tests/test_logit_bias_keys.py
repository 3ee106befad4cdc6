"""``logit_bias`` keys: only a canonical decimal token id (ASCII digits, no sign, no
leading zero, no spaces) or a non-negative int names a token; anything else, and any id
outside the model's vocabulary, is an InvalidRequestError that names the key, both from
``SamplingParams`` and from the server (a 400, never a 500)."""

from __future__ import annotations

import pytest

from omni_async import Engine, SamplingParams, errors

BAD_KEYS = ["\u00b2", "\u0661", "1" * 5000, " 5", "5 ", "+5", "-0", "05", "", "5.0", "0x10", "1_000", "\uff15"]


@pytest.mark.parametrize("key", BAD_KEYS, ids=lambda k: repr(k)[:20])
def test_non_canonical_keys_are_typed_errors_naming_the_key(key):
    with pytest.raises(errors.InvalidRequestError) as info:
        SamplingParams(logit_bias={key: 1.0})
    assert repr(key)[:20] in str(info.value)


@pytest.mark.parametrize("key", [10**40, 2**63, True])
def test_huge_or_bool_int_keys_are_typed_errors(key):
    with pytest.raises(errors.InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={key: 1.0})


def test_canonical_keys_are_accepted():
    assert SamplingParams(logit_bias={"0": 1, "17": -2, 5: 3}).logit_bias == {0: 1.0, 17: -2.0, 5: 3.0}


async def test_key_outside_the_vocabulary_is_refused_by_the_engine():
    async with Engine.from_pretrained("tiny", device="cpu") as engine:
        with pytest.raises(errors.InvalidRequestError, match="logit_bias"):
            await engine.generate(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2, logit_bias={"999999": 1.0}))
        out = await engine.generate(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2))
        assert out.finish_reason == "length"

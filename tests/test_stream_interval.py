"""``stream_interval``: fewer, larger deltas for callers who ask; the same tokens."""

from __future__ import annotations

import pytest

from omni_async import Engine, SamplingParams
from omni_async.errors import ConfigError

from .conftest import LOOPS, assert_kv_free


@pytest.mark.parametrize("loop", LOOPS)
async def test_deltas_every_n_tokens_and_at_finish(loop):
    sp = SamplingParams(max_new_tokens=11, temperature=0.7, seed=3, ignore_eos=True, return_logprob=True)
    plain = Engine.from_pretrained("tiny", loop=loop)
    async with plain:
        want = await plain.generate(input_ids=[5, 6, 7], sampling=sp)
        every = [d async for d in plain.stream(input_ids=[5, 6, 7], sampling=sp)]
    engine = Engine.from_pretrained("tiny", loop=loop, stream_interval=4)
    async with engine:
        deltas = [d async for d in engine.stream(input_ids=[5, 6, 7], sampling=sp)]
        result = await engine.generate(input_ids=[5, 6, 7], sampling=sp)
    assert_kv_free(engine)
    assert len(every) == 11
    # The first token at once, then every 4, and the rest at the finish.
    assert [len(d.token_ids) for d in deltas] == [1, 4, 4, 2]
    assert [d.finished for d in deltas] == [False, False, False, True]
    assert deltas[-1].finish_reason == "length"
    assert [t for d in deltas for t in d.token_ids] == want.output_ids == result.output_ids
    assert [lp for d in deltas for lp in d.logprobs] == pytest.approx(want.output_logprobs)


async def test_default_is_every_step():
    engine = Engine.from_pretrained("tiny")
    async with engine:
        deltas = [d async for d in engine.stream(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=5, ignore_eos=True))]
    assert [len(d.token_ids) for d in deltas] == [1] * 5


def test_stream_interval_must_be_positive():
    with pytest.raises(ConfigError, match="stream_interval"):
        Engine.from_pretrained("tiny", stream_interval=0)

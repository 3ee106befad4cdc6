"""Generated bad (and odd) requests sent next to valid companions in one engine: every
generated request ends with a typed error or a result, and the companions finish with
exactly the tokens they get alone. ``--soak`` runs many more cases."""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_async import Engine, SamplingParams, errors

from .conftest import assert_kv_free

COMPANIONS = [[5, 6, 7], [9, 10, 11, 12]]
VOCAB = 320

_values = st.one_of(
    st.none(), st.booleans(), st.integers(-10**20, 10**20), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5), st.lists(st.integers(-5, 400), max_size=6),
)
_sampling = st.dictionaries(
    st.sampled_from(["max_new_tokens", "min_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
                     "repetition_penalty", "suppress_tokens", "stop_token_ids", "ignore_eos", "return_logprob",
                     "stop", "n", "top_logprobs", "logprobs_mode", "bogus"]),
    _values, max_size=5,
)
_ids = st.one_of(st.lists(st.integers(-3, VOCAB + 3), max_size=12), _values)
_request = st.fixed_dictionaries({"input_ids": _ids, "sampling": _sampling})


def _alone() -> list[list[int]]:
    async def run():
        async with Engine.from_pretrained("tiny") as engine:
            return [(await engine.generate(input_ids=ids, sampling=SamplingParams(max_new_tokens=6, ignore_eos=True))).output_ids
                    for ids in COMPANIONS]
    return asyncio.run(run())


_EXPECTED: list[list[list[int]]] = []


def _check(batch: list[dict], loop: str) -> None:
    if not _EXPECTED:
        _EXPECTED.append(_alone())

    async def run():
        engine = Engine.from_pretrained("tiny", loop=loop)
        async with engine:
            companions = [asyncio.ensure_future(engine.generate(input_ids=ids, sampling=SamplingParams(max_new_tokens=6, ignore_eos=True)))
                          for ids in COMPANIONS]

            async def bad(req):
                sampling = dict(req["sampling"])
                sampling.setdefault("max_new_tokens", 4)
                try:
                    await asyncio.wait_for(engine.generate(input_ids=req["input_ids"], sampling=sampling), 60)
                except errors.OmniAsyncError:
                    pass  # a typed error on that request alone

            await asyncio.gather(*(bad(r) for r in batch))
            got = [(await c).output_ids for c in companions]
        assert got == _EXPECTED[0]
        assert_kv_free(engine)

    asyncio.run(run())


def _fuzz(soak: bool, loop: str):
    @settings(max_examples=400 if soak else 12, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(_request, min_size=1, max_size=4))
    def inner(batch):
        _check(batch, loop)

    inner()


def test_generated_bad_requests_beside_companions_normal(soak):
    _fuzz(soak, "normal")


def test_generated_bad_requests_beside_companions_async_decode(soak):
    _fuzz(soak, "async_decode")

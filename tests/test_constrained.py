"""Constrained decoding (SamplingParams json_schema / regex / ebnf) on the tiny model and on
a random checkpoint with a byte-level tokenizer.json, in every loop and with multi-step
decode: outputs parse and validate, loops agree token for token, free requests beside
constrained ones keep their tokens, and a bad grammar fails its request alone."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from omni_async import Engine, SamplingParams, errors
from omni_async.core.request import masked

from .conftest import assert_kv_free

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{1,3}(\.[0-9])?"
EBNF = 'root ::= "answer: " ("yes" | "no" | digit digit?) "."\ndigit ::= [0-9]'
EBNF_AS_REGEX = r"answer: (yes|no|[0-9][0-9]?)\."
# The loops, and the normal loop with four forwards per decode step.
CONFIGS = [{"loop": "normal"}, {"loop": "overlap"}, {"loop": "async_decode"}, {"loop": "normal", "decode_steps": 4}]
SEEDS = range(8)


def validate(value, schema) -> None:
    """The JSON Schema subset SCHEMA uses, checked directly."""
    if "enum" in schema:
        assert value in schema["enum"]
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict)
        assert set(schema["required"]) <= set(value) <= set(schema["properties"])
        for key, sub in value.items():
            validate(sub, schema["properties"][key])
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema["maxItems"]
        for item in value:
            validate(item, schema["items"])
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema["maxLength"]
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema["minimum"] <= value <= schema["maximum"]
    elif kind == "boolean":
        assert isinstance(value, bool)
    else:
        raise AssertionError(f"unexpected schema type {kind}")


def model_path(name: str, checkpoint) -> str:
    return "tiny" if name == "tiny" else str(checkpoint)


def requests() -> list[tuple[str, SamplingParams]]:
    """Constrained requests (greedy and seeded) beside free ones, one batch."""
    out = [("json", SamplingParams(max_new_tokens=200, json_schema=SCHEMA))]
    out += [("json", SamplingParams(max_new_tokens=200, json_schema=json.dumps(SCHEMA), temperature=1.0, seed=s)) for s in SEEDS]
    out += [("regex", SamplingParams(max_new_tokens=32, regex=REGEX, temperature=1.0, seed=s)) for s in SEEDS[:4]]
    out += [("ebnf", SamplingParams(max_new_tokens=32, ebnf=EBNF, temperature=1.0, seed=s)) for s in SEEDS[:4]]
    out += [("free", SamplingParams(max_new_tokens=24, ignore_eos=True)),
            ("free", SamplingParams(max_new_tokens=24, temperature=1.0, seed=7, ignore_eos=True))]
    return out


async def run(engine: Engine, reqs, prompt: str = "Reply in JSON:") -> list:
    return await asyncio.gather(*[engine.generate(prompt=prompt, sampling=sp) for _, sp in reqs])


@pytest.mark.parametrize("model", ["tiny", "random"])
async def test_constrained_outputs_valid_and_identical_across_loops(model, omni_checkpoint):
    reqs = requests()
    free = [(k, sp) for k, sp in reqs if k == "free"]
    outputs = {}
    for config in CONFIGS:
        async with Engine.from_pretrained(model_path(model, omni_checkpoint), device="cpu", **config) as engine:
            results = await run(engine, reqs)
            alone = await run(engine, free)
        assert_kv_free(engine)
        for (kind, _), r in zip(reqs, results):
            if kind == "json":
                assert r.finish_reason == "stop", r.text
                obj = json.loads(r.text)
                validate(obj, SCHEMA)
                assert list(obj) == [k for k in SCHEMA["properties"] if k in obj]  # the schema's order
            elif kind == "regex":
                assert r.finish_reason == "stop" and re.fullmatch(REGEX, r.text), r.text
            elif kind == "ebnf":
                assert r.finish_reason == "stop" and re.fullmatch(EBNF_AS_REGEX, r.text), r.text
        # Free requests beside constrained ones keep the tokens they get alone.
        assert [r.output_ids for (k, _), r in zip(reqs, results) if k == "free"] == [r.output_ids for r in alone]
        outputs[str(config)] = [r.output_ids for r in results]
    first = outputs[str(CONFIGS[0])]
    for name, got in outputs.items():
        assert got == first, f"{name} differs from the normal loop"
    # Seeds make different valid objects: the grammar constrains, it does not dictate.
    assert len({tuple(ids) for (k, _), ids in zip(reqs, first) if k == "json"}) > 3


@pytest.mark.parametrize("loop", ["normal", "overlap", "async_decode"])
async def test_bad_grammar_fails_its_request_alone(loop, omni_checkpoint):
    bad = [
        SamplingParams(max_new_tokens=8, json_schema={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}),
        SamplingParams(max_new_tokens=8, json_schema={"type": "strnig"}),
        SamplingParams(max_new_tokens=8, regex="(("),
        SamplingParams(max_new_tokens=8, ebnf="root ::= ( \"a\""),
    ]
    free = [SamplingParams(max_new_tokens=16, ignore_eos=True), SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, ignore_eos=True)]
    async with Engine.from_pretrained(str(omni_checkpoint), device="cpu", loop=loop) as engine:
        alone = await asyncio.gather(*[engine.generate(prompt="x", sampling=sp) for sp in free])
        mixed = await asyncio.gather(*[engine.generate(prompt="x", sampling=sp) for sp in bad + free], return_exceptions=True)
        good = await engine.generate(prompt="x", sampling=SamplingParams(max_new_tokens=32, regex=REGEX))
    assert_kv_free(engine)
    for result in mixed[: len(bad)]:
        assert isinstance(result, errors.InvalidRequestError), result
    assert [r.output_ids for r in mixed[len(bad):]] == [r.output_ids for r in alone]
    assert re.fullmatch(REGEX, good.text)


async def test_grammar_without_tokenizer_is_refused(hf_checkpoints):
    async with Engine.from_pretrained(str(hf_checkpoints["llama"]), device="cpu") as engine:
        with pytest.raises(errors.InvalidRequestError, match="tokenizer"):
            await engine.generate(input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=4, regex="a+"))
        r = await engine.generate(input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=4))
        assert len(r.output_ids) == 4
    assert_kv_free(engine)


async def test_grammar_completes_even_with_ignore_eos():
    """A complete grammar ends the request ("stop") whatever ignore_eos says."""
    async with Engine.from_pretrained("tiny", device="cpu") as engine:
        r = await engine.generate(prompt="n:", sampling=SamplingParams(max_new_tokens=64, regex="[0-9]{3}", ignore_eos=True))
    assert r.finish_reason == "stop" and re.fullmatch("[0-9]{3}", r.text) and len(r.output_ids) == 3


@pytest.mark.parametrize("loop", ["overlap", "async_decode"])
async def test_constrained_rows_scheduled_with_at_most_the_step_in_flights_token(loop):
    """A constrained row's next mask needs its last token on the host: a step holds such a
    row when nothing else of it is in flight, or, in a one-forward step sampling under late
    masks, with the token of the step in flight, which the host processes before this step
    samples (core.multi_step.late_mask_rows)."""
    async with Engine.from_pretrained("tiny", device="cpu", loop=loop) as engine:
        core = engine.scheduler.core
        schedule = core.get_next_batch
        held, late = [], []

        def checked():
            batch = schedule()
            if batch is not None:
                rows = [r for r, kept, index in zip(batch.reqs, batch.samples_kept, batch.sample_indices)
                        if kept and masked(r, index)]  # (rows sampling first carry no such rule)
                most = 2 if batch.late_masks and batch.row_steps is None else 1
                assert all(r.num_inflight <= most for r in rows), [r.num_inflight for r in rows]
                held.append(len(rows))
                late.append(any(r.num_inflight == 2 for r in rows))
            return batch

        core.get_next_batch = checked
        constrained = [SamplingParams(max_new_tokens=32, regex=REGEX, temperature=1.0, seed=s) for s in range(3)]
        free = [SamplingParams(max_new_tokens=24, ignore_eos=True) for _ in range(3)]
        results = await asyncio.gather(*[engine.generate(prompt="id:", sampling=sp) for sp in constrained + free])
        assert engine.scheduler.info()["lookahead_steps" if loop == "async_decode" else "steps"] > 0
    assert any(held) and any(late)
    for r in results[:3]:
        assert r.finish_reason == "stop" and re.fullmatch(REGEX, r.text), r.text

"""Prompts given as embeddings (``input_embeds``): the embedding rows of a prompt's ids
give that prompt's tokens in every loop, chunked, with the prefix cache and under
retraction; other rows give other tokens; bad input is a typed error on that request
alone; and greedy tokens equal transformers' ``generate(inputs_embeds=...)``."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from omni_async import Engine, IncomingMessage, RequestPayload, SamplingParams, errors

from .conftest import LOOPS, assert_kv_free, random_prompts
from .test_admission import Stage


def embedding_table(folder: Path) -> torch.Tensor:
    """The checkpoint's token embeddings, read from its safetensors file."""
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
        return f.get_tensor("model.embed_tokens.weight")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


PROMPTS = random_prompts(4, 256, 20, 45, seed=3)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("chunk", [None, 8])
async def test_embeddings_of_the_ids_give_the_same_tokens(omni_checkpoint, loop, chunk):
    table = embedding_table(omni_checkpoint)
    kw = {"chunked_prefill_size": chunk} if chunk else {}
    engine = Engine.from_pretrained(str(omni_checkpoint), loop=loop, page_size=8, **kw)
    async with engine:
        by_ids = await asyncio.gather(*[engine.generate(input_ids=p, sampling=greedy(10)) for p in PROMPTS])
        by_rows = await asyncio.gather(*[engine.generate(input_embeds=table[p], sampling=greedy(10)) for p in PROMPTS])
        # The same prompts again: ids now hit the prefix cache, embeddings never do.
        again = await asyncio.gather(*[engine.generate(input_embeds=table[p].numpy(), sampling=greedy(10)) for p in PROMPTS])
    for a, b, c, p in zip(by_ids, by_rows, again, PROMPTS):
        assert b.output_ids == a.output_ids and c.output_ids == a.output_ids
        assert b.prompt_ids == [0] * len(p) and b.cached_tokens == 0 and c.cached_tokens == 0
    assert_kv_free(engine)


async def test_other_embeddings_give_other_tokens_and_never_share_kv(omni_checkpoint):
    """Every prompt given as embeddings has the same placeholder ids: were its pages
    shared through the prefix cache, the second prompt would reuse the first's KV."""
    table = embedding_table(omni_checkpoint)
    p1, p2 = PROMPTS[0][:32], PROMPTS[1][:32]
    engine = Engine.from_pretrained(str(omni_checkpoint), loop="normal", page_size=8)
    async with engine:
        zeros = await engine.generate(input_ids=[0] * 32, sampling=greedy(12))  # the placeholder ids, cached
        first = await engine.generate(input_embeds=table[p1], sampling=greedy(12))
        second = await engine.generate(input_embeds=table[p2], sampling=greedy(12))
        expect1 = await engine.generate(input_ids=p1, sampling=greedy(12))
        expect2 = await engine.generate(input_ids=p2, sampling=greedy(12))
        scaled = await engine.generate(input_embeds=table[p1] * -2.0, sampling=greedy(12))
        random_rows = await engine.generate(input_embeds=torch.randn(32, table.shape[1]), sampling=greedy(12))
    assert first.output_ids == expect1.output_ids and second.output_ids == expect2.output_ids
    assert first.output_ids != second.output_ids
    assert scaled.output_ids != first.output_ids and random_rows.output_ids != zeros.output_ids
    assert first.cached_tokens == 0 and second.cached_tokens == 0
    assert_kv_free(engine)


@pytest.mark.parametrize("loop", LOOPS)
async def test_retraction_re_prefills_from_the_embeddings(omni_checkpoint, loop):
    table = embedding_table(omni_checkpoint)
    prompts = random_prompts(12, 256, 10, 60, seed=5)
    engine = Engine.from_pretrained(
        str(omni_checkpoint), loop=loop, page_size=8, kv_capacity_tokens=8 * 30, chunked_prefill_size=24, max_prefill_tokens=32,
    )
    async with engine:
        by_ids = await asyncio.gather(*[engine.generate(input_ids=p, sampling=greedy(30)) for p in prompts])
        retractions = engine.stack.core.num_retractions
        by_rows = await asyncio.gather(*[engine.generate(input_embeds=table[p], sampling=greedy(30)) for p in prompts])
        assert engine.stack.core.num_retractions > retractions, "the KV capacity was meant to force retraction"
    assert [r.output_ids for r in by_rows] == [r.output_ids for r in by_ids]
    assert_kv_free(engine)


BAD = {
    "a string": "not a tensor",
    "1-D": torch.zeros(128),
    "3-D": torch.zeros(1, 4, 128),
    "wrong width": torch.zeros(4, 64),
    "integers": torch.zeros(4, 128, dtype=torch.long),
    "nan": torch.tensor([[0.0] * 128, [float("nan")] + [0.0] * 127]),
    "inf": np.full((3, 128), np.inf, dtype=np.float32),
    "empty": torch.zeros(0, 128),
    "ragged list": [[0.0] * 128, [0.0] * 3],
    "longer than the context": torch.zeros(4096, 128),
}


@pytest.mark.parametrize("case", sorted(BAD))
async def test_bad_embeddings_are_typed_errors_and_the_batch_carries_on(tiny_engine, case):
    engine = tiny_engine()
    async with engine:
        good = await engine.submit(input_ids=PROMPTS[0], sampling=greedy(30))
        expected_type = errors.RequestRejectedError if case == "longer than the context" else errors.InvalidRequestError
        with pytest.raises(expected_type):
            await engine.submit(input_embeds=BAD[case], sampling=greedy(4))
        assert len((await good.result()).output_ids) == 30


async def test_embeddings_with_another_prompt_are_refused(tiny_engine):
    engine = tiny_engine(kv_capacity_tokens=256)
    async with engine:
        for other in ({"input_ids": [1, 2]}, {"prompt": "hi"}, {"messages": [{"role": "user", "content": "hi"}]}):
            with pytest.raises(errors.InvalidRequestError, match="input_embeds"):
                await engine.generate(input_embeds=torch.zeros(2, 128), **other)
        with pytest.raises(errors.RequestRejectedError, match="KV"):
            await engine.generate(input_embeds=torch.zeros(8, 128), sampling=SamplingParams(max_new_tokens=1000))
        res = await engine.generate(input_embeds=[[0.01] * 128] * 3, sampling=greedy(5))  # a nested list is taken
        assert len(res.output_ids) == 5 and res.prompt_ids == [0, 0, 0]


async def test_stage_payloads_carry_embeddings_and_bad_ones_fail_alone():
    """A scheduler used directly takes ``RequestPayload.input_embeds`` (or the dict key);
    a bad one is that request's error, the good ones finish."""
    table = None
    async with Stage() as st:
        table = st.stack.runner.model.model.embed_tokens.weight.detach().clone()
        ids = PROMPTS[2]
        await st.send("ids", ids=ids, n=8)
        sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
        await st.sched.inbox.send(IncomingMessage("rows", "new_request", RequestPayload("rows", [], sp, input_embeds=table[ids])))
        await st.sched.inbox.send(IncomingMessage("dict", "new_request", {"input_embeds": table[ids], "sampling": sp}))
        await st.sched.inbox.send(IncomingMessage("bad", "new_request", RequestPayload("bad", [], sp, input_embeds=torch.ones(2, 3))))
        await st.sched.inbox.send(IncomingMessage("both", "new_request", RequestPayload("both", [1], sp, input_embeds=table[ids])))
        got = dict(zip(["ids", "rows", "dict", "bad", "both"], await st.done("ids", "rows", "dict", "bad", "both")))
    assert got["ids"].type == got["rows"].type == got["dict"].type == "result"
    assert got["rows"].data.output_ids == got["ids"].data.output_ids == got["dict"].data.output_ids
    for rid in ("bad", "both"):
        assert got[rid].type == "error" and isinstance(got[rid].data, errors.InvalidRequestError)


async def test_a_stage_without_embedding_support_refuses_them():
    """The SGLang backend and tensor-parallel stages leave ``ModelLimits.hidden_size``
    unset: a prompt as embeddings is then a typed error."""
    async with Stage() as st:
        st.sched.limits = dataclasses.replace(st.sched.limits, hidden_size=None)
        sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
        await st.sched.inbox.send(IncomingMessage("rows", "new_request", RequestPayload("rows", [], sp, input_embeds=torch.zeros(2, 128))))
        await st.send("ids", n=4)
        rows, ids = await st.done("rows", "ids")
    assert rows.type == "error" and isinstance(rows.data, errors.InvalidRequestError) and "input_embeds" in str(rows.data)
    assert ids.type == "result"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
async def test_greedy_matches_transformers_inputs_embeds(hf_checkpoints, family):
    from transformers import AutoModelForCausalLM

    folder = hf_checkpoints[family]
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    hidden = model.config.hidden_size
    embeds = [torch.randn(n, hidden, generator=gen) * 0.5 for n in (5, 17, 33)]
    expected = []
    with torch.no_grad():
        for e in embeds:
            out = model.generate(
                inputs_embeds=e[None], attention_mask=torch.ones(1, e.shape[0], dtype=torch.long),
                max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
            )
            expected.append(out[0, -12:].tolist())
    engine = Engine.from_pretrained(str(folder), loop="overlap", page_size=8, chunked_prefill_size=16)
    async with engine:
        got = await asyncio.gather(*[engine.generate(input_embeds=e, sampling=SamplingParams(max_new_tokens=12, min_new_tokens=12)) for e in embeds])
    assert [g.output_ids for g in got] == expected
    assert_kv_free(engine)


async def test_tensor_parallel_refuses_embeddings_at_the_door(hf_checkpoints):
    engine = Engine.from_pretrained(str(hf_checkpoints["llama"]), tensor_parallel_size=2, page_size=8)
    async with engine:
        with pytest.raises(errors.InvalidRequestError, match="input_embeds"):
            await engine.submit(input_embeds=torch.zeros(3, 64))
        assert len((await engine.generate(input_ids=[5, 6, 7], sampling=greedy(4))).output_ids) == 4


ODD_TENSORS = {
    "float8": lambda: torch.zeros(4, 128).to(torch.float8_e4m3fn),
    "sparse COO": lambda: torch.zeros(4, 128).to_sparse(),
    "meta": lambda: torch.zeros(4, 128, device="meta"),
    "complex": lambda: torch.zeros(4, 128, dtype=torch.complex64),
}


@pytest.mark.parametrize("case", sorted(ODD_TENSORS))
async def test_odd_tensors_are_typed_errors(tiny_engine, case):
    """Tensors the door cannot read as dense floating rows (no ``isfinite`` for float8,
    no dense view of a sparse tensor, no data on the meta device) are refused by name."""
    engine = tiny_engine()
    async with engine:
        with pytest.raises(errors.InvalidRequestError, match="input_embeds"):
            await engine.submit(input_embeds=ODD_TENSORS[case](), sampling=greedy(4))
        assert len((await engine.generate(input_ids=PROMPTS[0], sampling=greedy(5))).output_ids) == 5


async def test_embeddings_past_the_model_dtype_range_are_refused_and_poison_nothing(tiny_engine):
    """On a float16 stage, rows finite in float32 but past float16's range (65504) would
    become inf at the prefill and leave NaN in KV pages that go back to the free list:
    the door checks them in the model's dtype, and the other requests, before and after,
    keep their tokens."""
    engine = tiny_engine(dtype="float16", page_size=8)
    prompts = random_prompts(4, 256, 5, 30, seed=11)
    async with engine:
        before = await asyncio.gather(*[engine.generate(input_ids=p, sampling=greedy(24)) for p in prompts])
        fine = await engine.generate(input_embeds=torch.full((13, 128), 6e4), sampling=greedy(4))  # within range
        assert len(fine.output_ids) == 4
        for big in (torch.full((13, 128), 1e5), np.full((5, 128), -7e4, dtype=np.float64)):
            with pytest.raises(errors.InvalidRequestError, match=r"input_embeds\[0\].*float16"):
                await engine.submit(input_embeds=big, sampling=greedy(24))
        after = await asyncio.gather(*[engine.generate(input_ids=p, sampling=greedy(24)) for p in prompts])
    assert [r.output_ids for r in after] == [r.output_ids for r in before]

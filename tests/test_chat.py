"""Chat templates: the checkpoint's template rendered to the same ids as transformers'
``apply_chat_template``; a clear error without one; the built-in model's own template."""

from __future__ import annotations

import pytest

from omni_async import Engine, SamplingParams
from omni_async.errors import InvalidRequestError
from omni_async.text.tokenizer import ByteTokenizer

from .conftest import assert_kv_free
from .text_fixtures import write_text_checkpoint

CONVERSATIONS = [
    [{"role": "user", "content": "naïve café 日本語?"}],
    [
        {"role": "system", "content": "You speak briefly."},
        {"role": "user", "content": "Grüße 🙂"},
        {"role": "assistant", "content": "привет"},
        {"role": "user", "content": "the talker speaks"},
    ],
]


def _hf_chat_ids(folder, messages):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return list(ids)


@pytest.mark.parametrize("where", ["config", "jinja"])
@pytest.mark.parametrize("kind", ["bytelevel", "llama"])
async def test_chat_ids_equal_transformers(hf_checkpoints, tmp_path, where, kind):
    folder = write_text_checkpoint(hf_checkpoints["llama"], tmp_path / f"{kind}-{where}", kind, chat=where)
    engine = Engine.from_pretrained(str(folder), loop="normal")
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    async with engine:
        for messages in CONVERSATIONS:
            expected = _hf_chat_ids(folder, messages)
            res = await engine.generate(messages=messages, sampling=sp)
            assert res.prompt_ids == expected
            by_ids = await engine.generate(input_ids=expected, sampling=sp)
            assert res.output_ids == by_ids.output_ids
            deltas = [d async for d in engine.stream(messages=messages, sampling=sp)]
            assert [t for d in deltas for t in d.token_ids] == res.output_ids
            handle = await engine.submit(messages=messages, sampling=sp)
            assert (await handle.result()).prompt_ids == expected
    assert_kv_free(engine)


async def test_chat_without_template_is_a_clear_error(hf_checkpoints, tmp_path):
    folder = write_text_checkpoint(hf_checkpoints["llama"], tmp_path / "plain", "bytelevel", chat=None)
    engine = Engine.from_pretrained(str(folder), loop="normal")
    async with engine:
        with pytest.raises(InvalidRequestError, match="no chat template"):
            await engine.submit(messages=CONVERSATIONS[0])
        with pytest.raises(InvalidRequestError, match="no chat template"):
            await engine.generate(messages=CONVERSATIONS[0])
        assert engine.open_requests == [] and engine.scheduler.active_request_ids() == []
        assert (await engine.generate(prompt="still serving", sampling=SamplingParams(max_new_tokens=3))).output_ids


@pytest.mark.parametrize(
    "bad,part",
    [([], "non-empty list"), ("hi", "non-empty list"), ([{"content": "no role"}], r"messages\[0\] must be a dict")],
)
async def test_malformed_messages(tiny_engine, bad, part):
    engine = tiny_engine()
    async with engine:
        with pytest.raises(InvalidRequestError, match=part):
            await engine.generate(messages=bad)
        with pytest.raises(InvalidRequestError, match="either prompt or input_ids or messages"):
            await engine.generate(prompt="x", messages=CONVERSATIONS[0])


async def test_builtin_model_chats_out_of_the_box(tiny_engine):
    engine = tiny_engine()
    async with engine:
        res = await engine.generate(messages=CONVERSATIONS[0], sampling=SamplingParams(max_new_tokens=5))
    rendered = "<|user|>\nnaïve café 日本語?\n<|assistant|>\n"
    assert res.prompt_ids == ByteTokenizer().encode(rendered, add_special_tokens=False)
    assert len(res.output_ids) >= 1 and isinstance(res.text, str)


async def test_add_special_tokens_for_prompts(tiny_engine):
    engine = tiny_engine()
    async with engine:
        with_bos = await engine.generate(prompt="hi", sampling=SamplingParams(max_new_tokens=2))
        without = await engine.generate(prompt="hi", add_special_tokens=False, sampling=SamplingParams(max_new_tokens=2))
    assert with_bos.prompt_ids == [ByteTokenizer.BOS, *b"hi"]
    assert without.prompt_ids == list(b"hi")

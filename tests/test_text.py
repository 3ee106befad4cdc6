"""Streamed text for real tokenizers: incremental detokenisation, stop strings, and the
end-of-sequence ids of generation_config.json."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from omni_async import Engine, SamplingParams
from omni_async.text.tokenizer import ByteTokenizer, HFTokenizer

from .conftest import LOOPS, assert_kv_free
from .text_fixtures import KINDS, MULTIBYTE_TEXTS, train_tokenizer, write_text_checkpoint

PROMPTS = ["naïve café", "the talker speaks", "Grüße 🙂 привет"]


@pytest.fixture(scope="module")
def text_ckpts(hf_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    return {k: write_text_checkpoint(hf_checkpoints["llama"], root / k, k) for k in KINDS}


def _joined(deltas, index=0):
    return "".join(d.text for d in deltas if d.index == index)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("skip", [True, False])
def test_decode_stream_joins_to_the_full_decode(kind, skip):
    """Real multi-byte text and random token sequences (partial characters, byte-fallback
    runs, special tokens in between): the joined chunks plus the final remainder equal
    the full decode, and every prefix emitted is a prefix of it."""
    tok = HFTokenizer.from_object(train_tokenizer(kind), eos_token_ids=(2,), vocab_size=512)
    rng = random.Random(7)
    vocab = tok.backend.get_vocab_size()
    cases = [tok.encode(t, add_special_tokens=False) for t in MULTIBYTE_TEXTS]
    cases += [[rng.randrange(vocab) for _ in range(rng.randint(1, 50))] for _ in range(150)]
    for ids in cases:
        stream = tok.decode_stream(skip)
        emitted = ""
        for n, t in enumerate(ids):
            emitted += stream.step(t)
            assert tok.decode(ids[: n + 1], skip).startswith(emitted), (kind, ids[: n + 1])
    for text in MULTIBYTE_TEXTS:  # text streams out as it goes (held back at most a token or a run)
        stream = tok.decode_stream(skip)
        ids = tok.encode(text, add_special_tokens=False)
        emitted = "".join(stream.step(t) for t in ids[:-1])
        assert len(emitted) >= len(tok.decode(ids[:-1], skip)) - 12 and text.startswith(emitted)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("skip", [True, False])
def test_decoders_sharing_decoded_pairs_emit_what_one_alone_emits(kind, skip, monkeypatch):
    """A tokenizer's decoders keep the two-token windows they decoded (``WindowDecoder``'s
    pairs, shared): streams after many others, the cache cleared at its bound midway, emit
    chunk for chunk what a decoder without the cache emits (real texts, random ids with
    partial characters, byte-fallback runs and special tokens)."""
    from omni_async.text import detokenize

    monkeypatch.setattr(detokenize, "PAIRS_KEPT", 300)  # cleared several times below
    tok = HFTokenizer.from_object(train_tokenizer(kind), eos_token_ids=(2,), vocab_size=512)
    rng = random.Random(11)
    vocab = tok.backend.get_vocab_size()
    cases = [tok.encode(t, add_special_tokens=False) for t in MULTIBYTE_TEXTS] * 3
    cases += [[rng.randrange(vocab) for _ in range(rng.randint(1, 60))] for _ in range(200)]
    rng.shuffle(cases)
    pairs = tok._pairs[skip]
    for ids in cases:
        shared, alone = tok.decode_stream(skip), tok.decode_stream(skip)
        alone._pairs = None
        assert [shared.step(t) for t in ids] == [alone.step(t) for t in ids], (kind, ids)
        assert len(pairs) <= 300
    assert pairs


def test_byte_tokenizer_stream_decode():
    tok = ByteTokenizer()
    data = "naïve café 日本語 🙂".encode()
    stream = tok.decode_stream()
    pieces = [stream.step(b) for b in data]
    assert "".join(pieces) == data.decode()
    assert "" in pieces  # the middle bytes of a character emit nothing


@pytest.mark.parametrize("kind", KINDS)
async def test_stream_text_equals_result_text(text_ckpts, kind):
    folder = text_ckpts[kind]
    engine = Engine.from_pretrained(str(folder), loop="normal")
    tok = engine.tokenizer
    async with engine:
        for skip in (True, False):
            sp = SamplingParams(max_new_tokens=40, ignore_eos=True, skip_special_tokens=skip)
            for prompt in PROMPTS:
                deltas = [d async for d in engine.stream(prompt=prompt, sampling=sp)]
                res = await engine.generate(prompt=prompt, sampling=sp)
                assert [t for d in deltas for t in d.token_ids] == res.output_ids
                assert _joined(deltas) == res.text == tok.decode(res.output_ids, skip_special_tokens=skip)
                assert deltas[-1].finished and res.outputs[0].text == res.text
    assert_kv_free(engine)


def _token_texts(tok, ids):
    """The text each token adds to the decode of the sequence so far."""
    out, prev = [], ""
    for n in range(len(ids)):
        cur = tok.decode(ids[: n + 1])
        out.append(cur[len(prev):] if cur.startswith(prev) else None)
        prev = cur
    return out


def _spanning_stop(tok, ids):
    """A stop string made of the last two characters of one token's text and the first
    two of the next one's, and the index of the token that completes it."""
    texts = _token_texts(tok, ids)
    full = tok.decode(ids)
    for k in range(len(ids) - 1):
        a, b = texts[k], texts[k + 1]
        if a and b and len(a) >= 2 and len(b) >= 2 and "\ufffd" not in a + b:
            stop = a[-2:] + b[:2]
            pos = full.find(stop)
            done = next(j for j in range(len(ids)) if stop in tok.decode(ids[: j + 1]))
            return stop, pos, done
    pytest.skip("no two neighbouring tokens with two characters each")


@pytest.mark.parametrize("kind", ["bytelevel", "llama"])
@pytest.mark.parametrize("include", [False, True])
async def test_stop_string_spanning_tokens(text_ckpts, kind, include):
    engine = Engine.from_pretrained(str(text_ckpts[kind]), loop="normal")
    tok = engine.tokenizer
    async with engine:
        base = await engine.generate(prompt=PROMPTS[1], sampling=SamplingParams(max_new_tokens=48, ignore_eos=True))
        stop, pos, done = _spanning_stop(tok, base.output_ids)
        sp = SamplingParams(max_new_tokens=48, ignore_eos=True, stop=["never-there", stop], include_stop_str_in_output=include)
        res = await engine.generate(prompt=PROMPTS[1], sampling=sp)
        deltas = [d async for d in engine.stream(prompt=PROMPTS[1], sampling=sp)]
        assert engine.open_requests == []
    assert_kv_free(engine)
    full = tok.decode(base.output_ids)
    expected = full[: pos + len(stop)] if include else full[:pos]
    assert res.finish_reason == "stop"
    assert res.text == expected
    assert res.output_ids == base.output_ids[: done + 1]  # ends with the completing token
    assert _joined(deltas) == expected
    assert [t for d in deltas for t in d.token_ids] == res.output_ids
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
    if not include:
        assert all(stop not in d.text for d in deltas)


@pytest.mark.parametrize("loop", LOOPS)
async def test_stop_string_on_the_builtin_model(tiny_engine, loop):
    """Byte tokens (a multi-byte character is several tokens); the stage request ends
    while later steps are in flight (overlap, async_decode) and KV is freed once."""
    engine = tiny_engine(loop=loop)
    async with engine:
        base = await engine.generate(prompt="hello", sampling=SamplingParams(max_new_tokens=40, ignore_eos=True))
        text = base.text
        stop = text[10:13]
        sp = SamplingParams(max_new_tokens=40, ignore_eos=True, stop=[stop])
        res, other = await asyncio.gather(
            engine.generate(prompt="hello", sampling=sp),
            engine.generate(prompt="other", sampling=SamplingParams(max_new_tokens=30, ignore_eos=True)),
        )
        assert len(other.output_ids) == 30
        assert engine.open_requests == []
    assert res.finish_reason == "stop" and res.text == text[: text.find(stop)]
    assert ByteTokenizer().decode(res.output_ids).endswith(stop) or "\ufffd" in stop


@pytest.mark.parametrize("as_list", [False, True])
async def test_generation_config_eos_is_used(hf_checkpoints, tmp_path, as_list):
    """An EOS id that only generation_config.json names ends generation."""
    folder = write_text_checkpoint(hf_checkpoints["llama"], tmp_path / "gen", "bytelevel")
    sp = SamplingParams(max_new_tokens=24)
    engine = Engine.from_pretrained(str(folder), loop="normal")
    async with engine:
        base = await engine.generate(input_ids=[5, 6, 7, 8], sampling=sp)
    eos = base.output_ids[5]
    first = base.output_ids.index(eos)
    assert base.finish_reason == "length"
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, eos] if as_list else eos}))
    engine = Engine.from_pretrained(str(folder), loop="normal")
    assert eos in engine.scheduler.limits.eos_token_ids and eos in engine.tokenizer.eos_token_ids
    async with engine:
        res = await engine.generate(input_ids=[5, 6, 7, 8], sampling=sp)
    assert res.output_ids == base.output_ids[: first + 1]
    assert res.finish_reason == "stop"


@pytest.mark.parametrize(
    "stops,chunks,include,streamed,stopped",
    [
        (["abc", "bcd"], ["xa", "b", "cd"], False, ["x", "", ""], "abc"),
        (["abc", "bcd"], ["xa", "b", "cd"], True, ["x", "", "abc"], "abc"),
        (["bcd", "abc"], ["xab", "cd"], False, ["x", ""], "abc"),  # the earliest one wins
        (["END"], ["the E", "N", "d"], False, ["the ", "", "ENd"], None),  # a false start is released
        (["日本"], ["naïve 日", "本語"], False, ["naïve ", ""], "日本"),
        ([], ["a", "b"], False, ["a", "b"], None),
    ],
)
def test_stop_matcher_holds_back_and_cuts(stops, chunks, include, streamed, stopped):
    from omni_async.text.stops import StopMatcher

    m = StopMatcher(stops, include)
    got = [m.feed(c)[0] for c in chunks]
    assert got == streamed
    assert m.stopped == stopped
    tail = m.release()
    full = "".join(chunks)
    if stopped is None:
        assert "".join(got) + tail == full == m.text
    else:
        cut = full.find(stopped) + (len(stopped) if include else 0)
        assert "".join(got) + tail == full[:cut] == m.text


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab日🙂", max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    stops=st.lists(st.text(alphabet="ab日🙂", min_size=1, max_size=4), max_size=3),
    include=st.booleans(),
)
def test_stop_matcher_equals_a_search_of_the_whole_text(text, cuts, stops, include):
    """However the text is chunked, the cut is where a search of the whole text so far
    puts it, and a stop string that is not included is never streamed."""
    from omni_async.text.stops import StopMatcher

    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    m = StopMatcher(stops, include)
    streamed = []
    for c in chunks:
        out, hit = m.feed(c)
        streamed.append(out)
        if hit:
            break
    streamed.append(m.release())
    # The reference: after each chunk, the whole text so far is searched; the first chunk
    # after which some stop string occurs ends it, at the earliest such occurrence.
    expected = text
    for end in bounds[1:]:
        seen = text[:end]
        hits = sorted((seen.find(s), i, s) for i, s in enumerate(stops) if s in seen)
        if hits:
            pos, _, stop = hits[0]
            expected = seen[: pos + len(stop)] if include else seen[:pos]
            break
    assert "".join(streamed) == expected == m.text

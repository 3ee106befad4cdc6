"""Assistant turns that refer to an earlier spoken reply by its audio id (OpenAI's
multi-turn audio chat), against a real server over the tiny Qwen3-Omni checkpoint with
OpenAI's client: the turn is read as the reply's transcript, so the thinker writes what
it writes for the conversation written out in text; an id the server does not hold is a
400 on that request only; the store forgets at ``expires_at`` and keeps at most its
count."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from omni_async import errors  # noqa: E402
from omni_async.server import running_server  # noqa: E402
from omni_async.server.audio_turns import AudioTurns  # noqa: E402
from omni_async.server.chat_messages import ChatMessage  # noqa: E402
from omni_async.text.chat import render_chat_ids  # noqa: E402

from .test_omni_chain import assert_stages_free, pipeline  # noqa: E402
from .test_omni_chat_server import AUDIO, MESSAGES, REPLY, chat_folder  # noqa: E402,F401 (a fixture)
from .test_omni_talker import omni_model  # noqa: E402,F401 (a fixture)

NEXT = {"role": "user", "content": "and again"}


@pytest.fixture
async def served(chat_folder, request):
    pipe = pipeline(chat_folder, "overlap")
    turns = getattr(request, "param", None)
    async with running_server(pipe, **({"audio_turns": turns} if turns is not None else {})) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        try:
            yield pipe, client
        finally:
            await client.close()


async def _spoken(client, messages, *, stream: bool = False) -> tuple[str, str]:
    """A spoken reply's audio id and transcript."""
    kw = dict(model="ck", messages=messages, max_tokens=REPLY, temperature=0, modalities=["text", "audio"], audio=AUDIO)
    if not stream:
        message = (await client.chat.completions.create(**kw)).choices[0].message
        return message.audio.id, message.audio.transcript
    ids, transcript = set(), []
    async for chunk in await client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            audio = choice.delta.to_dict().get("audio") or {}
            ids.update([audio["id"]] if "id" in audio else [])
            transcript.append(audio.get("transcript", ""))
    (audio_id,) = ids
    return audio_id, "".join(transcript)


async def _text(client, messages):
    """A greedy text reply with its tokens' log-probabilities (what tells the tokens apart)."""
    res = await client.chat.completions.create(model="ck", messages=messages, max_tokens=REPLY, temperature=0, logprobs=True)
    choice = res.choices[0]
    return res.usage.prompt_tokens, choice.message.content, [(t.token, t.logprob) for t in choice.logprobs.content]


def same_reply(a, b) -> bool:
    """The same prompt length, text and tokens, log-probabilities within float32 rounding:
    two replies to one prompt can be computed differently when the server's other work
    differs (the spoken reply before still running, a cached prefix), and under load on a
    2-core machine a log-probability moved in its seventh digit; a different prompt moves
    them far more."""
    return (a[:2] == b[:2] and [t for t, _ in a[2]] == [t for t, _ in b[2]]
            and all(abs(x - y) <= 1e-4 for (_, x), (_, y) in zip(a[2], b[2])))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_turn_referring_to_a_reply_reads_as_its_transcript(served, stream):
    pipe, client = served
    audio_id, transcript = await _spoken(client, MESSAGES, stream=stream)
    assert transcript
    written = [*MESSAGES, {"role": "assistant", "content": transcript}, NEXT]
    referred = [*MESSAGES, {"role": "assistant", "audio": {"id": audio_id}}, NEXT]
    want = await _text(client, written)
    got = await _text(client, referred)
    assert same_reply(got, want) and len(got[2]) == REPLY
    assert got[0] == len(render_chat_ids(pipe.thinker.tokenizer, written))  # the transcript is in the prompt
    # a spoken next turn too, and the assistant message as the client gave it back (model_dump)
    _, spoken_next = await _spoken(client, referred)
    assert spoken_next == want[1]
    await assert_stages_free(pipe)


async def test_the_answer_sent_back_as_the_client_received_it_is_read(served):
    pipe, client = served
    res = await client.chat.completions.create(model="ck", messages=MESSAGES, max_tokens=REPLY, temperature=0,
                                               modalities=["text", "audio"], audio=AUDIO)
    message = res.choices[0].message
    dumped = message.model_dump()  # content None, audio with id, data, expires_at, transcript
    written = [*MESSAGES, {"role": "assistant", "content": message.audio.transcript}, NEXT]
    assert same_reply(await _text(client, [*MESSAGES, dumped, NEXT]), await _text(client, written))


@pytest.mark.parametrize("turn,param", [
    ({"role": "assistant", "audio": {"id": "audio_0123456789abcdef01234567"}}, "messages[2].audio.id"),
    ({"role": "assistant", "audio": {"data": "AAAA"}}, "messages[2].audio.id"),
    ({"role": "assistant", "audio": {"id": ""}}, "messages[2].audio.id"),
])
async def test_an_id_the_server_does_not_hold_is_a_400_and_the_next_request_is_served(served, turn, param):
    pipe, client = served
    for stream in (False, True):
        for audio in (False, True):
            extra = {"modalities": ["text", "audio"], "audio": AUDIO} if audio else {}
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model="ck", messages=[*MESSAGES, turn, NEXT], max_tokens=REPLY, stream=stream,
                                                     **extra)
            assert err.value.status_code == 400 and err.value.body["param"] == param
    audio_id, _ = await _spoken(client, MESSAGES)
    await _spoken(client, [*MESSAGES, {"role": "assistant", "audio": {"id": audio_id}}, NEXT])
    await assert_stages_free(pipe)


async def test_a_turn_with_content_and_audio_is_refused(served):
    _, client = served
    audio_id, _ = await _spoken(client, MESSAGES)
    both = {"role": "assistant", "content": "hi", "audio": {"id": audio_id}}
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model="ck", messages=[*MESSAGES, both, NEXT], max_tokens=REPLY)
    assert err.value.body["param"] == "messages[2].content"


@pytest.mark.parametrize("served", [AudioTurns(max_turns=2)], indirect=True)
async def test_the_server_keeps_only_the_latest_replies(served):
    pipe, client = served
    ids = [(await _spoken(client, MESSAGES))[0] for _ in range(3)]
    assert len(set(ids)) == 3
    with pytest.raises(openai.BadRequestError) as err:  # pushed out by the later two
        await _text(client, [*MESSAGES, {"role": "assistant", "audio": {"id": ids[0]}}, NEXT])
    assert ids[0] in err.value.body["message"]
    for audio_id in ids[1:]:
        await _text(client, [*MESSAGES, {"role": "assistant", "audio": {"id": audio_id}}, NEXT])
    await assert_stages_free(pipe)


# ---------------------------------------------------------------- the store itself


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _turn(audio_id: str) -> list[ChatMessage]:
    return [ChatMessage(role="user", content="hi"), ChatMessage(role="assistant", audio={"id": audio_id})]


def test_a_reply_is_forgotten_at_its_expires_at():
    clock = Clock()
    turns = AudioTurns(ttl_s=60, clock=clock)
    expires_at = turns.keep("audio_a", "hello")
    assert expires_at == int(clock.now) + 60
    clock.now = expires_at - 0.5
    assert turns.resolve(_turn("audio_a"))[1].content == "hello" and len(turns) == 1
    clock.now = expires_at
    with pytest.raises(errors.InvalidRequestError):
        turns.resolve(_turn("audio_a"))
    assert len(turns) == 0


def test_the_store_stays_bounded_by_count_and_by_time():
    clock = Clock()
    turns = AudioTurns(max_turns=16, ttl_s=10, clock=clock)
    for i in range(1000):
        turns.keep(f"audio_{i}", str(i))
        clock.now += 0.001
        assert len(turns) == min(i + 1, 16)
    assert turns.transcript("audio_999") == "999" and turns.transcript("audio_984") == "984"
    assert turns.transcript("audio_983") is None
    clock.now += 10
    assert len(turns) == 0


def test_other_messages_pass_unchanged():
    turns = AudioTurns()
    messages = [ChatMessage(role="user", content="hi"), ChatMessage(role="assistant", content="yes")]
    assert turns.resolve(messages) == messages

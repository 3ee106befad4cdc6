"""The Qwen3-Omni talker from a ``Qwen3OmniMoeForConditionalGeneration`` folder: loaded
from its own tensors, its input built from the thinker's rows as the reference builds
it, and its greedy codes (talker greedy, sub-talker greedy) equal to the codes
transformers' ``generate(return_audio=True)`` hands to code2wav (float32, CPU, a tiny
random model saved by transformers; a user turn with an audio placeholder, so the
thinker's ``accept_hidden_layer`` rows are used too); then the same codes from the
talker stage, batched, in the three loops, with aborts, slot reuse and random weights."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from omni_async.errors import InvalidRequestError, ModelLoadError, RequestAbortedError
from omni_async.speech.omni_config import OmniTalkerConfig
from omni_async.speech.omni_runner import TRAILING_KEY
from omni_async.speech.omni_stage import build_omni_talker_stage, end_text_rows, frames_of, send_text_rows, talker_request
from omni_async.speech.omni_talker import TalkerPrompt, generate_codes, load_omni_talker, random_omni_talker, talker_prompt

from .conftest import LOOPS, assert_kv_free
from .test_omni_thinker import omni_config

# Special ids inside the tiny thinker's vocabulary (512) and the talker's (1024 control
# ids above a 64-entry codebook, as the release keeps its control ids in the top 1024).
IDS = dict(im_start_token_id=500, im_end_token_id=501, user_token_id=502, assistant_token_id=503, system_token_id=504,
           tts_bos_token_id=505, tts_eos_token_id=506, tts_pad_token_id=507)
AUDIO = 508
CODEC = dict(codec_eos_token_id=1080, codec_nothink_id=1081, codec_think_bos_id=1082, codec_think_eos_id=1083,
             codec_pad_id=1084, codec_bos_id=1085)
SPEAKERS = {"ethan": 1086, "chelsie": 1087}
GROUPS = 4


def talker_config():
    cfg = omni_config()
    for key, value in IDS.items():
        setattr(cfg, key, value)
    cfg.thinker_config.audio_token_id = AUDIO
    t = cfg.talker_config
    t.text_config.vocab_size = 1088
    for key, value in CODEC.items():
        setattr(t, key, value)
    t.speaker_id = SPEAKERS
    return cfg


@pytest.fixture(scope="module")
def omni_model(tmp_path_factory):
    """(folder, transformers' model) for one tiny random checkpoint."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    folder = tmp_path_factory.mktemp("omni_talker") / "ck"
    torch.manual_seed(1)
    reference = Qwen3OmniMoeForConditionalGeneration(talker_config()).eval()
    spread(reference.talker)
    reference.save_pretrained(folder)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    model.thinker.config.vision_start_token_id = 151652  # read by 5.25's text-only position ids
    return folder, model


@torch.no_grad()
def spread(talker) -> None:
    """Weights of unit gain (transformers draws them at std 0.02, where attention is
    near uniform and a changed input row barely moves a greedy pick): so the speaker, the
    thinker's rows and the repetition penalty each decide some codes."""
    for name, p in talker.named_parameters():
        if name.endswith("norm.weight"):
            p.uniform_(0.5, 1.5)
        elif p.ndim == 1:
            p.normal_(0.0, 0.1)
        elif "embedding" in name:
            p.normal_(0.0, 1.0)
        else:
            p.normal_(0.0, 1.5 / p.shape[-1] ** 0.5)


def chat_prompt(user: list[int]) -> list[int]:
    """A system turn, a user turn (text and an audio placeholder), the assistant's start."""
    return [500, 504, 7, 8, 501, 10, 500, 502, *user, 501, 10, 500, 503, 10]


def reference_run(model, prompt: list[int], *, reply: int, frames: int, speaker: str = "ethan", penalty: float = 1.05,
                  **inputs):
    """transformers' whole ``generate``, greedy everywhere (``inputs``: more of its inputs,
    an audio's features); returns the thinker's result and the codes it handed to code2wav
    (``[frames, groups]``)."""
    seen = {}
    thinker_generate, decode = model.thinker.generate, model.code2wav.chunked_decode

    def keep_thinker(*args, **kwargs):
        seen["thinker"] = thinker_generate(*args, **kwargs)
        return seen["thinker"]

    def keep_codes(codes, *args, **kwargs):
        seen["codes"] = codes
        return decode(codes, *args, **kwargs)

    model.thinker.generate, model.code2wav.chunked_decode = keep_thinker, keep_codes
    try:
        with torch.no_grad():
            model.generate(input_ids=torch.tensor([prompt]), speaker=speaker, return_audio=True, thinker_max_new_tokens=reply,
                           thinker_do_sample=False, thinker_eos_token_id=501, talker_do_sample=False,
                           talker_max_new_tokens=frames + 1, talker_repetition_penalty=penalty, **inputs)
    finally:
        del model.thinker.generate, model.code2wav.chunked_decode
    return seen["thinker"], seen["codes"][0].T


def thinker_rows(thinker_result, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    embeds = torch.cat([h[0] for h in thinker_result.hidden_states], dim=1)[0]
    hidden = torch.cat([h[layer] for h in thinker_result.hidden_states], dim=1)[0]
    return embeds, hidden


# (user turn, thinker reply tokens, frames asked, repetition penalty, how the talker ends):
# the reference's penalty (1.05); a reply longer than the frames (the trailing rows
# outlast them); a talker writing the codec EOS after 29 frames (tts_eos and tts_pad
# rows read past the reply); a penalty that changes the picks from the 6th frame on.
CASES = [([20, AUDIO, AUDIO, 31, 44], 7, 12, 1.05, "length"), ([61, 62], 3, 9, 1.05, "length"),
         ([20, AUDIO, AUDIO, 31, 44], 7, 40, 1.0, "stop"), ([61, 62], 3, 30, 3.0, "length")]


@pytest.mark.parametrize("user,reply,frames,penalty,finish", CASES)
def test_greedy_codes_equal_transformers(omni_model, user, reply, frames, penalty, finish):
    folder, model = omni_model
    talker = load_omni_talker(folder)
    prompt = chat_prompt(user)
    thinker, expected = reference_run(model, prompt, reply=reply, frames=frames, penalty=penalty)
    embeds, hidden = thinker_rows(thinker, talker.config.accept_hidden_layer)
    output = thinker.sequences[0, len(prompt):].tolist()
    got = generate_codes(talker, talker_prompt(talker, prompt, output, embeds, hidden, "Ethan"), max_frames=frames,
                         repetition_penalty=penalty)
    assert expected.shape[1] == GROUPS and (expected.shape[0] == frames) == (finish == "length")
    assert got.codes.tolist() == expected.tolist()
    assert got.finish_reason == finish


def test_the_speaker_and_the_thinker_rows_decide_codes(omni_model):
    """The same request with another voice, or with the audio positions' layer rows
    zeroed, writes other codes (what the equality above would miss if the talker
    ignored them)."""
    folder, model = omni_model
    talker = load_omni_talker(folder)
    prompt = chat_prompt([20, AUDIO, AUDIO, 31, 44])
    thinker, _ = reference_run(model, prompt, reply=5, frames=1)
    embeds, hidden = thinker_rows(thinker, talker.config.accept_hidden_layer)
    output = thinker.sequences[0, len(prompt):].tolist()

    def codes(speaker, rows):
        return generate_codes(talker, talker_prompt(talker, prompt, output, embeds, rows, speaker), max_frames=8).codes

    base = codes("ethan", hidden)
    assert not torch.equal(base, codes("chelsie", hidden))
    assert not torch.equal(base, codes("ethan", torch.zeros_like(hidden)))


def test_bad_requests_get_typed_errors(omni_model):
    folder, _ = omni_model
    talker = load_omni_talker(folder)
    width = talker.config.thinker_hidden_size
    prompt = chat_prompt([61, 62])
    rows = torch.randn(len(prompt) + 1, width)
    with pytest.raises(InvalidRequestError, match="unknown speaker"):
        talker_prompt(talker, prompt, [3, 4], rows, rows, "nobody")
    no_assistant = prompt[:-3]
    with pytest.raises(InvalidRequestError, match="assistant"):
        talker_prompt(talker, no_assistant, [3, 4], rows[: len(no_assistant) + 1], rows[: len(no_assistant) + 1], "ethan")
    with pytest.raises(InvalidRequestError, match="first reply token"):
        talker_prompt(talker, prompt, [3], rows[:-1], rows[:-1], "ethan")
    with pytest.raises(InvalidRequestError, match="hidden rows"):
        talker_prompt(talker, prompt, [3, 4], rows, rows[:-1], "ethan")
    good = talker_prompt(talker, prompt, [3, 4], rows, rows, "ethan")
    with pytest.raises(InvalidRequestError, match="max_frames"):
        generate_codes(talker, good, max_frames=0)


def test_a_folder_without_the_talker_is_refused(omni_model, tmp_path):
    folder, _ = omni_model
    raw = json.loads((folder / "config.json").read_text())
    del raw["talker_config"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="talker_config"):
        load_omni_talker(tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    raw["talker_config"]["code_predictor_config"]["hidden_size"] = 48
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="width"):
        load_omni_talker(tmp_path)


@pytest.fixture(scope="module")
def reference_requests(omni_model):
    """Each case's talker prompt and transformers' codes."""
    folder, model = omni_model
    talker = load_omni_talker(folder)
    out = []
    for user, reply, frames, penalty, finish in CASES:
        prompt = chat_prompt(user)
        thinker, expected = reference_run(model, prompt, reply=reply, frames=frames, penalty=penalty)
        embeds, hidden = thinker_rows(thinker, talker.config.accept_hidden_layer)
        output = thinker.sequences[0, len(prompt):].tolist()
        out.append((talker_prompt(talker, prompt, output, embeds, hidden, "ethan"), frames, penalty, finish, expected))
    return out


@pytest.mark.parametrize("loop", LOOPS)
async def test_the_talker_stage_writes_the_same_codes_in_every_loop(omni_model, reference_requests, loop):
    """All cases at once through the talker stage (batched frames, each request's own
    text rows per frame; chunked prefill; two forwards a decode step): each request's
    frames equal transformers' codes, its finish reason the reference's, the KV freed."""
    folder, _ = omni_model
    stage = build_omni_talker_stage(folder, loop=loop, page_size=8, chunked_prefill_size=16, decode_steps=2)
    async with stage.engine as engine:
        async def one(prompt, frames, penalty):
            handle = await engine.submit(**talker_request(stage.model, prompt, max_frames=frames, repetition_penalty=penalty))
            return await handle.result()

        results = await asyncio.gather(*(one(p, f, pen) for p, f, pen, _, _ in reference_requests))
        for result, (_, frames, _, finish, expected) in zip(results, reference_requests):
            assert frames_of(result.hidden_states).tolist() == expected.tolist()
            assert result.finish_reason == finish
        assert_kv_free(engine)


@pytest.mark.parametrize("loop", LOOPS)
async def test_an_aborted_talker_request_frees_its_kv_and_spares_the_others(omni_model, reference_requests, loop):
    """One request aborted after its first frames: it ends with RequestAbortedError, the
    request beside it still writes transformers' codes, and no KV page stays held."""
    folder, _ = omni_model
    stage = build_omni_talker_stage(folder, loop=loop, page_size=8)
    (kept, kept_frames, kept_penalty, _, kept_codes), (cut, cut_frames, cut_penalty, _, _) = reference_requests[3], reference_requests[2]
    async with stage.engine as engine:
        other = await engine.submit(**talker_request(stage.model, kept, max_frames=kept_frames, repetition_penalty=kept_penalty))
        victim = await engine.submit(**talker_request(stage.model, cut, max_frames=cut_frames, repetition_penalty=cut_penalty),
                                     request_id="cut")
        seen = 0
        async for delta in victim:
            seen += 0 if delta.hidden_states is None else delta.hidden_states.shape[0]
            if seen >= 3:
                await engine.abort("cut")
                break
        with pytest.raises(RequestAbortedError):
            await victim.result()
        result = await other.result()
        assert frames_of(result.hidden_states).tolist() == kept_codes.tolist()
        assert_kv_free(engine)


@pytest.mark.parametrize("loop", LOOPS)
async def test_streamed_requests_wait_for_their_rows_and_write_the_same_codes(omni_model, reference_requests, loop):
    """Every case at once with its trailing rows sent as it speaks (``streamed=True``), a
    row at a time with pauses, two forwards a step: each request writes transformers'
    codes (a frame runs only once its row is there), the KV freed. Rows sent to a request
    that took its rows at submission, or of the wrong width, fail that request alone."""
    folder, _ = omni_model
    stage = build_omni_talker_stage(folder, loop=loop, page_size=8, decode_steps=2)
    async with stage.engine as engine:
        async def one(i, prompt, frames, penalty):
            rid = f"streamed-{i}"
            request = talker_request(stage.model, TalkerPrompt(prompt.prefill, prompt.trailing[:0]), max_frames=frames,
                                     repetition_penalty=penalty, streamed=True)
            handle = await engine.submit(**request, request_id=rid)
            for k in range(prompt.trailing.shape[0]):
                await asyncio.sleep(0.01)
                send_text_rows(engine, rid, prompt.trailing[k:k + 1])
            end_text_rows(engine, rid)
            return await handle.result()

        results = await asyncio.gather(*(one(i, p, f, pen) for i, (p, f, pen, _, _) in enumerate(reference_requests)))
        for result, (_, _, _, finish, expected) in zip(results, reference_requests):
            assert frames_of(result.hidden_states).tolist() == expected.tolist()
            assert result.finish_reason == finish
        prompt, frames, penalty, _, expected = reference_requests[1]
        plain = await engine.submit(**talker_request(stage.model, prompt, max_frames=frames), request_id="plain")
        send_text_rows(engine, "plain", prompt.trailing[:1])
        narrow = await engine.submit(**talker_request(stage.model, prompt, max_frames=frames, streamed=True), request_id="narrow")
        send_text_rows(engine, "narrow", prompt.trailing[:1, :-1])
        for handle, match in ((plain, "streamed=True"), (narrow, "text rows are")):
            with pytest.raises(InvalidRequestError, match=match):
                await handle.result()
        assert_kv_free(engine)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("loop", LOOPS)
async def test_the_talker_stage_on_cuda_writes_transformers_codes(omni_model, reference_requests, loop):
    """On CUDA in float32 (the fused kernels, the grouped-expert kernel, the predictor's
    paged kernel, frames replayed as CUDA graphs with each row's text row copied in):
    every case at once, transformers' codes."""
    folder, _ = omni_model
    stage = build_omni_talker_stage(folder, device="cuda", dtype="float32", loop=loop)
    async with stage.engine as engine:
        handles = [await engine.submit(**talker_request(stage.model, p, max_frames=f, repetition_penalty=pen))
                   for p, f, pen, _, _ in reference_requests]
        for handle, (_, _, _, finish, expected) in zip(handles, reference_requests):
            result = await handle.result()
            assert frames_of(result.hidden_states).tolist() == expected.tolist()
            assert result.finish_reason == finish
        assert engine.scheduler.info()["speech_frame_graph_replays"] > 0
        assert_kv_free(engine)


async def test_a_request_without_text_rows_adds_tts_pad_even_in_a_reused_slot(omni_model, reference_requests):
    """A request whose metadata holds no trailing rows, in a slot that held another's
    (the 64 slots the runner starts with were all taken first, by requests with rows):
    each frame adds ``T(tts_pad)``, as ``generate_codes`` does for a prompt with no
    trailing rows, not the slot's last request's rows."""
    folder, _ = omni_model
    stage = build_omni_talker_stage(folder, loop="normal", page_size=8)
    prompt, frames, penalty, _, expected = reference_requests[3]
    bare = TalkerPrompt(prompt.prefill, prompt.trailing[:0])
    want = generate_codes(stage.model, bare, max_frames=frames, repetition_penalty=penalty).codes
    assert not torch.equal(want, expected)  # the rows matter for this prompt
    async with stage.engine as engine:
        async def run(request):
            return frames_of((await (await engine.submit(**request)).result()).hidden_states)

        fillers = await asyncio.gather(*(run(talker_request(stage.model, prompt, max_frames=1)) for _ in range(64)))
        assert all(f.tolist() == expected[:1].tolist() for f in fillers)
        request = talker_request(stage.model, prompt, max_frames=frames, repetition_penalty=penalty)
        del request["metadata"][TRAILING_KEY]
        assert (await run(request)).tolist() == want.tolist()
        assert_kv_free(engine)


async def test_a_random_weight_talker_stage_matches_its_own_oracle(omni_model, reference_requests):
    """A talker drawn on the device from a config (speed runs): the stage's codes equal
    ``generate_codes`` on the same weights, and two draws from one seed are the same
    model."""
    folder, _ = omni_model
    cfg = OmniTalkerConfig.from_folder(folder)
    stage = build_omni_talker_stage(cfg, loop="overlap", seed=3, page_size=8)
    again = random_omni_talker(cfg, seed=3)
    prompt, frames, _, _, _ = reference_requests[0]
    want = generate_codes(again, prompt, max_frames=frames).codes
    async with stage.engine as engine:
        got = frames_of((await (await engine.submit(**talker_request(stage.model, prompt, max_frames=frames))).result()).hidden_states)
        assert got.tolist() == want.tolist()
        assert_kv_free(engine)
    assert not torch.equal(want, generate_codes(random_omni_talker(cfg, seed=4), prompt, max_frames=frames).codes)

"""OpenAI's sampling controls: presence_penalty and frequency_penalty follow
``logit -= presence * (count > 0) + frequency * count`` over the generated tokens (after
repetition_penalty), logit_bias adds to a token's logit; checked against a direct
computation on a transformers reference's logits, in every loop and with multi-step decode."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omni_async import Engine, SamplingParams, errors
from omni_async.runners.sampling import RowSampling, sample_rows

from .conftest import LOOPS, _hf_model, assert_kv_free

CONFIGS = [{"loop": loop} for loop in LOOPS] + [{"loop": "normal", "decode_steps": 4}]


def openai_logits(logits: torch.Tensor, generated: list[int], sp: SamplingParams) -> torch.Tensor:
    """The formula, written out: repetition penalty, then OpenAI's penalties, then the bias."""
    x = logits.clone()
    for t in set(generated):
        x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
    for t in set(generated):
        count = generated.count(t)
        x[t] -= sp.presence_penalty + sp.frequency_penalty * count
    for t, b in sp.logit_bias.items():
        x[t] += b
    return x


def reference(folder, prompt: list[int], sp: SamplingParams) -> tuple[list[int], list[float]]:
    """Greedy tokens and their processed logprobs, step by step on transformers' logits."""
    model = _hf_model(folder)
    seq, out, lps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(sp.max_new_tokens):
            logits = model(torch.tensor([seq])).logits[0, -1].to(torch.float32)
            x = openai_logits(logits, out, sp)
            tok = int(torch.argmax(x))
            lps.append(float(torch.log_softmax(x, -1)[tok]))
            out.append(tok)
            seq.append(tok)
    return out, lps


PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [11] * 30]
PARAMS = [
    SamplingParams(max_new_tokens=20, frequency_penalty=1.5, ignore_eos=True, return_logprob=True),
    SamplingParams(max_new_tokens=20, presence_penalty=2.0, repetition_penalty=1.2, ignore_eos=True, return_logprob=True),
    SamplingParams(max_new_tokens=20, presence_penalty=-0.5, frequency_penalty=0.8, logit_bias={7: 3.0, 100: -2.5},
                   ignore_eos=True, return_logprob=True),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
async def test_penalties_and_bias_follow_openai_formulas(hf_checkpoints, config):
    folder = hf_checkpoints["llama"]
    expected = [reference(folder, p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    plain = [reference(folder, p, SamplingParams(max_new_tokens=20))[0] for p in PROMPTS]
    assert [e[0] for e in expected] != plain  # the controls change what greedy picks
    async with Engine.from_pretrained(str(folder), device="cpu", **config) as engine:
        free = SamplingParams(max_new_tokens=20, ignore_eos=True)
        res = await asyncio.gather(*[engine.generate(input_ids=p, sampling=sp) for p, sp in zip(PROMPTS, PARAMS)],
                                   engine.generate(input_ids=PROMPTS[0], sampling=free))
    assert_kv_free(engine)
    for r, (tokens, lps) in zip(res, expected):
        assert r.output_ids == tokens
        assert r.output_logprobs == pytest.approx(lps, abs=2e-4)
    assert res[-1].output_ids == plain[0]  # a row without controls beside them is untouched


async def test_logit_bias_steers_greedy_decoding():
    async with Engine.from_pretrained("tiny", device="cpu") as engine:
        base = await engine.generate(prompt="hello", sampling=SamplingParams(max_new_tokens=6, ignore_eos=True))
        target = next(t for t in range(65, 91) if t not in base.output_ids)
        forced = await engine.generate(prompt="hello", sampling=SamplingParams(max_new_tokens=6, ignore_eos=True,
                                                                            logit_bias={target: 100}))
        banned = await engine.generate(prompt="hello", sampling=SamplingParams(max_new_tokens=6, ignore_eos=True,
                                                                            logit_bias={t: -100 for t in set(base.output_ids)}))
        with pytest.raises(errors.InvalidRequestError, match="outside the vocabulary"):
            await engine.generate(prompt="hello", sampling=SamplingParams(logit_bias={10**6: 1.0}))
    assert forced.output_ids == [target] * 6
    assert not set(banned.output_ids) & set(base.output_ids)


def test_sampler_applies_the_formula_to_logits():
    """The device sampler on given logits, against the formula computed directly."""
    torch.manual_seed(0)
    vocab = 40
    logits = torch.randn(3, vocab) * 2
    history = [[1, 1, 1, 5, 9], [2, 3], []]
    params = [
        SamplingParams(frequency_penalty=0.9, presence_penalty=0.4, return_logprob=True),
        SamplingParams(presence_penalty=-1.5, logit_bias={0: 4.0, 39: -100.0}, return_logprob=True),
        SamplingParams(return_logprob=True),
    ]
    rows = [RowSampling(params=p, request_id=str(i), sample_index=len(h), output_ids=h, stop_ids=[])
            for i, (p, h) in enumerate(zip(params, history))]
    tokens, logprobs = sample_rows(logits, rows, want_logprobs=True)
    for i, (p, h) in enumerate(zip(params, history)):
        x = openai_logits(logits[i], h, p)
        assert int(tokens[i]) == int(torch.argmax(x))
        assert float(logprobs[i]) == pytest.approx(float(torch.log_softmax(x, -1).max()), abs=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device's stream is what must not be waited for")
def test_a_batchs_penalties_and_bias_reach_the_device_without_waiting_for_it():
    """Rows with presence / frequency penalties, a bias and a repetition penalty are
    sampled eagerly, their controls built every step: built with blocking copies they
    would wait for every step queued on the stream. Under CUDA's sync check in error
    mode, any wait raises."""
    from omni_async.runners.sampling import batch_from_rows

    dev = torch.device("cuda")
    rows = [RowSampling(SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, logit_bias={7: 2.0}, repetition_penalty=1.2,
                                       temperature=0.8, top_k=5, seed=3), f"r{i}", 2, [4, 4, 9], [2]) for i in range(3)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sb = batch_from_rows(rows, 32, dev, False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sb.controls is not None and sb.controls.counts[:, 4].tolist() == [2.0] * 3
    assert sb.controls.bias[:, 7].tolist() == [2.0] * 3 and sb.seen[:, 9].all()

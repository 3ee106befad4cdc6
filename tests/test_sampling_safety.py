"""Sampler safety over generated settings: whatever passes validation samples a token the
row allows, with finite logprobs, and a row that allows nothing fails alone."""

from __future__ import annotations

import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_async import SamplingParams
from omni_async.runners.sampling import RowSampling, batch_from_rows, sample

VOCAB = 48

params = st.builds(
    SamplingParams,
    max_new_tokens=st.just(16),
    min_new_tokens=st.integers(0, 4),
    temperature=st.one_of(st.just(0.0), st.sampled_from([1e-300, 1e-30, 1e-6]), st.floats(1e-3, 100)),
    top_k=st.integers(0, VOCAB + 5),
    top_p=st.one_of(st.just(1.0), st.floats(1e-300, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 0.999999)),
    seed=st.one_of(st.none(), st.integers(-(1 << 70), 1 << 70)),
    repetition_penalty=st.one_of(st.just(1.0), st.floats(0.01, 100)),
    suppress_tokens=st.lists(st.integers(0, VOCAB - 1), max_size=VOCAB),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=VOCAB),
    return_logprob=st.booleans(),
    logprobs_mode=st.sampled_from(["processed", "raw"]),
)

rows_strategy = st.lists(
    st.tuples(params, st.integers(0, 6), st.lists(st.integers(0, VOCAB - 1), max_size=10)), min_size=1, max_size=6
)


@settings(max_examples=int(os.environ.get("SAMPLER_FUZZ_EXAMPLES", "150")), deadline=None)
@given(rows=rows_strategy, scale=st.sampled_from([1.0, 30.0, 1e30]), seed=st.integers(0, 1000))
def test_valid_settings_never_poison_the_batch(rows, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), VOCAB, generator=gen) * scale
    specs = [RowSampling(sp, f"r{i}", idx, out, sp.stop_token_ids) for i, (sp, idx, out) in enumerate(rows)]
    sb = batch_from_rows(specs, VOCAB, torch.device("cpu"), want_logprobs=True)
    res = sample(logits.clone(), sb)
    assert res.tokens.shape == (len(rows),)
    assert torch.isfinite(res.logprobs).all()
    for i, spec in enumerate(specs):
        banned = set(spec.params.suppress_tokens)
        if spec.sample_index < spec.params.min_new_tokens:
            banned |= set(spec.stop_ids)
        allowed = len(banned) < VOCAB
        assert bool(res.ok[i]) == allowed, (i, len(banned))
        if allowed:
            token = int(res.tokens[i])
            assert 0 <= token < VOCAB and token not in banned
            if spec.params.is_greedy:
                x = logits[i].clone()
                if spec.params.repetition_penalty != 1.0 and spec.output_ids:
                    ids = torch.tensor(sorted(set(spec.output_ids)))
                    s = x[ids]
                    p = torch.tensor(spec.params.repetition_penalty, dtype=torch.float32)
                    x[ids] = torch.where(s > 0, s / p, s * p).clamp(max=torch.finfo(torch.float32).max)
                x[list(banned)] = float("-inf")
                assert x[token] == x.max()

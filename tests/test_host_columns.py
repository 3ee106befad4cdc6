"""The host path's column forms agree with the per-row rules they replace.

A step's length limits are computed once per step for all its rows
(``core.request.decode_limits`` / ``landing_limits``); ``Request.tokens_left`` stays the
rule. These tests hold the two equal over random request states, including tokens in
flight and prompts near the context's end."""

from __future__ import annotations

import random

from omni_async.config import SamplingParams
from omni_async.core.request import Request, decode_limits, landing_limits


def random_requests(rng: random.Random, n: int, ctx: int) -> list[Request]:
    reqs = []
    for i in range(n):
        prompt = [3] * rng.randint(1, ctx - 1)
        req = Request(f"r{i}", prompt, SamplingParams(max_new_tokens=rng.randint(1, 64)))
        req.output_ids = [4] * rng.randint(0, 40)
        req.num_inflight = rng.choice([0, 0, 1, 3, 8, 16])
        reqs.append(req)
    return reqs


def test_decode_limits_equal_tokens_left_when_scheduling():
    rng = random.Random(0)
    for ctx in (64, 128, 2048):
        reqs = random_requests(rng, 300, ctx)
        assert decode_limits(reqs, ctx) == [r.tokens_left(ctx, scheduling=True) for r in reqs]


def test_landing_limits_equal_tokens_left_once_the_step_landed():
    rng = random.Random(1)
    for ctx in (64, 128, 2048):
        reqs = random_requests(rng, 300, ctx)
        landing = [rng.randint(0, r.num_inflight) for r in reqs]
        got = landing_limits(reqs, landing, ctx)
        want = []
        for r, n in zip(reqs, landing):
            r.num_inflight -= n  # what processing does before it checks the limit
            want.append(r.tokens_left(ctx, scheduling=False))
        assert got == want

"""The length limit, written once (Request.tokens_left): tokens in flight hold context
positions; they count against max_new_tokens when scheduling, not when processing."""

from __future__ import annotations

from omni_async import SamplingParams
from omni_async.core.request import Request


def _req(prompt: int, out: int, inflight: int, max_new: int) -> Request:
    r = Request(rid="r", prompt_ids=[1] * prompt, sampling=SamplingParams(max_new_tokens=max_new))
    r.output_ids = [2] * out
    r.num_inflight = inflight
    return r


def test_in_flight_tokens_count_against_max_new_tokens_only_when_scheduling():
    r = _req(prompt=10, out=3, inflight=1, max_new=4)
    assert r.tokens_left(100, scheduling=True) == 0  # the token in flight is the last one
    assert r.tokens_left(100, scheduling=False) == 1  # processed now, the request runs on


def test_the_context_counts_in_flight_tokens_either_way():
    r = _req(prompt=10, out=3, inflight=2, max_new=100)
    assert r.tokens_left(16, scheduling=True) == r.tokens_left(16, scheduling=False) == 1
    assert _req(prompt=10, out=6, inflight=0, max_new=100).tokens_left(16, scheduling=False) == 0

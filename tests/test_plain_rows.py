"""A decode step's plain rows take short paths on the host; these tests hold each short
path equal to the per-row rule it skips, over random request states (tokens in flight,
prompts near the context's end, stop ids, ``min_new_tokens``, aborts, stale rows).

- processing: ``multi_step.process_multi_step`` appends a plain row's tokens with two
  comparisons for its length limit (and hands the rows that run on as columns), and ``step_results.process_one_forward`` checks the
  limit with the same comparisons; the reference walks every row token by token with
  ``Request.tokens_left`` and the stop ids;
- scheduling: with every running request free (``request.all_free``) the decode rows and
  their forwards come from the limits alone; the reference is the per-row path."""

from __future__ import annotations

import copy
import random

import pytest

from omni_async.config import SamplingParams
from omni_async.core.batch import ForwardMode, ScheduledBatch
from omni_async.core.multi_step import decoding_rows, process_multi_step, row_steps
from omni_async.core.request import Request, all_free
from omni_async.core.step_results import process_one_forward

EOS = 2


def random_rows(rng: random.Random, n: int, ctx: int) -> tuple[list[Request], list[int], list[int]]:
    """Requests as a multi-step decode leaves them before its processing: each row's
    ``steps`` tokens (and maybe a later step's) in flight; some with EOS or stop ids,
    some aborted, finished or retracted since."""
    reqs, epochs, steps = [], [], []
    for i in range(n):
        prompt = [3] * rng.randint(1, ctx - 20)
        most = rng.randint(1, 40)
        sp = SamplingParams(max_new_tokens=most, ignore_eos=rng.random() < 0.5,
                            stop_token_ids=[9] if rng.random() < 0.2 else [],
                            min_new_tokens=min(most, rng.choice([0, 0, 3])))
        req = Request(f"r{i}", prompt, sp, eos_token_ids=(EOS,))
        req.output_ids = [4] * rng.randint(0, 30)
        s = rng.randint(1, 8)
        req.num_inflight = s + rng.choice([0, 0, s])  # this step's tokens, maybe a later step's too
        epoch = 0
        kind = rng.random()
        if kind < 0.05:
            req.to_finish = "abort"
        elif kind < 0.08:
            req.finish_reason = "stop"
        elif kind < 0.11:
            req.epoch = 1  # retracted since (its row is stale)
        reqs.append(req)
        epochs.append(epoch)
        steps.append(s)
    return reqs, epochs, steps


def reference(reqs: list[Request], epochs: list[int], steps: list[int], tokens: list[int],
              logprobs: list[float] | None, ctx: int) -> tuple[list[tuple], list[tuple]]:
    """Every live row token by token: appended, then its stop ids (past ``min_new_tokens``),
    then ``tokens_left`` (the length rule's one place)."""
    size = len(reqs)
    outcomes, finishes = [], []
    for i, (req, epoch, s) in enumerate(zip(reqs, epochs, steps)):
        if req.finish_reason is not None or req.epoch != epoch:
            continue
        req.num_inflight -= s
        if req.to_finish is not None:
            finishes.append((req.rid, req.to_finish))
            outcomes.append((req.rid, None, True, None, None))
            continue
        kept, lps, reason = [], [], None
        for j in range(s):
            t = tokens[i + j * size]
            req.output_ids.append(t)
            kept.append(t)
            if logprobs is not None:
                lps.append(logprobs[i + j * size])
                req.output_logprobs.append(lps[-1])
            if t in req.stop_ids() and len(req.output_ids) > req.sampling.min_new_tokens:
                reason = "stop"
            elif req.tokens_left(ctx, scheduling=False) <= 0:
                reason = "length"
            if reason is not None:
                finishes.append((req.rid, reason))
                break
        outcomes.append((req.rid, kept[-1], reason is not None, kept, lps if logprobs is not None else None))
    return outcomes, finishes


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_a_multi_step_decode_keeps_what_a_token_by_token_walk_keeps(with_logprobs):
    rng = random.Random(7)
    for ctx in (64, 128, 4096):
        for _ in range(20):
            reqs, epochs, steps = random_rows(rng, 64, ctx)
            k = max(steps)
            tokens = [rng.choice([4, 5, 6, EOS, 9]) if rng.random() < 0.1 else 5 for _ in range(k * len(reqs))]
            logprobs = [-rng.random() for _ in tokens] if with_logprobs else None
            mine = copy.deepcopy(reqs)
            batch = ScheduledBatch(mode=ForwardMode.DECODE, reqs=mine, epochs=list(epochs), prefix_lens=[0] * len(mine),
                                   extend_lens=[1] * len(mine), samples_kept=[True] * len(mine), input_ids=[],
                                   row_steps=list(steps))
            outcomes, finishes = process_multi_step(batch, tokens, logprobs, ctx)
            s_of = {r.rid: s for r, s in zip(reqs, steps)}
            stops_of = {r.rid: r.stop_ids() for r in reqs}
            want_outcomes, want_finishes = reference(reqs, epochs, steps, tokens, logprobs, ctx)
            got = [(oc.req.rid, oc.token, oc.finished, oc.tokens, oc.logprobs) for oc in outcomes]
            assert got == want_outcomes
            # The rows that ran on with every token kept and no stop id among them (below
            # min_new_tokens) come as columns, not outcome objects.
            ran_on = [(rid, toks, lps) for rid, _, fin, toks, lps in want_outcomes
                      if not fin and len(toks or ()) == s_of[rid] and stops_of[rid].isdisjoint(toks)]
            assert [(r.rid, t) for r, t in zip(outcomes.plain_reqs, outcomes.plain_tokens)] == [(rid, t) for rid, t, _ in ran_on]
            assert outcomes.plain_logprobs == ([lps for *_, lps in ran_on] if with_logprobs else None)
            assert not any(oc.req.rid in {rid for rid, *_ in ran_on} for oc in outcomes.rest)
            assert [(r.rid, why) for r, why in finishes] == want_finishes
            for a, b in zip(mine, reqs):
                assert (a.output_ids, a.output_logprobs, a.num_inflight) == (b.output_ids, b.output_logprobs, b.num_inflight)


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_a_one_forward_step_keeps_what_a_token_by_token_walk_keeps(with_logprobs):
    rng = random.Random(11)
    for ctx in (64, 128, 4096):
        for _ in range(20):
            reqs, epochs, _ = random_rows(rng, 64, ctx)
            steps = [1] * len(reqs)
            for r in reqs:
                r.num_inflight = rng.choice([1, 1, 2])  # this step's token, maybe a later step's
            tokens = [rng.choice([4, 5, 6, EOS, 9]) if rng.random() < 0.2 else 5 for _ in reqs]
            logprobs = [-rng.random() for _ in tokens] if with_logprobs else None
            mine = copy.deepcopy(reqs)
            batch = ScheduledBatch(mode=ForwardMode.DECODE, reqs=mine, epochs=list(epochs), prefix_lens=[0] * len(mine),
                                   extend_lens=[1] * len(mine), samples_kept=[True] * len(mine), input_ids=[])
            outcomes, finishes = process_one_forward(batch, tokens, logprobs, ctx)
            want_outcomes, want_finishes = reference(reqs, epochs, steps, tokens, logprobs, ctx)
            got = [(oc.req.rid, oc.token, oc.finished) for oc in outcomes]
            assert got == [(rid, token, fin) for rid, token, fin, _, _ in want_outcomes]
            assert [(r.rid, why) for r, why in finishes] == want_finishes
            for a, b in zip(mine, reqs):
                assert (a.output_ids, a.output_logprobs, a.num_inflight) == (b.output_ids, b.output_logprobs, b.num_inflight)


def test_free_rows_are_scheduled_as_the_per_row_path_schedules_them():
    rng = random.Random(3)
    for ctx in (64, 2048):
        for k in (1, 4, 8, 16):
            reqs, _, _ = random_rows(rng, 100, ctx)
            for r in reqs:
                r.finish_reason, r.to_finish = None, None
                r.output_ids = r.output_ids[: r.sampling.max_new_tokens]
            assert all_free(reqs)
            fast, slow = decoding_rows(reqs, ctx, True, True), decoding_rows(reqs, ctx, True, False)
            assert fast == slow
            live = [r for r in reqs if r.tokens_left(ctx, scheduling=True) > 0]
            assert row_steps(live, k, ctx, None, True) == row_steps(live, k, ctx, None, False)


def test_a_row_under_a_grammar_conditioned_or_asking_top_logprobs_is_not_free():
    base = [Request(f"r{i}", [3, 4], SamplingParams(max_new_tokens=4)) for i in range(3)]
    assert all_free(base) and all_free([])
    for change in ("matcher", "conditioning", "top_logprobs"):
        reqs = copy.deepcopy(base)
        if change == "top_logprobs":
            reqs[1].sampling = SamplingParams(max_new_tokens=4, top_logprobs=2, return_logprob=True)
        else:
            setattr(reqs[1], change, object())
        assert not all_free(reqs)

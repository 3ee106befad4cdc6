"""The batch core's scheduling policies (``core.policy``), as properties of the core run
against a simulated clock: every decode step writes one 80 ms frame per row, delivered at
once to the row's player (``speech.playback.Playback``), and the clock advances by a step
cost that grows with the step's rows.

- deadline order: a decode step with a row budget takes the rows with the least slack;
- first-chunk express: a new stream decodes ahead of streams with seconds buffered,
  where FCFS makes it wait;
- no starvation: under overload every admitted stream still progresses and finishes;
- with enough capacity (no row budget) FCFS and deadline build identical steps.
"""

from __future__ import annotations

import math
import random

import pytest

from omni_async.config import SamplingParams, SchedulerConfig
from omni_async.core.batch_core import NativeBatchCore
from omni_async.core.core_state import DecodeSteps
from omni_async.core.plan import settle
from omni_async.core.policy import DeadlinePolicy, FCFSPolicy, SchedulingPolicy
from omni_async.core.request import Request
from omni_async.kv.allocator import PageAllocator
from omni_async.speech.playback import Playback

FRAME_S = 0.08
TTFP_BUDGET = 0.3
CTX = 4096


class Sim:
    """A batch core, a simulated clock and a player per request (normal-loop order:
    process a step, then schedule the next)."""

    def __init__(self, policy: str, cap: int | None, *, running: int = 64, pages: int = 4000, step_row_s: float = 0.002) -> None:
        self.t = 0.0
        self.players: dict[str, Playback] = {}
        config = settle(SchedulerConfig(max_running_requests=running, max_prefill_tokens=512, chunked_prefill_size=512,
                                        enable_prefix_cache=False))
        self.core = NativeBatchCore(config, PageAllocator(pages, 16), CTX)
        self.policy: SchedulingPolicy = (DeadlinePolicy(self.slack, max_decode_rows=cap) if policy == "deadline"
                                         else FCFSPolicy(max_decode_rows=cap))
        self.core.set_policy(self.policy)
        self.step_row_s = step_row_s
        self.reqs: dict[str, Request] = {}
        self.steps: list[tuple] = []  # (mode, rids) of every step
        self.decoded_at: dict[str, list[int]] = {}  # step indices of each request's decode rows
        self.checks: list[tuple[list[float], list[float]]] = []  # (chosen slacks, left-out slacks) of capped steps
        self.overdue: dict[str, int] = {}
        self.most_overdue = 0.0  # the longest such wait, in shares of a round (steps to serve every candidate once)

    def slack(self, req: Request) -> float | None:
        player = self.players.get(req.rid)
        return None if player is None else player.deadline_slack(TTFP_BUDGET, now=self.t)

    def add(self, rid: str, frames: int, prompt: int = 20) -> Request:
        req = Request(rid=rid, prompt_ids=[(i * 7 + len(rid)) % 50 for i in range(prompt)],
                      sampling=SamplingParams(max_new_tokens=frames + 1, ignore_eos=True))
        self.players[rid] = Playback(clock=lambda: self.t, created=self.t)
        self.reqs[rid] = req
        self.core.add_request(req)
        return req

    def step(self) -> bool:
        core = self.core
        if not core.has_work():
            return False
        candidates = [r for r in core.running if r.finish_reason is None and len(r.output_ids) < r.sampling.max_new_tokens]
        batch = core.get_next_batch()
        if batch is None:
            return False
        rids = [r.rid for r in batch.reqs]
        self.steps.append((batch.mode.name, rids))
        if batch.is_decode:
            for rid in rids:
                self.decoded_at.setdefault(rid, []).append(len(self.steps))
            if self.policy.caps(len(candidates)):
                chosen = [self.slack(r) for r in batch.reqs]
                left = [r for r in candidates if r.rid not in set(rids)]
                self.checks.append((chosen, [self.slack(r) for r in left]))
                for r in left:  # decode steps each row has sat out past its deadline, in a row
                    if self.slack(r) < 0:
                        self.overdue[r.rid] = self.overdue.get(r.rid, 0) + 1
                        self.most_overdue = max(self.most_overdue, self.overdue[r.rid] / math.ceil(len(candidates) / batch.size))
            for rid in rids:
                self.overdue.pop(rid, None)
            self.t += 0.004 + self.step_row_s * batch.size
        else:
            self.t += 0.01 + 0.00002 * len(batch.input_ids)
        tokens = [random.Random(f"{r.rid}/{i}").randrange(40) for r, i in zip(batch.reqs, batch.sample_indices)]
        for outcome in core.process_result(batch, tokens):
            if batch.is_decode:  # frame k travels with g0(k + 1): a decode row's token brings one frame
                self.players[outcome.req.rid].on_audio(FRAME_S, now=self.t)
            if outcome.finished:
                self.players[outcome.req.rid].finished = True
        return True

    def run(self, limit: int = 20000) -> None:
        for _ in range(limit):
            if not self.step():
                return
        raise AssertionError("the simulation did not finish")


def test_a_capped_step_takes_the_rows_with_the_least_slack():
    sim = Sim("deadline", cap=3, step_row_s=0.01)  # overloaded: 10 streams, 3 rows a step
    for i in range(10):
        sim.add(f"s{i}", frames=40 + 3 * i)
    sim.run()
    assert len(sim.checks) > 50
    for chosen, out in sim.checks:
        assert len(chosen) == 3 and out
        assert max(chosen) <= min(out) + 1e-12
    assert sim.core.stats()["decode_rows_left_out"] > 0


def test_fcfs_with_a_row_budget_takes_the_oldest_rows():
    sim = Sim("fcfs", cap=3)
    for i in range(6):
        sim.add(f"s{i}", frames=30)
    sim.run()
    first_decodes = [rids for mode, rids in sim.steps if mode == "DECODE"][:5]
    assert all(rids == ["s0", "s1", "s2"] for rids in first_decodes)


@pytest.mark.parametrize("policy", ["deadline", "fcfs"])
def test_a_new_streams_first_frame_goes_ahead_of_buffered_streams(policy):
    sim = Sim(policy, cap=4, step_row_s=0.001)
    for i in range(8):
        sim.add(f"old{i}", frames=400)
    while min(p.slack(sim.t) for rid, p in sim.players.items()) < 2.0:  # every old stream has seconds buffered
        assert sim.step()
    new = sim.add("new", frames=50)
    steps = len(sim.steps)
    while not new.output_ids or not sim.decoded_at.get("new"):
        assert sim.step()
        if len(sim.steps) - steps > 40:
            break
    waited = len(sim.steps) - steps
    if policy == "deadline":
        assert waited <= 2  # its prefill, then its first decode step
        assert sim.players["new"].first_audio_at is not None and sim.players["new"].ttfp_s < TTFP_BUDGET
    else:
        assert waited > 40  # FCFS: the oldest rows take every step; the new one waits for them to end


@pytest.mark.parametrize("policy", ["deadline", "fcfs"])
@pytest.mark.parametrize("seed", range(3))
def test_every_admitted_stream_progresses_and_finishes(policy, seed):
    rng = random.Random(seed)
    sim = Sim(policy, cap=4, step_row_s=0.006)  # overloaded past ~10 streams
    arrivals = sorted(rng.uniform(0, 3.0) for _ in range(24))
    n = 0
    while n < len(arrivals) or sim.core.has_work():
        while n < len(arrivals) and arrivals[n] <= sim.t:
            sim.add(f"r{n}", frames=rng.randint(10, 60))
            n += 1
        if not sim.step():
            sim.t = arrivals[n]
    assert all(r.finish_reason == "length" for r in sim.reqs.values())
    assert all(len(r.output_ids) == r.sampling.max_new_tokens for r in sim.reqs.values())
    # A row past its deadline (a first chunk due, a listener run dry) waits at most about
    # one round of the running rows under the deadline policy; FCFS keeps new streams
    # waiting for the oldest to end.
    if policy == "deadline":
        assert sim.most_overdue <= 1.5
    else:
        assert sim.most_overdue > 10


@pytest.mark.parametrize("seed", range(3))
def test_without_a_row_budget_the_policies_build_identical_steps(seed):
    rng = random.Random(seed)
    sims = [Sim("fcfs", cap=None, running=8), Sim("deadline", cap=None, running=8)]
    plan = [(rng.randint(0, 30), rng.randint(5, 50)) for _ in range(20)]
    for k, (when, frames) in enumerate(sorted(plan)):
        for sim in sims:
            while len(sim.steps) < when and sim.step():
                pass
            sim.add(f"q{k}", frames)
    for sim in sims:
        sim.run()
    assert sims[0].steps == sims[1].steps
    assert [r.output_ids for r in sims[0].reqs.values()] == [r.output_ids for r in sims[1].reqs.values()]


def express_core(express: int | None) -> NativeBatchCore:
    config = settle(SchedulerConfig(max_running_requests=8, max_prefill_tokens=512, chunked_prefill_size=512,
                                    enable_prefix_cache=False))
    core = NativeBatchCore(config, PageAllocator(400, 16), CTX, DecodeSteps(((1, 8),)))
    core.set_policy(DeadlinePolicy(lambda r: None, express_tokens=express))
    return core


def forwards_of_each_step(core: NativeBatchCore, arrivals: dict[int, str]) -> tuple[list[tuple], dict[str, list[int]]]:
    """Run ``core`` to the end (normal-loop order), adding request ``arrivals[i]`` before
    step ``i``; each step's (mode, {rid: forwards}) and every request's tokens."""
    reqs: dict[str, Request] = {}
    steps: list[tuple] = []
    for i in range(500):
        if i in arrivals:
            rid = arrivals[i]
            reqs[rid] = Request(rid=rid, prompt_ids=[(j * 5 + len(rid)) % 50 for j in range(12)],
                                sampling=SamplingParams(max_new_tokens=30, ignore_eos=True))
            core.add_request(reqs[rid])
        if not core.has_work():
            break
        batch = core.get_next_batch()
        if batch is None:
            break
        n, row_steps = batch.size, batch.row_steps
        k = 1 if row_steps is None or not batch.is_decode else max(row_steps)
        steps.append((batch.mode.name, {r.rid: 1 if row_steps is None else s for r, s in zip(batch.reqs, row_steps or [1] * n)}))
        # forward-major tokens, a function of (request, index): equal whatever the step sizes
        tokens = [random.Random(f"{r.rid}/{i0 + f}").randrange(40) for f in range(k) for r, i0 in zip(batch.reqs, batch.sample_indices)]
        list(core.process_result(batch, tokens))
    return steps, {rid: list(r.output_ids) for rid, r in reqs.items()}


def test_express_cuts_a_multi_step_decode_to_a_new_streams_first_chunk():
    """A stream joining a batch that decodes 8 forwards a step gets its first chunk's
    tokens (here 3: a 2-frame chunk) after the forwards it needs; then steps grow with
    the tokens it has back to 8."""
    arrivals = {0: "old", 4: "new"}
    fast, fast_tokens = forwards_of_each_step(express_core(3), arrivals)
    slow, slow_tokens = forwards_of_each_step(express_core(None), arrivals)
    after_prefill = [s for mode, s in fast if mode == "DECODE" and "new" in s]
    assert after_prefill[0]["new"] == 2  # prefill wrote token 1; two forwards bring tokens 2 and 3
    # then steps no longer than the audio sent (3 tokens: 3 forwards; 6: 6), then whole ones
    assert [max(s.values()) for s in after_prefill[1:4]] == [3, 6, 8]
    assert [s["new"] for mode, s in slow if mode == "DECODE" and "new" in s][0] == 8  # without it: a whole launch
    assert fast_tokens == slow_tokens  # the same tokens, in other step sizes


def test_express_tokens_must_be_a_positive_integer():
    with pytest.raises(ValueError):
        DeadlinePolicy(lambda r: None, express_tokens=0)

"""The runner contract: one launch and one collect path, step counters that agree in
every loop, per-row sampling failures, unseeded sampling drawn from the engine seed, and
a launch that does not wait for the device."""

from __future__ import annotations

import time

import pytest
import torch

from omni_async import Engine, SamplingParams, errors
from omni_async.core.request import Request, RequestData
from omni_async.runners.base import ModelRunner
from omni_async.runners.native import NativeModelRunner
from omni_async.core.runner_io import SchedulerOutput, SchedulerRequest

from .conftest import LOOPS, assert_kv_free


def test_contract_has_one_launch_and_one_collect_path():
    for name in ("launch", "collect"):
        assert callable(getattr(ModelRunner, name))
    for gone in ("execute", "launch_step", "finish_step", "execute_launch", "execute_resolve", "async_resolve_counts"):
        assert not hasattr(ModelRunner, gone), gone


class CountingRunner(NativeModelRunner):
    """Records every committed step and whether its request had already finished."""

    def on_generation_step_advanced(self, sched_req, generation_steps: int) -> None:
        self.advanced.append((sched_req.request_id, generation_steps, sched_req.data.req.finished()))


@pytest.mark.parametrize("loop", LOOPS)
async def test_generation_steps_equal_output_length_in_every_loop(loop):
    engine = Engine.from_pretrained("tiny", loop=loop)
    runner = engine.scheduler.runner
    runner.__class__ = CountingRunner
    runner.advanced = []
    lens = [1, 2, 5, 9, 17]
    async with engine:
        handles = [
            await engine.submit(
                input_ids=[i + 3, 7, 9], sampling=SamplingParams(max_new_tokens=n, ignore_eos=True), request_id=f"g{i}"
            )
            for i, n in enumerate(lens)
        ]
        results = [await h.result() for h in handles]
    for i, res in enumerate(results):
        steps = [s for rid, s, _ in runner.advanced if rid == f"g{i}"]
        assert steps == list(range(1, len(res.output_ids) + 1)), (loop, i, steps)
    assert not [a for a in runner.advanced if a[2]], "a step advanced for a request that had finished"
    assert_kv_free(engine)


def _stack_step(engine: Engine, sps: list[SamplingParams], prompt=(5, 6, 7)):
    """Schedule one prefill of ``sps`` with the engine's batch core; return the runner's
    output for it, driven directly (launch then collect)."""
    stack = engine.stack
    reqs = []
    for i, sp in enumerate(sps):
        req = Request(rid=f"r{i}", prompt_ids=list(prompt), sampling=sp)
        req.data = RequestData(req=req)
        stack.core.add_request(req)
        reqs.append(req)
    batch = stack.core.get_next_batch()
    so = SchedulerOutput([SchedulerRequest(r.rid, r.data) for r in batch.reqs], batch)
    pending = stack.runner.launch(so)
    if pending.event is not None:
        pending.event.synchronize()
    return stack.runner.collect(pending), batch


def test_a_row_without_admissible_token_fails_alone():
    engine = Engine.from_pretrained("tiny")
    vocab = engine.stack.limits.vocab_size
    stop = list(range(1, vocab))
    sps = [
        SamplingParams(max_new_tokens=4),
        SamplingParams(max_new_tokens=4, temperature=1e-300),  # float32 zero after the cast
        SamplingParams(max_new_tokens=4, suppress_tokens=[0], stop_token_ids=stop, min_new_tokens=2),
        SamplingParams(max_new_tokens=4, temperature=1.0, seed=3, suppress_tokens=[0], stop_token_ids=stop, min_new_tokens=2),
        SamplingParams(max_new_tokens=4, temperature=0.7, seed=5, repetition_penalty=0.01),
    ]
    out, batch = _stack_step(engine, sps)
    assert sorted(out.row_errors) == [2, 3]
    assert sorted(out.failed_requests()) == ["r2", "r3"]
    assert "no admissible token" in out.row_errors[2]
    for i in (2, 3):  # no token is emitted for a failed row, suppressed or not
        assert out.outputs[f"r{i}"].data is None
    alone, _ = _stack_step(Engine.from_pretrained("tiny"), [sps[0]])
    assert out.outputs["r0"].data == alone.outputs["r0"].data
    near_greedy = out.outputs["r1"].data
    assert near_greedy == alone.outputs["r0"].data  # temperature -> 0 is the argmax
    assert all(0 <= out.outputs[f"r{i}"].data < vocab for i in (0, 1, 4))


def test_values_that_overflow_float32_are_refused():
    with pytest.raises(errors.InvalidRequestError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e-40)
    with pytest.raises(errors.InvalidRequestError, match="logprobs_mode"):
        SamplingParams(logprobs_mode="softmax")


def test_tiny_temperature_never_yields_nan_logprobs():
    from omni_async.runners.sampling import RowSampling, sample_rows

    logits = torch.randn(3, 40) * 30
    rows = [RowSampling(SamplingParams(temperature=t, seed=1), "x", 0, [], []) for t in (1e-300, 1e-30, 1e-6)]
    tokens, lp = sample_rows(logits.clone(), rows, want_logprobs=True)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.isfinite(lp).all()


UNSEEDED = SamplingParams(max_new_tokens=24, temperature=1.5, ignore_eos=True)


async def _unseeded(seed: int, ids: list[str]) -> list[list[int]]:
    engine = Engine.from_pretrained("tiny", seed=seed)
    out = []
    async with engine:
        for rid in ids:
            out.append((await engine.generate(input_ids=[4, 8, 15, 16], sampling=UNSEEDED, request_id=rid)).output_ids)
    return out


async def test_unseeded_draws_follow_the_engine_seed_not_the_request_id():
    first = await _unseeded(0, ["same", "same"])
    again = await _unseeded(0, ["same", "same"])
    assert first == again, "the engine seed reproduces a run"
    assert first[0] != first[1], "a reused request id gets fresh draws"


def test_unseeded_base_seeds_come_from_the_runner_seed():
    engine = Engine.from_pretrained("tiny")
    stack = engine.stack
    runners = [NativeModelRunner(stack.runner.model, stack.runner.kv, stack.device, seed=s) for s in (0, 0, 1)]
    req = Request(rid="same", prompt_ids=[1], sampling=UNSEEDED)
    twin = Request(rid="same", prompt_ids=[1], sampling=UNSEEDED)
    seeds = [r.base_seed(req) for r in runners]
    assert seeds[0] == seeds[1] != seeds[2]
    assert runners[0].base_seed(req) == seeds[0], "drawn once per request"
    assert runners[0].base_seed(twin) != seeds[0], "a reused id is a new request"
    assert runners[0].base_seed(Request(rid="s", prompt_ids=[1], sampling=SamplingParams(seed=4))) is None


async def test_seeded_rows_are_batch_invariant_with_penalties_and_bans():
    from omni_async.runners.sampling import RowSampling, sample_rows

    torch.manual_seed(1)
    vocab = 64
    logits = torch.randn(8, vocab) * 2
    sps = [
        SamplingParams(temperature=0.8, top_k=10, seed=11, repetition_penalty=1.4),
        SamplingParams(temperature=1.2, top_p=0.7, seed=12, suppress_tokens=[1, 2, 3]),
        SamplingParams(temperature=1.0, min_p=0.05, seed=13, min_new_tokens=3),
        SamplingParams(),
    ]
    rows = [RowSampling(sp, f"q{i}", 1, [4, 5, 6], [7, 8]) for i, sp in enumerate(sps)]
    together, _ = sample_rows(logits[:4].clone(), rows, False)
    for i, row in enumerate(rows):
        mixed = [rows[j] for j in range(4) if j != i] + [row]
        picked = torch.cat([logits[[j for j in range(4) if j != i]], logits[i : i + 1]])
        alone, _ = sample_rows(logits[i : i + 1].clone(), [row], False)
        shuffled, _ = sample_rows(picked.clone(), mixed, False)
        assert int(alone[0]) == int(together[i]) == int(shuffled[-1])
    assert int(together[1]) not in (1, 2, 3)
    assert int(together[2]) not in (7, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_launch_does_not_wait_for_the_device():
    """With a long kernel in flight, launching the next decode step only enqueues work."""
    engine = Engine.from_pretrained("tiny", device="cuda")
    stack = engine.stack
    for i in range(8):
        req = Request(rid=f"c{i}", prompt_ids=[3 + i] * 20, sampling=SamplingParams(max_new_tokens=50, ignore_eos=True))
        req.data = RequestData(req=req)
        stack.core.add_request(req)

    def step():
        batch = stack.core.get_next_batch()
        so = SchedulerOutput([SchedulerRequest(r.rid, r.data) for r in batch.reqs], batch)
        return batch, stack.runner.launch(so)

    for _ in range(4):  # prefill and a few decode steps, processed normally (warm-up)
        batch, pending = step()
        pending.event.synchronize()
        out = stack.runner.collect(pending)
        stack.core.process_result(batch, out.token_ids, out.logprobs)
    sleep_s = 0.5
    torch.cuda.synchronize()
    torch.cuda._sleep(int(sleep_s * 2e9))  # ~0.5 s at ~2 GHz
    t0 = time.perf_counter()
    batch, pending = step()
    launch_s = time.perf_counter() - t0
    assert batch.is_decode
    assert not pending.event.query(), "the sleep should still be running"
    assert launch_s < sleep_s / 5, f"launch took {launch_s * 1000:.1f} ms behind a {sleep_s * 1000:.0f} ms kernel"
    pending.event.synchronize()
    out = stack.runner.collect(pending)
    # One token per forward: a multi-step decode (CUDA's default above a few rows) has k a row.
    assert not out.row_errors and len(out.token_ids) == (sum(batch.row_steps) if batch.row_steps else batch.size)


class ReplacingRunner(NativeModelRunner):
    """A lookahead resolve that chooses other tokens than the device sampled."""

    def post_decode_resolve(self, launch_buf, result, forward_batch, schedule_batch, requests) -> None:
        result.next_token_ids = torch.full_like(launch_buf, 7)


def test_collect_reports_tokens_a_resolve_hook_replaced():
    engine = Engine.from_pretrained("tiny")
    stack = engine.stack
    stack.runner.__class__ = ReplacingRunner
    for i in range(3):
        req = Request(rid=f"x{i}", prompt_ids=[5 + i] * 4, sampling=SamplingParams(max_new_tokens=8, ignore_eos=True))
        req.data = RequestData(req=req)
        stack.core.add_request(req)
    kinds = []
    for _ in range(3):
        batch = stack.core.get_next_batch()
        so = SchedulerOutput([SchedulerRequest(r.rid, r.data) for r in batch.reqs], batch)
        out = stack.runner.collect(stack.runner.launch(so, lookahead=batch.is_decode))
        kinds.append(batch.is_decode)
        stack.core.process_result(batch, out.token_ids, out.logprobs)
        if batch.is_decode:
            assert out.token_ids == [7, 7, 7]
            assert [o.data for o in out.outputs.values()] == [7, 7, 7]
    assert kinds == [False, True, True]
    with pytest.raises(ValueError, match="decode steps only"):
        req = Request(rid="p", prompt_ids=[1, 2], sampling=SamplingParams())
        req.data = RequestData(req=req)
        stack.core.add_request(req)
        batch = stack.core.get_next_batch()
        stack.runner.launch(SchedulerOutput([SchedulerRequest(req.rid, req.data)], batch), lookahead=True)


class DecodeHiddenRunner(NativeModelRunner):
    """Asks for hidden states on decode steps only, through the hook."""

    def requested_capture_hidden_mode_decode(self, schedule_batch, requests):
        return "last"


def test_capture_hidden_hook_is_honoured_per_phase():
    engine = Engine.from_pretrained("tiny")
    stack = engine.stack
    stack.runner.__class__ = DecodeHiddenRunner
    req = Request(rid="h", prompt_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=4, ignore_eos=True))
    req.data = RequestData(req=req)
    stack.core.add_request(req)
    seen = []
    for _ in range(3):
        batch = stack.core.get_next_batch()
        so = SchedulerOutput([SchedulerRequest(r.rid, r.data) for r in batch.reqs], batch)
        out = stack.runner.collect(stack.runner.launch(so))
        stack.core.process_result(batch, out.token_ids, out.logprobs)
        seen.append((batch.is_decode, "hidden_state" in out.outputs["h"].extra))
    assert seen == [(False, False), (True, True), (True, True)]


class RecordingRunner(NativeModelRunner):
    """Its own ``post_process_outputs``: every step must hand it per-request outputs."""

    def post_process_outputs(self, result, scheduler_output, outputs):
        self.seen.append({rid: out.data for rid, out in outputs.items()})


async def test_a_runners_own_post_process_outputs_sees_every_step():
    engine = Engine.from_pretrained("tiny")
    engine.stack.runner.__class__ = RecordingRunner
    engine.stack.runner.seen = []
    async with engine:
        res = await engine.generate(input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=4, ignore_eos=True))
    seen = engine.stack.runner.seen
    assert len(seen) == 4  # the prefill's token and three decode steps
    assert [list(s.values())[0] for s in seen] == res.output_ids


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("decode_steps", [1, 4])
async def test_cpu_keeps_the_reference_ops_whatever_fused_kernels_says(fused, decode_steps):
    """Neither ``fused_kernels`` nor a multi-step plan (whose fused launch is another
    thing) turns the Triton elementwise kernels on off CUDA."""
    from omni_async.kernels.reference import ReferenceOps

    engine = Engine.from_pretrained("tiny", fused_kernels=fused, decode_steps=decode_steps)
    async with engine:
        out = await engine.generate(input_ids=[256, *b"abc"], sampling=SamplingParams(max_new_tokens=4))
        ops = engine.stack.loaded.model.ops
    assert len(out.output_ids) == 4
    assert engine.stack.runner.fused is False and type(ops) is ReferenceOps


def test_live_rows_and_ok_flags_of_a_collected_step():
    """``live_rows`` picks the rows whose sample is kept and whose request neither
    finished nor moved epoch (all of them as a range in the usual step); ``host_values``
    gives None for the ok flags only when every one is set."""
    from omni_async.runners.host_copy import host_values, live_rows

    reqs = [Request(rid=f"l{i}", prompt_ids=[1], sampling=SamplingParams()) for i in range(5)]
    epochs = [r.epoch for r in reqs]
    assert live_rows([True] * 5, reqs, epochs) == [0, 1, 2, 3, 4]
    reqs[1].finish_reason = "stop"
    reqs[3].epoch += 1  # retracted after the step was scheduled
    assert live_rows([True] * 5, reqs, epochs) == [0, 2, 4]
    assert live_rows([True, True, False, True, True], reqs, epochs) == [0, 4]
    every = torch.tensor([[5, 6, 7], [1, 1, 1]])
    assert host_values(every, 3) == ([5, 6, 7], None, None)
    one_failed = torch.tensor([[5, 0, 7], [1, 0, 1]])
    assert host_values(one_failed, 3) == ([5, 0, 7], [1, 0, 1], None)
    fused = torch.tensor([[[5, 6, 9], [7, 8, 9]], [[1, 1, 0], [1, 1, 0]]])  # [2, k=2, bucket 3], one padding row
    assert host_values(fused, 2) == ([5, 6, 7, 8], None, None)

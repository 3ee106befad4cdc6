"""Late masks: a constrained row with its last token in flight joins a one-forward decode
step; the step's launch enqueues the forward, the host processes the step before (its
matchers accept their tokens, the masks go to the mask worker) and only then does the
runner sample under the masks (``core.multi_step.late_mask_rows``, ``Stepper.step_ahead``,
``ModelRunner.sample_pending``). So under the lookahead loops constrained rows run in
consecutive steps instead of every other one, and with every row constrained the loop
no longer drains to a synchronous step each time. Tokens stay those of the normal loop."""

# These tests are about rows that sample under their masks: optimistic_grammar=False keeps every
# constrained row there (rows that sample first: tests/test_optimistic_grammar.py).

from __future__ import annotations

import asyncio
import json

import anyio
import pytest

pytest.importorskip("llguidance")

from omni_async import Engine, SamplingParams, errors  # noqa: E402

from .conftest import assert_kv_free  # noqa: E402
from .constrained_cases import ENDLESS, SCHEMA, greedy, record_terminals, seeded, submit_constrained  # noqa: E402
from .test_constrained import validate  # noqa: E402

LOOPS = ["normal", "overlap", "async_decode"]
N = 8


async def run(engine: Engine, sampling: list[SamplingParams]) -> list:
    return await asyncio.gather(*[engine.generate(prompt=f"record {i}:", sampling=sp) for i, sp in enumerate(sampling)])


@pytest.mark.parametrize("make", [greedy, seeded], ids=["greedy", "seeded"])
async def test_all_constrained_rows_run_in_consecutive_steps_with_the_normal_loops_tokens(make):
    outputs = {}
    for loop in LOOPS:
        async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop=loop, decode_steps=1) as engine:
            engine.scheduler.trace_enabled = True
            results = await run(engine, [make(i) for i in range(N)])
            info = engine.scheduler.info()
            trace = list(engine.scheduler.stats.trace)
        assert_kv_free(engine)
        for r in results:
            assert r.finish_reason == "stop", r.text  # the grammar completed, while the row's next step was in flight
            validate(json.loads(r.text), SCHEMA)
        outputs[loop] = [r.output_ids for r in results]
        if loop == "normal":
            assert info.get("grammar_late_mask_steps", 0) == 0  # nothing is ever in flight at scheduling
            continue
        # Every decode step after the first held all the rows, launched while the one before
        # was in flight (before: each such step found no row ready and the loop drained).
        longest = max(len(o) for o in outputs[loop])
        assert trace.count(f"resolve:{N}") >= longest - 3, trace
        assert f"sync:{N}" not in trace[2:], trace
        assert info["grammar_late_mask_steps"] > 0
    assert outputs["overlap"] == outputs["normal"] and outputs["async_decode"] == outputs["normal"]


FREE = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("loop", ["overlap", "async_decode"])
async def test_free_rows_beside_late_constrained_rows_keep_their_tokens(loop):
    mixed = [seeded(i) if i % 2 else FREE for i in range(N)]
    async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop=loop, decode_steps=1) as engine:
        alone = await run(engine, [FREE] * N)
        before = engine.scheduler.info()["grammar_late_mask_steps"]
        results = await run(engine, mixed)
        late = engine.scheduler.info()["grammar_late_mask_steps"] - before
    async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop="normal", decode_steps=1) as engine:
        reference = await run(engine, mixed)
    assert_kv_free(engine)
    assert late > 0
    for i, (r, a, ref) in enumerate(zip(results, alone, reference)):
        assert r.output_ids == ref.output_ids, f"request {i} differs from the normal loop"
        if i % 2:
            validate(json.loads(r.text), SCHEMA)
        else:
            assert r.output_ids == a.output_ids, f"free request {i} changed beside constrained ones"


@pytest.mark.parametrize("loop", ["overlap", "async_decode"])
async def test_mostly_constrained_steps_take_several_tokens_a_step_instead_of_late_masks(loop):
    """With four forwards a step, constrained rows that are most of the step no longer
    take one forward a step under late masks (``multi_step.LATE_MAJORITY``): they wait
    for their tokens in flight and then run several forwards under masks computed between
    the forwards (``multi_step.between_steps``; tests/test_masks_between.py). Tokens stay
    the normal loop's; a minority of constrained rows still waits beside the free rows'
    fused launches."""
    mostly = [FREE if i < 2 else greedy(i) for i in range(N)]
    outputs = {}
    for run_loop in ("normal", loop):
        async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop=run_loop, decode_steps=4) as engine:
            results = await run(engine, mostly)
            info = engine.scheduler.info()
        assert_kv_free(engine)
        outputs[run_loop] = [r.output_ids for r in results]
        for r in results[2:]:
            assert r.finish_reason == "stop", r.text
            validate(json.loads(r.text), SCHEMA)
    assert outputs[loop] == outputs["normal"]
    assert info["grammar_late_mask_steps"] == 0 and info["grammar_between_forwards"] > 0
    # A minority waits: the free rows keep their fused launches.
    minority = [greedy(i) if i < 2 else FREE for i in range(N)]
    async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop=loop, decode_steps=4) as engine:
        before = engine.scheduler.info()["fused_decode_launches"]
        await run(engine, minority)
        assert engine.scheduler.info()["fused_decode_launches"] - before > 2


async def test_jump_forward_keeps_constrained_rows_out_of_steps_with_a_token_in_flight():
    """With jump_forward, processing a step may append forced tokens to a row, so a row with
    a token in flight waits (no late masks); the tokens still equal the normal loop's."""
    outputs = {}
    for loop in ("normal", "overlap"):
        async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop=loop, decode_steps=1, jump_forward=True) as engine:
            results = await run(engine, [greedy(i) for i in range(N)])
            assert engine.scheduler.info()["grammar_late_mask_steps"] == 0
        outputs[loop] = [r.output_ids for r in results]
    assert outputs["overlap"] == outputs["normal"]


class FailsAt:
    """The library's matcher, failing at its n-th token as llguidance reports a failure of
    its lazy compilation (``is_error``, ``get_error``)."""

    def __init__(self, real, n: int) -> None:
        self.real, self.n, self.seen, self.broken = real, n, 0, False

    def consume_token(self, token: int) -> bool:
        self.seen += 1
        if self.seen >= self.n:
            self.broken = True
            return False
        return self.real.consume_token(token)

    def is_error(self) -> bool:
        return self.broken or self.real.is_error()

    def is_stopped(self) -> bool:
        return self.real.is_stopped()

    def get_error(self) -> str:
        return "lexer error: injected" if self.broken else self.real.get_error()

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        if self.broken:
            raise RuntimeError("the grammar failed")
        self.real.unsafe_compute_mask_ptr(ptr, size)


def fail_grammar_at(monkeypatch, key: tuple[str, str], n: int, wrapper: type = FailsAt) -> None:
    """Every matcher the engine makes for ``key`` fails at its ``n``-th token (``wrapper``
    around the library's matcher, once its first mask is computed)."""
    from omni_async.structured.grammar import GrammarCompiler

    real_matcher = GrammarCompiler.matcher

    def matcher(self, k):
        m = real_matcher(self, k)
        if k == key:
            m.handle  # its first mask computed (queued at creation), then the library's matcher wrapped
            m._m = wrapper(m._m, n)
        return m

    monkeypatch.setattr(GrammarCompiler, "matcher", matcher)


async def test_a_grammar_failing_mid_stream_ends_its_request_alone(monkeypatch):
    failing = ("regex", "[a-z]{4,40}")
    fail_grammar_at(monkeypatch, failing, 4)
    async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop="overlap", decode_steps=1) as engine:
        others = run(engine, [SamplingParams(max_new_tokens=200, json_schema=ENDLESS) for _ in range(N - 1)])
        streamed: list[int] = []

        async def fails():
            with pytest.raises(errors.InvalidRequestError, match="failed during generation"):
                async for delta in engine.stream(prompt="x", sampling=SamplingParams(max_new_tokens=32, regex=failing[1])):
                    streamed.extend(delta.token_ids)

        results, _ = await asyncio.gather(others, fails())
        info = engine.scheduler.info()
    assert_kv_free(engine)
    assert len(streamed) == 3  # its first three tokens went out before the failure
    assert info["grammar_late_mask_steps"] > 0
    for r in results:
        assert r.finish_reason == "length" and len(r.output_ids) == 200
        assert r.text.startswith("[{")


async def test_one_terminal_each_when_constrained_rows_abort_with_a_step_in_flight():
    """Aborts of constrained rows whose next step is launched (under late masks, always):
    exactly one terminal message per request, KV freed once, the others run to their end."""
    from omni_async.backends.native.builder import build_native_stack, build_scheduler
    from omni_async.config import SchedulerConfig

    config = SchedulerConfig(loop="overlap", decode_steps=1)
    stack = build_native_stack("tiny", config)
    sched = build_scheduler(stack, config)
    terminals: dict[str, list[str]] = {}
    lengths: dict[str, int] = {}

    async with anyio.create_task_group() as tg:
        tg.start_soon(sched.run)

        tg.start_soon(record_terminals, sched, terminals, lengths)
        await submit_constrained(sched, N, ENDLESS, 120)
        with anyio.fail_after(60):
            while stack.core.running == [] or min(len(r.output_ids) for r in stack.core.running) < 8:
                await anyio.sleep(0.01)
        sched.abort("r1")
        sched.abort("r6")
        with anyio.fail_after(120):
            while len(terminals) < N:
                await anyio.sleep(0.01)
        info = sched.info()
        await sched.aclose()
    assert {rid: len(kinds) for rid, kinds in terminals.items()} == {f"r{i}": 1 for i in range(N)}
    assert all(lengths[f"r{i}"] == 120 for i in range(N) if i not in (1, 6))
    assert info["grammar_late_mask_steps"] > 0
    assert stack.allocator.is_fully_free()


async def test_the_fill_leaves_rows_of_ended_or_retracted_requests_all_ones():
    """A row whose request completed its grammar, failed or was retracted after its step
    was scheduled (under late masks: when the step before was processed) gets every bit,
    and its matcher is not asked for a mask."""
    import torch

    from omni_async.core.batch import ForwardMode, ScheduledBatch
    from omni_async.core.request import Request
    from omni_async.structured.batch_mask import GrammarMasks
    from omni_async.structured.grammar import GrammarCompiler

    async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu") as engine:
        tok = engine.tokenizer
    compiler = GrammarCompiler(tok, tok.vocab_size)
    try:
        reqs = [Request(rid=str(i), prompt_ids=[1], sampling=SamplingParams(regex="ab")) for i in range(4)]
        for r in reqs:
            r.matcher = compiler.matcher(("regex", "ab"))
        for t in tok.encode("ab", add_special_tokens=False):
            reqs[0].matcher.accept(t)
        assert reqs[0].matcher.complete  # its mask would admit only the end
        reqs[0].finish_reason = "stop"
        reqs[1].matcher = FailsAt(None, 1)  # failed: computing its mask raises
        reqs[1].matcher.next_mask = reqs[1].matcher.unsafe_compute_mask_ptr
        reqs[1].finish_reason = "error"
        reqs[2].epoch = 1  # retracted after scheduling
        batch = ScheduledBatch(mode=ForwardMode.DECODE, reqs=reqs, epochs=[0] * 4, prefix_lens=[1] * 4, extend_lens=[1] * 4,
                               samples_kept=[True] * 4, input_ids=[-1] * 4, sample_indices=[0] * 4, late_masks=True)
        masks = GrammarMasks()
        mask = masks.fill(batch, tok.vocab_size, torch.device("cpu"))
        assert bool((mask[:3] == -1).all())
        allowed = [t for t in range(tok.vocab_size) if mask[3, t // 32] >> (t % 32) & 1]
        assert allowed == tok.encode("a", add_special_tokens=False)
        assert masks.stats()["grammar_late_mask_steps"] == 1 and masks.rows == 1
    finally:
        compiler.close()


def test_a_late_mask_batch_rebuilt_after_a_drain_keeps_sampling_late():
    from omni_async.core.batch import ForwardMode, ScheduledBatch
    from omni_async.core.request import Request

    reqs = [Request(rid=str(i), prompt_ids=[1, 2], sampling=FREE) for i in range(3)]
    batch = ScheduledBatch(mode=ForwardMode.DECODE, reqs=reqs, epochs=[0, 0, 0], prefix_lens=[2, 2, 2], extend_lens=[1, 1, 1],
                           samples_kept=[True] * 3, input_ids=[-1, -1, -1], sample_indices=[0, 0, 0],
                           page_tables=[[0], [1], [2]], page_counts=[1, 1, 1], late_masks=True)
    reqs[1].finish_reason = "stop"
    out = batch.runnable_after_drain()
    assert out.reqs == [reqs[0], reqs[2]] and out.late_masks


@pytest.mark.parametrize("loop", ["overlap", "async_decode"])
async def test_inline_launches_sample_late_on_the_loop_thread(loop, monkeypatch):
    """CUDA's thread discipline on the CPU: decode steps launched (and sampled) inline on
    the loop thread, prefills on the worker. Every row constrained: late masks in each
    step, the normal loop's tokens."""
    from omni_async.backends.native import builder
    from omni_async.stage.executor import EventWaiter, InlineStepExecutor

    async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop="normal", decode_steps=1) as engine:
        reference = [r.output_ids for r in await run(engine, [seeded(i) for i in range(N)])]
    monkeypatch.setattr(builder, "make_step_executor", lambda launch, device, wait: InlineStepExecutor(event_waiter=EventWaiter(wait)))
    async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop=loop, decode_steps=1) as engine:
        assert engine.scheduler.executor.launches_inline
        results = await run(engine, [seeded(i) for i in range(N)])
        info = engine.scheduler.info()
    assert_kv_free(engine)
    assert info["grammar_late_mask_steps"] > 0
    assert [r.output_ids for r in results] == reference


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("loop", ["overlap", "async_decode"])
async def test_cuda_late_masks_keep_the_normal_loops_tokens(loop):
    """On CUDA (float32, graphs, inline decode launches on the runner's stream): every row
    constrained, greedy and seeded, beside free rows at one forward a step; the late-mask
    steps' tokens equal the normal loop's, every constrained output valid, KV freed once."""
    mixed = [(greedy(i) if i % 4 == 1 else seeded(i)) if i % 2 else FREE for i in range(2 * N)]
    limits = dict(device="cuda", dtype="float32", decode_steps=1, kv_capacity_tokens=8192)
    async with Engine.from_pretrained("tiny", optimistic_grammar=False, loop="normal", **limits) as engine:
        reference = [r.output_ids for r in await run(engine, mixed)]
    async with Engine.from_pretrained("tiny", optimistic_grammar=False, loop=loop, **limits) as engine:
        results = await run(engine, mixed)
        info = engine.scheduler.info()
    assert_kv_free(engine)
    assert info["grammar_late_mask_steps"] > 0
    for i, r in enumerate(results):
        if i % 2:
            validate(json.loads(r.text), SCHEMA)
        assert r.output_ids == reference[i], f"request {i} differs from the normal loop"


async def test_pause_with_retraction_between_late_mask_steps_keeps_the_tokens():
    """A pause in retract mode drains (a step whose masks are due samples first), sends
    every constrained row back to waiting with its matcher where its kept tokens left it,
    and the rows go on after resume: the tokens of a run without the pause."""
    sampling = [SamplingParams(max_new_tokens=60, json_schema=ENDLESS, temperature=0.7, seed=i) for i in range(N)]
    async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop="normal", decode_steps=1) as engine:
        reference = [r.output_ids for r in await run(engine, sampling)]
    async with Engine.from_pretrained("tiny", optimistic_grammar=False, device="cpu", loop="overlap", decode_steps=1) as engine:
        core = engine.scheduler.core
        task = asyncio.ensure_future(run(engine, sampling))
        with anyio.fail_after(60):
            while not core.running or min(len(r.output_ids) for r in core.running) < 10:
                await asyncio.sleep(0.005)
        await engine.pause(mode="retract")
        assert core.num_retractions >= N
        await engine.resume()
        results = await task
        info = engine.scheduler.info()
    assert_kv_free(engine)
    assert info["grammar_late_mask_steps"] > 0
    assert [r.output_ids for r in results] == reference

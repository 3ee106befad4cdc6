"""RequestHandle readers and the per-handle collector; errors raised by submit itself;
an engine used from another event loop; a CUDA device that is not there."""

from __future__ import annotations

import asyncio
import threading
import time

import anyio
import pytest
import torch

from omni_async import Engine, SamplingParams
from omni_async.errors import ConfigError, InvalidRequestError, RequestAbortedError, RequestFailedError, RequestRejectedError
from omni_async.text.tokenizer import ByteTokenizer
from omni_async.client.loopbridge import EventLoopMismatchError
from omni_async.testing import BackgroundEngine

from .conftest import assert_kv_free

LONG = SamplingParams(max_new_tokens=40, ignore_eos=True)


async def test_every_result_reader_gets_the_result(tiny_engine):
    engine = tiny_engine()
    async with engine:
        handle = await engine.submit(prompt="readers", sampling=LONG)
        streamed = []

        async def stream_it():
            async for d in handle:
                streamed.append(d)

        results = await asyncio.gather(handle.result(), handle.result(), handle.result(), stream_it())
        late = await handle.result()  # after the end, too
        assert results[0] is results[1] is results[2] is late
        assert len(late.output_ids) == 40
        assert [t for d in streamed for t in d.token_ids] == late.output_ids
        assert "".join(d.text for d in streamed) == late.text
        assert engine.open_requests == []
    assert_kv_free(engine)


async def test_second_concurrent_stream_is_refused(tiny_engine):
    engine = tiny_engine()
    async with engine:
        handle = await engine.submit(prompt="one stream", sampling=LONG)
        first = handle.__aiter__()
        got = await first.__anext__()
        with pytest.raises(RuntimeError, match="already being streamed"):
            async for _ in handle:
                pass
        rest = [d async for d in first]
        res = await handle.result()
        assert [t for d in [got, *rest] for t in d.token_ids] == res.output_ids
    assert_kv_free(engine)


async def test_a_lagging_reader_gets_one_merged_delta(tiny_engine):
    """Deltas merge in the handle's single slot while nobody reads: a reader that comes
    after the end sees one delta holding every token, logprob and the whole text."""
    engine = tiny_engine()
    sp = SamplingParams(max_new_tokens=30, ignore_eos=True, return_logprob=True)
    async with engine:
        handle = await engine.submit(prompt="lagging", sampling=sp)
        res = await handle.result()
        deltas = [d async for d in handle]
    assert len(deltas) == 1
    (d,) = deltas
    assert d.token_ids == res.output_ids and d.text == res.text
    assert d.logprobs == res.output_logprobs and len(d.logprobs) == 30
    assert d.finished and d.finish_reason == "length"
    assert_kv_free(engine)


async def test_cancelling_one_reader_aborts_for_all(tiny_engine):
    engine = tiny_engine()
    async with engine:
        handle = await engine.submit(prompt="cancel", sampling=SamplingParams(max_new_tokens=3000, ignore_eos=True))
        waiter = asyncio.ensure_future(handle.result())
        other = asyncio.ensure_future(handle.result())
        async for _ in handle:
            break  # leaving the stream early aborts too; wait for a token first
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        with anyio.fail_after(30):
            with pytest.raises(RequestAbortedError):
                await other
        assert engine.open_requests == []
    assert_kv_free(engine)


@pytest.mark.parametrize(
    "engine_kw,kwargs,exc,part",
    [
        ({}, dict(input_ids=[1, 2, 999]), InvalidRequestError, "outside the vocabulary"),
        ({}, dict(input_ids=[1, 2.5]), InvalidRequestError, "not an int"),
        ({}, dict(input_ids=[1, 2], sampling=SamplingParams(suppress_tokens=[400])), InvalidRequestError, "suppress_tokens"),
        ({"context_length": 64}, dict(input_ids=[1] * 64, sampling=SamplingParams(max_new_tokens=10)), RequestRejectedError, "over by 1"),
        ({"kv_capacity_tokens": 64}, dict(input_ids=[1] * 60, sampling=SamplingParams(max_new_tokens=10)), RequestRejectedError, "KV cache capacity 64 by 6"),
        ({}, dict(input_ids=[1], metadata=5), InvalidRequestError, "metadata"),
    ],
)
async def test_submit_raises_early_and_leaves_nothing(tiny_engine, engine_kw, kwargs, exc, part):
    engine = tiny_engine(**engine_kw)
    async with engine:
        with pytest.raises(exc, match=part):
            await engine.submit(request_id="bad", **kwargs)
        assert engine.open_requests == [] and engine.scheduler.active_request_ids() == []
        ok = await engine.generate(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=3), request_id="bad")
        assert len(ok.output_ids) >= 1  # the id was never taken
    assert_kv_free(engine)


async def test_engine_serving_on_another_loop_is_marshalled(tiny_engine):
    engine = tiny_engine()
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    async with engine:
        expected = await engine.generate(prompt="two loops", sampling=sp)
    other = asyncio.new_event_loop()
    thread = threading.Thread(target=other.run_forever, daemon=True)
    thread.start()
    engine = tiny_engine()
    try:
        asyncio.run_coroutine_threadsafe(engine.start(), other).result(60)
        with anyio.fail_after(60):
            res = await engine.generate(prompt="two loops", sampling=sp)
            deltas = [d async for d in engine.stream(prompt="two loops", sampling=sp)]
            handle = await engine.submit(prompt="two loops", sampling=sp)
            again = await asyncio.gather(handle.result(), handle.result())
            info = await engine.model_info()
        assert res.output_ids == expected.output_ids and res.text == expected.text
        assert [t for d in deltas for t in d.token_ids] == expected.output_ids
        assert again[0].output_ids == expected.output_ids and info["success"]
        with anyio.fail_after(60):
            await engine.aclose()
    finally:
        other.call_soon_threadsafe(other.stop)
        thread.join(30)
        other.close()


async def _on_loop(loop: asyncio.AbstractEventLoop, fn):
    """``fn()`` on ``loop``, after everything already queued there."""
    async def call():
        return fn()
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(), loop))


async def _until_idle(engine: Engine) -> dict:
    """The stage's info once it holds no request (or after 20 s: the request was orphaned;
    the engine is paused, so a request that was not aborted never ends on its own)."""
    deadline = time.monotonic() + 20
    while True:
        info = await _on_loop(engine.event_loop, engine.scheduler.info)
        if info["active_requests"] == 0 or time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.02)


async def _block(seconds: float) -> None:
    """Keep this loop busy (its thread asleep) while the engine's loop runs on."""
    time.sleep(seconds)


async def _no_wait() -> None:
    return None


CANCEL_POINTS = {
    "at once": _no_wait,
    "after a hop": lambda: asyncio.sleep(0),
    # The engine's loop finishes its part of the call while this loop is busy: the call's
    # answer reaches the caller only after the cancellation.
    "engine side done": lambda: _block(0.05),
}


async def test_a_cancelled_caller_on_another_loop_aborts_its_request():
    """An engine serving on a loop of its own (a thread): a caller on this loop that is
    cancelled at any point of ``generate``, ``submit``, a stream or ``result()`` gets
    CancelledError and its request is aborted, KV freed, whether the engine's side of
    the call had finished or not when the cancellation came."""
    background = BackgroundEngine("tiny")
    engine = background.engine
    try:
        await engine.pause(mode="in_place")  # requests wait: only an abort ends them
        sp = SamplingParams(max_new_tokens=64, ignore_eos=True)

        async def submitted_result():
            handle = await engine.submit(input_ids=[5, 6, 7], sampling=sp)
            return await handle.result()

        async def first_delta():
            async for delta in engine.stream(input_ids=[5, 6, 7], sampling=sp):
                return delta

        calls = {
            "generate": lambda: engine.generate(input_ids=[5, 6, 7], sampling=sp),
            "submit": lambda: engine.submit(input_ids=[5, 6, 7], sampling=sp),
            "submit then result": submitted_result,
            "stream": first_delta,
        }
        for name, call in calls.items():
            for point, wait in CANCEL_POINTS.items():
                for hops in range(4):
                    task = asyncio.ensure_future(call())
                    for _ in range(hops):
                        await asyncio.sleep(0)
                    await wait()
                    task.cancel()
                    try:
                        got = await task
                    except asyncio.CancelledError:
                        got = None
                    if name == "submit" and got is not None:  # the handle came back first: abort it as its owner
                        await engine.abort(got.request_id)
                    info = await _until_idle(engine)
                    assert info["active_requests"] == 0, f"{name}, cancelled {point} after {hops} hops: request orphaned"
        await engine.resume()
        info = await _until_idle(engine)
        assert info["kv_free_pages"] == info["kv_total_pages"] and engine.open_requests == []
        res = await engine.generate(input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert len(res.output_ids) == 4
    finally:
        await asyncio.to_thread(background.close)


async def test_engine_of_a_stopped_loop_raises_at_once(tiny_engine):
    engine = tiny_engine()
    other = asyncio.new_event_loop()
    try:
        # Started on a loop of its own (in a thread: one loop runs per thread), which
        # stops once start() returns, as a session loop does between tests.
        await asyncio.to_thread(other.run_until_complete, engine.start())
        with anyio.fail_after(5):
            with pytest.raises(EventLoopMismatchError, match="not running"):
                await engine.generate(prompt="hangs?", sampling=SamplingParams(max_new_tokens=2))
            with pytest.raises(EventLoopMismatchError):
                await engine.admin("model_info")
    finally:
        await asyncio.to_thread(other.run_until_complete, engine.aclose())
        other.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_cuda_without_cuda_is_a_config_error():
    with pytest.raises(ConfigError, match="needs CUDA"):
        Engine.from_pretrained("tiny", device="cuda")
    with pytest.raises(ConfigError, match="needs CUDA"):
        Engine.from_pretrained("tiny", device="cuda:0")


class _BrokenTokenizer(ByteTokenizer):
    """Decodes prompts fine, raises while streaming text."""

    def decode_stream(self, skip_special_tokens=True):
        class Broken:
            def step(self, token_id):
                raise UnicodeError("broken decoder")

        return Broken()


async def test_a_failing_tokenizer_fails_its_requests_not_the_engine(tiny_engine):
    engine = tiny_engine()
    async with engine:
        good = engine.tokenizer
        engine.tokenizer = _BrokenTokenizer()
        handles = [await engine.submit(prompt=p, sampling=LONG) for p in ("a", "b")]
        for h in handles:
            with pytest.raises(RequestFailedError, match="broken decoder"):
                await h.result()
        engine.tokenizer = good
        res = await engine.generate(prompt="a", sampling=LONG)
        assert len(res.output_ids) == 40 and engine.open_requests == []
        with anyio.fail_after(30):
            while engine.scheduler.active_request_ids():
                await asyncio.sleep(0.01)
    assert_kv_free(engine)


async def test_stop_strings_need_a_tokenizer(hf_checkpoints):
    engine = Engine.from_pretrained(str(hf_checkpoints["qwen3"]), loop="normal")
    assert engine.tokenizer is None
    async with engine:
        with pytest.raises(InvalidRequestError, match="stop strings need a tokenizer"):
            await engine.submit(input_ids=[1, 2], sampling=SamplingParams(stop=["x"]))
        res = await engine.generate(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert res.text is None and res.outputs[0].text is None and len(res.output_ids) == 3
    assert_kv_free(engine)

"""Engine.load keeps the loop responsive; in-process metrics; CPU KV sizing; version."""

from __future__ import annotations

import asyncio
from importlib.metadata import version

import pytest

import omni_async
from omni_async import Engine, SamplingParams
from omni_async.backends.native.facts import available_memory_bytes
from omni_async.config import SchedulerConfig
from omni_async.core.plan import CPU_KV_MAX_TOKENS, CPU_KV_MEMORY_FRACTION, CPU_KV_MIN_TOKENS, CheckpointFacts, DeviceFacts, kv_pages


def cpu_kv_tokens(bytes_per_token: int) -> int:
    """The plan's KV size on this CPU for a checkpoint of ``bytes_per_token`` (even)
    bytes of KV per token (one layer, one head, int8-sized elements: 2 * head_dim)."""
    checkpoint = CheckpointFacts(num_layers=1, num_kv_heads=1, head_dim=max(1, bytes_per_token // 2), dtype="int8")
    device = DeviceFacts(type="cpu", free_bytes=available_memory_bytes())
    return kv_pages(SchedulerConfig(page_size=1), device, checkpoint)
from omni_async.testing import write_random_checkpoint


class Ticker:
    """Counts turns of the event loop."""

    def __init__(self) -> None:
        self.ticks = 0

    async def run(self) -> None:
        while True:
            self.ticks += 1
            await asyncio.sleep(0)


async def _ticks_during(load) -> tuple[int, Engine]:
    ticker = Ticker()
    task = asyncio.create_task(ticker.run())
    await asyncio.sleep(0)
    before = ticker.ticks
    engine = await load()
    during = ticker.ticks - before
    task.cancel()
    return during, engine


async def test_the_loop_keeps_ticking_while_a_checkpoint_loads(tmp_path):
    folder = write_random_checkpoint(tmp_path / "ckpt", seed=3)
    during, engine = await _ticks_during(lambda: Engine.load(str(folder), loop="normal"))
    assert during >= 2  # the loop turned while the worker thread loaded
    async with engine:
        res = await engine.generate(prompt="hi", sampling=SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(res.output_ids) == 3

    async def blocking() -> Engine:  # the contrast: a load on the loop thread stops it
        return Engine.from_pretrained(str(folder), loop="normal")

    stalled, other = await _ticks_during(blocking)
    assert stalled == 0
    await other.aclose()


async def test_random_checkpoint_matches_tiny(tmp_path):
    """The written folder holds tiny's weights and a tokenizer that encodes as tiny's does."""
    folder = write_random_checkpoint(tmp_path / "ckpt", seed=0)
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    async with await Engine.load(str(folder)) as from_folder, await Engine.load("tiny") as builtin:
        a = await from_folder.generate(prompt="héllo", sampling=sp)
        b = await builtin.generate(prompt="héllo", sampling=sp)
        chat = await from_folder.generate(messages=[{"role": "user", "content": "hi"}], sampling=sp)
    assert (a.prompt_ids, a.output_ids, a.text) == (b.prompt_ids, b.output_ids, b.text)
    assert len(chat.output_ids) == 6


async def test_in_process_metrics(tiny_engine):
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from omni_async.server.metrics import EngineMetrics

    engine = tiny_engine()
    metrics = EngineMetrics(engine)
    async with engine:
        handle = await engine.submit(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=5, ignore_eos=True, n=2))
        result = await metrics.result(handle)
        streamed = [d async for d in metrics.observe(await engine.submit(prompt="ab", sampling=SamplingParams(max_new_tokens=4, ignore_eos=True)))]
    assert sum(len(d.token_ids) for d in streamed) == 4
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(metrics.render().decode())
        for s in fam.samples
    }
    assert values[("omni_async_requests_total", (("finish_reason", "length"), ("model", "tiny")))] == 2
    assert values[("omni_async_generation_tokens_total", (("model", "tiny"),))] == 5 * 2 + 4 == sum(len(o.output_ids) for o in result.outputs) + 4
    assert values[("omni_async_prompt_tokens_total", (("model", "tiny"),))] == 3 + 3  # "ab" is BOS + 2 bytes
    steps = values[("omni_async_step_duration_seconds_count", ())]
    assert steps >= 5, "every processed step is timed"
    assert 0 < values[("omni_async_step_duration_seconds_sum", ())] < steps * 5


def test_cpu_kv_is_sized_from_memory():
    small = cpu_kv_tokens(bytes_per_token=1 << 40)  # a model whose KV dwarfs any machine
    large = cpu_kv_tokens(bytes_per_token=2)
    assert small == CPU_KV_MIN_TOKENS and large == CPU_KV_MAX_TOKENS
    avail = available_memory_bytes()
    assert avail and avail > 0
    per_token = int(avail * CPU_KV_MEMORY_FRACTION) // 10_000 // 2 * 2  # a model that fits ~10k tokens
    assert abs(cpu_kv_tokens(per_token) - 10_000) < 1_000  # memory moves a little between reads


def test_version_comes_from_metadata():
    assert omni_async.__version__ == version("omni-async")

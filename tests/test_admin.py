"""The admin channel: weight updates (disk, tensors, distributed), checksums, pause
modes and the lifecycle rules, admin from other threads, timeouts."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from omni_async import Engine, SamplingParams, errors
from omni_async.models.loader import load_model
from omni_async.models.checksum import weights_checksum

from .conftest import LOOPS, assert_kv_free, hf_greedy, random_prompts, save_random_checkpoint
from .test_abort_close import wait_until

PROMPTS = random_prompts(4, 512, 3, 30, seed=21)
N_NEW = 10


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    a = save_random_checkpoint("llama", root / "a", seed=1)
    b = save_random_checkpoint("llama", root / "b", seed=2)
    return a, b


async def greedy_all(engine: Engine) -> list[list[int]]:
    res = await asyncio.gather(*[engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=N_NEW)) for p in PROMPTS])
    return [r.output_ids for r in res]


def expected(folder: Path) -> list[list[int]]:
    return [hf_greedy(folder, p, N_NEW) for p in PROMPTS]


def checksum_of(folder: Path) -> str:
    return weights_checksum(load_model(str(folder)).model)["checksum"]


async def test_update_from_disk_and_from_tensor(two_checkpoints):
    a, b = two_checkpoints
    engine = Engine.from_pretrained(str(a))
    async with engine:
        assert await greedy_all(engine) == expected(a)
        before = await engine.weights_checker()
        assert before["data"]["checksum"] == checksum_of(a)
        res = await engine.update_weights_from_disk(str(b), weight_version="v2")
        assert res["success"], res
        info = (await engine.model_info())["data"]
        assert info["weight_version"] == "v2" and info["model_path"] == str(b)
        assert await greedy_all(engine) == expected(b)
        after = await engine.weights_checker()
        assert after["data"]["checksum"] == checksum_of(b) != before["data"]["checksum"]
        # back to A through named tensors
        named = list(load_file(str(a / "model.safetensors")).items())
        res = await engine.update_weights_from_tensor(named)
        assert res["success"], res
        assert await greedy_all(engine) == expected(a)
        assert (await engine.weights_checker())["data"]["checksum"] == before["data"]["checksum"]
        assert (await engine.model_info())["data"]["weight_version"] != "v2"
    assert_kv_free(engine)


@pytest.mark.parametrize(
    "bad",
    [
        {"named_tensors": [("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))]},
        {"named_tensors": [("model.layers.99.nope", torch.zeros(3))]},
        {},
    ],
    ids=["wrong-shape", "wrong-name", "nothing"],
)
async def test_failed_tensor_update_keeps_old_weights(two_checkpoints, bad):
    a, _ = two_checkpoints
    engine = Engine.from_pretrained(str(a))
    async with engine:
        before = (await engine.weights_checker())["data"]["checksum"]
        # a valid tensor listed first must not be written when a later one is bad
        good_first = [("model.norm.weight", torch.full((64,), 3.0))]
        payload = dict(bad)
        if "named_tensors" in payload:
            payload["named_tensors"] = good_first + payload["named_tensors"]
        res = await engine.admin("update_weights_from_tensor", payload)
        assert not res["success"] and res["error"]
        assert (await engine.weights_checker())["data"]["checksum"] == before
        assert await greedy_all(engine) == expected(a)
        bad_disk = await engine.update_weights_from_disk("/nonexistent/folder")
        assert not bad_disk["success"] and "nonexistent" in bad_disk["message"]
        assert (await engine.weights_checker())["data"]["checksum"] == before
        assert not (await engine.model_info())["data"]["engine_paused"]


async def test_update_refused_while_requests_are_active(two_checkpoints):
    a, b = two_checkpoints
    engine = Engine.from_pretrained(str(a))
    async with engine:
        handles = [
            await engine.submit(input_ids=[5, i], sampling=SamplingParams(max_new_tokens=300), request_id=f"busy{i}")
            for i in range(20)
        ]
        await wait_until(lambda: len(engine.stack.core.running) > 0)
        res = await engine.update_weights_from_disk(str(b))
        assert not res["success"]
        assert "abort_all_requests" in res["message"] and "retract" in res["message"]
        assert res["data"]["active_request_count"] == 20
        assert len(res["data"]["active_request_ids"]) == 16
        assert not (await engine.model_info())["data"]["engine_paused"]
        # abort_all_requests: every active request ends aborted, the update goes through
        res = await engine.update_weights_from_disk(str(b), abort_all_requests=True)
        assert res["success"] and res["data"]["num_paused_requests"] == 20
        for h in handles:
            with pytest.raises(errors.RequestAbortedError):
                await h.result()
        assert await greedy_all(engine) == expected(b)
    assert_kv_free(engine)


@pytest.mark.parametrize("loop", LOOPS)
async def test_pause_retract_then_update_then_resume(two_checkpoints, loop):
    a, b = two_checkpoints
    engine = Engine.from_pretrained(str(a), loop=loop)
    async with engine:
        handle = await engine.submit(input_ids=PROMPTS[0], sampling=SamplingParams(max_new_tokens=40), request_id="r")
        await wait_until(lambda: (r := engine.stack.core.find("r")) is not None and len(r.output_ids) >= 5)
        res = await engine.pause(mode="retract")
        assert res["success"] and res["data"]["num_paused_requests"] == 1
        assert engine.stack.allocator.is_fully_free()  # retracted: KV freed
        res = await engine.update_weights_from_disk(str(b))  # allowed: paused in retract mode
        assert res["success"], res
        assert (await engine.model_info())["data"]["engine_paused"]
        await engine.resume()
        out = await handle.result()
        assert len(out.output_ids) == 40
    assert_kv_free(engine)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
async def test_pause_modes_under_load(loop, mode):
    engine = Engine.from_pretrained("tiny", loop=loop, max_running_requests=4)
    mix = [([i + 3] * (4 + i), SamplingParams(max_new_tokens=30 + i, ignore_eos=True)) for i in range(6)]
    ref_engine = Engine.from_pretrained("tiny", loop="normal")
    async with ref_engine:
        ref = [(await ref_engine.generate(input_ids=p, sampling=sp)).output_ids for p, sp in mix]
    async with engine:
        handles = [await engine.submit(input_ids=p, sampling=sp) for p, sp in mix]
        await wait_until(lambda: any(len(r.output_ids) > 3 for r in engine.stack.core.running))
        res = await engine.pause(mode=mode)
        assert res["success"] and res["data"]["mode"] == mode
        steps = engine.scheduler.stats.steps
        await asyncio.sleep(0.05)
        assert engine.scheduler.stats.steps == steps, "a paused scheduler ran a step"
        if mode == "retract":
            assert engine.stack.allocator.is_fully_free()
        if mode == "in_place":
            assert not engine.stack.allocator.is_fully_free()
        await engine.resume()
        for h, want in zip(handles, ref):
            if mode == "abort":
                with pytest.raises(errors.RequestAbortedError):
                    await h.result()
            else:
                assert (await h.result()).output_ids == want
        after = await engine.generate(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=3))
        assert len(after.output_ids) == 3
    assert_kv_free(engine)


async def test_invalid_pause_mode_and_unknown_action(tiny_engine):
    engine = tiny_engine()
    async with engine:
        res = await engine.pause(mode="sideways")
        assert not res["success"] and "invalid pause mode" in res["message"]
        assert not (await engine.model_info())["data"]["engine_paused"]
        res = await engine.admin("reticulate_splines", {})
        assert res["success"] and res["data"] == {"skipped": True, "unsupported": True}
        info = (await engine.model_info())["data"]
        for key in ("model_path", "load_format", "weight_version", "stage_tp_rank", "stage_tp_size", "engine_paused",
                    "waiting_queue_size", "running_batch_size", "request_build_pending", "request_build_backlog"):
            assert key in info, key
        assert set(res) == {"success", "message", "data", "error"}


async def test_admin_from_another_thread_and_timeout(tiny_engine):
    engine = tiny_engine()
    async with engine:
        gen = asyncio.create_task(engine.generate(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=200, ignore_eos=True)))
        replies = {}

        def other_thread():
            replies["info"] = engine.scheduler.admin_threadsafe("model_info")
            # joining a group nobody else joins: the reply cannot come within 0.3 s
            replies["slow"] = engine.scheduler.admin_threadsafe(
                "init_weights_update_group",
                {"master_address": "127.0.0.1", "master_port": _free_port(), "world_size": 2, "rank_offset": 1,
                 "timeout_s": 3, "_admin_timeout_s": 0.3},
            )

        th = threading.Thread(target=other_thread)
        th.start()
        await asyncio.to_thread(th.join)
        assert replies["info"]["success"] and "weight_version" in replies["info"]["data"]
        assert not replies["slow"]["success"] and "timed out after 0.3s" in replies["slow"]["message"]
        assert len((await gen).output_ids) == 200  # generation went on meanwhile


async def test_failed_distributed_update_leaves_generation_paused(tiny_engine):
    engine = tiny_engine()
    async with engine:
        res = await engine.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[128]], group_name="missing")
        assert not res["success"] and "no weights update group" in res["message"]
        assert (await engine.model_info())["data"]["engine_paused"]
        await engine.resume()
        assert len((await engine.generate(input_ids=[1], sampling=SamplingParams(max_new_tokens=2))).output_ids) == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_two_process_gloo_weight_update(two_checkpoints, tmp_path):
    """A trainer process joins a gloo group with the engine and broadcasts new weights;
    the event loop keeps serving while the group forms."""
    a, b = two_checkpoints
    engine = Engine.from_pretrained(str(a))
    names = sorted(n for n in load_file(str(b / "model.safetensors")))
    tensors = load_file(str(b / "model.safetensors"))
    port = _free_port()
    spec = {"host": "127.0.0.1", "port": port, "world_size": 2, "group_name": "wug", "names": names,
            "safetensors": str(b / "model.safetensors"), "delay_s": 1.0}
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    trainer = subprocess.Popen([sys.executable, str(Path(__file__).with_name("weight_trainer.py")), str(spec_path)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        async with engine:
            ticks = 0
            stop = asyncio.Event()

            async def ticker():
                nonlocal ticks
                while not stop.is_set():
                    await asyncio.sleep(0.005)
                    ticks += 1

            tick_task = asyncio.create_task(ticker())
            join = asyncio.create_task(engine.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="wug", timeout_s=60))
            # while the trainer is not there yet, requests are served and coroutines run
            served = await engine.generate(input_ids=PROMPTS[1], sampling=SamplingParams(max_new_tokens=N_NEW))
            assert not join.done()
            assert served.output_ids == expected(a)[1]
            res = await join
            stop.set()
            await tick_task
            assert res["success"], res
            assert ticks > 20, "the event loop froze while the group formed"
            import torch.distributed as dist

            store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
            store.set("ready", "1")
            res = await engine.update_weights_from_distributed(
                names, [str(tensors[n].dtype).replace("torch.", "") for n in names], [list(tensors[n].shape) for n in names], group_name="wug"
            )
            assert res["success"], res
            assert not (await engine.model_info())["data"]["engine_paused"]
            assert await greedy_all(engine) == expected(b)
            store.set("done", "1")
            assert (await engine.destroy_weights_update_group("wug"))["success"]
    finally:
        out, _ = trainer.communicate(timeout=60)
    assert trainer.returncode == 0, out
    assert "broadcast done" in out

"""Weight updates on the SGLang backend through SGLang's weight updater: from tensors
(applied directly between steps, no pause, no refusal, no flush, as the reference does)
and from a trainer process over a gloo group (SGLang's protocol). After an update,
greedy tokens are those of the new weights."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from omni_async import SamplingParams

from .conftest import assert_sglang_pools_free, hf_greedy, random_prompts, sglang_engine

N_NEW = 10


def prompts_starting_with(first: int, n: int, seed: int) -> list[list[int]]:
    """Prompts with a first token no other group uses: the radix cache (not flushed by
    a tensor update) holds no KV of them computed with other weights."""
    return [[first] + p for p in random_prompts(n, 512, 3, 20, seed=seed)]


async def greedy(engine, prompts) -> list[list[int]]:
    res = await asyncio.gather(*[engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=N_NEW)) for p in prompts])
    return [r.output_ids for r in res]


def expected(folder, prompts) -> list[list[int]]:
    return [hf_greedy(folder, p, N_NEW) for p in prompts]


async def test_update_from_tensor_applies_between_steps(sg_checkpoints):
    folder_a, folder_b = sg_checkpoints["llama"], sg_checkpoints["llama_b"]
    tensors_a = load_file(str(folder_a / "model.safetensors"))
    tensors_b = load_file(str(folder_b / "model.safetensors"))
    long_prompt = [3] + random_prompts(1, 512, 10, 10, seed=71)[0]
    engine = sglang_engine(folder_a, loop="overlap")
    async with engine:
        first = prompts_starting_with(4, 3, seed=72)
        assert await greedy(engine, first) == expected(folder_a, first)
        check_a = (await engine.weights_checker())["data"]["checksum"]
        # A request is running: the update is neither refused nor deferred.
        running = await engine.submit(input_ids=long_prompt, sampling=SamplingParams(max_new_tokens=60), request_id="busy")
        seen: list[int] = []
        it = running.__aiter__()
        while len(seen) < 3:
            seen.extend((await it.__anext__()).token_ids)
        reply = await engine.update_weights_from_tensor(list(tensors_b.items()))
        assert reply["success"], reply
        assert reply["data"]["weight_version"] == "initial+1"
        assert not (await engine.model_info())["data"]["engine_paused"]
        assert engine.stack.core.find("busy") is not None  # still running, not aborted
        done = await running.result()
        second = prompts_starting_with(5, 3, seed=73)
        after_b = await greedy(engine, second)
        check_b = (await engine.weights_checker())["data"]["checksum"]
        # Back to A through torch.save bytes, one tensor dict.
        buf = io.BytesIO()
        torch.save(tensors_a, buf)
        reply = await engine.admin("update_weights_from_tensor", {"serialized_named_tensors": buf.getvalue()})
        assert reply["success"], reply
        third = prompts_starting_with(6, 2, seed=74)
        after_a = await greedy(engine, third)
        check_back = (await engine.weights_checker())["data"]["checksum"]
    assert len(done.output_ids) == 60
    assert done.output_ids[:3] == hf_greedy(folder_a, long_prompt, 3)
    assert after_b == expected(folder_b, second)
    assert after_a == expected(folder_a, third)
    assert check_a != check_b and check_back == check_a
    assert_sglang_pools_free(engine)


@pytest.mark.parametrize(
    "bad",
    [
        {"named_tensors": [("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))]},
        {"named_tensors": [("model.layers.99.nope", torch.zeros(3))]},
        {},
    ],
    ids=["wrong-shape", "wrong-name", "nothing"],
)
async def test_refused_tensor_update_keeps_old_weights(sg_checkpoints, bad):
    folder = sg_checkpoints["llama"]
    engine = sglang_engine(folder)
    prompts = prompts_starting_with(7, 2, seed=75)
    async with engine:
        before = (await engine.weights_checker())["data"]["checksum"]
        # A valid tensor listed first must not be written when a later one is bad.
        payload = dict(bad)
        if "named_tensors" in payload:
            payload["named_tensors"] = [("model.norm.weight", torch.full((64,), 3.0))] + payload["named_tensors"]
        reply = await engine.admin("update_weights_from_tensor", payload)
        assert not reply["success"] and reply["error"]
        assert (await engine.weights_checker())["data"]["checksum"] == before
        assert await greedy(engine, prompts) == expected(folder, prompts)
        assert (await engine.model_info())["data"]["weight_version"] == "initial"
    assert_sglang_pools_free(engine)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_two_process_gloo_weight_update(sg_checkpoints, tmp_path):
    """A trainer process forms a gloo group with the engine (SGLang's protocol) and
    broadcasts new weights; the loop serves while the group forms; a bad request for
    an update is refused before anything is received."""
    folder_a, folder_b = sg_checkpoints["llama"], sg_checkpoints["llama_b"]
    tensors = load_file(str(folder_b / "model.safetensors"))
    names = sorted(tensors)
    port = _free_port()
    done_file = tmp_path / "done"
    spec = {"host": "127.0.0.1", "port": port, "world_size": 2, "group_name": "wug", "names": names,
            "safetensors": str(folder_b / "model.safetensors"), "done_file": str(done_file)}
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    trainer = subprocess.Popen([sys.executable, str(Path(__file__).with_name("sglang_trainer.py")), str(spec_path)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    engine = sglang_engine(folder_a)
    first = prompts_starting_with(8, 2, seed=76)
    second = prompts_starting_with(9, 2, seed=77)
    try:
        async with engine:
            missing = await engine.update_weights_from_distributed(names[:1], ["float32"], [[64]], group_name="missing")
            assert not missing["success"] and "no weights update group" in missing["message"]
            assert (await engine.model_info())["data"]["engine_paused"]  # kept paused on failure
            await engine.resume()
            join = asyncio.create_task(engine.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="wug"))
            served = await greedy(engine, first)  # served while the group forms
            res = await join
            assert res["success"], res
            bad = await engine.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[3]], group_name="wug")
            assert not bad["success"] and "shape" in bad["message"]
            await engine.resume()
            res = await engine.update_weights_from_distributed(
                names, [str(tensors[n].dtype).replace("torch.", "") for n in names], [list(tensors[n].shape) for n in names],
                group_name="wug",
            )
            assert res["success"], res
            assert res["data"]["flush_success"] is True
            assert not (await engine.model_info())["data"]["engine_paused"]
            after = await greedy(engine, second)
            assert (await engine.destroy_weights_update_group("wug"))["success"]
            done_file.write_text("1")
    finally:
        done_file.write_text("1")
        out, _ = trainer.communicate(timeout=120)
    assert trainer.returncode == 0, out
    assert "broadcast done" in out
    assert served == expected(folder_a, first)
    assert after == expected(folder_b, second)
    assert_sglang_pools_free(engine)

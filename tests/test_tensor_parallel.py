"""Tensor parallelism on CPU over gloo: two ranks (this process and one worker process)
give the greedy tokens of one rank, in every loop and family; the admin lifecycle
(abort, pause, weight updates) reaches both ranks; a dead worker fails the requests
with RankFailedError and closing still returns. Float32 throughout: the all-reduce
sums partial products in another order than one rank's matmul, so only float32 keeps
greedy choices apart from rounding."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from omni_async import Engine, SamplingParams, errors

from .conftest import LOOPS, assert_kv_free, random_prompts, save_random_checkpoint
from .test_abort_close import wait_until

FAMILIES = ["llama", "qwen2", "qwen3"]
PROMPTS = random_prompts(6, 512, 3, 70, seed=5)
N_NEW = 12
# Small pages and KV, chunked prefill: retraction and chunking happen with two ranks too.
# (32 pages: with prefill and decode steps alternating, every loop retracts here.)
LIMITS = dict(page_size=8, kv_capacity_tokens=8 * 32, chunked_prefill_size=32, max_prefill_tokens=48)

_REFERENCE: dict[str, list[list[int]]] = {}


async def greedy_all(engine: Engine, prompts=PROMPTS, n=N_NEW) -> list[list[int]]:
    res = await asyncio.gather(*[engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=n)) for p in prompts])
    return [r.output_ids for r in res]


async def one_rank(folder, prompts=PROMPTS) -> list[list[int]]:
    key = str(folder)
    if key not in _REFERENCE:
        engine = Engine.from_pretrained(key, **LIMITS)
        async with engine:
            _REFERENCE[key] = await greedy_all(engine, prompts)
    return _REFERENCE[key]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("loop", LOOPS)
async def test_two_ranks_match_one_rank(hf_checkpoints, family, loop):
    folder = hf_checkpoints[family]
    expected = await one_rank(folder)
    engine = Engine.from_pretrained(str(folder), loop=loop, tensor_parallel_size=2, **LIMITS)
    async with engine:
        got = await greedy_all(engine)
        info = (await engine.model_info())["data"]
        assert info["stage_tp_size"] == 2 and info["failed_steps"] == 0
        assert info["num_retractions"] > 0, "LIMITS were meant to force retraction"
    assert got == expected
    assert_kv_free(engine)


async def test_a_vocabulary_that_does_not_divide_is_padded(tmp_path):
    """511 rows: rank 1 holds 255 and a zero row; the padded logit never reaches sampling."""
    folder = save_random_checkpoint("qwen2", tmp_path / "v511", vocab_size=511)
    prompts = random_prompts(4, 511, 3, 40, seed=8)
    expected = await one_rank(folder, prompts)
    engine = Engine.from_pretrained(str(folder), tensor_parallel_size=2, **LIMITS)
    async with engine:
        got = await greedy_all(engine, prompts)
        assert await engine.generate(input_ids=[510, 3], sampling=SamplingParams(max_new_tokens=2))  # the last row
    assert got == expected


def test_heads_that_do_not_divide_are_refused(tmp_path):
    folder = save_random_checkpoint("llama", tmp_path / "odd", num_attention_heads=3, num_key_value_heads=3, hidden_size=48)
    with pytest.raises(errors.ConfigError, match="tensor_parallel_size=2 does not divide.*attention heads \\(3\\)"):
        Engine.from_pretrained(str(folder), tensor_parallel_size=2)
    with pytest.raises(errors.ConfigError, match="KV heads \\(2\\)"):
        Engine.from_pretrained("tiny", tensor_parallel_size=4)
    with pytest.raises(errors.ConfigError, match="tensor_parallel_size must be an integer >= 1"):
        Engine.from_pretrained("tiny", tensor_parallel_size=0)
    with pytest.raises(errors.ConfigError, match="backend='sglang' runs with tensor_parallel_size=1 only"):
        Engine.from_pretrained("tiny", backend="sglang", tensor_parallel_size=2)


@pytest.fixture(scope="module")
def two_llamas(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-weights")
    return save_random_checkpoint("llama", root / "a", seed=1), save_random_checkpoint("llama", root / "b", seed=2)


async def test_abort_pause_and_weight_updates_reach_both_ranks(two_llamas):
    a, b = two_llamas
    expected_a, expected_b = await one_rank(a), await one_rank(b)
    engine = Engine.from_pretrained(str(a), tensor_parallel_size=2, loop="overlap", **LIMITS)
    async with engine:
        # abort a running request
        handle = await engine.submit(input_ids=PROMPTS[0], sampling=SamplingParams(max_new_tokens=150, ignore_eos=True), request_id="long")
        await wait_until(lambda: (r := engine.stack.core.find("long")) is not None and len(r.output_ids) >= 3)
        await engine.abort("long")
        with pytest.raises(errors.RequestAbortedError):
            await handle.result()
        # pause in retract mode mid-generation, resume: the same tokens as without a pause
        pending = asyncio.ensure_future(greedy_all(engine))
        await wait_until(lambda: engine.scheduler.info()["decode_steps"] > 0)
        assert (await engine.pause(mode="retract"))["success"]
        info = engine.scheduler.info()
        assert info["kv_free_pages"] == info["kv_total_pages"]  # retracted: no request holds KV
        await engine.resume()
        assert await pending == expected_a
        # weights from disk: every rank loads its slice of B
        before = (await engine.weights_checker())["data"]
        res = await engine.update_weights_from_disk(str(b))
        assert res["success"], res
        assert await greedy_all(engine) == expected_b
        after = (await engine.weights_checker())["data"]
        assert after["checksum"] != before["checksum"] and len(after["rank_checksums"]) == 2
        # a bad folder fails on every rank and B keeps serving
        res = await engine.update_weights_from_disk(str(a.parent / "missing"))
        assert not res["success"] and "missing" in res["message"]
        assert (await engine.weights_checker())["data"]["checksum"] == after["checksum"]
        # back to A through full tensors: each rank keeps its slice
        res = await engine.update_weights_from_tensor(list(load_file(str(a / "model.safetensors")).items()))
        assert res["success"], res
        assert (await engine.weights_checker())["data"]["checksum"] == before["checksum"]
        assert await greedy_all(engine) == expected_a
    assert_kv_free(engine)


async def test_weights_from_a_trainers_group_reach_both_ranks(two_llamas, tmp_path):
    """A trainer process (rank 0 of a gloo group of three) broadcasts B's whole tensors;
    both engine ranks (1 and 2) receive them and keep their slices. Requests are served
    while the group forms."""
    a, b = two_llamas
    expected_a, expected_b = await one_rank(a), await one_rank(b)
    tensors = load_file(str(b / "model.safetensors"))
    names = sorted(tensors)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spec = {"host": "127.0.0.1", "port": port, "world_size": 3, "group_name": "tp-wug", "names": names,
            "safetensors": str(b / "model.safetensors"), "delay_s": 1.0}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    trainer = subprocess.Popen([sys.executable, str(Path(__file__).with_name("weight_trainer.py")), str(tmp_path / "spec.json")],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    engine = Engine.from_pretrained(str(a), tensor_parallel_size=2, **LIMITS)
    try:
        async with engine:
            join = asyncio.create_task(engine.init_weights_update_group("127.0.0.1", port, 1, 3, group_name="tp-wug", timeout_s=60))
            assert await greedy_all(engine) == expected_a
            res = await join
            assert res["success"], res
            import torch.distributed as dist

            dist.TCPStore("127.0.0.1", port, 3, is_master=False).set("ready", "1")
            res = await engine.update_weights_from_distributed(
                names, [str(tensors[n].dtype).replace("torch.", "") for n in names], [list(tensors[n].shape) for n in names], group_name="tp-wug"
            )
            assert res["success"], res
            assert await greedy_all(engine) == expected_b
            dist.TCPStore("127.0.0.1", port, 3, is_master=False).set("done", "1")
            assert (await engine.destroy_weights_update_group("tp-wug"))["success"]
    finally:
        out, _ = trainer.communicate(timeout=60)
    assert trainer.returncode == 0, out


async def test_a_dead_worker_fails_requests_and_close_returns(hf_checkpoints):
    engine = Engine.from_pretrained(str(hf_checkpoints["llama"]), tensor_parallel_size=2, loop="async_decode", **LIMITS)
    await engine.start()
    handles = [
        await engine.submit(input_ids=p, sampling=SamplingParams(max_new_tokens=110, ignore_eos=True)) for p in PROMPTS[:3]
    ]
    await wait_until(lambda: engine.scheduler.info()["decode_steps"] >= 3)
    (pid,) = engine.stack.tensor_parallel.worker_pids
    os.kill(pid, signal.SIGKILL)
    for h in handles:
        with pytest.raises(errors.RankFailedError, match="tensor-parallel"):
            await asyncio.wait_for(h.result(), 60)
    # later requests fail at once with the same error, and closing returns
    with pytest.raises(errors.RankFailedError):
        await asyncio.wait_for(engine.generate(input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=4)), 60)
    await asyncio.wait_for(engine.aclose(), 60)
    assert_kv_free(engine)


def _ctx_kernel_extend():
    from omni_async.kv.attention import AttentionContext

    ctx = AttentionContext(is_decode=False, slot_mapping=torch.arange(7), logits_rows=torch.tensor([2, 6]), use_kernel=True,
                           block_tables=torch.tensor([[3, 4], [5, 0]], dtype=torch.int32), page_size=4, max_q_len=4)
    ctx.q_starts, ctx.q_lens, ctx.prefix_lens = torch.tensor([0, 3]), torch.tensor([3, 4]), torch.tensor([5, 0])
    return ctx, None


def _ctx_reference_extend():
    from omni_async.kv.attention import AttentionContext

    ctx = AttentionContext(is_decode=False, slot_mapping=torch.arange(5), logits_rows=torch.tensor([1, 4]))
    ctx.seq_slices = [(0, 2, 1), (2, 3, 0)]
    ctx.seq_kv_slots = [torch.tensor([9, 10, 11]), torch.tensor([20, 21, 22])]
    return ctx, None


def _ctx_graphed_decode():
    from omni_async.kv.attention import AttentionContext

    ctx = AttentionContext(is_decode=True, slot_mapping=torch.tensor([17, 33]), logits_rows=torch.arange(2), kv_lens=torch.tensor([2, 2]))
    return ctx, torch.tensor([[4, 7], [8, 1]])


@pytest.mark.parametrize("make", [_ctx_kernel_extend, _ctx_reference_extend, _ctx_graphed_decode])
def test_step_inputs_survive_the_broadcast_format(make):
    """Every field of every step shape (the CUDA kernel and graph ones included) comes out
    of one header and one int64 tensor as it went in, dtype and shape kept."""
    from omni_async.backends.native.parallel import plan

    ctx, graph_tables = make()
    n = ctx.slot_mapping.numel()
    header, payload = plan.pack(torch.arange(n) + 100, torch.arange(n) + 200, ctx, graph_tables)
    assert payload.dtype == torch.int64 and plan.payload_numel(header) == payload.numel()
    got = plan.unpack(header, payload.clone())
    assert got.input_ids.tolist() == (torch.arange(n) + 100).tolist() and got.positions.tolist() == (torch.arange(n) + 200).tolist()
    for name in ("slot_mapping", "logits_rows", "kv_slots", "kv_lens", "block_tables", "q_starts", "q_lens", "prefix_lens"):
        want, have = getattr(ctx, name), getattr(got.ctx, name)
        assert (want is None) == (have is None), name
        if want is not None:
            assert have.dtype == want.dtype and torch.equal(have, want), name
    assert (got.ctx.is_decode, got.ctx.page_size, got.ctx.use_kernel, got.ctx.max_q_len) == (ctx.is_decode, ctx.page_size, ctx.use_kernel, ctx.max_q_len)
    assert got.ctx.seq_slices == ctx.seq_slices
    assert [t.tolist() for t in got.ctx.seq_kv_slots or []] == [t.tolist() for t in ctx.seq_kv_slots or []]
    assert (got.graph_tables is None) == (graph_tables is None)
    if graph_tables is not None:
        assert torch.equal(got.graph_tables, graph_tables)

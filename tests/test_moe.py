"""Qwen3-MoE decoders in the native backend against transformers (float32, CPU): routing
equal to transformers' router, checkpoint tensors under their per-expert names, greedy
tokens equal to ``generate`` in every loop under KV pressure, and typed load errors.

Checkpoints are tiny random ``Qwen3MoeForCausalLM`` models written by transformers'
``save_pretrained``: one with a dense layer among sparse ones and renormalised top-k
weights, one with every other layer sparse and raw top-k probabilities."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omni_async import Engine, SamplingParams
from omni_async.errors import ModelLoadError
from omni_async.models.loader import load_model
from omni_async.models.merged import hf_named_tensors
from omni_async.models.moe import SparseMoeBlock, route

from .conftest import LOOPS, assert_kv_free, hf_greedy, random_prompts

VOCAB = 512
SHAPES = {
    # a dense layer (1) between sparse ones, top-k weights renormalised
    "dense_between": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1),
    # every other layer sparse, raw top-k probabilities, more experts than rows often
    "every_other": dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=2),
    # Qwen2-MoE: a shared expert beside the routed ones in every sparse block, q/k/v biases
    "qwen2_shared": dict(arch="qwen2", num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[2],
                         decoder_sparse_step=1, shared_expert_intermediate_size=96),
}


def moe_config(arch: str = "qwen3", **over):
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    shape = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, moe_intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        initializer_range=0.3, bos_token_id=1, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
    )
    shape.update(over)
    if arch == "qwen2":
        return Qwen2MoeConfig(**shape)
    return Qwen3MoeConfig(head_dim=32, **shape)


def save_moe_checkpoint(folder: Path, seed: int, **over) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(moe_config(**over), dtype=torch.float32).eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {name: save_moe_checkpoint(root / name, seed=i, **over) for i, (name, over) in enumerate(SHAPES.items())}


def test_routing_equals_transformers_router():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 64, generator=gen)
    for norm in (True, False):
        cfg = moe_config(num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm)
        router = Qwen3MoeTopKRouter(cfg)
        with torch.no_grad():
            router.weight.copy_(torch.randn(16, 64, generator=gen))
            _, want_weights, want_ids = router(x)
            got_weights, got_ids = route(torch.nn.functional.linear(x, router.weight), 4, norm)
        assert torch.equal(got_ids, want_ids)
        assert torch.equal(got_weights, want_weights)
        if norm:
            assert torch.allclose(got_weights.sum(-1), torch.ones(37))
        else:
            assert (got_weights.sum(-1) < 1).all()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_checkpoint_tensors_land_under_their_names(moe_checkpoints, shape):
    """Every per-expert tensor of the checkpoint is readable back under its own name
    from the stacked weights, and the layers are sparse exactly where transformers
    makes them so."""
    from transformers import AutoModelForCausalLM

    folder = moe_checkpoints[shape]
    loaded = load_model(str(folder))
    stored = load_file(str(folder / "model.safetensors"))
    ours = {name: t for name, t in hf_named_tensors(loaded.model)}
    assert set(ours) == set(stored)
    for name, tensor in stored.items():
        assert torch.equal(ours[name], tensor), name
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ours_sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in loaded.model.model.layers]
    hf_sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert ours_sparse == hf_sparse and any(ours_sparse) and not all(ours_sparse)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("loop", LOOPS)
async def test_greedy_matches_transformers_under_pressure(moe_checkpoints, shape, loop):
    folder = moe_checkpoints[shape]
    prompts = random_prompts(18, VOCAB, 3, 150, seed=7)
    rng = random.Random(11)
    lengths = [rng.randint(1, 40) for _ in prompts]
    expected = [hf_greedy(folder, p, n) for p, n in zip(prompts, lengths)]
    engine = Engine.from_pretrained(
        str(folder), loop=loop, page_size=8,
        kv_capacity_tokens=8 * 40,  # 320 tokens for ~1,900 of demand: retraction
        chunked_prefill_size=48, max_prefill_tokens=64,
    )
    async with engine:
        results = await asyncio.gather(
            *[engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, lengths)]
        )
        assert engine.stack.core.num_retractions > 0, "the KV capacity was meant to force retraction"
        info = (await engine.model_info())["data"]
    assert [r.output_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)
    assert info["model_family"] == ("qwen2_moe" if shape == "qwen2_shared" else "qwen3_moe")
    assert_kv_free(engine)


async def test_seeded_sampling_is_the_same_in_every_loop(moe_checkpoints):
    folder = moe_checkpoints["dense_between"]
    prompts = random_prompts(6, VOCAB, 4, 40, seed=9)
    outputs = []
    for loop in LOOPS:
        async with Engine.from_pretrained(str(folder), loop=loop) as engine:
            results = await asyncio.gather(*[
                engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=12, temperature=0.8, seed=i))
                for i, p in enumerate(prompts)
            ])
        outputs.append([r.output_ids for r in results])
        assert_kv_free(engine)
    assert outputs[0] == outputs[1] == outputs[2]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_missing_expert_tensor_is_a_load_error(moe_checkpoints, tmp_path):
    folder = _copy(moe_checkpoints["dense_between"], tmp_path / "ck")
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"experts\.5\.up_proj"):
        load_model(str(folder))


def test_a_wrongly_shaped_expert_tensor_is_a_load_error(moe_checkpoints, tmp_path):
    folder = _copy(moe_checkpoints["dense_between"], tmp_path / "ck")
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.mlp.experts.0.down_proj.weight"] = torch.zeros(64, 47)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"experts\.0\.down_proj.*\(64, 47\)"):
        load_model(str(folder))


@pytest.mark.parametrize("field,value,message", [
    ("num_experts_per_tok", 9, "exceeds num_experts"),
    ("moe_intermediate_size", None, "moe_intermediate_size"),
])
def test_impossible_expert_settings_are_load_errors(moe_checkpoints, tmp_path, field, value, message):
    folder = _copy(moe_checkpoints["dense_between"], tmp_path / "ck")
    cfg = json.loads((folder / "config.json").read_text())
    cfg[field] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(folder))


async def test_an_expert_updated_by_name_changes_what_the_model_writes(moe_checkpoints):
    """A weight update addresses one expert's tensor by its checkpoint name; only that
    slice of the stack changes."""
    folder = moe_checkpoints["dense_between"]
    prompt = list(range(5, 40))
    name = "model.layers.0.mlp.experts.3.gate_proj.weight"
    async with Engine.from_pretrained(str(folder), loop="normal") as engine:
        before = (await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=16))).output_ids
        stacked = engine.stack.loaded.model.model.layers[0].mlp.experts.gate_up_proj
        others = stacked.detach().clone()
        new = torch.randn(48, 64, generator=torch.Generator().manual_seed(1)) * 3
        answer = await engine.update_weights_from_tensor({name: new})
        assert answer["success"], answer
        after = (await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=16))).output_ids
    assert torch.equal(stacked[3, :48], new)
    changed = (stacked.detach() != others).any(dim=(1, 2)).tolist()
    assert changed == [i == 3 for i in range(8)]
    assert torch.equal(stacked[3, 48:], others[3, 48:])  # the up rows of expert 3 kept
    assert before != after


def test_tensor_parallelism_refuses_a_moe_decoder(moe_checkpoints):
    from omni_async.errors import ConfigError

    with pytest.raises(ConfigError, match="does not shard mixture-of-experts"):
        Engine.from_pretrained(str(moe_checkpoints["dense_between"]), tensor_parallel_size=2)


def _routed_case(t: int, hidden: int, inter: int, experts: int, top_k: int, seed: int, device: str = "cpu",
                 dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    # skewed logits: some experts take many rows, some none
    logits = torch.randn(t, experts, generator=gen) + torch.linspace(3, -3, experts)
    weights, ids = route(logits, top_k, norm_topk_prob=True)
    return [v.to(device, dtype) if v.is_floating_point() else v.to(device) for v in (x, gate_up, down, ids, weights)]


@pytest.mark.parametrize("t,experts,top_k", [(0, 8, 2), (1, 8, 2), (7, 8, 1), (33, 16, 4), (5, 64, 8), (200, 16, 2)])
def test_the_grouped_gemm_path_equals_the_torch_path(t, experts, top_k):
    """torch's grouped GEMM over the pairs sorted by expert (``EXPERT_PATH = "grouped_mm"``)
    gives the per-expert loop's sum: rows with one expert and with eight, experts hit by
    many rows and by none, no rows at all."""
    from omni_async.kernels.reference import ReferenceOps
    from omni_async.models.moe import experts_grouped_mm, experts_torch

    x, gate_up, down, ids, weights = _routed_case(t, 64, 32, experts, top_k, seed=t)
    want = experts_torch(x, gate_up, down, ids, weights, ReferenceOps())
    got = experts_grouped_mm(x, gate_up, down, ids, weights, ReferenceOps())
    assert got.shape == want.shape == (t, 64) and got.dtype == want.dtype
    if t:
        assert (got - want).abs().max().item() < 1e-5


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@needs_cuda
def test_the_grouped_gemm_path_replays_new_routing_in_a_graph():
    """Captured once at a batch size and replayed with other routing (other experts hit,
    other counts): the offsets are computed on the device, so the graph follows them
    (bfloat16, the 30B-A3B expert shape with 32 experts)."""
    from omni_async.kernels.reference import ReferenceOps
    from omni_async.models.moe import experts_grouped_mm, experts_torch

    ops = ReferenceOps()
    x, gate_up, down, ids, weights = _routed_case(160, 2048, 768, 32, 8, seed=1, device="cuda", dtype=torch.bfloat16)
    static = [x.clone(), ids.clone(), weights.clone()]
    for _ in range(2):
        experts_grouped_mm(static[0], gate_up, down, static[1], static[2], ops)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts_grouped_mm(static[0], gate_up, down, static[1], static[2], ops)
    for seed in (2, 3):
        x2, _, _, ids2, w2 = _routed_case(160, 2048, 768, 32, 8, seed=seed, device="cuda", dtype=torch.bfloat16)
        for dst, src in zip(static, (x2, ids2, w2)):
            dst.copy_(src)
        graph.replay()
        want = experts_torch(x2.float(), gate_up.float(), down.float(), ids2, w2.float(), ops)
        assert ((out.float() - want).norm() / want.norm()).item() < 2e-2, seed

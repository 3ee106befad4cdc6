"""Merged q/k/v and gate/up projections: checkpoints and weight updates still address
Hugging Face names, each landing in its rows of the merged weight."""

from __future__ import annotations

import dataclasses
import json

import torch
from safetensors.torch import load_file, save_file

from omni_async import Engine, SamplingParams
from omni_async.models.config import ModelConfig
from omni_async.models.decoder import DecoderModel
from omni_async.models.loader import copy_named_tensors, load_model
from omni_async.models.merged import hf_named_tensors, hf_parameter_slots
from omni_async.models.checksum import weights_checksum

from .conftest import hf_greedy, random_prompts

PROMPTS = random_prompts(3, 512, 3, 20, seed=5)


def test_hf_names_map_onto_merged_rows(hf_checkpoints):
    folder = hf_checkpoints["qwen2"]  # q/k/v biases too
    hf = load_file(str(folder / "model.safetensors"))
    model = load_model(str(folder)).model
    names = {n for n, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in names)
    views = dict(hf_named_tensors(model))
    assert set(views) == set(hf) - {"lm_head.weight"} or set(views) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(views[name], tensor), name
    attn = model.model.layers[1].self_attn
    q_rows = attn.num_heads * attn.head_dim
    kv_rows = attn.num_kv_heads * attn.head_dim
    merged = attn.qkv_proj.weight
    assert torch.equal(merged[q_rows : q_rows + kv_rows], hf["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(merged[q_rows + kv_rows :], hf["model.layers.1.self_attn.v_proj.weight"])
    assert torch.equal(attn.qkv_proj.bias[:q_rows], hf["model.layers.1.self_attn.q_proj.bias"])


def test_per_rank_slices_merge_into_a_model_built_with_local_shapes(hf_checkpoints):
    """A rank's model is built with its local head counts; HF tensors sliced by rank
    first then land in the right rows of that rank's merged weights."""
    folder = hf_checkpoints["llama"]
    full_cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    hf = load_file(str(folder / "model.safetensors"))
    ranks = 2
    local = dataclasses.replace(
        full_cfg,
        num_heads=full_cfg.num_heads // ranks,
        num_kv_heads=max(1, full_cfg.num_kv_heads // ranks),
        intermediate_size=full_cfg.intermediate_size // ranks,
    )
    for rank in range(ranks):
        model = DecoderModel(local)
        sliced = []
        for name, t in hf.items():
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
                t = t.chunk(ranks, dim=0)[rank]
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                t = t.chunk(ranks, dim=1)[rank]
            sliced.append((name, t))
        copy_named_tensors(model, sliced, require_all=True)
        mlp = model.model.layers[0].mlp
        rows = local.intermediate_size
        assert torch.equal(mlp.gate_up_proj.weight[:rows], hf["model.layers.0.mlp.gate_proj.weight"].chunk(ranks)[rank])
        assert torch.equal(mlp.gate_up_proj.weight[rows:], hf["model.layers.0.mlp.up_proj.weight"].chunk(ranks)[rank])
        slot = hf_parameter_slots(model)["model.layers.0.self_attn.v_proj.weight"]
        assert slot.param_name == "model.layers.0.self_attn.qkv_proj.weight"
        assert slot.start == (local.num_heads + local.num_kv_heads) * local.head_dim


async def test_updating_one_part_changes_only_its_rows(hf_checkpoints, tmp_path):
    """An update of ``k_proj`` and ``up_proj`` alone serves exactly what a checkpoint
    with those tensors replaced serves in transformers."""
    folder = hf_checkpoints["llama"]
    hf = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(9)
    changed = {
        name: torch.randn(hf[name].shape, generator=gen) / hf[name].shape[1] ** 0.5
        for name in ("model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight")
    }
    edited = tmp_path / "edited"
    edited.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (edited / f.name).write_bytes(f.read_bytes())
    save_file({**hf, **changed}, str(edited / "model.safetensors"), metadata={"format": "pt"})
    engine = Engine.from_pretrained(str(folder))
    async with engine:
        res = await engine.update_weights_from_tensor(list(changed.items()))
        assert res["success"], res
        got = [
            (await engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=8))).output_ids for p in PROMPTS
        ]
        checksum = (await engine.weights_checker())["data"]["checksum"]
    assert got == [hf_greedy(edited, p, 8) for p in PROMPTS]
    assert checksum == weights_checksum(load_model(str(edited)).model)["checksum"]

"""Folders whose weights are drawn, not stored (``random_weights.json`` beside
``config.json``): served like any checkpoint, the same seed the same model, norms at 1 and
the rest at the asked spread; a folder with neither weights nor the file still fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from omni_async import Engine, SamplingParams
from omni_async.errors import ModelLoadError
from omni_async.models.loader import load_model
from omni_async.models.random_weights import RANDOM_WEIGHTS_FILE

from .test_moe import moe_config


def drawn_folder(root: Path, name: str, spec: dict | str | None) -> Path:
    folder = root / name
    moe_config(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True).save_pretrained(folder)
    if spec is not None:
        (folder / RANDOM_WEIGHTS_FILE).write_text(spec if isinstance(spec, str) else json.dumps(spec))
    assert not list(folder.glob("*.safetensors"))
    return folder


async def test_a_drawn_model_serves_and_its_seed_decides_it(tmp_path):
    prompt = list(range(3, 30))
    outputs = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        folder = drawn_folder(tmp_path, name, {"seed": seed, "std": 0.3})
        async with Engine.from_pretrained(str(folder), loop="normal") as engine:
            outputs[name] = (await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=12))).output_ids
            info = (await engine.model_info())["data"]
        assert info["load_format"] == "random" and info["model_family"] == "qwen3_moe"
    assert outputs["a"] == outputs["b"] != outputs["c"]


def test_drawn_weights_have_the_asked_spread(tmp_path):
    model = load_model(str(drawn_folder(tmp_path, "m", {"seed": 1, "std": 0.05}))).model
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif p.numel() > 2000:
            assert abs(p.float().std().item() - 0.05) < 0.005, name
    # the config's initializer_range (0.3 in these configs) when the file gives no std
    model = load_model(str(drawn_folder(tmp_path, "n", {}))).model
    assert abs(model.model.embed_tokens.weight.std().item() - 0.3) < 0.03


@pytest.mark.parametrize("spec,message", [
    ("{not json", "not JSON"),
    ({"seed": "7"}, "seed must be an integer"),
    ({"std": 0}, "std must be a positive number"),
    ({"seed": 1, "scale": 2}, "'seed' and 'std' at most"),
])
def test_a_bad_random_weights_file_is_a_load_error(tmp_path, spec, message):
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(drawn_folder(tmp_path, "m", spec)))


def test_a_folder_without_weights_or_the_file_still_fails(tmp_path):
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weights found"):
        load_model(str(drawn_folder(tmp_path, "m", None)))

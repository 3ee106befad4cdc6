"""``thinker_to_talker_proj``: attached to a loaded talker, from its checkpoint when it
holds one (shapes checked), random from the seed otherwise."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from omni_async.backends.native.builder import build_native_stack
from omni_async.config import SchedulerConfig
from omni_async.errors import ConfigError
from omni_async.models.conditioning import attach_projection
from omni_async.models.loader import load_model
from omni_async.testing import write_random_checkpoint


def test_random_projection_is_seeded_in_the_models_dtype():
    a = attach_projection(load_model("tiny", dtype="bfloat16"), 96, seed=3)
    b = attach_projection(load_model("tiny"), 96, seed=3)
    c = attach_projection(load_model("tiny"), 96, seed=4)
    assert a.weight.shape == (128, 96) and a.bias.shape == (128,)
    assert a.weight.dtype == torch.bfloat16 and b.weight.dtype == torch.float32
    assert torch.equal(a.weight, b.weight.to(torch.bfloat16))
    assert not torch.equal(b.weight, c.weight)


def test_projection_comes_from_the_checkpoint_when_it_holds_one(tmp_path):
    folder = write_random_checkpoint(tmp_path / "talker", tokenizer=False)
    weight, bias = torch.randn(128, 40), torch.randn(128)
    save_file({"thinker_to_talker_proj.weight": weight, "thinker_to_talker_proj.bias": bias},
              str(folder / "projection.safetensors"))
    loaded = load_model(folder)  # the projection's tensors do not trouble a plain load
    proj = attach_projection(loaded, 40, seed=0)
    assert torch.equal(proj.weight, weight) and torch.equal(proj.bias, bias)
    assert loaded.model.thinker_to_talker_proj is proj
    # the stage option attaches the same
    stack = build_native_stack(str(folder), SchedulerConfig(), conditioning_size=40)
    assert torch.equal(stack.loaded.model.thinker_to_talker_proj.weight, weight)


def test_a_checkpoint_projection_of_other_shapes_is_a_config_error(tmp_path):
    folder = write_random_checkpoint(tmp_path / "talker", tokenizer=False)
    save_file({"thinker_to_talker_proj.weight": torch.randn(128, 40), "thinker_to_talker_proj.bias": torch.randn(128)},
              str(folder / "projection.safetensors"))
    with pytest.raises(ConfigError, match=r"\(128, 40\).*\(128, 64\)"):
        attach_projection(load_model(folder), 64)


def test_a_bad_conditioning_size_is_a_config_error():
    with pytest.raises(ConfigError, match="conditioning_size"):
        attach_projection(load_model("tiny"), 0)


def test_a_hidden_talker_needs_its_projection_and_a_pad_id_in_its_vocabulary():
    from omni_async.pipeline.colocate import build_stage_scheduler, build_talker, talker_request_builder

    with pytest.raises(ConfigError, match="conditioning_size"):
        build_talker("tiny")
    callbacks, bind = talker_request_builder(3, "hidden")
    sched, stack = build_stage_scheduler("tiny", callbacks=callbacks)  # no projection
    with pytest.raises(ConfigError, match="conditioning_size"):
        bind(sched, stack)
    with pytest.raises(ConfigError, match="pad_id 999"):
        build_talker("tiny", conditioning_size=64, pad_id=999)

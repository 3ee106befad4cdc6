"""A Qwen3-Omni checkpoint folder (``Qwen3OmniMoeForConditionalGeneration``: thinker,
talker, code predictor and code2wav in one folder) served for its thinker: the text
decoder loads from ``thinker.*`` alone, greedy tokens equal transformers' thinker in every
loop, and the rows at the talker's ``accept_hidden_layer`` equal the thinker's
``hidden_states[accept_hidden_layer]`` (float32, CPU, a tiny random model saved by
transformers)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch

from omni_async import Engine, SamplingParams
from omni_async.errors import ModelLoadError
from omni_async.models.loader import load_model
from omni_async.models.merged import hf_named_tensors

from .conftest import LOOPS, assert_kv_free, random_prompts

VOCAB = 512
ROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 2, 2], "interleaved": True}
ACCEPT_LAYER = 2


def omni_config():
    from transformers import Qwen3OmniMoeConfig

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=1024, initializer_range=0.3, rope_parameters=ROPE)
    talker_text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=32, rope_parameters=ROPE)
    predictor = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, num_code_groups=4)
    return Qwen3OmniMoeConfig(
        thinker_config=dict(
            text_config=text,
            audio_config=dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, output_dim=64,
                              num_mel_bins=16, downsample_hidden_size=16),
            vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                               deepstack_visual_indexes=[0], patch_size=4, num_position_embeddings=16),
        ),
        talker_config=dict(text_config=talker_text, code_predictor_config=predictor, num_code_groups=4, thinker_hidden_size=64,
                           accept_hidden_layer=ACCEPT_LAYER, spatial_merge_size=2, codec_eos_token_id=120, codec_nothink_id=121,
                           codec_think_bos_id=122, codec_think_eos_id=123, codec_pad_id=124, codec_bos_id=125),
        code2wav_config=dict(codebook_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1,
                             num_quantizers=4, decoder_dim=32, intermediate_size=64),
    )


@pytest.fixture(scope="module")
def omni_folder(tmp_path_factory) -> Path:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    folder = tmp_path_factory.mktemp("omni") / "ck"
    torch.manual_seed(0)
    Qwen3OmniMoeForConditionalGeneration(omni_config()).eval().save_pretrained(folder)
    return folder


_THINKERS: dict[str, object] = {}


def hf_thinker(folder: Path):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    if str(folder) not in _THINKERS:
        model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        # transformers 5.25's text-only position ids read this; the thinker's config lacks it
        model.thinker.config.vision_start_token_id = 151652
        _THINKERS[str(folder)] = model.thinker
    return _THINKERS[str(folder)]


def hf_thinker_greedy(folder: Path, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf_thinker(folder).generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                          max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_thinker_rows(folder: Path, tokens: list[int], layer: int) -> torch.Tensor:
    with torch.no_grad():
        out = hf_thinker(folder)(input_ids=torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
                                 output_hidden_states=True)
    return out.hidden_states[layer][0]


def test_the_thinker_loads_from_its_own_tensors(omni_folder):
    from safetensors import safe_open

    loaded = load_model(str(omni_folder))
    assert loaded.config.family == "qwen3_moe" and loaded.config.num_layers == 4
    names = []
    for file in omni_folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names += list(f.keys())
    thinker = {n[len("thinker."):] for n in names if n.startswith(("thinker.model.", "thinker.lm_head."))}
    assert {n for n, _ in hf_named_tensors(loaded.model)} == thinker
    assert any(n.startswith("talker.") for n in names) and any(n.startswith("thinker.audio_tower.") for n in names)


@pytest.mark.parametrize("loop", LOOPS)
async def test_thinker_greedy_and_accept_layer_rows_equal_transformers(omni_folder, loop):
    """Served with the talker's ``accept_hidden_layer`` as the stage's layer, as a thinker
    feeding the talker is: tokens as transformers' thinker writes them, and each token's
    row (and every prompt position's) its ``hidden_states[accept_hidden_layer]``."""
    cfg = json.loads((omni_folder / "config.json").read_text())
    layer = cfg["talker_config"]["accept_hidden_layer"]
    prompts = random_prompts(5, VOCAB, 3, 40, seed=12)
    lengths = [9, 1, 14, 6, 11]
    sampling = dict(return_hidden_states=True, return_prompt_hidden_states=True)
    engine = Engine.from_pretrained(str(omni_folder), loop=loop, hidden_states_layer=layer, decode_steps=4, page_size=8,
                                    chunked_prefill_size=16, max_prefill_tokens=24)
    async with engine:
        results = await asyncio.gather(*[
            engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=n, **sampling)) for p, n in zip(prompts, lengths)
        ])
    assert_kv_free(engine)
    for prompt, n, res in zip(prompts, lengths, results):
        assert res.output_ids == hf_thinker_greedy(omni_folder, prompt, n)
        ref = hf_thinker_rows(omni_folder, prompt + res.output_ids, layer)
        lp = len(prompt)
        torch.testing.assert_close(res.hidden_states, ref[lp - 1 : lp - 1 + n], atol=2e-4, rtol=1e-3)
        torch.testing.assert_close(res.prompt_hidden_states, ref[:lp], atol=2e-4, rtol=1e-3)


async def test_weights_update_from_an_omni_folder(omni_folder, tmp_path):
    """Reloading from another Qwen3-Omni folder reads its thinker's tensors by the same
    names: the tokens follow the new weights."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    other = tmp_path / "other"
    torch.manual_seed(7)
    Qwen3OmniMoeForConditionalGeneration(omni_config()).eval().save_pretrained(other)
    prompt = list(range(10, 30))
    async with Engine.from_pretrained(str(omni_folder), loop="normal") as engine:
        before = (await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=10))).output_ids
        answer = await engine.update_weights_from_disk(str(other))
        assert answer["success"], answer
        after = (await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=10))).output_ids
    assert before == hf_thinker_greedy(omni_folder, prompt, 10)
    assert after == hf_thinker_greedy(other, prompt, 10) and after != before


def test_an_omni_config_without_its_thinker_is_a_load_error(omni_folder, tmp_path):
    folder = tmp_path / "ck"
    shutil.copytree(omni_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["thinker_config"]["text_config"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="thinker_config.text_config"):
        load_model(str(folder))

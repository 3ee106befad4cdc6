"""Model loading and the decoder itself: typed load errors, sharded checkpoints, half
precision, the built-in ``tiny``, a folder's own tokenizer, and logits against transformers.

Checkpoints are random-weight models written with transformers' ``save_pretrained``
(``conftest.hf_checkpoints``); every test that changes one works on a copy.
"""

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
from omni_async.errors import InvalidRequestError, ModelLoadError
from omni_async.kv.attention import AttentionContext
from omni_async.kv.cache import PagedKVCache
from omni_async.models.decoder import rope_inv_freq
from omni_async.models.loader import load_model
from omni_async.text.tokenizer import ByteTokenizer, HFTokenizer

from .conftest import _hf_model, assert_kv_free, random_prompts

VOCAB = 512  # conftest's checkpoints


# ---------------------------------------------------------------- helpers


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(folder: Path, fn) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    fn(cfg)
    path.write_text(json.dumps(cfg))


def edit_tensors(folder: Path, fn) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _page_table(num_tokens: int, page_size: int, num_pages: int, seed: int) -> list[int]:
    """A scattered page table: the model must not rely on contiguous pages."""
    pages = list(range(num_pages))
    random.Random(seed).shuffle(pages)
    return pages[: -(-num_tokens // page_size)]


def _slots(table: list[int], start: int, end: int, page_size: int) -> torch.Tensor:
    pos = torch.arange(start, end)
    return torch.tensor(table)[pos // page_size] * page_size + pos % page_size


def new_kv(model, num_pages: int = 16, page_size: int = 16) -> PagedKVCache:
    cfg = model.config
    return PagedKVCache(
        num_layers=cfg.num_layers,
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=next(model.parameters()).dtype,
        device=torch.device("cpu"),
    )


def extend_logits(model, kv, table, ids, prefix_len, page_size=16) -> torch.Tensor:
    """Logits of every row of one sequence's extend step (prefill or a later chunk)."""
    n = len(ids)
    ctx = AttentionContext(
        is_decode=False,
        slot_mapping=_slots(table, prefix_len, prefix_len + n, page_size),
        logits_rows=torch.arange(n),
        seq_slices=[(0, n, prefix_len)],
        seq_kv_slots=[_slots(table, 0, prefix_len + n, page_size)],
    )
    return model(torch.tensor(ids), torch.arange(prefix_len, prefix_len + n), kv, ctx)


def decode_logits(model, kv, table, token, pos, page_size=16) -> torch.Tensor:
    """Logits of one decode row at position ``pos`` (the cache holds positions < pos)."""
    ctx = AttentionContext(
        is_decode=True,
        slot_mapping=_slots(table, pos, pos + 1, page_size),
        logits_rows=torch.tensor([0]),
        kv_slots=_slots(table, 0, pos + 1, page_size)[None, :],
        kv_lens=torch.tensor([pos + 1]),
    )
    return model(torch.tensor([token]), torch.tensor([pos]), kv, ctx)[0]


def prefill_logits(model, ids, page_size=16) -> torch.Tensor:
    num_pages = -(-len(ids) // page_size) + 2
    kv = new_kv(model, num_pages, page_size)
    table = _page_table(len(ids), page_size, num_pages, seed=len(ids))
    return extend_logits(model, kv, table, ids, 0, page_size)


async def greedy(engine: Engine, prompts, n: int) -> list[list[int]]:
    results = await asyncio.gather(
        *[engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=n, ignore_eos=True)) for p in prompts]
    )
    return [r.output_ids for r in results]


# ---------------------------------------------------------------- load errors


def _arch_gpt2(c):
    c["architectures"] = ["GPT2LMHeadModel"]
    c["model_type"] = "gpt2"


def _model_type_only_unknown(c):
    c.pop("architectures")
    c["model_type"] = "mistral"


def _rope_yarn(c):
    c["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256}


def _rope_dynamic_legacy(c):
    # The pre-transformers-5 layout: rope_theta and rope_scaling at the top level.
    c.pop("rope_parameters")
    c["rope_theta"] = 10000.0
    c["rope_scaling"] = {"type": "dynamic", "factor": 2.0}


def _rope_yarn_legacy_beside_default(c):
    # A v5 config (rope_parameters: default) with a legacy rope_scaling added by hand:
    # transformers gives rope_scaling priority, so the checkpoint means yarn.
    c["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}


def _sliding_window(c):
    c["use_sliding_window"] = True
    c["sliding_window"] = 32


def _sliding_layer_types(c):
    c["layer_types"] = ["sliding_attention", "full_attention"]


def _gelu(c):
    c["hidden_act"] = "gelu"


def _drop_field(name):
    return lambda c: c.pop(name)


def _field_as(name, value):
    def fn(c):
        c[name] = value

    return fn


def _drop_tensor(name):
    return lambda t: t.pop(name)


def _transpose(name):
    def fn(t):
        t[name] = t[name].t().contiguous()

    return fn


def _extra_tensor(t):
    t["model.layers.0.self_attn.extra.weight"] = torch.zeros(4)


CONFIG_ERRORS = [
    ("architecture", "llama", _arch_gpt2, ["unsupported architecture", "GPT2LMHeadModel", "LlamaForCausalLM"]),
    ("model-type", "llama", _model_type_only_unknown, ["unsupported model_type", "mistral"]),
    ("rope-yarn", "llama", _rope_yarn, ["unsupported rope scaling type", "'yarn'", "llama3"]),
    ("rope-dynamic-legacy", "llama", _rope_dynamic_legacy, ["unsupported rope scaling type", "'dynamic'"]),
    ("rope-yarn-legacy-beside-default",
        "llama",
        _rope_yarn_legacy_beside_default,
        ["unsupported rope scaling type", "yarn"]),
    ("sliding-window-qwen2", "qwen2", _sliding_window, ["sliding-window", "use_sliding_window"]),
    ("sliding-layer-types-qwen2", "qwen2", _sliding_layer_types, ["layer_types", "sliding_attention"]),
    ("hidden-act", "qwen3", _gelu, ["hidden_act", "gelu"]),
    ("no-num-attention-heads", "llama", _drop_field("num_attention_heads"), ["config.json has no 'num_attention_heads'"]),
    ("no-vocab-size", "qwen2", _drop_field("vocab_size"), ["config.json has no 'vocab_size'"]),
    ("no-num-hidden-layers", "qwen3", _drop_field("num_hidden_layers"), ["config.json has no 'num_hidden_layers'"]),
    ("hidden-size-text", "llama", _field_as("hidden_size", "wide"), ["'hidden_size' must be a positive integer", "'wide'"]),
]

TENSOR_ERRORS = [
    ("missing-tensor", "llama", _drop_tensor("model.layers.1.self_attn.k_proj.weight"), ["missing 1 tensor", "model.layers.1.self_attn.k_proj.weight"]),
    ("missing-lm-head-untied", "llama", _drop_tensor("lm_head.weight"), ["missing 1 tensor", "lm_head.weight"]),
    ("missing-qk-norm", "qwen3", _drop_tensor("model.layers.0.self_attn.q_norm.weight"), ["q_norm.weight"]),
    ("missing-qkv-bias", "qwen2", _drop_tensor("model.layers.0.self_attn.v_proj.bias"), ["v_proj.bias"]),
    ("wrong-shape", "llama", _transpose("model.layers.0.mlp.up_proj.weight"), ["model.layers.0.mlp.up_proj.weight", "shape (64, 160)", "expects (160, 64)"]),
    ("unexpected-tensor", "llama", _extra_tensor, ["unexpected tensor", "model.layers.0.self_attn.extra.weight"]),
]


def _params(cases):
    out = []
    for case in cases:
        if hasattr(case, "marks"):  # a pytest.param (itself a tuple)
            out.append(pytest.param(*case.values[1:], id=case.values[0], marks=case.marks))
        else:
            out.append(pytest.param(*case[1:], id=case[0]))
    return out


@pytest.mark.parametrize("family,edit,parts", _params(CONFIG_ERRORS))
def test_config_load_errors(hf_checkpoints, tmp_path, family, edit, parts):
    folder = copy_ckpt(hf_checkpoints[family], tmp_path / "ckpt")
    edit_config(folder, edit)
    with pytest.raises(ModelLoadError) as info:
        Engine.from_pretrained(str(folder))
    for part in parts:
        assert part in str(info.value), f"{part!r} not in {str(info.value)!r}"


@pytest.mark.parametrize("family,edit,parts", _params(TENSOR_ERRORS))
def test_tensor_load_errors(hf_checkpoints, tmp_path, family, edit, parts):
    folder = copy_ckpt(hf_checkpoints[family], tmp_path / "ckpt")
    edit_tensors(folder, edit)
    with pytest.raises(ModelLoadError) as info:
        Engine.from_pretrained(str(folder))
    for part in parts:
        assert part in str(info.value), f"{part!r} not in {str(info.value)!r}"


def test_folder_layout_errors(hf_checkpoints, tmp_path):
    src = hf_checkpoints["llama"]

    no_config = copy_ckpt(src, tmp_path / "no_config")
    (no_config / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        Engine.from_pretrained(str(no_config))

    missing_dir = tmp_path / "does_not_exist"
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        Engine.from_pretrained(str(missing_dir))

    no_weights = copy_ckpt(src, tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        Engine.from_pretrained(str(no_weights))

    with pytest.raises(ModelLoadError, match="unsupported dtype"):
        Engine.from_pretrained("tiny", dtype="int8")
    with pytest.raises(ModelLoadError, match="unsupported dtype"):
        load_model(str(src), dtype=torch.float64)


# ---------------------------------------------------------------- sharded checkpoints


def save_sharded(src: Path, dst: Path) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(dst, max_shard_size="100KB")
    return dst


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # untied and tied embeddings
async def test_sharded_checkpoint_loads_like_single_file(hf_checkpoints, tmp_path, family):
    single = hf_checkpoints[family]
    sharded = save_sharded(single, tmp_path / "sharded")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) >= 3 and not (sharded / "model.safetensors").exists()
    assert {sharded / f for f in index["weight_map"].values()} == set(shards)

    a = load_model(str(single)).model.state_dict()
    b = load_model(str(sharded)).model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name

    prompts = random_prompts(4, VOCAB, 3, 40, seed=3)
    outs = []
    for folder in (single, sharded):
        engine = Engine.from_pretrained(str(folder), loop="normal")
        async with engine:
            outs.append(await greedy(engine, prompts, 12))
        assert_kv_free(engine)
    assert outs[0] == outs[1]
    assert all(len(o) == 12 for o in outs[1])

    # A shard named in the index but absent is a load error.
    shards[-1].unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        load_model(str(sharded))


# ---------------------------------------------------------------- dtypes

# (dtype, max |logit diff| to float32, min argmax agreement); measured values sit at about
# half these bounds (bf16 ~0.7, fp16 ~0.2 on logits of magnitude ~10).
HALF = [("bfloat16", 1.5, 0.85), ("float16", 0.5, 0.9)]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype,max_diff,min_agree", HALF, ids=[h[0] for h in HALF])
def test_half_precision_logits_close_to_float32(hf_checkpoints, family, dtype, max_diff, min_agree):
    folder = hf_checkpoints[family]
    ids = random_prompts(1, VOCAB, 100, 100, seed=1)[0]
    ref = prefill_logits(load_model(str(folder)).model, ids)
    half = load_model(str(folder), dtype=dtype).model
    assert {p.dtype for p in half.parameters()} == {getattr(torch, dtype)}
    out = prefill_logits(half, ids)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max().item() < max_diff
    cos = torch.nn.functional.cosine_similarity(out, ref, dim=-1)
    assert cos.min().item() > 0.99
    agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= min_agree


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
async def test_half_precision_engine_generates(hf_checkpoints, dtype):
    folder = hf_checkpoints["qwen2"]
    prompts = random_prompts(6, VOCAB, 5, 60, seed=9)
    engine = Engine.from_pretrained(str(folder), loop="normal", dtype=dtype)
    assert engine.stack.kv.k[0].dtype == getattr(torch, dtype)
    async with engine:
        info = await engine.model_info()
        outs = await greedy(engine, prompts, 10)
    assert_kv_free(engine)
    assert dtype in json.dumps(info)
    assert all(len(o) == 10 and all(0 <= t < VOCAB for t in o) for o in outs)
    ref_engine = Engine.from_pretrained(str(folder), loop="normal")
    async with ref_engine:
        ref = await greedy(ref_engine, prompts, 1)
    same_first = sum(o[0] == r[0] for o, r in zip(outs, ref))
    assert same_first >= 4, (outs, ref)


@pytest.mark.parametrize(
    "name",
    [
        "folder",
        "tiny",
    ],
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_keeps_rope_frequencies_in_float32(hf_checkpoints, name, dtype):
    path = str(hf_checkpoints["llama"]) if name == "folder" else "tiny"
    loaded = load_model(path, dtype=dtype)
    assert loaded.model.inv_freq.dtype == torch.float32
    assert torch.equal(loaded.model.inv_freq, rope_inv_freq(loaded.config))


# ---------------------------------------------------------------- the built-in tiny


async def test_tiny_is_deterministic_per_seed():
    prompts = [[256, *b"hello"], [256, *b"continuous batching"], list(range(40, 90))]
    sampled = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7)
    runs = []
    for seed in (0, 0, 1):
        engine = Engine.from_pretrained("tiny", loop="normal", seed=seed)
        async with engine:
            weights = {k: v.clone() for k, v in engine.stack.loaded.model.state_dict().items()}
            g = await greedy(engine, prompts, 16)
            s = [(await engine.generate(input_ids=p, sampling=sampled)).output_ids for p in prompts]
        assert_kv_free(engine)
        runs.append((weights, g, s))
    (w0, g0, s0), (w0b, g0b, s0b), (w1, g1, s1) = runs
    assert all(torch.equal(w0[k], w0b[k]) for k in w0)
    assert (g0, s0) == (g0b, s0b)
    assert any(not torch.equal(w0[k], w1[k]) for k in w0 if not k.endswith("norm.weight"))
    assert all(not torch.equal(w0[k], w1[k]) for k in w0 if k.endswith("proj.weight"))
    assert (g0, s0) != (g1, s1)


async def test_tiny_context_and_long_prompt():
    engine = Engine.from_pretrained("tiny", loop="normal")
    cfg = engine.stack.loaded.config
    assert cfg.max_position_embeddings >= 2048
    assert engine.stack.limits.context_length >= 2048
    assert cfg.vocab_size == ByteTokenizer.VOCAB_SIZE and cfg.eos_token_ids == (ByteTokenizer.EOS,)
    rng = random.Random(4)
    ids = [rng.randrange(0, 256) for _ in range(2040)]
    model = engine.stack.loaded.model  # closing releases the engine's reference to it
    async with engine:
        res = await engine.generate(input_ids=ids, sampling=SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert_kv_free(engine)
    assert len(res.output_ids) == 8 and res.finish_reason == "length"
    # Chunked prefill and decode at positions up to 2047 agree with one plain forward.
    full = prefill_logits(model, ids + res.output_ids[:-1])
    assert full[len(ids) - 1 :].argmax(-1).tolist() == res.output_ids


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    for text in ["", "hello", "héllo wörld ✓ 日本語 🙂", "a\nb\tc\x00"]:
        ids = tok.encode(text)
        assert ids[0] == ByteTokenizer.BOS == 256
        assert ids[1:] == list(text.encode("utf-8"))
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
        assert tok.decode(ids + [ByteTokenizer.EOS, 300]) == text  # specials and padding ids skipped
    assert tok.vocab_size == 320 and tok.eos_token_ids == (257,)


async def test_tiny_prompt_and_text():
    engine = Engine.from_pretrained("tiny", loop="normal")
    text = "Streams arrive token by token: ünïcode ✓"
    async with engine:
        res = await engine.generate(prompt=text, sampling=SamplingParams(max_new_tokens=12, ignore_eos=True))
        by_ids = await engine.generate(input_ids=ByteTokenizer().encode(text), sampling=SamplingParams(max_new_tokens=12, ignore_eos=True))
        deltas = [d async for d in engine.stream(prompt=text, sampling=SamplingParams(max_new_tokens=12, ignore_eos=True))]
    assert_kv_free(engine)
    assert res.prompt_ids == [256, *text.encode("utf-8")]
    assert res.output_ids == by_ids.output_ids
    assert res.text == ByteTokenizer().decode(res.output_ids)
    assert [t for d in deltas for t in d.token_ids] == res.output_ids
    assert all(d.text == ByteTokenizer().decode(d.token_ids) for d in deltas)


# ---------------------------------------------------------------- a folder's tokenizer.json

CORPUS = [
    "the thinker writes text and the talker speaks it",
    "continuous batching keeps the model busy",
    "an idle loop should cost nothing at all",
    "streams arrive token by token",
    "paged caches grow one page at a time",
    "abort retract resume and carry on",
]


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["[UNK]", "[BOS]", "[EOS]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() <= VOCAB
    return tok


async def test_folder_tokenizer_json_is_used(hf_checkpoints, tmp_path):
    folder = copy_ckpt(hf_checkpoints["llama"], tmp_path / "with_tok")
    tok = train_tokenizer()
    tok.save(str(folder / "tokenizer.json"))
    prompt = "the talker speaks token by token"
    expected_ids = tok.encode(prompt).ids
    assert expected_ids != ByteTokenizer().encode(prompt)
    assert len(expected_ids) < len(prompt)  # merges were learnt: not one id per byte

    engine = Engine.from_pretrained(str(folder), loop="normal")
    assert isinstance(engine.tokenizer, HFTokenizer)
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    async with engine:
        res = await engine.generate(prompt=prompt, sampling=sp)
        by_ids = await engine.generate(input_ids=expected_ids, sampling=sp)
        deltas = [d async for d in engine.stream(prompt=prompt, sampling=sp)]
    assert_kv_free(engine)
    assert res.prompt_ids == expected_ids
    assert tok.decode(res.prompt_ids) == prompt
    assert res.output_ids == by_ids.output_ids and len(res.output_ids) == 16
    assert res.text == tok.decode(res.output_ids, skip_special_tokens=True)
    assert by_ids.text == res.text
    assert [t for d in deltas for t in d.token_ids] == res.output_ids
    # Streamed text is decoded incrementally: the joined deltas equal the full decode.
    assert "".join(d.text for d in deltas) == res.text


async def test_folder_without_tokenizer(hf_checkpoints):
    folder = hf_checkpoints["qwen3"]
    assert not (folder / "tokenizer.json").exists()
    engine = Engine.from_pretrained(str(folder), loop="normal")
    assert engine.tokenizer is None
    async with engine:
        res = await engine.generate(input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=4))
        assert len(res.output_ids) == 4 and res.text is None
        with pytest.raises(InvalidRequestError, match="no tokenizer"):
            await engine.generate(prompt="hello")
        with pytest.raises(InvalidRequestError, match="no tokenizer"):
            async for _ in engine.stream(prompt="hello"):
                pass
        again = await engine.generate(input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=4))
        assert again.output_ids == res.output_ids
    assert_kv_free(engine)


# ---------------------------------------------------------------- logits against transformers


@pytest.mark.parametrize("family", ["llama", "llama3rope", "qwen2", "qwen3"])
def test_forward_logits_match_transformers(hf_checkpoints, family):
    """Float32, one sequence over a scattered page table: the full prefill, the same
    sequence as two chunks, and decode steps after it, all within 1e-4 of transformers."""
    folder = hf_checkpoints[family]
    hf = _hf_model(folder)
    ours = load_model(str(folder)).model
    ids = random_prompts(1, VOCAB, 90, 90, seed=17)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].to(torch.float32)

    full = prefill_logits(ours, ids)
    torch.testing.assert_close(full, ref, atol=1e-4, rtol=0)

    kv = new_kv(ours, num_pages=8)
    table = _page_table(len(ids), 16, 8, seed=2)
    first = extend_logits(ours, kv, table, ids[:37], 0)
    second = extend_logits(ours, kv, table, ids[37:80], 37)
    torch.testing.assert_close(torch.cat([first, second]), ref[:80], atol=1e-4, rtol=0)
    for pos in range(80, 90):
        row = decode_logits(ours, kv, table, ids[pos], pos)
        torch.testing.assert_close(row, ref[pos], atol=1e-4, rtol=0)

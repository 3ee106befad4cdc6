"""Shared fixtures: random-weight checkpoints written with transformers' save_pretrained,
engines over them, and the invariants every test ends with."""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest
import torch

from omni_async import Engine

# The package's pytest plugin (also registered by its pytest11 entry point when installed).
pytest_plugins = ["omni_async.testing"]

LOOPS = ["normal", "overlap", "async_decode"]

_SGLANG_TESTS = Path(__file__).parent / "sglang"
_SCALE_TESTS = Path(__file__).parent / "scale"

# Converted GGUF weights go to a cache folder of the test run's own (inherited by the
# command-line subprocesses), never to the user's cache; removed when the run ends.
_CACHE_DIR = tempfile.mkdtemp(prefix="omni-async-test-cache-")
os.environ["OMNI_ASYNC_CACHE_DIR"] = _CACHE_DIR


def pytest_unconfigure(config):
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)


def pytest_ignore_collect(collection_path, config):
    """tests/sglang and tests/scale need optional installs (scripts/install_sglang.sh,
    scripts/install_scale.sh): the main suite leaves them out unless asked for by path
    (CI's own steps)."""
    path = Path(collection_path)
    for folder in (_SGLANG_TESTS, _SCALE_TESTS):
        if path == folder or folder in path.parents:
            asked = [Path(a.split("::")[0]).resolve() for a in config.args]
            if not any(a == folder or folder in a.parents for a in asked):
                return True
    return None


def _hf_config(family: str, **over):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    common.update(over)
    if family == "llama":
        return LlamaConfig(tie_word_embeddings=False, **common)
    if family == "llama3rope":
        return LlamaConfig(
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 50000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            **common,
        )
    if family == "qwen2":
        return Qwen2Config(tie_word_embeddings=True, **common)
    if family == "qwen3":
        return Qwen3Config(tie_word_embeddings=False, head_dim=32, **common)
    raise ValueError(family)


def save_random_checkpoint(family: str, folder: Path, seed: int = 0, **over) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_hf_config(family, **over), torch_dtype=torch.float32)
    model.eval()
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {f: save_random_checkpoint(f, root / f, seed=i) for i, f in enumerate(["llama", "llama3rope", "qwen2", "qwen3"])}


def hf_greedy(folder: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    model = _hf_model(folder)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


_HF_CACHE: dict[str, object] = {}


def _hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    key = str(folder)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    return _HF_CACHE[key]


def random_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_kv_free(engine: Engine) -> None:
    alloc = engine.stack.allocator
    assert alloc.is_fully_free(), f"KV leak: {alloc.used_pages} pages still in use"


@pytest.fixture
def tiny_engine():
    """Factory for engines over the built-in tiny model; checks KV is free after use."""
    made: list[Engine] = []

    def make(**kw) -> Engine:
        kw.setdefault("loop", "normal")
        eng = Engine.from_pretrained("tiny", **kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        assert_kv_free(eng)


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true", default=False,
                     help="run the fuzz and fault-injection tests far longer (many more generated cases)")


@pytest.fixture
def soak(request) -> bool:
    return bool(request.config.getoption("--soak"))


@pytest.fixture
def one_intra_op_thread():
    """Torch on one intra-op thread for tests that run thousands of tiny steps while the
    loop thread processes the one before: with torch's default team (one OpenMP thread per
    core) beside the loop thread, a loaded 2-core machine made each step wait on spinning
    OpenMP barriers, and the same 753 steps took 1 to 75 s (tokens equal; 1-4 s with one
    thread or a passive wait policy, docs/host-path.md). Such tests check tokens and
    terminals, not threading."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def llguidance(monkeypatch):
    """Pin the grammar library to llguidance (``OMNI_ASYNC_GRAMMAR_BACKEND``): for tests of
    its own behaviour (forced runs from ``compute_ff_tokens``, jump-forward over them, the
    mask worker's counters and slices, its error messages), which xgrammar, the default
    where installed, does not share."""
    monkeypatch.setenv("OMNI_ASYNC_GRAMMAR_BACKEND", "llguidance")


def load_script(relative: str, name: str) -> ModuleType:
    """A script of the repository (``bench/constrained.py``, ``tools/gpu_gaps.py``) loaded as
    a module under ``name``, its own folder importable while it loads (its sibling helpers)."""
    path = Path(__file__).resolve().parent.parent / relative
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(path.parent))

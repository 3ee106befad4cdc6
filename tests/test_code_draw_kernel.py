"""The code predictor's draw kernel (what CUDA runs for sampled frames) against the torch
path of :func:`omni_async.speech.sampling.draw_codes`: the same draws for the same seeds
and indices under temperature, top-k (both the capped and the whole-vocabulary widths)
and top-p (the same code, or one of equal logit where the draw lands among ties), greedy
rows the first maximum. On the CPU through
Triton's interpreter in a process of its own; on CUDA directly."""

from __future__ import annotations

import pytest
import torch

from .triton_interpreter import interpreted_result, interpreter_only, needs_triton

COMPARE = r'''
import torch
from omni_async.kernels.code_draw import draw_codes_kernel
from omni_async.speech.sampling import PredictorSampling, draw_codes


def settings(b, device, gen):
    temperature = torch.rand(b, generator=gen) * 1.5
    temperature[::5] = 0.0  # greedy rows beside sampled ones
    top_k = torch.randint(0, 80, (b,), generator=gen)
    top_p = torch.where(torch.rand(b, generator=gen) < 0.5, torch.rand(b, generator=gen) * 0.9 + 0.05, torch.ones(b))
    seeds = torch.randint(0, 2**62, (b,), generator=gen)
    base = torch.randint(0, 10**6, (b,), generator=gen) * 16
    return [t.to(device) for t in (temperature, top_k, top_p, seeds, base)]


def compare(device, dtype, rows=48, vocab=2048, trials=6):
    gen = torch.Generator().manual_seed(7)
    same = total = 0
    for trial in range(trials):
        logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
        logits[0, :] = 1.0  # a row of ties: greedy takes index 0, draws stay in the row
        logits = logits.to(device)
        t, k, p, seeds, base = settings(rows, device, gen)
        cap = 64 if trial % 2 else 0  # the captured variants: top-k over a cap, or the whole row
        if cap:
            k = torch.where((k > 0) & (k <= cap), k, torch.full_like(k, cap))
        s = PredictorSampling(t, k, p, seeds, True, cap)
        group = 1 + trial
        ref = draw_codes(logits.float().cpu(), PredictorSampling(*(x.cpu() for x in (t, k, p, seeds)), True, cap), base.cpu(), group)
        got = draw_codes_kernel(logits, t, k, p, seeds, base, group, top_k_cap=cap).cpu()
        greedy = (t == 0).cpu()
        assert torch.equal(got[greedy], logits.float().cpu().argmax(-1)[greedy]), "greedy rows"
        kept = k.cpu().clamp(min=0)
        for r in range(rows):  # every draw within the row's top-k
            if not greedy[r] and 0 < kept[r] < vocab:
                kth = logits[r].float().cpu().topk(int(kept[r])).values[-1]
                assert logits[r, got[r]].float().cpu() >= kth, (r, int(kept[r]))
        # Ties (frequent in bfloat16) are ordered by index here and arbitrarily by torch's
        # sort: a draw that lands in a group of equal logits may name another member of it.
        values = logits.float().cpu()
        rows_idx = torch.arange(rows)
        same += int((values[rows_idx, got] == values[rows_idx, ref]).sum())
        total += rows
    return same, total
'''

@needs_triton
@interpreter_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # 64-bit keys, 32-bit keys
def test_kernel_codes_equal_the_torch_path_in_the_interpreter(dtype):
    script = COMPARE + f"\nsame, total = compare('cpu', torch.{dtype}, rows=12, trials=2)\nprint('RESULT', same, total)\n"
    same, total = map(int, interpreted_result(script).split())
    assert same >= total - 1, (same, total)  # at most one draw on a rounding boundary


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_codes_equal_the_torch_path(dtype):
    namespace: dict = {}
    exec(compile(COMPARE, "code_draw_compare", "exec"), namespace)
    same, total = namespace["compare"]("cuda", dtype)
    assert same >= total - 2, (same, total)

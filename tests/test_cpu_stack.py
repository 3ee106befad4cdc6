"""A CPU decode step's layer stack in one C++ call (omni_async/kernels/cpu_stack.py)
computes exactly what the per-op path computes: the same hidden states bit for bit, so
the same greedy tokens, in every loop; it is what decode steps run where it applies
(block weights, the C++ kernels on), follows a weight update, and leaves everything
else on the per-op path."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omni_async import Engine, SamplingParams
from tests.conftest import LOOPS, assert_kv_free

PROMPTS = [[5, 6, 7], list(range(3, 60)), [9] * 20, [3 + i % 200 for i in range(300)]]
KERNELS = dict(cpu_attention_kernel=True, cpu_fused_ops=True)


class Counted:
    """The model's stack, counting its calls."""

    def __init__(self, stack) -> None:
        self.stack, self.calls = stack, 0

    def __call__(self, *args):
        self.calls += 1
        return self.stack(*args)


async def _run(engine: Engine, stack: bool, tokens: int = 10):
    model = engine.stack.runner.model
    counted = None
    if stack:
        assert model.cpu_stack is not None  # on wherever it applies
        if isinstance(model.cpu_stack, Counted):
            model.cpu_stack = model.cpu_stack.stack
        counted = model.cpu_stack = Counted(model.cpu_stack)
    else:
        model.cpu_stack = None  # the per-op path
    sp = SamplingParams(max_new_tokens=tokens, ignore_eos=True, return_hidden_states=True)
    out = await asyncio.gather(*(engine.generate(input_ids=p, sampling=sp) for p in PROMPTS))
    one = await engine.generate(input_ids=PROMPTS[0], sampling=sp)  # batch 1
    return [r.output_ids for r in out + [one]], [r.hidden_states for r in out + [one]], counted


@pytest.mark.parametrize("mode,loops", [("q4", LOOPS), ("q8", ["normal"])])
async def test_the_stack_computes_the_per_op_paths_bits_in_every_loop(mode, loops):
    results = {}
    for loop in loops:
        for stack in (False, True):
            engine = Engine.from_pretrained("tiny", loop=loop, quantization=mode, kv_capacity_tokens=4096, **KERNELS)
            async with engine:
                ids, hidden, counted = await _run(engine, stack)
            assert_kv_free(engine)
            if stack:
                assert counted.calls >= 9  # every decode forward went through it
            results[loop, stack] = ids, hidden
    ref_ids, ref_hidden = results["normal", False]
    for (loop, stack), (ids, hidden) in results.items():
        assert ids == ref_ids, (loop, stack)
        for a, b in zip(hidden, ref_hidden):
            assert torch.equal(a, b), (loop, stack)


async def test_a_weight_update_reaches_the_stack(hf_checkpoints, tmp_path):
    """After update_weights_from_disk the stack reads the new blocks: its tokens are the
    per-op path's on the new weights (a stack holding the old blocks would answer as before)."""
    from tests.conftest import save_random_checkpoint

    other = save_random_checkpoint("llama", tmp_path / "other", seed=11)
    runs = []
    for stack in (False, True):
        engine = Engine.from_pretrained(str(hf_checkpoints["llama"]), loop="normal", quantization="q4", kv_capacity_tokens=4096, **KERNELS)
        async with engine:
            before, _, _ = await _run(engine, stack)
            assert (await engine.update_weights_from_disk(str(other)))["success"]
            after, _, counted = await _run(engine, stack)
            if stack:
                assert counted.calls >= 9 and not isinstance(counted.stack, Counted)  # a new stack, built for the new blocks
        runs.append((before, after))
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]


async def test_float_weights_and_qwen3_keep_the_per_op_path(hf_checkpoints):
    engine = Engine.from_pretrained("tiny", loop="normal", dtype="bfloat16", kv_capacity_tokens=1024, **KERNELS)
    async with engine:
        assert engine.stack.runner.model.cpu_stack is None
    engine = Engine.from_pretrained(str(hf_checkpoints["qwen3"]), loop="normal", quantization="q4", kv_capacity_tokens=1024, **KERNELS)
    async with engine:
        assert engine.stack.runner.model.cpu_stack is None  # per-head q/k norms
        out = await engine.generate(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(out.output_ids) == 4


def _random_stack(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, inter: int = 96):
    """A small DecodeStack on random q4 weights, and the shapes its inputs take."""
    from omni_async.kernels import cpu_quant
    from omni_async.kernels.cpu_kernels import load

    g = torch.Generator().manual_seed(1)
    shapes = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden), (hidden, inter)]
    entries = []
    for _ in range(layers):
        entry = [1 + 0.1 * torch.randn(hidden, generator=g), 1 + 0.1 * torch.randn(hidden, generator=g)]
        for n, k in shapes:
            b = cpu_quant.quantize(torch.randn(n, k, generator=g) * 0.1, "q4")
            entry += [b.codes, b.scale, b.minimum, b.bias]
        entries.append(entry)
    stack = load().DecodeStack(entries, 1 + 0.1 * torch.randn(hidden, generator=g), 1e-5, heads, kv_heads, head_dim, head_dim**-0.5)
    return stack, dict(layers=layers, hidden=hidden, kv_heads=kv_heads, head_dim=head_dim)


def test_rows_split_across_threads_give_the_bits_of_one_row_at_a_time():
    """With the row split on, from rows_per_thread rows per thread up each thread takes
    whole rows through the stack (one parallel region a step); otherwise every GEMM and
    attention is split by columns and heads. A row's hidden state must be the same bits
    either way."""
    stack, s = _random_stack()
    stack.set_rows_per_thread(4)
    g = torch.Generator().manual_seed(2)
    rows, page, pages_per_row = 17, 16, 4
    slots = rows * pages_per_row * page
    k = [torch.randn(slots, s["kv_heads"], s["head_dim"], generator=g) for _ in range(s["layers"])]
    v = [torch.randn(slots, s["kv_heads"], s["head_dim"], generator=g) for _ in range(s["layers"])]
    pages = torch.randperm(rows * pages_per_row, generator=g).view(rows, pages_per_row)
    lens = torch.randint(1, pages_per_row * page, (rows,), generator=g)
    slot = pages.gather(1, ((lens - 1) // page)[:, None])[:, 0] * page + (lens - 1) % page
    x = torch.randn(rows, s["hidden"], generator=g)
    angles = torch.randn(rows, s["head_dim"], generator=g)
    cos, sin = angles.cos(), angles.sin()

    def forward(lo: int, hi: int) -> torch.Tensor:
        return stack.forward(x[lo:hi], cos[lo:hi], sin[lo:hi], k, v, pages[lo:hi], page, lens[lo:hi], slot[lo:hi])

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert rows >= 2 * stack.rows_per_thread()  # this call takes the row split
        together = forward(0, rows)
        stack.set_rows_per_thread(0)  # the same rows split by columns and heads instead
        by_columns = forward(0, rows)
        torch.set_num_threads(1)
        alone = torch.cat([forward(i, i + 1) for i in range(rows)])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together, alone)
    assert torch.equal(by_columns, alone)


def test_the_row_split_follows_its_environment_variable(monkeypatch):
    from omni_async.kernels.cpu_stack import ROW_SPLIT_ENV, apply_row_split

    stack, _ = _random_stack(layers=1)
    assert stack.rows_per_thread() == 0  # the extension's own default: off
    monkeypatch.setenv(ROW_SPLIT_ENV, "6")
    apply_row_split(stack)
    assert stack.rows_per_thread() == 6
    monkeypatch.setenv(ROW_SPLIT_ENV, "0")
    apply_row_split(stack)
    assert stack.rows_per_thread() == 0


def test_the_row_split_is_on_by_default_at_two_threads_only(monkeypatch):
    from omni_async.kernels.cpu_stack import ROW_SPLIT_ENV, row_split_rows

    monkeypatch.delenv(ROW_SPLIT_ENV, raising=False)
    assert row_split_rows(2) == 4
    assert row_split_rows(1) == 4  # (a single thread never splits: the extension checks the threads)
    assert row_split_rows(8) == 0

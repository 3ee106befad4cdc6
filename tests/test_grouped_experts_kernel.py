"""The grouped-expert Triton kernel (what a MoE layer runs on CUDA) against the torch
expert path: on the CPU through Triton's interpreter in a process of its own; on CUDA,
compiled, in bfloat16, inside a CUDA graph replayed with new routing, and greedy tokens
of a Qwen3-MoE checkpoint on CUDA (float32, graphs on) equal to the CPU's."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("triton")

from .triton_interpreter import run_interpreted  # noqa: E402

# Shared by the interpreter script and the CUDA tests.
CASES = r"""
import torch
from omni_async.kernels.grouped_experts import grouped_experts, sort_by_expert
from omni_async.kernels.reference import ReferenceOps
from omni_async.models.moe import experts_torch, route

# (tokens, hidden, expert channels, experts, top_k, rows per block or None)
SHAPES = (
    (1, 64, 32, 8, 2, None),        # one decode row
    (7, 96, 48, 16, 4, None),       # widths that end mid-tile
    (40, 64, 80, 8, 2, 16),         # experts holding several blocks each
    (3, 32, 16, 64, 8, None),       # more experts than pairs: most never hit
    (50, 64, 32, 4, 2, 32),         # a larger block
    (0, 64, 32, 8, 2, None),        # no rows
)


def make_case(t, h, inter, e, k, gen, device="cpu", dtype=torch.float32):
    x = torch.randn(t, h, generator=gen).to(device, dtype)
    gate_up = (torch.randn(e, 2 * inter, h, generator=gen) / h ** 0.5).to(device, dtype)
    down = (torch.randn(e, h, inter, generator=gen) / inter ** 0.5).to(device, dtype)
    weights, ids = route(torch.randn(t, e, generator=gen).to(device, dtype), k, True)
    return x, gate_up, down, ids, weights


def check_sorting(ids, num_experts, block_m):
    # Every pair appears once, in a block of its own expert; padding only at block tails.
    blocks = sort_by_expert(ids, num_experts, block_m)
    pairs = blocks.pairs.view(-1, blocks.block_m).cpu()
    owner = blocks.block_expert.cpu()
    flat = ids.reshape(-1).cpu()
    seen = []
    for b in range(pairs.shape[0]):
        real = pairs[b][pairs[b] < blocks.num_pairs]
        if owner[b] < 0:
            assert real.numel() == 0
            continue
        assert (flat[real.long()] == owner[b]).all()
        seen += real.tolist()
    assert sorted(seen) == list(range(flat.numel()))
"""

SCRIPT = CASES + r"""
gen = torch.Generator().manual_seed(0)
checked = 0
for t, h, inter, e, k, bm in SHAPES:
    x, gate_up, down, ids, weights = make_case(t, h, inter, e, k, gen)
    if t:
        check_sorting(ids, e, bm or 16)
    want = experts_torch(x, gate_up, down, ids, weights, ReferenceOps())
    got = grouped_experts(x, gate_up, down, ids, weights, block_m=bm)
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got - want).abs().max().item() if t else 0.0
    assert err < 1e-4, (t, h, inter, e, k, err)
    if t == 7:
        # Half precision (the interpreter's dot of bfloat16 operands is unreliable;
        # bfloat16 is checked on CUDA).
        got = grouped_experts(x.half(), gate_up.half(), down.half(), ids, weights.half())
        assert got.dtype == torch.float16
        rel = ((got.float() - want).norm() / want.norm()).item()
        assert rel < 1e-2, ("fp16", rel)
    checked += 1
print("ok", checked)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernel's tests below run instead")
def test_grouped_experts_equal_the_torch_path_in_the_interpreter():
    done = run_interpreted(SCRIPT, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().startswith("ok"), done.stderr[-3000:]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel needs a GPU")


def _cases() -> dict:
    scope: dict = {}
    exec(CASES, scope)
    return scope


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_experts_equal_the_torch_path_on_cuda(dtype):
    from omni_async.kernels.grouped_experts import grouped_experts
    from omni_async.kernels.reference import ReferenceOps
    from omni_async.models.moe import experts_torch

    scope = _cases()
    gen = torch.Generator().manual_seed(1)
    shapes = [*scope["SHAPES"], (256, 2048, 768, 128, 8, None), (3000, 512, 256, 64, 8, None)]
    for t, h, inter, e, k, bm in shapes:
        x, gate_up, down, ids, weights = scope["make_case"](t, h, inter, e, k, gen, "cuda", dtype)
        if t:
            scope["check_sorting"](ids, e, bm or 16)
        want = experts_torch(x.float(), gate_up.float(), down.float(), ids, weights.float(), ReferenceOps())
        got = grouped_experts(x, gate_up, down, ids, weights, block_m=bm).float()
        if t:
            rel = ((got - want).norm() / want.norm()).item()
            assert rel < (2e-2 if dtype == torch.bfloat16 else 1e-4), (t, h, e, k, rel)


@needs_cuda
def test_a_graph_of_the_kernel_replays_new_routing():
    """Captured once at a batch size, replayed with other tokens routed to other experts:
    the sort runs on the device, so the graph follows the routing."""
    from omni_async.kernels.grouped_experts import grouped_experts
    from omni_async.kernels.reference import ReferenceOps
    from omni_async.models.moe import experts_torch, route

    scope = _cases()
    gen = torch.Generator().manual_seed(2)
    x, gate_up, down, ids, weights = scope["make_case"](24, 256, 128, 32, 4, gen, "cuda", torch.float32)
    static_x, static_ids, static_w = x.clone(), ids.clone(), weights.clone()
    grouped_experts(static_x, gate_up, down, static_ids, static_w)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_experts(static_x, gate_up, down, static_ids, static_w)
    for seed in range(3):
        g = torch.Generator().manual_seed(100 + seed)
        new_x = torch.randn(24, 256, generator=g).cuda()
        new_w, new_ids = route(torch.randn(24, 32, generator=g).cuda() * 4, 4, True)
        static_x.copy_(new_x)
        static_ids.copy_(new_ids)
        static_w.copy_(new_w)
        graph.replay()
        want = experts_torch(new_x, gate_up, down, new_ids, new_w, ReferenceOps())
        assert ((out - want).norm() / want.norm()).item() < 1e-4


@needs_cuda
def test_moe_greedy_on_cuda_equals_the_cpu(tmp_path):
    """Float32 on CUDA with graphs (the grouped kernel inside them) against the CPU's
    torch path, in every loop."""
    from omni_async import Engine, SamplingParams

    from .conftest import LOOPS, assert_kv_free, random_prompts
    from .test_moe import save_moe_checkpoint

    folder = save_moe_checkpoint(tmp_path / "moe", seed=0, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                                 mlp_only_layers=[1], decoder_sparse_step=1)
    prompts = random_prompts(8, 512, 3, 60, seed=4)

    async def run(device: str, loop: str) -> list[list[int]]:
        async with Engine.from_pretrained(str(folder), device=device, dtype="float32", loop=loop) as engine:
            results = await asyncio.gather(*[engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=20)) for p in prompts])
        assert_kv_free(engine)
        return [r.output_ids for r in results]

    want = asyncio.run(run("cpu", "normal"))
    for loop in LOOPS:
        assert asyncio.run(run("cuda", loop)) == want, loop


@needs_cuda
@pytest.mark.parametrize("tiles", [((128, 128, 4, 3), (128, 128, 4, 3)), ((64, 128, 4, 4), (128, 64, 8, 3))])
def test_other_launch_settings_give_the_same_sum(tiles, monkeypatch):
    """The tile settings a benchmark sweeps (``GATE_UP_TILE`` / ``DOWN_TILE``) change how
    the GEMMs are cut, not what they compute: the 30B-A3B expert shape (32 of its experts) at decode and prefill row
    counts against the torch path."""
    from omni_async.kernels import grouped_experts as module
    from omni_async.kernels.reference import ReferenceOps
    from omni_async.models.moe import experts_torch

    monkeypatch.setattr(module, "GATE_UP_TILE", tiles[0])
    monkeypatch.setattr(module, "DOWN_TILE", tiles[1])
    scope = _cases()
    gen = torch.Generator().manual_seed(2)
    for t in (5, 160, 3000):
        x, gate_up, down, ids, weights = scope["make_case"](t, 2048, 768, 32, 8, gen, "cuda", torch.bfloat16)
        want = experts_torch(x.float(), gate_up.float(), down.float(), ids, weights.float(), ReferenceOps())
        got = module.grouped_experts(x, gate_up, down, ids, weights).float()
        assert ((got - want).norm() / want.norm()).item() < 2e-2, (t, tiles)

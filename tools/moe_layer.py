"""A Qwen3-MoE sparse block at decode and prefill row counts on CUDA: the grouped-expert
Triton kernel (:mod:`omni_async.kernels.grouped_experts`) in a CUDA graph and eagerly,
against the torch expert path (one GEMM pair per expert hit, host syncs), with the bytes
of expert weights each call must read and the rate it read them at.

Why: a decode step of a MoE model is bound by reading the experts its rows hit (Qwen3-30B-
A3B: 128 experts of 2048 x 768, 8 per token; at 64 rows most of the 128 are hit), and the
issue's goal is NV256 at >= 70% of the bandwidth limit of the active parameters. This
says how close one layer gets, per row count, and what the graph saves over eager launch.

Each variant walks ``--layers`` blocks with their own weights (one block of the 30B-A3B
shape is 1.2 GB in bf16, far past L2), routing random rows through a random router (about
uniform over the experts). Timed with CUDA events over replays; the median of
``--repeats`` is quoted. ``read_GBps``: the distinct experts hit per layer times their
bytes (gate, up, down), over the time a layer took.

    python tools/moe_layer.py --out bench/results/moe_layer_h100.json
        # the 30B-A3B shape, bf16, rows 1..4096; about a minute on an H100 (Triton compiles)
    python tools/moe_layer.py --smoke      # CPU, Triton's interpreter, tiny shapes
    python tools/moe_layer.py --rows 64,160,256 --tiles 64x64w4s3,64x128w4s4,128x128w4s3/64x128w4s3
        # the graphed kernel under each launch setting (``GATE_UP_TILE`` / ``DOWN_TILE`` of
        # omni_async.kernels.grouped_experts: BLOCK_N x BLOCK_K, warps, stages; one spec for
        # both GEMMs or ``gate_up/down``), interleaved with the default's
    python tools/moe_layer.py --rows 64,160,1024,4096 --grouped-mm
        # also torch's grouped GEMM over the sorted pairs (``EXPERT_PATH = "grouped_mm"``)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter is chosen when Triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # _common
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's omni_async

from _common import machine_facts, save_json  # noqa: E402
from graph_timer import graph_timer  # noqa: E402

from omni_async.kernels import grouped_experts as grouped_module  # noqa: E402
from omni_async.kernels.grouped_experts import grouped_experts  # noqa: E402
from omni_async.kernels.reference import ReferenceOps  # noqa: E402
from omni_async.models.config import ModelConfig, MoeConfig  # noqa: E402
from omni_async.models.moe import SparseMoeBlock, experts_grouped_mm, experts_torch, route  # noqa: E402


def block_config(hidden: int, inter: int, experts: int, top_k: int) -> ModelConfig:
    moe = MoeConfig(num_experts=experts, top_k=top_k, intermediate_size=inter, norm_topk_prob=True)
    return ModelConfig(family="qwen3_moe", vocab_size=1, hidden_size=hidden, intermediate_size=inter, num_layers=1,
                       num_heads=1, num_kv_heads=1, head_dim=hidden, moe=moe)


def make_blocks(cfg: ModelConfig, layers: int, device: str, dtype: torch.dtype) -> list[SparseMoeBlock]:
    blocks = []
    for i in range(layers):
        gen = torch.Generator(device=device).manual_seed(i)
        with torch.device("meta"):  # allocated once, on the device, in its dtype
            block = SparseMoeBlock(cfg)
        block = block.to(dtype).to_empty(device=device)
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32).to(dtype) / p.shape[-1] ** 0.5)
        blocks.append(block)
    return blocks


def distinct_experts(blocks: list[SparseMoeBlock], x: torch.Tensor) -> float:
    """Experts hit per layer, averaged: what a call must read."""
    hit = []
    for block in blocks:
        _, ids = route(block.gate(x), block.top_k, block.norm_topk_prob)
        hit.append(torch.unique(ids).numel())
    return sum(hit) / len(hit)


def parse_tile(spec: str) -> tuple[int, int, int, int]:
    """``64x128w4s3`` -> (BLOCK_N 64, BLOCK_K 128, 4 warps, 3 stages)."""
    cols, rest = spec.split("x")
    depth, rest = rest.split("w")
    warps, stages = rest.split("s")
    return int(cols), int(depth), int(warps), int(stages)


def parse_tiles(spec: str) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """``A`` (both GEMMs) or ``A/B`` (gate/up, down)."""
    parts = spec.split("/")
    return parse_tile(parts[0]), parse_tile(parts[-1])


def timer_of(fn, device: str, graph: bool):
    if graph:
        return graph_timer(fn, device)[0]
    fn()

    def timed(replays: int) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(replays):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3
    return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768, help="each expert's intermediate channels")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rows", default="1,8,32,64,128,256,1024,4096")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--torch-max-rows", type=int, default=1024, help="skip the torch path above this many rows")
    ap.add_argument("--tiles", default="", help="launch settings to time the graphed kernel under, comma-separated (see above)")
    ap.add_argument("--grouped-mm", action="store_true", help="also torch's grouped GEMM path (experts_grouped_mm) in a graph")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    args = ap.parse_args()
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    if args.smoke:
        args.hidden, args.inter, args.experts, args.top_k, args.layers = 64, 32, 8, 2, 2
        args.rows, args.replays, args.repeats = "1,5", 1, 1
    cfg = block_config(args.hidden, args.inter, args.experts, args.top_k)
    blocks = make_blocks(cfg, args.layers, device, dtype)
    expert_bytes = 3 * args.hidden * args.inter * torch.finfo(dtype).bits // 8
    ops = ReferenceOps()
    rows_out = []
    for m in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(m, args.hidden, device=device, dtype=torch.float32).to(dtype)
        hit = distinct_experts(blocks, x)

        def grouped() -> torch.Tensor:
            out = x
            for block in blocks:
                weights, ids = route(block.gate(out), block.top_k, block.norm_topk_prob)
                out = grouped_experts(out, block.experts.gate_up_proj, block.experts.down_proj, ids, weights)
            return out

        def torch_path() -> torch.Tensor:
            out = x
            for block in blocks:
                weights, ids = route(block.gate(out), block.top_k, block.norm_topk_prob)
                out = experts_torch(out, block.experts.gate_up_proj, block.experts.down_proj, ids, weights, ops)
            return out

        def grouped_mm() -> torch.Tensor:  # torch's grouped GEMM (EXPERT_PATH = "grouped_mm")
            out = x
            for block in blocks:
                weights, ids = route(block.gate(out), block.top_k, block.norm_topk_prob)
                out = experts_grouped_mm(out, block.experts.gate_up_proj, block.experts.down_proj, ids, weights, ops)
            return out

        variants = {"grouped_graph": (grouped, device == "cuda"), "grouped_eager": (grouped, False)}
        if args.grouped_mm:
            variants["grouped_mm_graph"] = (grouped_mm, device == "cuda")
        if m <= args.torch_max_rows:
            variants["torch_eager"] = (torch_path, False)
        timers = {name: timer_of(fn, device, graph) for name, (fn, graph) in variants.items()}
        default_tiles = (grouped_module.GATE_UP_TILE, grouped_module.DOWN_TILE)
        reference = grouped().float()
        diffs: dict[str, float] = {}
        if args.grouped_mm:
            row_mm_diff = round(((grouped_mm().float() - reference).abs().max() / reference.abs().max()).item(), 6)
        for spec in filter(None, args.tiles.split(",")):
            grouped_module.GATE_UP_TILE, grouped_module.DOWN_TILE = parse_tiles(spec)
            try:  # a graph keeps the settings it was captured with
                timers[f"tiles_{spec}_graph"] = timer_of(grouped, device, device == "cuda")
                diffs[spec] = round(((grouped().float() - reference).abs().max() / reference.abs().max()).item(), 6)
            except Exception as exc:  # a setting the compiler refuses (shared memory) is reported, not fatal
                print(f"tiles {spec}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            finally:
                grouped_module.GATE_UP_TILE, grouped_module.DOWN_TILE = default_tiles
        samples: dict[str, list[float]] = {name: [] for name in timers}
        for _ in range(args.repeats):  # interleaved, so drift hits every variant alike
            for name, timed in timers.items():
                samples[name].append(timed(args.replays) / args.replays / args.layers)
        row = {"rows": m, "experts_hit": hit, "expert_MB": hit * expert_bytes / 1e6}
        for name, ms in samples.items():
            med = statistics.median(ms)
            row[f"{name}_us"] = round(med * 1e3, 1)
            row[f"{name}_read_GBps"] = round(hit * expert_bytes / (med * 1e-3) / 1e9, 1)
        if args.grouped_mm:
            row["grouped_mm_max_abs_diff"] = row_mm_diff
        if diffs:
            row["tiles_max_abs_diff"] = diffs
            timed_tiles = {spec: row[f"tiles_{spec}_graph_us"] for spec in diffs}
            row["best_tiles"] = min(timed_tiles, key=timed_tiles.get)
            gate_up, down = parse_tiles(row["best_tiles"])  # as tools/with_knobs.py takes them
            row["best_tiles_with_knobs"] = " ".join(
                f"--set omni_async.kernels.grouped_experts.{name}={','.join(map(str, tile))}"
                for name, tile in (("GATE_UP_TILE", gate_up), ("DOWN_TILE", down)))
        rows_out.append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    payload = {"tool": "moe_layer", "machine": machine_facts(), "args": vars(args), "rows": rows_out}
    if args.out:
        print("saved", save_json(args.out, payload))


if __name__ == "__main__":
    main()

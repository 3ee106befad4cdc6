"""The kernels of one decode step, by name: how many a step launches, how many per layer,
and their device time (issue 60: a decode layer in few kernels). Run on the CUDA machine.

A decoder of the given shape with random weights (no checkpoint: built in place on the
device), a paged KV cache holding each row's context, then ``--steps`` eager decode
steps of the model's forward under ``torch.profiler`` (CUDA activity). Every kernel the
device ran is counted by name, and counted again in the same step through the first layer
alone: the difference is the layers' share, the rest the step's own (embedding, rotary
table, final norm, head). The ops
between the GEMMs are the fused Triton ones or the torch reference (``--ops``), so one
call prints the before and the after side by side.

    python tools/decode_kernels.py --shape qwen05 --batch 1,64,256 [--ops triton,reference]
        [--context 512 | --context 100:1100] [--steps 5] [--out $OUT/decode_kernels.json]
        [--code /path/to/main]   # another checkout's omni_async (the before)

Prints, per (ops, batch): a table of kernel name, launches per step, per layer, and
microseconds per step; then the totals (kernels per step, per layer). ``--smoke`` runs a
tiny shape on the CPU (torch ops instead of kernels; checks the script runs).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import defaultdict
from pathlib import Path

import torch


def _checkout_first() -> None:
    """``--code PATH`` (a checkout to measure, e.g. main for the before) or this one,
    first on the path, before anything imports omni_async."""
    code = Path(__file__).resolve().parents[1]
    if "--code" in sys.argv:
        code = Path(sys.argv[sys.argv.index("--code") + 1]).resolve()
    sys.path.insert(0, str(code))


_checkout_first()

from omni_async.kernels import model_ops, triton_available  # noqa: E402
from omni_async.kv.attention import AttentionContext  # noqa: E402
from omni_async.kv.cache import PagedKVCache  # noqa: E402
from omni_async.models.config import ModelConfig  # noqa: E402
from omni_async.models.decoder import DecoderModel, rope_inv_freq  # noqa: E402

# Model shapes (ModelConfig fields): Qwen2-0.5B (NV256's), Qwen3-0.6B (per-head q/k
# norms), Llama-3-8B; and a tiny one for the CPU smoke run.
SHAPES = {
    "qwen05": dict(family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                   num_kv_heads=2, head_dim=64, qkv_bias=True, tie_word_embeddings=True, rope_theta=1e6),
    "qwen3-06b": dict(family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                      num_kv_heads=8, head_dim=128, qk_norm=True, tie_word_embeddings=True, rope_theta=1e6),
    "llama8b": dict(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                    num_kv_heads=8, head_dim=128, rope_theta=5e5),
    "smoke": dict(family="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, qk_norm=True, tie_word_embeddings=True),
}
PAGE_SIZE = 16


def build_model(shape: str, device: torch.device, dtype: torch.dtype) -> DecoderModel:
    """Random weights of a realistic scale (std 0.02, norms 1), made on the device."""
    cfg = ModelConfig(max_position_embeddings=1 << 17, **SHAPES[shape])
    with torch.device("meta"):
        model = DecoderModel(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * 0.02)
        model.inv_freq = rope_inv_freq(cfg).to(device)
    return model.eval()


def decode_inputs(model: DecoderModel, batch: int, lens: list[int], device: torch.device):
    """A KV cache holding ``lens[i]`` positions of row ``i`` (random values) and the
    step's inputs: each row's next token at position ``lens[i]``."""
    cfg = model.config
    pages_per_row = [(n + 1 + PAGE_SIZE - 1) // PAGE_SIZE for n in lens]
    kv = PagedKVCache(num_layers=cfg.num_layers, num_pages=sum(pages_per_row) + 1, page_size=PAGE_SIZE,
                      num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=next(model.parameters()).dtype, device=device)
    for t in kv.k + kv.v:
        t.normal_()
    width = max(pages_per_row)
    tables = torch.zeros(batch, width, dtype=torch.long)
    first = 0
    for row, pages in enumerate(pages_per_row):
        tables[row, :pages] = torch.arange(first, first + pages)
        first += pages
    positions = torch.tensor(lens, dtype=torch.long)
    slots = tables[torch.arange(batch), positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
    ctx = AttentionContext(
        is_decode=True, slot_mapping=slots.to(device), logits_rows=torch.arange(batch, device=device),
        kv_lens=(positions + 1).to(device), block_tables=tables.to(device), page_size=PAGE_SIZE,
        use_kernel=device.type == "cuda",
    )
    ids = torch.randint(0, cfg.vocab_size, (batch,), device=device)
    return ids, positions.to(device), kv, ctx


def profile_steps(model: DecoderModel, inputs: tuple, steps: int, device: torch.device) -> tuple[dict, dict]:
    """Launch counts and device microseconds per kernel name over ``steps`` decode steps
    (on the CPU: the step's top-level torch ops and their CPU time)."""
    ids, positions, kv, ctx = inputs
    with torch.inference_mode():
        for _ in range(3):  # compile and warm outside the profile
            model(ids, positions, kv, ctx, float_logits=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        acts = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(steps):
                with torch.profiler.record_function("decode_step"):
                    model(ids, positions, kv, ctx, float_logits=False)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    counts: dict[str, int] = defaultdict(int)
    micros: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if device.type == "cuda":
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            counts[ev.name] += 1
            micros[ev.name] += ev.device_time
        elif ev.cpu_parent is not None and ev.cpu_parent.name == "decode_step":
            counts[ev.name] += 1
            micros[ev.name] += ev.cpu_time_total
    return counts, micros


def kernel_table(model: DecoderModel, batch: int, lens: list[int], steps: int, device: torch.device) -> dict:
    """The step's kernels by name, each with its launches per step and per layer. Per
    layer is measured, not guessed: the same step is profiled again through the first
    layer alone, and a name's launches per layer are the difference over the layers
    removed (the head's GEMM and a layer's may share a kernel name)."""
    inputs = decode_inputs(model, batch, lens, device)
    counts, micros = profile_steps(model, inputs, steps, device)
    layers = model.model.layers
    n_layers = len(layers)
    one = counts
    if n_layers > 1:
        model.model.layers = torch.nn.ModuleList(list(layers)[:1])
        try:
            one, _ = profile_steps(model, inputs, steps, device)
        finally:
            model.model.layers = layers
    rows = []
    for name in sorted(set(counts) | set(one), key=lambda n: -micros.get(n, 0.0)):
        per_step = counts.get(name, 0) / steps
        per_layer = (counts.get(name, 0) - one.get(name, 0)) / steps / max(1, n_layers - 1) if n_layers > 1 else per_step
        rows.append({"name": name, "per_step": per_step, "per_layer": per_layer, "us_per_step": micros.get(name, 0.0) / steps})
    per_step = sum(r["per_step"] for r in rows)
    per_layer = sum(r["per_layer"] for r in rows)
    return {"batch": batch, "kernels": rows, "kernels_per_step": per_step, "kernels_per_layer": per_layer,
            "step_kernels_outside_layers": per_step - per_layer * n_layers,
            "device_us_per_step": sum(r["us_per_step"] for r in rows)}


def print_table(ops: str, shape: str, result: dict) -> None:
    print(f"\n== {shape} ops={ops} batch={result['batch']}: {result['kernels_per_step']:.0f} kernels a step, "
          f"{result['kernels_per_layer']:.0f} a layer (+{result['step_kernels_outside_layers']:.0f} outside the layers), "
          f"{result['device_us_per_step']:.1f} us of kernels a step")
    print(f"{'per step':>9} {'per layer':>9} {'us/step':>9}  kernel")
    for r in result["kernels"]:
        layer = f"{r['per_layer']:g}"
        print(f"{r['per_step']:>9g} {layer:>9} {r['us_per_step']:>9.1f}  {r['name'][:110]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen05", choices=sorted(SHAPES))
    ap.add_argument("--batch", default="1,64,256", help="comma-separated batch sizes")
    ap.add_argument("--context", default="100:1100", help="each row's KV length: N, or LO:HI drawn per row (NV256-like)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--ops", default="triton,reference", help="the ops between the GEMMs: triton, reference (comma-separated)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None, help="also write the tables here (JSON)")
    ap.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU (reference ops)")
    ap.add_argument("--code", default=None, help="the checkout whose omni_async is measured (default: this one)")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    shape = "smoke" if args.smoke else args.shape
    dtype = torch.float32 if args.smoke else getattr(torch, args.dtype)
    ops_list = ["reference"] if args.smoke else args.ops.split(",")
    model = build_model(shape, device, dtype)
    rng = random.Random(0)
    lo, _, hi = args.context.partition(":")
    results = []
    for ops in ops_list:
        if ops == "triton" and not triton_available(device):
            raise SystemExit("--ops triton needs CUDA and Triton")
        model.ops = model_ops(triton=ops == "triton", cpu=False)
        for batch in (int(b) for b in args.batch.split(",")):
            lens = [int(lo) if not hi else rng.randint(int(lo), int(hi)) for _ in range(batch)]
            result = kernel_table(model, batch, lens, args.steps, device)
            result.update(ops=ops, shape=shape, context=args.context)
            print_table(ops, shape, result)
            results.append(result)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        Path(args.out).write_text(json.dumps({"device": device_name, "torch": torch.__version__,
                                              "omni_async": str(Path(sys.modules["omni_async"].__file__).parent),
                                              "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

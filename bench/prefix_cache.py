"""Prefix caching on and off, side by side (issue: prefix caching). Run on the CUDA machine.

Sections, each saved to the JSON as soon as it is done:
- ``shared``: 256 requests sharing a 1,024-token system prompt, each with 64-256
  tokens of its own, 64 new tokens, greedy, all submitted at once (Qwen2-0.5B shape,
  bf16, random weights). Per run: time to first token (p50/p90), total time, output
  tok/s, prompt tokens computed against prompt tokens served from the cache.
- ``reference``: the reference workload (256 requests, prompts 64-512 with no shared
  prefix, 128 new tokens): output tok/s with the cache on and off, to show that
  indexing and lookups cost nothing measurable when nothing is shared.

Repeats are interleaved (on, off, on, off, ...) and every figure is reported as the
median with the range. ``--smoke`` runs a tiny shape on the CPU to check the script.

    python bench/prefix_cache.py --out results.json [--repeats 3] [--loop overlap] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omni_async import Engine, SamplingParams  # noqa: E402

QWEN05 = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
              intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)
SMOKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=True)
RESULTS: dict = {"sections": {}}


def log(*a) -> None:
    print(*a, flush=True)


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else None


def make_checkpoint(folder: Path, shape: dict, device: str) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(0)
    cfg = Qwen2Config(bos_token_id=1, eos_token_id=None, pad_token_id=0, **shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model.save_pretrained(folder)
    return folder


def shared_workload(n: int, system_len: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(2, vocab) for _ in range(system_len)]
    return [system + [rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def plain_workload(n: int, lo: int, hi: int, vocab: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


async def run_once(args, path: Path, reqs: list[list[int]], new: int, cache: bool) -> dict:
    device = "cpu" if args.smoke else "cuda"
    eng = Engine.from_pretrained(
        str(path), device=device, loop=args.loop, dtype="bfloat16" if device == "cuda" else "float32",
        kv_capacity_tokens=args.kv_tokens, max_running_requests=256, max_prefill_tokens=8192,
        chunked_prefill_size=8192, max_queued_requests=8192, cuda_graph_max_len=2048, enable_prefix_cache=cache,
    )
    async with eng:
        await eng.generate(input_ids=[7] * 40, sampling=SamplingParams(max_new_tokens=4))  # warm-up
        assert (await eng.flush_cache())["success"]
        ttft: list[float] = []
        steps: list[float] = []
        eng.scheduler.add_step_observer(steps.append)
        gen2 = gc.get_stats()[2]["collections"]
        t0 = time.perf_counter()

        async def one(p: list[int]) -> tuple[int, int]:
            n, first = 0, None
            handle = await eng.submit(input_ids=p, sampling=SamplingParams(max_new_tokens=new, ignore_eos=True))
            async for d in handle:
                if first is None:
                    first = time.perf_counter() - t0
                n += len(d.token_ids)
            ttft.append(first or 0.0)
            return n, (await handle.result()).cached_tokens

        got = await asyncio.gather(*(one(p) for p in reqs))
        wall = time.perf_counter() - t0
        info = (await eng.model_info())["data"]
    prompt_tokens = sum(len(p) for p in reqs)
    cached = sum(c for _, c in got)
    return {
        "cache": cache, "wall_s": wall, "tok_s": sum(n for n, _ in got) / wall,
        "ttft_p50_ms": 1000 * pct(ttft, 50), "ttft_p90_ms": 1000 * pct(ttft, 90),
        "prompt_tokens": prompt_tokens, "cached_tokens": cached, "prefill_tokens_computed": prompt_tokens - cached,
        "prefix_cache_hit_rate": info.get("prefix_cache_hit_rate"),
        # Stall diagnostics: the longest step, steps over 50 ms, full GC passes meanwhile.
        "step_max_ms": 1000 * max(steps, default=0.0), "steps": len(steps),
        "steps_over_50ms": sum(1 for x in steps if x > 0.05), "gc_gen2": gc.get_stats()[2]["collections"] - gen2,
        "first_steps_ms": [round(1000 * x, 2) for x in steps[:12]],
    }


def summarise(runs: list[dict], keys: list[str]) -> dict:
    out = {}
    for cache in (True, False):
        rs = [r for r in runs if r["cache"] == cache]
        out["on" if cache else "off"] = {
            k: {"median": statistics.median(r[k] for r in rs), "min": min(r[k] for r in rs), "max": max(r[k] for r in rs)}
            for k in keys
        }
    return out


async def section(args, name: str, path: Path, reqs: list[list[int]], new: int, keys: list[str]) -> None:
    runs = []
    await run_once(args, path, reqs[: len(reqs) // 4], new, True)  # unmeasured: kernel compilation
    for rep in range(args.repeats):
        for cache in ((True, False) if rep % 2 == 0 else (False, True)):  # order alternates
            gc.collect()
            r = await run_once(args, path, reqs, new, cache)
            r["repeat"] = rep
            runs.append(r)
            extra = ("step_max_ms", "steps_over_50ms", "gc_gen2")
            log(f"{name} rep {rep} cache={'on ' if cache else 'off'}: " + "  ".join(f"{k}={r[k]:.4g}" for k in keys + list(extra)))
    summ = summarise(runs, keys)
    RESULTS["sections"][name] = {"runs": runs, "summary": summ, "num_requests": len(reqs), "new_tokens": new}
    Path(args.out).write_text(json.dumps(RESULTS, indent=2))
    on, off = summ["on"], summ["off"]
    log(f"== {name} (median, range; {args.repeats} interleaved repeats)")
    for k in keys:
        log(f"  {k:26s} on {on[k]['median']:10.4g} ({on[k]['min']:.4g}-{on[k]['max']:.4g})   "
            f"off {off[k]['median']:10.4g} ({off[k]['min']:.4g}-{off[k]['max']:.4g})   "
            f"off/on {off[k]['median'] / max(on[k]['median'], 1e-9):.2f}")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loop", default="overlap")
    ap.add_argument("--sections", default="shared,reference")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU, few requests")
    ap.add_argument("--workdir", default="/tmp/omni_prefix_bench")
    args = ap.parse_args()
    shape = SMOKE if args.smoke else QWEN05
    device = "cpu" if args.smoke else "cuda"
    args.kv_tokens = 1 << 16 if args.smoke else 1 << 20
    path = make_checkpoint(Path(args.workdir) / ("smoke" if args.smoke else "qwen05"), shape, device)
    RESULTS["machine"] = machine_facts(device)
    RESULTS["loop"] = args.loop
    n = 16 if args.smoke else 256
    vocab = shape["vocab_size"]
    sections = args.sections.split(",")
    if "shared" in sections:
        reqs = shared_workload(n, 256 if args.smoke else 1024, 16 if args.smoke else 64, 64 if args.smoke else 256, vocab)
        await section(args, "shared", path, reqs, 8 if args.smoke else 64,
                      ["ttft_p50_ms", "ttft_p90_ms", "wall_s", "tok_s", "prefill_tokens_computed", "cached_tokens"])
    if "reference" in sections:
        reqs = plain_workload(n, 16 if args.smoke else 64, 64 if args.smoke else 512, vocab)
        await section(args, "reference", path, reqs, 8 if args.smoke else 128, ["tok_s", "wall_s", "ttft_p50_ms", "cached_tokens"])
    log(f"saved {args.out}")


def machine_facts(device: str) -> dict:
    import platform

    import torch

    facts = {"python": platform.python_version(), "torch": torch.__version__, "device": device,
             "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if device == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(0)
    return facts


if __name__ == "__main__":
    asyncio.run(main())

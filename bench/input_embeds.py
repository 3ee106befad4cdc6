"""Prompts as token ids and as their embedding rows (``input_embeds``), side by side.

Per loop, repeats interleaved (ids, embeds, ids, embeds, ...): N requests submitted at
once, greedy; wall time, prompt tok/s, time to first token (p50), and whether the two
arms gave the same tokens (they must: the rows are the checkpoint's own embeddings of the
ids). The cost of the rows is their validation at the door and one host-to-device copy
of each prefill chunk; decode steps are the same.

    python bench/input_embeds.py --device cuda [--model PATH] [--requests 64] [--prompt-len 512]
    python bench/input_embeds.py --device cpu --smoke      # checks the script
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import fmt, machine_facts, make_prompts, parse_loops, run_benchmark, write_random_llama  # noqa: E402


def embedding_table(folder: str):
    from safetensors import safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            if "model.embed_tokens.weight" in f.keys():
                return f.get_tensor("model.embed_tokens.weight")
    raise SystemExit(f"no model.embed_tokens.weight in {folder}")


async def one_run(engine, prompts, table, arm: str, new: int):
    from omni_async import SamplingParams

    sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()

    async def one(p):
        kw = {"input_ids": p} if arm == "ids" else {"input_embeds": table[p]}
        first, out = None, []
        async for delta in engine.stream(sampling=sp, **kw):
            first = first or time.perf_counter() - t0
            out.extend(delta.token_ids)
        return first, out

    got = await asyncio.gather(*[one(p) for p in prompts])
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "ttft_p50_s": statistics.median(g[0] for g in got),
            "prompt_tok_s": sum(map(len, prompts)) / wall}, [g[1] for g in got]


async def main_async(args):
    from omni_async import Engine

    folder = args.model
    if folder is None:
        shape = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=512) \
            if args.smoke else dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864)
        folder, _ = write_random_llama(**shape)
    table = embedding_table(folder)
    prompts = make_prompts(args.requests, 0, args.prompt_len // 2, args.prompt_len, vocab=min(256, table.shape[0]))
    if args.device == "cuda":
        table = table.to("cuda")  # device-resident rows, as a co-located stage would give them
    result = {"machine": machine_facts(), "args": vars(args).copy(), "loops": {}}
    for loop in parse_loops(args.loops):
        engine = Engine.from_pretrained(folder, device=args.device, loop=loop)
        async with engine:
            await one_run(engine, prompts[:4], table, "ids", 4)  # warm-up
            await one_run(engine, prompts[:4], table, "embeds", 4)
            runs = {"ids": [], "embeds": []}
            outs = {}
            for _ in range(args.repeats):
                for arm in ("ids", "embeds"):
                    stats, outs[arm] = await one_run(engine, prompts, table, arm, args.new)
                    runs[arm].append(stats)
        result["loops"][loop] = {"runs": runs, "tokens_equal": outs["ids"] == outs["embeds"]}
    return result


def print_table(result) -> None:
    print(f"{'loop':<14}{'arm':<8}{'wall s (min-max)':<22}{'prompt tok/s':<16}{'ttft p50 ms':<14}same tokens")
    for loop, r in result["loops"].items():
        for arm, runs in r["runs"].items():
            walls = [x["wall_s"] for x in runs]
            print(f"{loop:<14}{arm:<8}{fmt(statistics.median(walls), '.3f') + f' ({min(walls):.3f}-{max(walls):.3f})':<22}"
                  f"{fmt(statistics.median(x['prompt_tok_s'] for x in runs), '.0f'):<16}"
                  f"{fmt(1000 * statistics.median(x['ttft_p50_s'] for x in runs), '.1f'):<14}{r['tokens_equal']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=None, help="a checkpoint folder (default: a random Qwen2-0.5B-shaped Llama)")
    ap.add_argument("--loops", default="normal,overlap,async_decode")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="a tiny shape and workload (checks the script on the CPU)")
    ap.add_argument("--malloc", default="default")
    ap.add_argument("--out", default="input_embeds.json")
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.prompt_len, args.new, args.repeats = 6, 48, 6, 2
    return run_benchmark(args, main_async, print_table)


if __name__ == "__main__":
    sys.exit(main())

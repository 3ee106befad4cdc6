#!/usr/bin/env python
"""The cost of constrained decoding: NV256-style throughput with a quarter of the requests
under a JSON schema, against none.

Workload (nano-vllm's bench.py, as in bench/RESULTS.md's NV256): Python ``random`` seeded 0;
``--requests`` prompts of ``randint(100, 1024)`` ids, each ``randint(0, 10000)``; per request
``max_new_tokens = randint(100, 1024)``; temperature 0.6 with a per-request seed; free
requests ``ignore_eos``; all submitted at once. Arm "none": every request free. Arm
"quarter": every fourth request (same prompt) is under SCHEMA instead, with room to finish
(``max_new_tokens`` at least 256); the other requests are the same in both arms, and so make
the same tokens (a constrained row never changes a free row's tokens; "same" in the table
checks it). The prefix cache is flushed before every run.

Measured per run: the output tok/s of the requests free in both arms (their tokens over
the time the last of them finished), the constrained outputs' validity (parse + schema, and finish "stop"), and
the host time to fill the grammar bitmask per step with a constrained row (from the
runner's ``grammar_mask_*`` counters). Each loop keeps one engine; the two arms alternate
within every repeat (order rotated), and the table gives the median and range over repeats
and the median paired ratio quarter / none.

Model: ``--model qwen05-smol`` (default on CUDA) is the NV256 shape (Qwen2-0.5B, bf16,
random weights) with SmolLM2's vocabulary and tokenizer, a grammar needing a tokenizer;
``smollm2`` is the real SmolLM2-135M-Instruct; ``tiny`` the built-in model (``--smoke``).

    python bench/constrained.py --smoke                      # CPU, a minute or two
    python bench/constrained.py --device cuda --repeats 3    # the H200 run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _common as C

from omni_async import Engine, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "active"],
    "additionalProperties": False,
}


def valid(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    props = SCHEMA["properties"]
    return (
        isinstance(obj, dict) and set(SCHEMA["required"]) <= set(obj) <= set(props)
        and isinstance(obj["name"], str) and len(obj["name"]) <= 24
        and isinstance(obj["age"], int) and not isinstance(obj["age"], bool) and 0 <= obj["age"] <= 150
        and obj["role"] in props["role"]["enum"] and isinstance(obj["active"], bool)
        and all(isinstance(t, str) and len(t) <= 10 for t in obj.get("tags", [])) and len(obj.get("tags", [])) <= 3
    )


def workload(n: int, vocab: int, smoke: bool, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    lo, hi = (16, 64) if smoke else (100, 1024)
    prompts = [[rng.randint(0, 10000) % vocab for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return [(p, rng.randint(lo, hi)) for p in prompts]


def requests(work, arm: str) -> list[tuple[bool, SamplingParams]]:
    out = []
    for i, (_, new) in enumerate(work):
        if arm == "quarter" and i % 4 == 3:
            out.append((True, SamplingParams(max_new_tokens=max(new, 256), temperature=0.6, seed=i, json_schema=SCHEMA)))
        else:
            out.append((False, SamplingParams(max_new_tokens=new, temperature=0.6, seed=i, ignore_eos=True)))
    return out


async def run_arm(engine: Engine, work, arm: str) -> dict[str, Any]:
    reqs = requests(work, arm)
    await engine.flush_cache()  # every run prefills its prompts (repeats would hit the cache)
    info0 = engine.scheduler.info()
    t0 = time.perf_counter()
    done: list[float] = [0.0] * len(reqs)

    async def one(i: int) -> Any:
        r = await engine.generate(input_ids=work[i][0], sampling=reqs[i][1])
        done[i] = time.perf_counter() - t0
        return r

    results = await asyncio.gather(*[one(i) for i in range(len(reqs))])
    info1 = engine.scheduler.info()
    free = [i for i in range(len(reqs)) if i % 4 != 3]  # free in both arms
    cons = [i for i, (c, _) in enumerate(reqs) if c]
    free_tokens = sum(len(results[i].output_ids) for i in free)
    mask_steps = info1["grammar_mask_steps"] - info0["grammar_mask_steps"]
    return {
        "arm": arm,
        "free_tok_s": free_tokens / max(done[i] for i in free),
        "total_tok_s": sum(len(r.output_ids) for r in results) / max(done),
        "wall_s": max(done),
        "free_tokens": free_tokens,
        "constrained": len(cons),
        "valid": sum(valid(results[i].text) and results[i].finish_reason == "stop" for i in cons),
        "constrained_tokens_mean": statistics.mean(len(results[i].output_ids) for i in cons) if cons else None,
        "mask_steps": mask_steps,
        "mask_ms_per_step": 1e3 * (info1["grammar_mask_s"] - info0["grammar_mask_s"]) / mask_steps if mask_steps else None,
        "mask_rows_per_step": (info1["grammar_mask_rows"] - info0["grammar_mask_rows"]) / mask_steps if mask_steps else None,
        "free_outputs_digest": hash(tuple(tuple(results[i].output_ids) for i in free)),
    }


def qwen05_smol(folder: Path) -> Path:
    """NV256's model shape with SmolLM2's 49,152-token vocabulary and tokenizer (random weights)."""
    from gpu_suite import QWEN05, make_checkpoint

    from omni_async.models.gguf import GGUFFile, config_from_gguf, load_gguf_tokenizer, smollm2_path

    shape = dict(QWEN05, vocab_size=49152)
    path = make_checkpoint(folder, shape)
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if not (path / "tokenizer.json").exists():
        saved = os.environ.get("OMNI_BENCH_SMOLLM2_TOKENIZER")  # a tokenizer.json saved from the GGUF before
        if saved:
            shutil.copyfile(saved, path / "tokenizer.json")
        else:
            f = GGUFFile(smollm2_path())
            tok = load_gguf_tokenizer(f, config_from_gguf(f))
            tok.backend.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}))
        cfg["eos_token_id"] = 2
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return path


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or ("tiny" if args.smoke else "qwen05-smol")
    path = str(qwen05_smol(Path(args.checkpoint_dir) / "qwen05-smol")) if model == "qwen05-smol" else model
    kwargs: dict[str, Any] = {"device": args.device}
    if args.device == "cuda":
        kwargs.update(dtype="bfloat16", max_running_requests=args.max_running)
    result: dict[str, Any] = {"machine": C.machine_facts(), "args": vars(args), "model": model, "runs": {}}
    loops = C.parse_loops(args.loops)
    for loop in loops:
        engine = await Engine.load(path, loop=loop, **kwargs)
        async with engine:
            vocab = engine.tokenizer.vocab_size
            work = workload(args.requests, vocab, args.smoke, args.seed)
            warm = SamplingParams(max_new_tokens=64, json_schema=SCHEMA)  # tokenizer set-up, schema compile
            await engine.generate(input_ids=work[0][0][:32], sampling=warm)
            runs = []
            for rep in range(args.repeats):
                for arm in (("none", "quarter") if rep % 2 == 0 else ("quarter", "none")):
                    runs.append(dict(await run_arm(engine, work, arm), repeat=rep))
                    print(f"{loop} rep {rep} {arm}: free {runs[-1]['free_tok_s']:.0f} tok/s, valid "
                          f"{runs[-1]['valid']}/{runs[-1]['constrained']}", flush=True)
        result["runs"][loop] = runs
    return result


def print_table(result: dict[str, Any]) -> None:
    print(f"\nmodel {result['model']}; free requests' tok/s, median [min-max] over repeats")
    print(f"{'loop':14s} {'none':>22s} {'quarter':>22s} {'ratio':>7s} {'valid':>9s} {'mask ms/step':>13s} {'same':>5s}")
    for loop, runs in result["runs"].items():
        arms = {a: [r for r in runs if r["arm"] == a] for a in ("none", "quarter")}

        def span(rs):
            xs = [r["free_tok_s"] for r in rs]
            return f"{statistics.median(xs):.0f} [{min(xs):.0f}-{max(xs):.0f}]"

        ratios = [q["free_tok_s"] / n["free_tok_s"] for q, n in zip(arms["quarter"], arms["none"])]
        valid = sum(r["valid"] for r in arms["quarter"])
        total = sum(r["constrained"] for r in arms["quarter"])
        masks = [r["mask_ms_per_step"] for r in arms["quarter"] if r["mask_ms_per_step"] is not None]
        same = len({r["free_outputs_digest"] for r in runs}) == 1
        print(f"{loop:14s} {span(arms['none']):>22s} {span(arms['quarter']):>22s} {statistics.median(ratios):7.3f} "
              f"{valid:>4d}/{total:<4d} {statistics.median(masks) if masks else 0:13.3f} {str(same):>5s}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="'qwen05-smol' (CUDA default), 'smollm2', 'tiny' (--smoke default) or a folder")
    p.add_argument("--device", default="cpu")
    p.add_argument("--loops", default=",".join(C.LOOPS))
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-running", type=int, default=256, help="max_running_requests on CUDA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default="/tmp/omni-bench-checkpoints")
    p.add_argument("--smoke", action="store_true", help="16 short requests, one repeat each way (CPU)")
    p.add_argument("--malloc", default="default", help="see _common.apply_malloc_mode")
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--out", default="constrained.json")
    args = p.parse_args(argv)
    if args.smoke:
        args.requests, args.repeats = min(args.requests, 16), min(args.repeats, 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke and args.out == "constrained.json":
        args.out = "constrained_smoke.json"
    return C.run_benchmark(args, main_async, print_table)


if __name__ == "__main__":
    sys.exit(main())

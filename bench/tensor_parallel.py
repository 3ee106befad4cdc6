"""Tensor parallelism: TP 1 against TP 2, side by side (issue 20). Two GPUs of one host.

For each shape (random weights, bf16, CUDA graphs and kernels as configured):

- ``tok_s``: the reference workload (``--requests`` requests, prompts 64-512 tokens,
  ``--max-new`` new tokens, greedy, every request streamed), repeats interleaved
  (TP 1, TP 2, TP 1, TP 2, ...), after one unmeasured warm-up pass per engine;
- ``b1_step_ms``: batch-1 decode step time: one request decoding ``--b1-tokens`` tokens,
  the median time per token over the deltas after the eighth token;
- ``collectives``: what a decode step's collectives cost on their own, at the step's
  exact shapes (one all-reduce of ``[B, hidden]`` per attention and MLP block plus the
  embedding's, the LM head's all-gather of ``[B, vocab / 2]``, the step-input
  broadcast), through the engine's own communication code, replayed back to back in a
  CUDA graph across two processes; the *all-reduce share* is that time over the TP 2
  batch-1 step.

Shapes: ``qwen05`` (Qwen2-0.5B, the reference workload's) and ``qwen7b`` (Qwen2-7B).
``--smoke`` runs a tiny shape on CPU (gloo) with small counts: a check that the script
works, not a measurement.

    python bench/tensor_parallel.py --out bench/results/tensor_parallel_h200x2.json
    python bench/tensor_parallel.py --smoke --out /tmp/tp_smoke.json

Bounded: ``--budget-s`` (default 540 s) skips what no longer fits and still writes the
JSON (after every section); each run has its own timeout; an engine that fails to build
is recorded with its error (TP 2 is retried once without CUDA graphs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omni_async import Engine, SamplingParams  # noqa: E402

SHAPES = {
    "qwen05": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                   intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True),
    "qwen7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                   intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768, tie_word_embeddings=False),
    "smoke": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256, vocab_size=1024, max_position_embeddings=4096, tie_word_embeddings=True),
}
RESULTS: dict = {"sections": {}, "notes": []}
T0 = time.perf_counter()


def log(*a) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, flush=True)


def left(args) -> float:
    return args.budget_s - (time.perf_counter() - T0)


def save(args) -> None:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(RESULTS, indent=2, default=str))


def make_checkpoint(folder: Path, shape: dict, device: str, dtype: torch.dtype) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(0)
    cfg = Qwen2Config(bos_token_id=1, eos_token_id=None, pad_token_id=0, **shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return folder


def workload(n: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab - 1) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# ------------------------------------------------------------------ engines and runs


def build_engine(path: Path, tp: int, args) -> tuple[Engine | None, dict]:
    kw = dict(device=args.device, loop=args.loop, dtype=args.dtype, tensor_parallel_size=tp, kv_capacity_tokens=args.kv_tokens,
              max_running_requests=args.requests, max_prefill_tokens=8192, chunked_prefill_size=8192,
              max_queued_requests=8192, cuda_graph_max_len=1024, page_size=16)
    attempts = [True, False] if args.device == "cuda" else [False]
    info: dict = {"tp": tp}
    for graphs in attempts:
        t = time.perf_counter()
        try:
            eng = Engine.from_pretrained(str(path), cuda_graphs=graphs, **kw)
        except Exception as exc:  # recorded, and TP 2 is tried once more without graphs
            info.setdefault("errors", []).append(f"cuda_graphs={graphs}: {exc!r}")
            log(f"  TP {tp} failed to build (cuda_graphs={graphs}): {exc!r}")
            continue
        info.update(build_s=time.perf_counter() - t, cuda_graphs=graphs)
        return eng, info
    return None, info


async def run_workload(eng: Engine, reqs: list[list[int]], new: int) -> dict:
    async def one(p):
        n = 0
        async for d in eng.stream(input_ids=p, sampling=SamplingParams(max_new_tokens=new, ignore_eos=True)):
            n += len(d.token_ids)
        return n

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(p) for p in reqs)))
    wall = time.perf_counter() - t0
    return {"tok_s": tokens / wall, "wall_s": wall, "tokens": tokens}


async def batch1_step(eng: Engine, prompt: list[int], new: int) -> dict:
    """Median seconds per token while one request decodes (after its eighth token)."""
    per_token, seen, last = [], 0, None
    async for d in eng.stream(input_ids=prompt, sampling=SamplingParams(max_new_tokens=new, ignore_eos=True)):
        now = time.perf_counter()
        if last is not None and seen >= 8 and d.token_ids:
            per_token.append((now - last) / len(d.token_ids))
        seen += len(d.token_ids)
        last = now
    return {"b1_step_ms": 1000 * statistics.median(per_token) if per_token else None, "b1_tokens": seen}


def spread(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {}
    med = statistics.median(xs)
    return {"median": med, "min": min(xs), "max": max(xs), "n": len(xs)}


async def section_shape(name: str, args) -> dict:
    shape = dict(SHAPES[name])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    folder = Path(args.ckpt_dir) / name
    t = time.perf_counter()
    make_checkpoint(folder, shape, "cuda" if args.device == "cuda" else "cpu", getattr(torch, args.dtype))
    out: dict = {"shape": shape, "checkpoint_s": time.perf_counter() - t, "engines": {}, "runs": {}}
    RESULTS["sections"][name] = out  # saved after every run, so a killed command keeps what it measured
    vocab = shape["vocab_size"]
    reqs = workload(args.requests, vocab, args.prompt_lo, args.prompt_hi, seed=1)
    warm = workload(max(4, args.requests // 4), vocab, args.prompt_lo, args.prompt_hi, seed=9)
    b1_prompt = workload(1, vocab, 128, 128, seed=3)[0]
    engines: dict[int, Engine] = {}
    for tp in args.tp:
        if left(args) < 60:
            RESULTS["notes"].append(f"{name}: TP {tp} skipped, budget spent")
            continue
        eng, info = build_engine(folder, tp, args)
        out["engines"][str(tp)] = info
        if eng is not None:
            await eng.start()
            await asyncio.wait_for(run_workload(eng, warm, 16), args.run_timeout_s)
            engines[tp] = eng
            log(f"  {name} TP {tp} ready in {info['build_s']:.1f} s (graphs {info['cuda_graphs']})")
    runs: dict[str, list[dict]] = {str(tp): [] for tp in engines}
    out["runs"] = runs
    save(args)
    for rep in range(args.repeats):
        for tp, eng in engines.items():
            if left(args) < 30:
                RESULTS["notes"].append(f"{name}: repeat {rep} TP {tp} skipped, budget spent")
                continue
            try:
                r = await asyncio.wait_for(run_workload(eng, reqs, args.max_new), args.run_timeout_s)
                r.update(await asyncio.wait_for(batch1_step(eng, b1_prompt, args.b1_tokens), args.run_timeout_s))
            except Exception as exc:
                r = {"error": repr(exc)}
            runs[str(tp)].append(r)
            save(args)
            log(f"  {name} rep {rep} TP {tp}: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    for eng in engines.values():
        await asyncio.wait_for(eng.aclose(), 120)
    out["summary"] = {tp: {"tok_s": spread([r.get("tok_s") for r in rs]), "b1_step_ms": spread([r.get("b1_step_ms") for r in rs])}
                      for tp, rs in runs.items()}
    return out


# ------------------------------------------------------------------ collectives alone


def _collectives_rank(rank: int, port: int, device_type: str, shape: dict, batches: list[int], dtype: str, reps: int, q) -> None:
    from omni_async.backends.native.parallel.comm import GroupComm

    try:
        dev = torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        store = torch.distributed.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=120))
        comm = GroupComm(store, rank, 2, dev, 120.0)
        dt = getattr(torch, dtype)
        h, layers = shape["hidden_size"], shape["num_hidden_layers"]
        vocab_half = -(-shape["vocab_size"] // 2)
        out = {}
        for b in batches:
            x = torch.randn(b, h, dtype=dt, device=dev)
            logits = torch.randn(b, vocab_half, dtype=dt, device=dev)
            plan = torch.zeros(4 * b + b * 40, dtype=torch.int64, device=dev)  # ids, positions, slots, lens + pages

            def step():
                comm.broadcast_data(plan)
                for _ in range(2 * layers + 1):
                    comm.all_reduce(x)
                comm.all_gather_last(logits)

            for _ in range(3):
                step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
                run = step
                try:  # graphed, as the engine's decode steps are; eager when capture fails
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        step()
                    run = graph.replay
                except Exception as exc:
                    out[f"graph_error_{b}"] = repr(exc)
                for _ in range(3):
                    run()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    run()
                end.record()
                torch.cuda.synchronize()
                out[str(b)] = start.elapsed_time(end) / reps
            else:
                t = time.perf_counter()
                for _ in range(reps):
                    step()
                out[str(b)] = 1000 * (time.perf_counter() - t) / reps
        if rank == 0:
            q.put({"step_collectives_ms": out, "all_reduces_per_step": 2 * layers + 1})
    except Exception:
        if rank == 0:
            q.put({"error": traceback.format_exc()[-2000:]})
        raise


def section_collectives(name: str, args) -> dict:
    shape = dict(SHAPES[name])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    probe = torch.distributed.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    port = probe.port
    del probe
    reps = 200 if args.device == "cuda" else 20
    procs = [ctx.Process(target=_collectives_rank, args=(r, port, args.device, shape, args.coll_batches, args.dtype, reps, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        res = q.get(timeout=min(180.0, max(30.0, left(args))))
    except Exception:
        res = {"error": "collectives timed out"}
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    return res


# ------------------------------------------------------------------ main


def table(args) -> None:
    print("\n| shape | TP | tok/s median (min-max) | batch-1 step ms median (min-max) | collectives ms/step at B=1 | all-reduce share at B=1 |")
    print("|---|---|---|---|---|---|")
    for name in args.shapes:
        sec = RESULTS["sections"].get(name, {})
        coll = RESULTS["sections"].get(f"{name}_collectives", {}).get("step_collectives_ms", {})
        for tp, s in sec.get("summary", {}).items():
            tok, b1 = s.get("tok_s", {}), s.get("b1_step_ms", {})
            c1 = coll.get("1") if tp != "1" else None
            share = (c1 / b1["median"]) if (c1 and b1.get("median")) else None
            cell = lambda d, f: f"{d['median']:{f}} ({d['min']:{f}}-{d['max']:{f}})" if d else "-"  # noqa: E731
            print(f"| {name} | {tp} | {cell(tok, ',.0f')} | {cell(b1, '.3f')} | {c1 and f'{c1:.3f}' or '-'} | {share and f'{100 * share:.0f}%' or '-'} |")
            if share is not None:
                sec.setdefault("allreduce_share_b1", {})[tp] = share


async def amain(args) -> None:
    for name in args.shapes:
        if "collectives" in args.sections and 2 in args.tp and left(args) > 60:
            log(f"{name}: collectives alone")
            RESULTS["sections"][f"{name}_collectives"] = section_collectives(name, args)
            log(f"  {RESULTS['sections'][f'{name}_collectives']}")
            save(args)
        if "engines" in args.sections and left(args) > 90:
            log(f"{name}: engines TP {args.tp}")
            try:
                RESULTS["sections"][name] = await section_shape(name, args)
            except Exception as exc:
                RESULTS["sections"].setdefault(name, {})["error"] = traceback.format_exc()[-3000:]
                log(f"  {name} failed: {exc!r}")
            save(args)
        elif "engines" in args.sections:
            RESULTS["notes"].append(f"{name}: engines skipped, budget spent")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="where the JSON goes")
    p.add_argument("--smoke", action="store_true", help="tiny shape on CPU (gloo), small counts: checks the script only")
    p.add_argument("--shapes", default="qwen05,qwen7b")
    p.add_argument("--sections", default="collectives,engines")
    p.add_argument("--tp", default="1,2")
    p.add_argument("--loop", default="async_decode")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--prompt-lo", type=int, default=64)
    p.add_argument("--prompt-hi", type=int, default=512)
    p.add_argument("--b1-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=0, help="override the shape's layer count (0 keeps it)")
    p.add_argument("--kv-tokens", type=int, default=1 << 18)
    p.add_argument("--coll-batches", default="1,64,256")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting new work after this long")
    p.add_argument("--run-timeout-s", type=float, default=120.0)
    p.add_argument("--ckpt-dir", default=None, help="checkpoints are written here (reused when present); default a temp dir")
    args = p.parse_args()
    if args.smoke:
        args.shapes, args.device, args.dtype = "smoke", "cpu", "float32"
        args.requests, args.max_new, args.prompt_lo, args.prompt_hi, args.b1_tokens = 8, 8, 8, 32, 24
        args.repeats, args.kv_tokens, args.coll_batches = 2, 4096, "1,8"
    else:
        args.device, args.dtype = "cuda", "bfloat16"
        if not torch.cuda.is_available():
            sys.exit("error: no CUDA device visible; use --smoke for the CPU check")
    args.shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        sys.exit(f"error: unknown shape(s) {unknown}; choose from {list(SHAPES)}")
    args.tp = [int(t) for t in args.tp.split(",")]
    args.sections = set(args.sections.split(","))
    args.coll_batches = [int(b) for b in args.coll_batches.split(",")]
    if args.device == "cuda" and max(args.tp) > torch.cuda.device_count():
        sys.exit(f"error: TP {max(args.tp)} needs {max(args.tp)} GPUs, {torch.cuda.device_count()} visible")
    tmp = None
    if args.ckpt_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="omni-tp-bench-")
        args.ckpt_dir = tmp.name
    RESULTS["machine"] = {
        "host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else [],
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    RESULTS["args"] = {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()}
    try:
        asyncio.run(amain(args))
    finally:
        table(args)
        RESULTS["total_s"] = time.perf_counter() - T0
        save(args)
        log(f"wrote {args.out}")
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    main()

"""One replica against two: the same wave of concurrent streamed completions over HTTP,
sent to one ``omni-async serve`` worker, then to two behind a router.

Two ways to run the replicas (``--via``):

- ``router``: N ``omni-async serve`` processes and SGLang's router (``sglang-router``,
  cache-aware policy) in front of them (N = 1 goes through the router too, so both arms
  pay the same hop);
- ``ray``: ``omni-async serve-ray``'s deployment on a local Ray instance, N replicas behind
  Serve's proxy.

Each wave: C requests at once (random text prompts, ``ignore_eos``, T tokens each), streamed
with the openai client. Reported per arm: output tokens/s over the wave, time to first
token p50 / p99, requests per replica. The arms alternate (1, 2, 1, 2 ...) so that load
from elsewhere on the machine falls on both; the spread over repeats is printed.

    python bench/replicas.py --via router --concurrency 64 --tokens 32 --repeats 3
    python bench/replicas.py --via router --device cuda --model /models/qwen2-0.5b --concurrency 256 --tokens 256
    python bench/replicas.py --via ray --device cuda --model /models/qwen2-0.5b --concurrency 256 --tokens 256

With ``--device cuda`` each worker gets its own GPU (``CUDA_VISIBLE_DEVICES``; Ray gives
each replica one). Results: bench/results/replicas_<via>_<device>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from typing import Any, Iterator

from _common import REPO_DIR, machine_facts, ms, percentile, run_benchmark

STARTUP_S = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status
    except OSError:
        return 0


def _wait(url: str, ok: Any = lambda status: status == 200) -> None:
    deadline = time.monotonic() + STARTUP_S
    while not ok(_status(url)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not come up")
        time.sleep(0.5)


def _workers_ready(router: str, n: int) -> bool:
    try:
        with urllib.request.urlopen(f"{router}/workers", timeout=10) as resp:
            workers = json.loads(resp.read()).get("workers", [])
    except OSError:
        return False
    return sum(1 for w in workers if w.get("is_healthy")) == n


@contextmanager
def router_fleet(args: argparse.Namespace, n: int) -> Iterator[str]:
    """``n`` workers and the router; yields the router's URL."""
    procs: list[subprocess.Popen] = []
    try:
        urls = []
        for i in range(n):
            port = _free_port()
            env = dict(os.environ)
            if args.device.startswith("cuda"):
                env["CUDA_VISIBLE_DEVICES"] = str(i)
            cmd = [sys.executable, "-m", "omni_async.cli", "serve", "--model", args.model, "--device", args.device,
                   "--host", "127.0.0.1", "--port", str(port), "--log-level", "ERROR"]
            procs.append(subprocess.Popen(cmd, cwd=REPO_DIR, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            _wait(f"{url}/health")
        port = _free_port()
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *urls, "--policy", "cache_aware", "--log-level", "warn",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        router = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + STARTUP_S
        while not _workers_ready(router, n):
            if time.monotonic() > deadline:
                raise TimeoutError("the router did not take its workers")
            time.sleep(0.5)
        yield router
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)


@contextmanager
def ray_fleet(args: argparse.Namespace, n: int) -> Iterator[str]:
    """``n`` replicas on a local Ray instance behind Serve's proxy; yields its URL."""
    import ray
    from ray import serve

    from omni_async.serving.ray_serve import build_app, run

    ray.init(include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": str(REPO_DIR)}})
    try:
        port = _free_port()
        run(build_app(args.model, replicas=n, device=args.device), host="127.0.0.1", port=port)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


async def wave(url: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    import openai

    rng = random.Random(seed)
    # Text prompts (the router takes strings only), distinct from the first character on,
    # so that the cache-aware policy balances them rather than pinning a shared prefix.
    letters = "abcdefghijklmnopqrstuvwxyz "
    prompts = ["".join(rng.choice(letters) for _ in range(args.prompt_chars)) for _ in range(args.concurrency)]
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=STARTUP_S)
    model = (await client.models.list()).data[0].id
    ttft: list[float] = []
    tokens = [0]

    async def one(prompt: str) -> None:
        start = time.perf_counter()
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=args.tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        first = True
        async for chunk in stream:
            if first and chunk.choices and chunk.choices[0].text:
                ttft.append(time.perf_counter() - start)
                first = False
            if chunk.usage is not None:
                tokens[0] += chunk.usage.completion_tokens

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    elapsed = time.perf_counter() - start
    await client.close()
    return {
        "elapsed_s": elapsed,
        "output_tokens": tokens[0],
        "tok_per_s": tokens[0] / elapsed,
        "ttft_p50_ms": ms(percentile(ttft, 50)),
        "ttft_p99_ms": ms(percentile(ttft, 99)),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    fleet = router_fleet if args.via == "router" else ray_fleet
    runs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    for rep in range(args.repeats):
        for n in (1, 2):  # alternate, so that outside load falls on both arms
            with fleet(args, n) as url:
                await wave(url, args, seed=100 + rep)  # warm-up: first steps, allocator, connections
                runs[n].append(await wave(url, args, seed=rep))
    summary = {}
    for n, rows in runs.items():
        rates = [r["tok_per_s"] for r in rows]
        summary[n] = {"tok_per_s_median": sorted(rates)[len(rates) // 2], "tok_per_s_min": min(rates), "tok_per_s_max": max(rates),
                      "ttft_p50_ms_median": sorted(r["ttft_p50_ms"] for r in rows)[len(rows) // 2]}
    return {
        "bench": "replicas",
        "via": args.via,
        "model": args.model,
        "device": args.device,
        "concurrency": args.concurrency,
        "tokens": args.tokens,
        "prompt_chars": args.prompt_chars,
        "repeats": args.repeats,
        "runs": runs,
        "summary": summary,
        "two_over_one": summary[2]["tok_per_s_median"] / summary[1]["tok_per_s_median"],
        "machine": machine_facts(),
    }


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['model']} on {result['device']} via {result['via']}: {result['concurrency']} streamed requests at once, "
          f"{result['tokens']} tokens each, {result['repeats']} repeats (median [min, max])")
    print(f"{'replicas':>8} {'tok/s':>10} {'[min, max]':>20} {'TTFT p50 ms':>12}")
    for n, s in result["summary"].items():
        print(f"{n:>8} {s['tok_per_s_median']:>10.1f} {'[%.1f, %.1f]' % (s['tok_per_s_min'], s['tok_per_s_max']):>20} {s['ttft_p50_ms_median']:>12.1f}")
    print(f"two replicas / one: {result['two_over_one']:.2f}x")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--via", choices=("router", "ray"), default="router")
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-chars", type=int, default=64, help="random letters per prompt")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--malloc", default="default")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.out = args.out or f"replicas_{args.via}_{args.device.split(':')[0]}.json"
    return run_benchmark(args, main_async, print_table)


if __name__ == "__main__":
    sys.exit(main())

"""What the HTTP layer costs: the same streamed requests in-process (``engine.stream``)
and through ``omni-async serve`` (a subprocess on 127.0.0.1, driven by the official
``openai`` client's streaming completions), on the built-in ``tiny`` model.

For each concurrency C: C requests at once, each streaming T tokens (``ignore_eos``);
both ask for logprobs, so that every step's tokens are sent (a chunk without text
is otherwise held back until its text completes). Reported: tokens/s over the wave,
time to first token (p50, p99), and the gap between a request's chunks (p50). Client and
server share the machine's cores.

    python bench/serve_http.py --concurrency 1,8,32 --tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any, AsyncIterator, Callable

from _common import REPO_DIR, event_loop_name, machine_facts, ms, parse_int_list, percentile, run_benchmark

from omni_async import Engine, SamplingParams


async def _wave(c: int, one: Callable[[int], AsyncIterator[int]]) -> dict[str, Any]:
    ttfts: list[float] = []
    gaps: list[float] = []
    counts: list[int] = []

    async def run(i: int) -> None:
        start = time.perf_counter()
        last = None
        n = 0
        async for tokens in one(i):
            now = time.perf_counter()
            if last is None:
                ttfts.append(now - start)
            else:
                gaps.append(now - last)
            last = now
            n += tokens
        counts.append(n)

    t0 = time.perf_counter()
    await asyncio.gather(*(run(i) for i in range(c)))
    elapsed = time.perf_counter() - t0
    return {
        "tokens": sum(counts),
        "seconds": elapsed,
        "tokens_per_s": sum(counts) / elapsed,
        "ttft_p50_ms": ms(percentile(ttfts, 50)),
        "ttft_p99_ms": ms(percentile(ttfts, 99)),
        "chunk_gap_p50_ms": ms(percentile(gaps, 50)),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "omni_async.cli", "serve", "--model", "tiny", "--port", str(port), "--log-level", "ERROR"],
        cwd=REPO_DIR, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=dict(os.environ),
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {proc.communicate()[1]}")
            time.sleep(0.2)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from openai import AsyncOpenAI

    rows = []
    engine = Engine.from_pretrained("tiny", loop=args.loop)
    sp = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True, return_logprob=True)
    async with engine:

        async def local(i: int) -> AsyncIterator[int]:
            async for delta in engine.stream(prompt=f"request {i}: once upon a time", sampling=sp):
                yield len(delta.token_ids)

        for c in args.concurrency:
            await _wave(c, local)  # warm-up
            rows.append({"path": "in-process", "concurrency": c, **await _wave(c, local)})
    port = _free_port()
    proc = _start_server(port)
    try:
        client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)

        async def http(i: int) -> AsyncIterator[int]:
            stream = await client.completions.create(
                model="tiny", prompt=f"request {i}: once upon a time", max_tokens=args.tokens, temperature=0,
                stream=True, logprobs=0, extra_body={"ignore_eos": True},
            )
            async for chunk in stream:  # with logprobs, every step's tokens come, text or not
                lp = chunk.choices[0].logprobs if chunk.choices else None
                yield len(lp.tokens) if lp is not None else 0

        for c in args.concurrency:
            await _wave(c, http)
            rows.append({"path": "http (openai client)", "concurrency": c, **await _wave(c, http)})
        await client.close()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    return {"benchmark": "serve_http", "machine": machine_facts(), "event_loop": event_loop_name(),
            "loop": args.loop, "tokens_per_request": args.tokens, "rows": rows}


def print_table(result: dict[str, Any]) -> None:
    print(f"{'path':<22} {'C':>4} {'tok/s':>9} {'ttft p50':>9} {'ttft p99':>9} {'gap p50':>8}  (ms)")
    for r in result["rows"]:
        print(f"{r['path']:<22} {r['concurrency']:>4} {r['tokens_per_s']:>9.1f} {r['ttft_p50_ms']:>9.1f} {r['ttft_p99_ms']:>9.1f} {r['chunk_gap_p50_ms'] or 0:>8.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=parse_int_list, default=[1, 8, 32])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--loop", default="normal")
    p.add_argument("--malloc", default="default", choices=["default", "steady"])
    p.add_argument("--out", default="serve_http.json")
    return run_benchmark(p.parse_args(), main_async, print_table)


if __name__ == "__main__":
    raise SystemExit(main())

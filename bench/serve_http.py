"""A serving benchmark in the manner of ``vllm bench serve`` and SGLang's ``bench_serving``,
with an in-process arm in the same run: what the HTTP layer costs, under load.

Workload (``--num-prompts`` requests, seeded): token-id prompts and output lengths drawn
like a chat data set. ShareGPT-style conversations have long-tailed lengths (most turns
short, a few long), so both lengths are log-normal: input median ``--input-median``
(default 128) and output median ``--output-median`` (default 128), shape sigma 0.9 and
0.7, clipped to [8, ``--input-max``] and [4, ``--output-max``]. These are synthetic (no
data set is downloaded) and shaped like, not fitted to, ShareGPT; prompt ids are uniform
in [10, vocab). Every request streams a completion of exactly its drawn length
(``ignore_eos``, greedy).

Load: for each rate in ``--request-rates`` (requests/s; ``inf`` = all at once), requests
arrive as a Poisson process (exponential gaps, seeded). Each rate runs twice per repeat,
interleaved: ``in-process`` (``engine.stream`` in this process, same arrivals) and
``http`` (``omni-async serve`` in a subprocess on 127.0.0.1, a minimal asyncio HTTP/1.1
client reading the SSE stream, so that the client's own parsing is cheap, as vLLM's
aiohttp client is).

Reported per run, as both peers report them: TTFT, TPOT (time per output token after the
first), ITL (gaps between streamed chunks) and end-to-end latency at p50/p99; request
throughput, output tok/s; goodput (requests/s that met the SLO ``--slo-ttft-ms`` and
``--slo-tpot-ms``). Medians over repeats, with the range, and HTTP/in-process ratios.
JSON under bench/results/, and an SVG plot of latency against load (no plotting library
needed).

    python bench/serve_http.py --model smollm2 --num-prompts 32 --request-rates 1,2,inf
    python bench/serve_http.py --model qwen2-0.5b --device cuda --memory-budget 0.4 --num-prompts 256 \\
        --request-rates 32,inf --input-median 256 --output-median 256 --repeats 3 --out serve_http_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's omni_async

from _common import REPO_DIR, RESULTS_DIR, event_loop_name, machine_facts, percentile, run_benchmark  # noqa: E402

from omni_async import Engine, SamplingParams

# ------------------------------------------------------------------ workload


@dataclass
class Request:
    prompt: list[int]
    output_len: int


def draw_workload(n: int, seed: int, vocab: int, args: argparse.Namespace) -> list[Request]:
    """Log-normal input and output lengths (chat-like long tails), documented above."""
    rng = random.Random(seed)

    def lognormal(median: float, sigma: float, lo: int, hi: int) -> int:
        return max(lo, min(hi, int(round(rng.lognormvariate(math.log(median), sigma)))))

    out = []
    for _ in range(n):
        n_in = lognormal(args.input_median, 0.9, 8, args.input_max)
        n_out = lognormal(args.output_median, 0.7, 4, args.output_max)
        out.append(Request([rng.randrange(10, vocab) for _ in range(n_in)], n_out))
    return out


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: Poisson at ``rate``/s."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ------------------------------------------------------------------ one request's timeline


@dataclass
class Timeline:
    start: float
    events: list[float] = field(default_factory=list)  # arrival of each chunk with tokens
    tokens: int = 0
    error: str | None = None


async def run_load(reqs: list[Request], arrivals: list[float], one: Callable[[Request, Timeline], Any]) -> tuple[list[Timeline], float]:
    t0 = time.perf_counter()
    lines: list[Timeline] = []

    async def fire(req: Request, at: float) -> None:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        line = Timeline(time.perf_counter())
        lines.append(line)
        try:
            await one(req, line)
        except Exception as exc:  # counted as failed, reported
            line.error = repr(exc)

    await asyncio.gather(*(fire(r, a) for r, a in zip(reqs, arrivals)))
    return lines, time.perf_counter() - t0


def metrics(lines: list[Timeline], duration: float, slo_ttft_ms: float, slo_tpot_ms: float) -> dict[str, Any]:
    ok = [x for x in lines if x.error is None and x.events]
    ttft = [x.events[0] - x.start for x in ok]
    e2e = [x.events[-1] - x.start for x in ok]
    tpot = [(x.events[-1] - x.events[0]) / (x.tokens - 1) for x in ok if x.tokens > 1]
    itl = [b - a for x in ok for a, b in zip(x.events, x.events[1:])]
    good = sum(
        1 for x in ok
        if (x.events[0] - x.start) * 1e3 <= slo_ttft_ms
        and (x.tokens <= 1 or (x.events[-1] - x.events[0]) / (x.tokens - 1) * 1e3 <= slo_tpot_ms)
    )
    out_tokens = sum(x.tokens for x in ok)

    def p(xs: list[float], q: float) -> float | None:
        v = percentile(xs, q)
        return None if v is None else v * 1e3

    return {
        "completed": len(ok),
        "failed": len(lines) - len(ok),
        "errors": sorted({x.error for x in lines if x.error})[:3],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_tok_s": out_tokens / duration,
        "goodput_req_s": good / duration,
        "ttft_p50_ms": p(ttft, 50), "ttft_p99_ms": p(ttft, 99), "ttft_mean_ms": statistics.fmean(ttft) * 1e3 if ttft else None,
        "tpot_p50_ms": p(tpot, 50), "tpot_p99_ms": p(tpot, 99),
        "itl_p50_ms": p(itl, 50), "itl_p99_ms": p(itl, 99),
        "e2el_p50_ms": p(e2e, 50), "e2el_p99_ms": p(e2e, 99),
    }


# ------------------------------------------------------------------ the two arms


def in_process(engine: Engine) -> Callable[[Request, Timeline], Any]:
    async def one(req: Request, line: Timeline) -> None:
        sp = SamplingParams(max_new_tokens=req.output_len, ignore_eos=True, temperature=0)
        async for delta in engine.stream(input_ids=req.prompt, sampling=sp):
            if delta.token_ids:
                line.events.append(time.perf_counter())
                line.tokens += len(delta.token_ids)

    return one


async def _sse_events(host: str, port: int, body: bytes) -> AsyncIterator[bytes]:
    """POST ``body`` to /v1/completions and yield each SSE event's data (HTTP/1.1,
    chunked transfer encoding as uvicorn sends it)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
        writer.write(head.encode() + body)
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"HTTP {status.decode().strip()}: {(await reader.read(2000)).decode(errors='replace')}")
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            chunked |= line.lower().startswith(b"transfer-encoding: chunked")
        buffer = b""
        while True:
            if chunked:
                size = int((await reader.readline()).strip() or b"0", 16)
                if size == 0:
                    break
                data = await reader.readexactly(size + 2)
                buffer += data[:-2]
            else:
                data = await reader.read(65536)
                if not data:
                    break
                buffer += data
            while (cut := buffer.find(b"\n\n")) >= 0:
                ev, buffer = buffer[:cut], buffer[cut + 2 :]
                if ev.startswith(b"data: "):
                    yield ev[6:]
    finally:
        writer.close()


def over_http(port: int, model: str) -> Callable[[Request, Timeline], Any]:
    async def one(req: Request, line: Timeline) -> None:
        body = json.dumps({
            "model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True},
        }).encode()
        async for data in _sse_events("127.0.0.1", port, body):
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(obj["error"].get("message"))
            if obj.get("usage"):
                line.tokens = obj["usage"]["completion_tokens"]
            elif obj["choices"] and (obj["choices"][0].get("text") or obj["choices"][0].get("finish_reason") is None):
                # a chunk of new tokens (its text may be empty: a partial character, or a
                # checkpoint without a tokenizer), not the closing one
                line.events.append(time.perf_counter())

    return one


# ------------------------------------------------------------------ models and the server


def model_path(args: argparse.Namespace) -> str:
    """``qwen2-0.5b``: a random-weight checkpoint of Qwen2-0.5B's shape, bf16, written
    once (as bench/nv256.py makes it); any other name goes to Engine/serve as given."""
    if args.model != "qwen2-0.5b":
        return args.model
    import torch
    from nv256 import QWEN05, make_checkpoint

    folder = Path(args.checkpoint or Path(tempfile.gettempdir()) / "nv-qwen2-05b-bf16")
    return str(make_checkpoint(folder, QWEN05, torch.bfloat16, args.device))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, path: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "omni_async.cli", "serve", "--model", path, "--served-model-name", "bench",
           "--device", args.device, "--loop", args.loop, "--port", str(port), "--log-level", "ERROR"]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.memory_budget:
        cmd += ["--memory-budget", str(args.memory_budget)]
    env = dict(os.environ)
    if args.torch_threads:
        env["OMP_NUM_THREADS"] = str(args.torch_threads)
    proc = subprocess.Popen(cmd, cwd=REPO_DIR, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 600
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {proc.communicate()[1][-3000:]}")
            time.sleep(0.5)


# ------------------------------------------------------------------ the run


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of each figure over repeats, with its range."""
    out: dict[str, Any] = {"repeats": len(runs)}
    for key in runs[0]:
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
        if values and key not in ("completed", "failed"):
            out[key] = statistics.median(values)
            out[key + "_range"] = [min(values), max(values)]
        elif key in ("completed", "failed"):
            out[key] = sum(r[key] for r in runs)
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    path = model_path(args)
    kw: dict[str, Any] = {"device": args.device, "loop": args.loop}
    if args.dtype:
        kw["dtype"] = args.dtype
    if args.memory_budget:
        kw["memory_budget"] = args.memory_budget
    engine = await Engine.load(path, **kw)
    vocab = min(engine.scheduler.limits.vocab_size, args.id_max)
    reqs = draw_workload(args.num_prompts, args.seed, vocab, args)
    warm = draw_workload(min(8, args.num_prompts), args.seed + 1, vocab, args)
    port = _free_port()
    proc = start_server(args, path, port)
    raw: dict[str, list[dict[str, Any]]] = {}
    try:
        async with engine:
            arms = {"in-process": in_process(engine), "http": over_http(port, "bench")}
            for arm in arms.values():  # warm-up: compile, allocate, connect
                await run_load(warm, [0.0] * len(warm), arm)
            for rep in range(args.repeats):
                for rate in args.request_rates:
                    arrivals = arrival_times(len(reqs), rate, args.seed + rep)
                    order = list(arms) if rep % 2 == 0 else list(reversed(arms))
                    for name in order:
                        lines, duration = await run_load(reqs, arrivals, arms[name])
                        row = metrics(lines, duration, args.slo_ttft_ms, args.slo_tpot_ms)
                        raw.setdefault(f"{name}@{rate}", []).append(row)
                        print(f"  rep {rep} rate {rate:>5} {name:<10} {row['output_tok_s']:9.1f} tok/s  "
                              f"ttft p50 {row['ttft_p50_ms'] or 0:8.1f} ms  failed {row['failed']}", file=sys.stderr, flush=True)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    rows = []
    for rate in args.request_rates:
        for name in ("in-process", "http"):
            rows.append({"arm": name, "request_rate": rate, **summarize(raw[f"{name}@{rate}"])})
    ratios = []
    for rate in args.request_rates:
        a, b = (next(r for r in rows if r["arm"] == n and r["request_rate"] == rate) for n in ("in-process", "http"))
        per_rep = [h["output_tok_s"] / i["output_tok_s"] for i, h in zip(raw[f"in-process@{rate}"], raw[f"http@{rate}"])]
        ratios.append({
            "request_rate": rate,
            "http_over_in_process_tok_s": statistics.median(per_rep), "range": [min(per_rep), max(per_rep)],
            "ttft_p50_delta_ms": (b.get("ttft_p50_ms") or 0) - (a.get("ttft_p50_ms") or 0),
        })
    result = {
        "benchmark": "serve_http", "machine": machine_facts(), "event_loop": event_loop_name(),
        "model": args.model, "device": args.device, "loop": args.loop, "num_prompts": args.num_prompts,
        "workload": {"input_median": args.input_median, "input_max": args.input_max, "output_median": args.output_median,
                     "output_max": args.output_max, "input_tokens": sum(len(r.prompt) for r in reqs),
                     "output_tokens": sum(r.output_len for r in reqs), "seed": args.seed},
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "rows": rows, "ratios": ratios, "raw": raw,
    }
    svg = Path(args.out).with_suffix(".svg")
    svg = svg if svg.is_absolute() else RESULTS_DIR / svg.name
    svg.write_text(latency_svg(result))
    result["plot"] = str(svg.relative_to(REPO_DIR)) if svg.is_relative_to(REPO_DIR) else str(svg)
    for row in (*rows, *ratios):  # strict JSON has no Infinity
        row["request_rate"] = "inf" if math.isinf(row["request_rate"]) else row["request_rate"]
    return result


# ------------------------------------------------------------------ output


def print_table(result: dict[str, Any]) -> None:
    def f(x: Any, spec: str = ".1f") -> str:
        return "-" if x is None else format(x, spec)

    w = result["workload"]
    print(f"{result['model']} on {result['device']}, {result['num_prompts']} requests, {w['input_tokens']} in / "
          f"{w['output_tokens']} out tokens, SLO ttft<={result['slo']['ttft_ms']} ms tpot<={result['slo']['tpot_ms']} ms")
    print("| rate (req/s) | arm | req/s | out tok/s | goodput req/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        lo, hi = r["output_tok_s_range"]
        print(f"| {r['request_rate']} | {r['arm']} | {f(r['request_throughput'], '.2f')} | {f(r['output_tok_s'])} ({f(lo)}-{f(hi)}) | "
              f"{f(r['goodput_req_s'], '.2f')} | {f(r['ttft_p50_ms'])} / {f(r['ttft_p99_ms'])} | {f(r['tpot_p50_ms'])} / "
              f"{f(r['tpot_p99_ms'])} | {f(r['itl_p50_ms'])} / {f(r['itl_p99_ms'])} |")
    print()
    for q in result["ratios"]:
        print(f"rate {q['request_rate']}: http/in-process tok/s {q['http_over_in_process_tok_s']:.3f} "
              f"(range {q['range'][0]:.3f}-{q['range'][1]:.3f}), TTFT p50 +{q['ttft_p50_delta_ms']:.1f} ms")
    print(f"plot: {result['plot']}")


def latency_svg(result: dict[str, Any]) -> str:
    """TTFT and TPOT p50 (solid) and p99 (dashed) against offered load, one colour per arm;
    ``inf`` (all at once) is drawn as the rightmost point."""
    rates = [r for r in result["ratios"]]
    xs = [q["request_rate"] for q in rates]
    finite = [x for x in xs if not math.isinf(x)]
    top = (max(finite) * 2 if finite else 1.0)
    pos = {x: (top if math.isinf(x) else x) for x in xs}
    W, H, M = 760, 330, 50
    panels = [("TTFT (ms)", "ttft"), ("TPOT (ms)", "tpot")]
    colours = {"in-process": "#1f77b4", "http": "#d62728"}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
             f'<text x="{W / 2}" y="14" text-anchor="middle">{result["model"]} on {result["device"]}: latency against load '
             f'(req/s; rightmost = all at once)</text>']
    pw = (W - 3 * M) / 2
    for k, (title, key) in enumerate(panels):
        x0, y0, ph = M + k * (pw + M), 30, H - 80
        ys = [r.get(f"{key}_{q}_ms") or 0 for r in result["rows"] for q in ("p50", "p99")]
        ymax = max(ys + [1e-9]) * 1.1
        xmax = max(pos.values()) * 1.05 or 1

        def sx(x: float) -> float:
            return x0 + pw * (pos[x] / xmax)

        def sy(y: float) -> float:
            return y0 + ph * (1 - y / ymax)

        parts.append(f'<rect x="{x0}" y="{y0}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
        parts.append(f'<text x="{x0 + pw / 2}" y="{y0 + ph + 30}" text-anchor="middle">{title}</text>')
        parts.append(f'<text x="{x0 - 4}" y="{y0 + 8}" text-anchor="end">{ymax:.0f}</text><text x="{x0 - 4}" y="{y0 + ph}" text-anchor="end">0</text>')
        for x in xs:
            parts.append(f'<text x="{sx(x)}" y="{y0 + ph + 14}" text-anchor="middle">{"all" if math.isinf(x) else x:g}</text>'
                         if not math.isinf(x) else f'<text x="{sx(x)}" y="{y0 + ph + 14}" text-anchor="middle">all</text>')
        for arm, colour in colours.items():
            for q, dash in (("p50", ""), ("p99", ' stroke-dasharray="4 3"')):
                pts = [(sx(r["request_rate"]), sy(r.get(f"{key}_{q}_ms") or 0)) for r in result["rows"] if r["arm"] == arm]
                path = " ".join(f"{a:.1f},{b:.1f}" for a, b in pts)
                parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"{dash}/>')
        for i, (arm, colour) in enumerate(colours.items()):
            parts.append(f'<text x="{x0 + 8}" y="{y0 + 14 + 13 * i}" fill="{colour}">{arm} (p50 solid, p99 dashed)</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def parse_rates(text: str) -> list[float]:
    return [float("inf") if t.strip() in ("inf", "all") else float(t) for t in text.split(",")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny, smollm2, a checkpoint folder, or qwen2-0.5b (random weights)")
    p.add_argument("--checkpoint", default=None, help="where qwen2-0.5b's random checkpoint is written")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--loop", default="normal")
    p.add_argument("--memory-budget", type=float, default=None,
                   help="each engine's share of device memory (both arms hold the model at once: 0.4 on one GPU)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rates", type=parse_rates, default=[2.0, 8.0, float("inf")])
    p.add_argument("--input-median", type=int, default=128)
    p.add_argument("--input-max", type=int, default=1024)
    p.add_argument("--output-median", type=int, default=128)
    p.add_argument("--output-max", type=int, default=512)
    p.add_argument("--id-max", type=int, default=10000, help="prompt ids are drawn below min(vocab, this)")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch's CPU threads in both arms (1 on a shared CPU box: spinning threads there stall every op)")
    p.add_argument("--malloc", default="default", choices=["default", "steady"])
    p.add_argument("--out", default="serve_http.json")
    return run_benchmark(p.parse_args(), main_async, print_table)


if __name__ == "__main__":
    raise SystemExit(main())

"""Speech serving as omni servers are measured: TTFP, RTF, audio-s/s, playback gaps.

Closed loop: C clients, each sending the next sentence (bench/data/tts_sentences.txt, 200
English sentences of 7-40 words) as soon as its last one has fully arrived; a level's
warm-up requests are excluded. Random weights never stop on the codec EOS reliably, so
every request speaks a fixed number of frames from its text: 12.5 frames a second of
speech at 2.5 words a second (5 frames a word), ``ignore_eos``. Sampling is the
checkpoint's default (temperature 0.9, top-k 50, repetition penalty 1.05; the predictor
the same).

Per request: TTFP (submit to the first audio chunk at the client), RTF (last chunk's
arrival minus submit, over the audio's length), and a player that plays each chunk in real
time from the first chunk's arrival and records the stream's worst silent gap (a chunk
arriving after the audio before it ran out). C50 / C100 / C200: share of streams whose
worst gap is at most 50 / 100 / 200 ms. Per level: audio-s/s, requests/s, GPU busy
(NVML, sampled every 10 ms), the process's peak GPU memory (NVML's figure for this
process: context, weights, KV, graphs and the allocator's pool).

Arms: ``inprocess`` (SpeechPipeline.stream in this event loop) and ``http`` (the same
model behind ``omni-async serve`` in this process, a client streaming raw PCM from
``POST /v1/audio/speech``), closed loop; ``openloop``: requests arrive as a Poisson
process at each of ``--rates`` (requests a second) for ``--duration`` seconds, each
streamed in process, the level over when the last has ended. Each level runs once per
scheduling policy (``--policies``: ``fcfs``, arrival order with no admission limit,
today's behaviour; ``deadline``, least slack first with the admission gate of
``--admission-wait`` / ``--max-streams``), the policies interleaved and their order
alternated across ``--repeats``. A request the gate refuses (HTTP 503's
``OverloadedError``) counts in ``refused`` and as a failure in ``C100_of_arrivals``.
Results print as a table and go to --out (JSON).

    python bench/tts_serving.py --model tts-1.7b --device cuda --streams 1,4,16,64
    python bench/tts_serving.py --model tts-1.7b --device cuda --arms openloop --rates 5,10,20,30 --duration 60 \
        --policies fcfs,deadline --repeats 2 --admission-wait 0.25
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _common import GpuSampler  # noqa: E402

FRAMES_PER_WORD = 5  # 12.5 frames/s at 2.5 words/s
FRAME_S = 0.08


def sentences() -> list[str]:
    return [s for s in (ROOT / "bench/data/tts_sentences.txt").read_text().splitlines() if s.strip()]


def frames_for(text: str) -> int:
    return FRAMES_PER_WORD * len(text.split())


def worst_gap(arrivals: list[tuple[float, float]]) -> float:
    """Playback from the first arrival: ``arrivals`` = (time, seconds of audio)."""
    if not arrivals:
        return float("inf")
    play_end, worst = arrivals[0][0], 0.0
    for t, dur in arrivals:
        if t > play_end:
            worst = max(worst, t - play_end)
            play_end = t
        play_end += dur
    return worst


async def one_inprocess(tts, text: str, frames: int, seed: int) -> dict:
    from omni_async import errors
    from omni_async.speech import SpeechParams

    t0 = time.perf_counter()
    arrivals, audio = [], 0.0
    try:
        async for chunk in tts.stream(text, voice="ryan", language="English",
                                      params=SpeechParams(max_frames=frames, ignore_eos=True, seed=seed)):
            now = time.perf_counter()
            if len(chunk.audio):
                arrivals.append((now, chunk.seconds))
                audio += chunk.seconds
    except errors.OverloadedError as exc:
        return {"t0": t0, "arrivals": [], "audio_s": 0.0, "end": time.perf_counter(), "refused": exc.reason}
    return {"t0": t0, "arrivals": arrivals, "audio_s": audio, "end": time.perf_counter()}


async def one_http(client, url: str, text: str, frames: int, seed: int, rate: int) -> dict:
    body = {"model": "tts", "input": text, "voice": "ryan", "language": "English", "response_format": "pcm",
            "stream_format": "audio", "max_frames": frames, "ignore_eos": True, "seed": seed}
    t0 = time.perf_counter()
    arrivals, audio = [], 0.0
    async with client.stream("POST", url, json=body, timeout=600) as resp:
        resp.raise_for_status()
        async for data in resp.aiter_raw():
            if data:
                sec = len(data) / 2 / rate
                arrivals.append((time.perf_counter(), sec))
                audio += sec
    return {"t0": t0, "arrivals": arrivals, "audio_s": audio, "end": time.perf_counter()}


def summarise(results: list[dict], wall: float, arrivals: int | None = None, since: float | None = None) -> dict:
    """``arrivals``: requests sent (open loop), some maybe unfinished when the level was cut.
    ``since``: when the level's clock started (closed loop): audio-s/s counts only the audio
    that arrived after it, since the measured requests of a closed loop began before it."""
    done = [r for r in results if "refused" not in r]
    refused = len(results) - len(done)
    arrivals = len(results) if arrivals is None else arrivals
    ttfp = np.array([r["arrivals"][0][0] - r["t0"] for r in done if r["arrivals"]]) * 1000
    if not done:
        return {"requests": 0, "wall_s": round(wall, 3), "refused": refused, "unfinished": arrivals - len(results),
                "C100_of_arrivals": 0.0 if arrivals else None}
    rtf = np.array([(r["end"] - r["t0"]) / r["audio_s"] for r in done if r["audio_s"]])
    gaps = np.array([worst_gap(r["arrivals"]) * 1000 for r in done])
    audio = sum(sec for r in done for t, sec in r["arrivals"] if since is None or t >= since)
    pct = lambda a, q: round(float(np.percentile(a, q)), 2) if len(a) else None  # noqa: E731
    return {
        "requests": len(done), "wall_s": round(wall, 3), "audio_s": round(audio, 2),
        "audio_s_per_s": round(audio / wall, 2), "requests_per_s": round(len(done) / wall, 3),
        "ttfp_ms_p50": pct(ttfp, 50), "ttfp_ms_p99": pct(ttfp, 99), "rtf_p50": pct(rtf, 50), "rtf_p99": pct(rtf, 99),
        "worst_gap_ms_p50": pct(gaps, 50), "worst_gap_ms_p95": pct(gaps, 95),
        "C50": round(float((gaps <= 50).mean()), 4), "C100": round(float((gaps <= 100).mean()), 4),
        "C200": round(float((gaps <= 200).mean()), 4),
        "refused": refused,
        "unfinished": arrivals - len(results),
        "C100_of_arrivals": round(float((gaps <= 100).sum()) / arrivals, 4) if arrivals else None,
        "slowest_first_packets": slowest_first_packets(done, since),
        **ttfp_by_start(done, since),
    }


def ttfp_by_start(done: list[dict], since: float | None) -> dict:
    """A closed loop's TTFP split by when each measured request was sent (the headline
    figures mix both): ``ttfp_*_sent_before_clock`` for those sent before the clock started
    (the level's first burst, every stream at once, whose long replies outlast the warm-up
    and are measured), ``ttfp_*_sent_after_clock`` for the rest (the steady state). Where
    a p99 comes from: on the CPU the three slowest first packets of 16 streams were all
    sent in the first burst."""
    if since is None:
        return {}
    out: dict = {}
    for name, keep in (("before", lambda t: t < since), ("after", lambda t: t >= since)):
        ms = np.array([r["arrivals"][0][0] - r["t0"] for r in done if r["arrivals"] and keep(r["t0"])]) * 1000
        out[f"requests_sent_{name}_clock"] = int(len(ms))
        out[f"ttfp_ms_p50_sent_{name}_clock"] = round(float(np.percentile(ms, 50)), 2) if len(ms) else None
        out[f"ttfp_ms_p99_sent_{name}_clock"] = round(float(np.percentile(ms, 99)), 2) if len(ms) else None
    return out


def slowest_first_packets(done: list[dict], since: float | None, n: int = 8) -> list[dict]:
    """The ``n`` slowest first packets: when each request was sent (seconds after the level's
    clock started; negative: before), its TTFP and its audio (where a p99 comes from)."""
    base = since if since is not None else min((r["t0"] for r in done), default=0.0)
    rows = [{"sent_s": round(r["t0"] - base, 3), "ttfp_ms": round(1000 * (r["arrivals"][0][0] - r["t0"]), 1),
             "audio_s": round(r["audio_s"], 2)} for r in done if r["arrivals"]]
    return sorted(rows, key=lambda x: -x["ttfp_ms"])[:n]


async def level(send, streams: int, requests: int, warmup: int, texts: list[str], offset: int) -> tuple[dict, float]:
    """``streams`` closed-loop clients until ``warmup + requests`` requests are done; the
    first ``warmup`` to finish are left out, and the clock starts when they are done."""
    queue = list(range(warmup + requests))
    done: list[dict] = []
    started = {"t": None}

    async def client() -> None:
        while queue:
            i = queue.pop(0)
            text = texts[(offset + i) % len(texts)]
            r = await send(text, frames_for(text), offset + i)
            r["index"] = i
            done.append(r)
            if len(done) == warmup:
                started["t"] = time.perf_counter()

    t_all = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(streams)))
    measured = [r for r in done[warmup:]]
    start = started["t"] or t_all
    # Requests that began before the clock started count only for the audio they produced after it.
    wall = time.perf_counter() - start
    return summarise(measured, wall, since=start), wall


def machine() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node(),
            "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    # The GPU machine gets a copy of the working tree: its git data may be older than the
    # code, so the caller names the commit there (OMNI_COMMIT).
    try:
        info["commit"] = os.environ.get("OMNI_COMMIT") or subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except Exception:
        info["commit"] = "unknown"
    return info


def memory_by_part(tts: SpeechPipeline) -> dict:
    """Where the process's CUDA memory is after loading, in GiB: torch's reserved and
    allocated totals, each memory pool's segments (torch's own, ``(0, 0)``, and each CUDA
    graph pool: the talker's frame and prefill graphs share one, the codec's graphs another),
    and the bytes of each stage's parameters (tensors shared by two modules counted once)."""
    import torch

    gib = 2 ** 30
    pools: dict[str, int] = {}
    for seg in torch.cuda.memory_snapshot():
        key = str(tuple(seg.get("segment_pool_id", (0, 0))))
        pools[key] = pools.get(key, 0) + int(seg["total_size"])

    def size(modules) -> int:
        seen = {id(p): p for m in modules for p in m.parameters()}
        return sum(p.numel() * p.element_size() for p in seen.values())

    params = {"talker_stage": size(tts.stage.model.modules()), "codec": size([tts.codec.decoder])}
    return {"reserved": round(torch.cuda.memory_reserved() / gib, 3), "allocated": round(torch.cuda.memory_allocated() / gib, 3),
            "pools": {k: round(v / gib, 3) for k, v in sorted(pools.items(), key=lambda kv: -kv[1])},
            "parameters": {k: round(v / gib, 3) for k, v in params.items()}}


async def run(args) -> dict:
    import torch

    from omni_async.speech import SpeechPipeline

    texts = sentences()
    sampler = GpuSampler()
    out: dict = {"machine": machine(), "args": vars(args), "levels": {}}
    t0 = time.perf_counter()
    limits = {"kv_capacity_tokens": args.kv_tokens} if args.kv_tokens else {}
    if args.codec_graphs is not None:
        limits["codec_graphs"] = args.codec_graphs == "on"
    if args.decode_steps is not None:
        limits["decode_steps"] = args.decode_steps
    if args.first_chunk_frames is not None:
        limits["first_chunk_frames"] = args.first_chunk_frames
    if args.codec_stream is not None:
        limits["codec_stream"] = args.codec_stream
    if args.codec_sms is not None:
        limits["codec_sms"] = args.codec_sms
    if args.gc == "server":  # what `omni-async serve` sets by default
        limits.update(gc_freeze=True, gc_gen0_threshold=10_000)
    if args.codec_max_frames is not None:  # (at load too: the codec's graphs are captured for its rounds)
        limits["schedule"] = {"codec_max_frames": args.codec_max_frames}
    if args.fused_snake is not None:
        from omni_async.speech import codec_layers

        codec_layers.FUSED_SNAKE = args.fused_snake == "on"
    tts = SpeechPipeline.from_pretrained(args.model, device=args.device, loop=args.loop, dtype=args.dtype, **limits)
    out["load_s"] = round(time.perf_counter() - t0, 2)
    if torch.cuda.is_available() and args.device.startswith("cuda"):
        out["memory_after_load"] = memory_by_part(tts)
        print("memory after load", json.dumps(out["memory_after_load"]), flush=True)
    async with tts:
        offset = 0
        if "inprocess" in args.arms:
            async def send(text, frames, seed):
                return await one_inprocess(tts, text, frames, seed)

            for c in args.streams:
                n = max(args.min_requests, args.requests_per_stream * c)
                for rep_i in range(args.repeats):
                    for policy in arm_order(args.policies, rep_i):
                        tts.set_schedule(schedule_of(policy, args))
                        before = codec_counts(tts)
                        with sampler:
                            res, _ = await level(send, c, n, args.warmup or c, texts, offset)
                        res.update(codec_delta(before, codec_counts(tts)))
                        offset += n + c
                        res["gpu_busy_pct"] = sampler.busy()
                        res["peak_gpu_mem_gib"] = round(sampler.peak_bytes / 2**30, 3) if sampler.peak_bytes else None
                        if torch.cuda.is_available():
                            res["torch_max_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
                        out["levels"][f"inprocess/{policy}/{c}/r{rep_i}"] = res
                        print(f"inprocess {policy} C={c} repeat {rep_i}", json.dumps(res), flush=True)
        if "openloop" in args.arms:
            out["levels"].update(await run_open_loop(tts, args, texts, offset, sampler))
        if "http" in args.arms:
            out["levels"].update(await run_http(tts, args, texts, offset, sampler))
        out["stage_info"] = {k: v for k, v in tts.info().get("speech", {}).items()}
    return out


def codec_counts(tts) -> dict:
    """The codec stage's counters now (those an older checkout has)."""
    info = tts.info().get("speech", {})
    out = {k: info[k] for k in ("codec_calls", "codec_rounds", "codec_frames", "codec_express_calls") if k in info}
    bulk = info.get("codec_bulk_shapes")
    if bulk:
        out.update(bulk_frames_wanted=bulk["frames_wanted"], bulk_frames_computed=bulk["frames_computed"], bulk_calls=bulk["calls"])
    return out


def codec_delta(before: dict, after: dict) -> dict:
    """A level's codec work (warm-up included): calls, rounds, calls a round, frames a bulk
    call, and the share of a bulk call's frames that were a stream's (the rest padding)."""
    d = {k: after[k] - before.get(k, 0) for k in after}
    out = {f"level_{k}": v for k, v in d.items() if k in ("codec_calls", "codec_rounds", "codec_frames", "codec_express_calls")}
    if d.get("bulk_calls"):
        out["level_codec_calls_per_round"] = round(d["bulk_calls"] / max(1, d.get("codec_rounds", 0)), 2)
        out["level_codec_frames_per_bulk_call"] = round(d["bulk_frames_wanted"] / d["bulk_calls"], 1)
        out["level_codec_useful_share"] = round(d["bulk_frames_wanted"] / max(1, d["bulk_frames_computed"]), 4)
    return out


def arm_order(policies: list[str], repeat: int) -> list[str]:
    """The policies of one repeat: their order alternates, so neither always runs first."""
    return policies if repeat % 2 == 0 else policies[::-1]


def schedule_of(policy: str, args) -> "object":
    """The pipeline's schedule for an arm: FCFS as today (no admission limit), deadline
    with the admission gate the flags give; both with the same row budget. A ``-noexpress``
    suffix turns the codec's express lane for first chunks off; ``-bylength`` plans the
    codec's rounds a call per chunk length (``-merged``: the shared-length plan)."""
    from omni_async.speech import SpeechSchedule

    policy, _, suffix = policy.partition("-")
    if suffix not in ("", "noexpress", "bylength", "merged"):
        raise SystemExit(f"unknown policy suffix {suffix!r} (-noexpress, -bylength, -merged)")
    off: dict = {"codec_express": False} if suffix == "noexpress" else {}  # (named only when off: older checkouts lack it)
    if args.codec_max_frames is not None:
        off["codec_max_frames"] = args.codec_max_frames
    plan = {"bylength": "by-length", "merged": "merged"}.get(suffix, args.codec_plan)
    if plan is not None:
        off["codec_round_plan"] = plan
    if policy == "fcfs":
        return SpeechSchedule(policy="fcfs", max_decode_rows=args.decode_rows, **off)
    return SpeechSchedule(policy="deadline", max_decode_rows=args.decode_rows, max_streams=args.max_streams,
                          admission_wait_s=args.admission_wait, ttfp_budget_s=args.ttfp_budget, **off)


async def open_level(tts, rate: float, duration: float, texts: list[str], offset: int, seed: int,
                     drain_s: float = 120.0) -> tuple[dict, int]:
    """Poisson arrivals at ``rate`` a second for ``duration`` seconds, each request
    streamed as it arrives; over when the last one has ended, or ``drain_s`` after the
    last arrival (the rest are cancelled, counted as ``unfinished``: failures)."""
    rng = np.random.default_rng(seed)
    results: list[dict] = []
    tasks = []
    t_start = time.perf_counter()
    i = 0

    async def one(k: int) -> None:
        text = texts[(offset + k) % len(texts)]
        results.append(await one_inprocess(tts, text, frames_for(text), offset + k))

    at = rng.exponential(1.0 / rate)
    while at < duration:
        delay = t_start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
        i += 1
        at += rng.exponential(1.0 / rate)
    _, pending = await asyncio.wait(tasks, timeout=drain_s) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - t_start
    res = summarise(results, wall, arrivals=i)
    res["arrivals"] = i
    res["offered_rate"] = rate
    return res, i


async def run_open_loop(tts, args, texts, offset, sampler) -> dict:
    """Every rate, every repeat, the policies interleaved (see module)."""
    results = {}
    for k in range(args.warmup or 4):  # graphs captured, caches warm, before any arm
        await one_inprocess(tts, texts[k % len(texts)], 10, k)
    for rate in args.rates:
        if args.open_warmup:  # this rate's load once, unmeasured: no arm meets it first
            tts.set_schedule(schedule_of(args.policies[0], args))
            _, n = await open_level(tts, rate, args.open_warmup, texts, offset, seed=7, drain_s=args.drain)
            offset += n
        for rep_i in range(args.repeats):
            for policy in arm_order(args.policies, rep_i):
                tts.set_schedule(schedule_of(policy, args))
                with sampler:
                    res, n = await open_level(tts, rate, args.duration, texts, offset, seed=1000 * rep_i + int(rate * 10),
                                              drain_s=args.drain)
                offset += n
                res["gpu_busy_pct"] = sampler.busy()
                res["policy"] = policy
                results[f"openloop/{policy}/{rate:g}/r{rep_i}"] = res
                print(f"openloop {policy} rate={rate:g}/s repeat {rep_i}", json.dumps(res), flush=True)
                if args.out:  # each level as it ends: a run cut short keeps what it measured
                    Path(args.out + ".partial").write_text(json.dumps(results, indent=1))
    return results


async def run_http(tts, args, texts, offset, sampler) -> dict:
    try:
        import httpx
    except ImportError:  # the openai client's own copy, under its newer name
        import httpx2 as httpx
    import uvicorn

    from omni_async.server.speech import create_speech_app

    app = create_speech_app(tts, model_name="tts", close_engine=False)
    port = args.port
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", loop="none"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    results = {}
    policy = args.policies[0]
    tts.set_schedule(schedule_of(policy, args))
    url = f"http://127.0.0.1:{port}/v1/audio/speech"
    try:
        limits = httpx.Limits(max_connections=max(args.streams) + 8, max_keepalive_connections=max(args.streams) + 8)
        async with httpx.AsyncClient(limits=limits) as client:
            async def send(text, frames, seed):
                return await one_http(client, url, text, frames, seed, tts.sample_rate)

            for c in args.streams:
                n = max(args.min_requests, args.requests_per_stream * c)
                with sampler:
                    res, _ = await level(send, c, n, args.warmup or c, texts, offset)
                offset += n + c
                res["gpu_busy_pct"] = sampler.busy()
                results[f"http/{policy}/{c}"] = res
                print(f"http {policy} C={c}", json.dumps(res), flush=True)
    finally:
        server.should_exit = True
        await task
    return results


def table(out: dict) -> str:
    cols = ["audio_s_per_s", "requests_per_s", "ttfp_ms_p50", "ttfp_ms_p99", "ttfp_ms_p99_sent_before_clock",
            "ttfp_ms_p99_sent_after_clock", "rtf_p50", "rtf_p99", "C50", "C100", "C200",
            "refused", "unfinished", "C100_of_arrivals", "gpu_busy_pct", "peak_gpu_mem_gib"]
    lines = ["| arm/streams | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for name, res in out["levels"].items():
        lines.append(f"| {name} | " + " | ".join(str(res.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def policy_summary(out: dict) -> str:
    """Open-loop levels by policy and rate, repeats pooled (means): C100 of the streams
    served and of all arrivals, TTFP p99, refusals; and per policy the highest rate held
    (C100 of all arrivals >= 99% in every repeat). Empty without open-loop levels."""
    by: dict[tuple[str, float], list[dict]] = {}
    for name, res in out["levels"].items():
        if name.startswith("openloop/"):
            by.setdefault((res["policy"], res["offered_rate"]), []).append(res)
    if not by:
        return ""
    mean = lambda rs, k: round(float(np.mean([r[k] for r in rs if r.get(k) is not None])), 4) if any(r.get(k) is not None for r in rs) else None  # noqa: E731
    lines = ["| policy | rate/s | repeats | C100 served | C100 of arrivals | TTFP p99 ms | refused | unfinished | audio-s/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    held: dict[str, float | None] = {}
    for (policy, rate), rs in sorted(by.items()):
        lines.append(f"| {policy} | {rate:g} | {len(rs)} | {mean(rs, 'C100')} | {mean(rs, 'C100_of_arrivals')} | {mean(rs, 'ttfp_ms_p99')} | "
                     f"{mean(rs, 'refused')} | {mean(rs, 'unfinished')} | {mean(rs, 'audio_s_per_s')} |")
        ok = all((r.get("C100_of_arrivals") or 0) >= 0.99 for r in rs)
        held.setdefault(policy, None)
        if ok and (held[policy] is None or rate > held[policy]):
            held[policy] = rate
    lines += [f"highest rate held (C100 of arrivals >= 99% in every repeat), {p}: {r if r is not None else 'none'}" for p, r in held.items()]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tts-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--loop", default="overlap")
    ap.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--decode-steps", type=int, default=None,
                    help="frames a talker step writes per stream (default: the plan's tiers on CUDA, 4 below 64 streams, 8 from 64)")
    ap.add_argument("--warmup", type=int, default=0, help="requests left out per level (default: one per stream)")
    ap.add_argument("--arms", default="inprocess,http", help="inprocess, http (closed loop), openloop (Poisson arrivals)")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[5, 10, 20, 30],
                    help="openloop: arrival rates, requests a second")
    ap.add_argument("--duration", type=float, default=60.0, help="openloop: seconds of arrivals per level")
    ap.add_argument("--drain", type=float, default=120.0, help="openloop: seconds after the last arrival before the rest are cut")
    ap.add_argument("--open-warmup", type=float, default=0.0,
                    help="openloop: seconds of each rate's arrivals run once, unmeasured, before its arms (on an H100 the first "
                         "arm at a high rate broke where the second held)")
    ap.add_argument("--policies", type=lambda s: s.split(","), default=["deadline"],
                    help="scheduling policies to compare, interleaved: fcfs, deadline (a -noexpress suffix: the codec's express lane off)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each level and policy (order alternated)")
    ap.add_argument("--decode-rows", type=int, default=None, help="a talker step's row budget (both policies)")
    ap.add_argument("--admission-wait", type=float, default=None,
                    help="deadline arm: seconds a request may wait to start before a 503 (none: no gate)")
    ap.add_argument("--max-streams", type=int, default=None, help="deadline arm: streams at once")
    ap.add_argument("--ttfp-budget", type=float, default=0.3, help="deadline arm: a new stream's first-chunk deadline")
    ap.add_argument("--port", type=int, default=8790)
    ap.add_argument("--kv-tokens", type=int, default=None, help="the talker's KV positions (default: the stage's)")
    ap.add_argument("--codec-graphs", choices=("on", "off"), default=None, help="the codec's calls as CUDA graphs (default: the pipeline's)")
    ap.add_argument("--codec-sms", type=int, default=None,
                    help="CUDA: the codec's kernels on at most this many SMs (a green context; default all)")
    ap.add_argument("--gc", choices=("default", "server"), default="default",
                    help="the cyclic GC: Python's settings (the Python API's default) or the server's (gc_freeze, first threshold 10,000)")
    ap.add_argument("--codec-stream", choices=("own", "talker"), default=None,
                    help="CUDA: the codec's calls on a stream of their own (the default) or between the talker's steps on its stream")
    ap.add_argument("--first-chunk-frames", type=int, default=None,
                    help="frames of a stream's first audio chunk (SpeechPipeline.from_pretrained's; default 2)")
    ap.add_argument("--codec-plan", choices=("merged", "by-length"), default=None,
                    help="how a codec round's chunks become calls (SpeechSchedule.codec_round_plan; default merged); "
                         "or an arm's policy suffix: --policies deadline,deadline-bylength")
    ap.add_argument("--codec-max-frames", type=int, default=None,
                    help="frames a codec round decodes at most (SpeechSchedule.codec_max_frames; default 256)")
    ap.add_argument("--fused-snake", choices=("on", "off"), default=None,
                    help="CUDA: the vocoder's elementwise work fused (SnakeBeta in one Triton pass, the residual units' biases in the passes after their convolutions; on, the default) or torch ops")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.arms = args.arms.split(",")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    out = asyncio.run(run(args))
    print(table(out))
    summary = policy_summary(out)
    if summary:
        print(summary)
        out["open_loop_summary"] = summary
    path = Path(args.out) if args.out else ROOT / "bench/results" / f"tts_serving_{args.model}_{args.device}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print("saved", path)


if __name__ == "__main__":
    main()

"""Where an end-to-end speech stream's time goes: the talker's steps, the frames' way to
the codec, the codec's rounds and the client's chunks, on one clock. A diagnosis tool
(bench/tts_serving.py is the benchmark; tools/speech_profile.py times the talker and the
codec apart).

For each level, C streams start at once, each one utterance of ``--frames`` frames
(``ignore_eos``, the checkpoint's default sampling). Recorded with ``perf_counter``:
every talker step's completion (and its rows), every push of frames to the codec, every
codec round (start, end, streams, frames), every chunk the client receives. Printed:

- the first chunk's path for the first stream (submit -> frames reach the codec -> its
  round starts -> ends -> the client has it), with the talker steps in between;
- the steady state (the middle half of the level's wall time): talker steps a second
  and their spacing, frames a step, codec rounds a second, their duration and frames,
  the codec's busy share, and the talker's step spacing while a codec round runs
  against while none does;
- with ``--trace`` on CUDA, a torch.profiler window in the steady state: kernel time by
  CUDA stream (the talker's and the codec's) and the busy share of their union;
- with ``--ab-repeats``, the widest level again under each of ``--variants`` (the talker's
  stream priority, a SpeechSchedule field) against the defaults, alternated;
- with ``--cprofile``, the host's functions by own time over the widest level (every
  thread on Python 3.12).

    python tools/speech_timeline.py --model tts-1.7b --device cuda --streams 1,64 --frames 120 --trace
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni_async.speech import SpeechParams, SpeechPipeline  # noqa: E402


class Recorder:
    """Hooks on the pipeline's talker steps, codec pushes and codec rounds."""

    def __init__(self, tts: SpeechPipeline) -> None:
        self.steps: list[tuple[float, float, int, int]] = []  # (done at, took, running rows, frames written so far)
        self.pushes: list[tuple[float, str, int]] = []
        self.rounds: list[tuple[float, float, int, int]] = []  # (start, end, streams, frames)
        core, runner = tts.engine.scheduler.core, tts.stage.runner
        tts.engine.scheduler.add_step_observer(
            lambda took: self.steps.append((time.perf_counter(), took, len(core.running), runner.frames_written)))
        codec = tts.codec
        push, decode = codec.push, codec._decode

        def on_push(stream, frames):
            self.pushes.append((time.perf_counter(), stream.request_id, int(frames.shape[0])))
            push(stream, frames)

        async def on_decode(ready):
            t0 = time.perf_counter()
            took = await decode(ready)
            self.rounds.append((t0, time.perf_counter(), len(ready), sum(n for _, n in ready)))
            return took

        codec.push, codec._decode = on_push, on_decode

    def clear(self) -> None:
        self.steps.clear()
        self.pushes.clear()
        self.rounds.clear()


def _ms(x: float) -> float:
    return round(1000 * x, 2)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def one(tts: SpeechPipeline, i: int, frames: int, chunks: list) -> None:
    params = SpeechParams(max_frames=frames, ignore_eos=True, seed=i + 1)
    t0 = time.perf_counter()
    got = []
    async for chunk in tts.stream(f"Sentence number {i} for the timeline.", "ryan", "English", params=params, request_id=f"tl-{i}"):
        got.append((time.perf_counter(), chunk.codes.shape[0]))
    chunks.append((f"tl-{i}", t0, got))


def first_chunk_path(rec: Recorder, chunks: list) -> dict:
    rid, t0, got = min(chunks, key=lambda c: c[1])
    first_push = next((t for t, r, _ in rec.pushes if r == rid), None)
    # The first round to start after the stream's first frames came (one ending after them
    # but started before cannot hold them: its time would count as the delivery's).
    rounds = [r for r in rec.rounds if first_push is not None and r[0] >= first_push]
    first_round = rounds[0] if rounds else None
    steps_before = [s for s in rec.steps if t0 <= s[0] <= (first_push or t0)]
    return {"request": rid, "submit_to_first_frames_ms": _ms(first_push - t0) if first_push else None,
            "talker_steps_before": len(steps_before), "their_took_ms": [_ms(s[1]) for s in steps_before],
            "frames_to_round_start_ms": _ms(first_round[0] - first_push) if first_round else None,
            "round_ms": _ms(first_round[1] - first_round[0]) if first_round else None,
            "round_end_to_client_ms": _ms(got[0][0] - first_round[1]) if first_round else None,
            "ttfp_ms": _ms(got[0][0] - t0), "first_chunk_frames": got[0][1]}


def steady(rec: Recorder, start: float, end: float) -> dict:
    lo, hi = start + 0.25 * (end - start), start + 0.75 * (end - start)
    span = hi - lo
    steps = [s for s in rec.steps if lo <= s[0] <= hi]
    gaps = [b[0] - a[0] for a, b in zip(steps, steps[1:])]
    rounds = [r for r in rec.rounds if lo <= r[0] <= hi]
    busy = sum(min(r[1], hi) - max(r[0], lo) for r in rec.rounds if r[1] > lo and r[0] < hi)

    def in_round(t: float) -> bool:
        return any(r[0] <= t <= r[1] for r in rec.rounds)

    with_codec = [g for (a, b), g in zip(zip(steps, steps[1:]), gaps) if in_round(b[0])]
    without = [g for (a, b), g in zip(zip(steps, steps[1:]), gaps) if not in_round(b[0])]
    rows = sum(s[2] for s in steps)
    # frames the talker wrote over the window's steps (a step of k forwards writes k per row)
    frames = steps[-1][3] - steps[0][3] if len(steps) > 1 else 0
    frames_span = steps[-1][0] - steps[0][0] if len(steps) > 1 else span
    return {"window_s": round(span, 3), "talker_steps_per_s": round(len(steps) / span, 1),
            "step_spacing_ms_p50": _ms(_pct(gaps, 0.5)), "step_spacing_ms_p90": _ms(_pct(gaps, 0.9)),
            "step_took_ms_p50": _ms(_pct([s[1] for s in steps], 0.5)),
            "rows_per_step_mean": round(rows / max(1, len(steps)), 1), "frames_per_s": round(frames / max(frames_span, 1e-9), 1),
            "frames_per_step_mean": round(frames / max(1, len(steps) - 1), 1),
            "codec_rounds_per_s": round(len(rounds) / span, 1), "codec_round_ms_p50": _ms(_pct([r[1] - r[0] for r in rounds], 0.5)),
            "codec_round_ms_p90": _ms(_pct([r[1] - r[0] for r in rounds], 0.9)),
            "codec_frames_per_round_mean": round(statistics.mean([r[3] for r in rounds]), 1) if rounds else None,
            "codec_streams_per_round_mean": round(statistics.mean([r[2] for r in rounds]), 1) if rounds else None,
            "codec_busy_share": round(busy / span, 3),
            "step_spacing_ms_p50_codec_running": _ms(_pct(with_codec, 0.5)), "steps_codec_running": len(with_codec),
            "step_spacing_ms_p50_codec_idle": _ms(_pct(without, 0.5)), "steps_codec_idle": len(without)}


def kernel_streams(trace_path: str) -> dict:
    """Kernel time by CUDA stream in a chrome trace, and the busy share of their union."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return {}
    by_stream: dict[str, dict] = {}
    for e in kernels:
        s = by_stream.setdefault(str(e.get("args", {}).get("stream")), {"kernels": 0, "ms": 0.0, "names": {}})
        s["kernels"] += 1
        s["ms"] += e["dur"] / 1000
        s["names"][e["name"][:60]] = s["names"].get(e["name"][:60], 0.0) + e["dur"] / 1000
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    union, cur_s, cur_e = 0.0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            union, cur_s, cur_e = union + cur_e - cur_s, s, e
        else:
            cur_e = max(cur_e, e)
    union += cur_e - cur_s
    window = spans[-1][1] - spans[0][0]
    for s in by_stream.values():
        s["ms"] = round(s["ms"], 2)
        s["top"] = [(n, round(ms, 2)) for n, ms in sorted(s.pop("names").items(), key=lambda kv: -kv[1])[:8]]
    return {"window_ms": round(window / 1000, 2), "busy_union_ms": round(union / 1000, 2), "busy_share": round(union / window, 3),
            "streams": by_stream}


async def level(tts: SpeechPipeline, rec: Recorder, streams: int, frames: int, trace: bool, cprofile: bool = False) -> dict:
    rec.clear()
    host = None
    if cprofile:
        import cProfile
        host = cProfile.Profile()
        host.enable()
    chunks: list = []
    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(one(tts, i, frames, chunks)) for i in range(streams)]
    prof = None
    if trace and tts.stage.runner.device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile
        await asyncio.sleep(0.4 * frames * 0.08 * max(0.3, min(1.0, streams / 64)))  # into the steady state
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        prof.__enter__()
        await asyncio.sleep(0.5)
        prof.__exit__(None, None, None)
    await asyncio.gather(*tasks)
    end = time.perf_counter()
    if host is not None:
        import io
        import pstats
        host.disable()
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(30)
        print(text.getvalue()[-9000:], flush=True)
    out = {"streams": streams, "frames": frames, "wall_s": round(end - t0, 3),
           "ttfp_ms": sorted(_ms(got[0][0] - s) for _, s, got in chunks),
           "first_chunk": first_chunk_path(rec, chunks), "steady": steady(rec, t0, end)}
    out["ttfp_ms"] = {"p50": _pct(out["ttfp_ms"], 0.5), "max": out["ttfp_ms"][-1]}
    if prof is not None:
        path = os.path.join(tempfile.mkdtemp(), "trace.json")
        prof.export_chrome_trace(path)
        out["kernels"] = kernel_streams(path)
    return out


def apply_variant(tts: SpeechPipeline, variant: str) -> None:
    """``default``; ``priority=N``: the talker's stream at priority N; ``codec_max_frames=N``
    (0: no budget) or another SpeechSchedule field (``policy=fcfs``: no deadline order and
    no first-chunk express)."""
    runner = tts.stage.runner
    if runner.stream is not None:  # the talker's stream: its own priority unless the variant says
        runner.release_stream()
        saved = runner.stream_priority
        if variant.startswith("priority="):
            runner.stream_priority = int(variant.split("=")[1])
        runner.use_own_stream(runner.device)
        runner.stream_priority = saved
    from omni_async.speech import SpeechSchedule
    if variant.startswith("priority=") or variant == "default":
        tts.set_schedule(SpeechSchedule())
    else:
        name, value = variant.split("=")
        tts.set_schedule(SpeechSchedule(**{name: (int(value) or None) if value.isdigit() else value}))


async def main(args) -> None:
    tts = SpeechPipeline.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    rec = Recorder(tts)
    res = {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "model": args.model,
           "commit": os.environ.get("OMNI_COMMIT"), "levels": []}
    async with tts:
        await level(tts, rec, 2, 24, False)  # warm-up
        for c in args.streams:
            r = await level(tts, rec, c, args.frames, args.trace, args.cprofile and c == max(args.streams))
            res["levels"].append(r)
            print(json.dumps(r, indent=1), flush=True)
        for i in range(args.ab_repeats):  # the widest level under each variant and the defaults, alternated
            order = ["default", *args.variants] if i % 2 == 0 else [*args.variants, "default"]
            for variant in order:
                apply_variant(tts, variant)
                r = await level(tts, rec, max(args.streams), args.frames, False)
                r["variant"] = variant
                res["levels"].append(r)
                print("variant", variant, r["ttfp_ms"], {k: r["steady"][k] for k in ("step_spacing_ms_p50", "frames_per_s", "codec_busy_share",
                                                                                   "codec_round_ms_p90")}, flush=True)
                apply_variant(tts, "default")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tts-tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--frames", type=int, default=60)
    p.add_argument("--trace", action="store_true", help="a torch.profiler window in the steady state (CUDA)")
    p.add_argument("--cprofile", action="store_true", help="the host's functions by own time over the widest level")
    p.add_argument("--variants", type=lambda x: x.split(","), default=["priority=0", "codec_max_frames=0"],
                   help="variants of the widest level run against the defaults: priority=N (the talker's stream), a SpeechSchedule field=N (0: None)")
    p.add_argument("--ab-repeats", type=int, default=0, help="rounds of the variants against the defaults, order alternated")
    p.add_argument("--out", default=None)
    asyncio.run(main(p.parse_args()))

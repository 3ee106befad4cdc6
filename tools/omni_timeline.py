"""Where a burst of Qwen3-Omni replies spends the time to its first audio: the thinker's
steps, the talker's prompts, the talker's steps (prefill pieces, rows, frames), the codec's
rounds and each reply's milestones, on one clock. A diagnosis tool (bench/omni_serving.py
is the benchmark).

C replies start at once (the bench's chat prompts, random weights at its shapes; greedy,
``--reply`` text tokens and ``--frames`` frames each). Recorded with ``perf_counter``: each
reply's first text token, talker request and first audio chunk; every step of the thinker
and of the talker when it ends (its running requests, the talker's frames written and
prefill pieces replayed so far); every pass of the talker's input (prompts or text rows);
every codec round. Printed: the milestones' p50 / max, then for the window from the first
talker request to the last first chunk the talker's steps one by one (what each ran, how
long it took), the thinker's steps and the codec's rounds in it, and with ``--trace`` on
CUDA the kernel time of each CUDA stream in a profiler window from the burst's start
(``--trace-s``).

    python tools/omni_timeline.py --device cuda --streams 64 --trace
    python tools/omni_timeline.py --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tools"))

from omni_serving import chat_prompt, make_folder  # noqa: E402
from speech_timeline import kernel_streams  # noqa: E402

from omni_async import SamplingParams  # noqa: E402
from omni_async.speech.omni_pipeline import OmniPipeline  # noqa: E402


def _ms(x: float) -> float:
    return round(1000 * x, 1)


class Recorder:
    """Hooks on the pipeline's thinker and talker steps, its input passes and codec rounds."""

    def __init__(self, pipe: OmniPipeline) -> None:
        self.thinker: list[tuple[float, float, int]] = []  # (done at, took, running)
        self.talker: list[tuple[float, float, int, int, int]] = []  # (done at, took, running, frames so far, prefill pieces so far)
        self.passes: list[tuple[float, float, str, int]] = []  # (start, end, kind, items)
        self.rounds: list[tuple[float, float, int, int]] = []  # (start, end, streams, frames)
        self.submits: dict[str, float] = {}
        thinker_core = pipe.thinker.scheduler.core
        pipe.thinker.scheduler.add_step_observer(lambda took: self.thinker.append((time.perf_counter(), took, len(thinker_core.running))))
        talker_core, runner = pipe.talker.engine.scheduler.core, pipe.talker.runner

        def replays() -> int:
            graphs = runner.prefill_graphs
            return 0 if graphs is None else graphs.replays

        pipe.talker.engine.scheduler.add_step_observer(
            lambda took: self.talker.append((time.perf_counter(), took, len(talker_core.running), runner.frames_written, replays())))
        run_pass = pipe.input._run_pass

        async def on_pass(many: Any, wanted: list) -> None:
            t0 = time.perf_counter()
            await run_pass(many, wanted)
            self.passes.append((t0, time.perf_counter(), "prompts" if many == pipe.input.prompts_of else "rows", len(wanted)))

        pipe.input._run_pass = on_pass
        decode = pipe.codec._decode

        async def on_decode(ready: Any) -> Any:
            t0 = time.perf_counter()
            took = await decode(ready)
            self.rounds.append((t0, time.perf_counter(), len(ready), sum(n for _, n in ready)))
            return took

        pipe.codec._decode = on_decode
        submit = pipe.talker.engine.submit

        async def on_submit(*a: Any, **kw: Any) -> Any:
            self.submits[kw.get("request_id", "")] = time.perf_counter()
            return await submit(*a, **kw)

        pipe.talker.engine.submit = on_submit

    def clear(self) -> None:
        for kept in (self.thinker, self.talker, self.passes, self.rounds):
            kept.clear()
        self.submits.clear()


async def reply(pipe: OmniPipeline, rid: str, prompt: list[int], args: argparse.Namespace) -> dict[str, float | None]:
    sampling = SamplingParams(max_new_tokens=args.reply, temperature=0.0, ignore_eos=True)
    seen: dict[str, float | None] = {"start": time.perf_counter(), "text": None, "audio": None}
    async for d in pipe.stream(input_ids=prompt, voice="ethan", sampling=sampling, max_frames=args.frames, request_id=rid):
        kind = "text" if d.kind == "text" else "audio"
        if seen[kind] is None and (kind == "text" or (d.audio is not None and len(d.audio.audio))):
            seen[kind] = time.perf_counter()
    return seen


def _p(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 1) if xs else None


def burst(rec: Recorder, replies: dict[str, dict], t0: float) -> dict:
    """The milestones, and what ran between the first talker request and the last first chunk."""
    text = [_ms(r["text"] - t0) for r in replies.values() if r["text"]]
    audio = [_ms(r["audio"] - t0) for r in replies.values() if r["audio"]]
    submits = [_ms(t - t0) for rid, t in rec.submits.items() if rid in replies]
    out: dict[str, Any] = {"first_text_ms": {"p50": _p(text, 0.5), "max": _p(text, 1.0)},
                           "talker_request_ms": {"p50": _p(submits, 0.5), "min": _p(submits, 0.0), "max": _p(submits, 1.0)},
                           "first_audio_ms": {"p50": _p(audio, 0.5), "max": _p(audio, 1.0)}}
    if not submits or not audio:
        return out
    lo, hi = t0 + min(submits) / 1000, t0 + max(audio) / 1000
    steps, last = [], None
    for done, took, running, frames, pieces in rec.talker:
        if lo <= done <= hi:
            prev = last or (frames, pieces)
            steps.append({"at_ms": _ms(done - t0), "took_ms": _ms(took), "running": running, "frames": frames - prev[0],
                          "prefill_replays": pieces - prev[1]})
        last = (frames, pieces)
    thinker = [(d, took) for d, took, _ in rec.thinker if lo <= d <= hi]
    rounds = [(s, e, n, f) for s, e, n, f in rec.rounds if e >= lo and s <= hi]
    passes = [(s, e, k, n) for s, e, k, n in rec.passes if e >= t0 and s <= hi]
    out["window_ms"] = [_ms(lo - t0), _ms(hi - t0)]
    out["talker_steps"] = steps
    out["talker"] = {"steps": len(steps), "took_ms_sum": round(sum(s["took_ms"] for s in steps), 1),
                     "prefill_replays": sum(s["prefill_replays"] for s in steps), "frames": sum(s["frames"] for s in steps)}
    out["thinker"] = {"steps": len(thinker), "took_ms_p50": _p([_ms(t) for _, t in thinker], 0.5),
                      "took_ms_sum": round(sum(_ms(t) for _, t in thinker), 1)}
    out["codec"] = {"rounds": len(rounds), "ms_sum": round(sum(_ms(e - s) for s, e, _, _ in rounds), 1),
                    "streams": sum(n for _, _, n, _ in rounds), "frames": sum(f for _, _, _, f in rounds)}
    out["input_passes"] = [{"at_ms": _ms(s - t0), "took_ms": _ms(e - s), "kind": k, "items": n} for s, e, k, n in passes]
    return out


async def _stop_after(prof: Any, seconds: float) -> None:
    """End the profiler's window ``seconds`` into the burst (a whole burst's kernels make a
    trace of hundreds of MB)."""
    await asyncio.sleep(seconds)
    prof.__exit__(None, None, None)


async def main_async(args: argparse.Namespace, folder: Path) -> dict:
    raw = json.loads((folder / "config.json").read_text())
    limits = dict(max_running_requests=max(64, args.streams))
    pipe = OmniPipeline.from_pretrained(folder, device=args.device, dtype=args.dtype,
                                        thinker_limits={**limits, "kv_capacity_tokens": args.thinker_kv_tokens},
                                        talker_limits={**limits, "kv_capacity_tokens": args.talker_kv_tokens})
    rec = Recorder(pipe)
    rng = random.Random(0)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                           "args": vars(args), "bursts": []}
    async with pipe:
        warm = argparse.Namespace(**{**vars(args), "reply": 4, "frames": 4})
        await reply(pipe, "omni-timeline-warm", chat_prompt(raw, args.prompt, rng), warm)
        for n in range(args.repeats):
            rec.clear()
            prompts = [chat_prompt(raw, args.prompt, rng) for _ in range(args.streams)]
            prof = None
            if args.trace and args.device == "cuda":
                from torch.profiler import ProfilerActivity, profile
                prof = profile(activities=[ProfilerActivity.CUDA])
                prof.__enter__()
            t0 = time.perf_counter()
            ids = [f"omni-timeline-{n}-{i}" for i in range(args.streams)]
            stop = asyncio.ensure_future(_stop_after(prof, args.trace_s)) if prof is not None else None
            done = await asyncio.gather(*(reply(pipe, rid, p, args) for rid, p in zip(ids, prompts)))
            if stop is not None:
                await stop
            out = burst(rec, dict(zip(ids, done)), t0)
            out["wall_ms"] = _ms(time.perf_counter() - t0)
            if prof is not None:
                path = os.path.join(tempfile.mkdtemp(), "trace.json")
                prof.export_chrome_trace(path)
                out["kernels"] = kernel_streams(path)
            res["bursts"].append(out)
            print(json.dumps({k: v for k, v in out.items() if k != "talker_steps"}, indent=1), flush=True)
            for s in out.get("talker_steps", [])[: args.print_steps]:
                print("talker step", s, flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--streams", type=int, default=None, help="replies started together (default 64; 4 with --smoke)")
    ap.add_argument("--prompt", type=int, default=100, help="chat prompt tokens")
    ap.add_argument("--reply", type=int, default=100, help="text tokens a reply")
    ap.add_argument("--frames", type=int, default=125, help="speech frames a reply")
    ap.add_argument("--repeats", type=int, default=1, help="bursts, one after another")
    ap.add_argument("--trace", action="store_true", help="CUDA: kernel time by stream over each burst (torch.profiler)")
    ap.add_argument("--trace-s", type=float, default=1.5, help="the profiler's window from the burst's start, seconds")
    ap.add_argument("--print-steps", type=int, default=60, help="the talker's steps printed one by one")
    ap.add_argument("--thinker-kv-tokens", type=int, default=16384)
    ap.add_argument("--talker-kv-tokens", type=int, default=16384)
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny config, few tokens: checks the script runs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.device, args.dtype, args.prompt, args.reply, args.frames = "cpu", "float32", 40, 8, 6
    args.streams = args.streams or (4 if args.smoke else 64)
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(main_async(args, make_folder(Path(tmp) / "qwen3-omni-random", args.smoke)))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

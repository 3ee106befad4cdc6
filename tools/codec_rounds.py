"""The codec stage's rounds under a device-cost model: how many calls a round makes, what
they pad, and the device time a second of audio costs, for the stage's real scheduling
code at 64 streams, on the CPU.

Why: at 64 streams the codec bounds Qwen3-TTS serving on the H100 (bench/RESULTS.md), and a
codec call's time there is mostly not its frames: a graphed call costs about 2.8 ms +
0.040 ms a stream + 0.046 ms a frame + 0.037 ms a (stream x frame) (least squares over the
twelve shapes of `results/codec_variants_1.7b_h100_eb9a01e.json`, within ~15%). So four small
calls a round cost about twice one call of the same frames. Which rounds the stage makes
depends on when streams' chunks become ready, i.e. on the talker's timing and the listeners'
buffers, not on the device: this runs the real `CodecStage` (rounds, express lane, chunk
targets, listeners' playback on the wall clock) with a decoder that sleeps the modelled
time of each call (`codec_plan.call_cost`) (its batch padded to the graphs' bucket) and returns silence, fed by a
model talker: every step, each running stream gets `--frames-per-step` frames; a step takes
that many frames' time at the talker's measured rate for its running streams (H100, 1.7B,
graphed, alone: 5.31 / 6.54 / 7.04 ms a frame at 1 / 16 / 64 streams) times `--talker-slowdown`
(the two stages share the device), and a codec call takes its modelled time
times `--codec-slowdown` (its device time counted as the modelled time). Closed loop: a stream's next request starts when its last
chunk arrives, after one step of prefill; lengths from bench/data's sentences (5 frames a word).

    python tools/codec_rounds.py --streams 64 --requests-per-stream 3 --arms by-length,merged

The figures are the model's: what ranks arms is codec device time per audio second and calls
a round; the GPU decides (bench/tts_serving.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omni_async.speech.codec import CodecDecoder  # noqa: E402
from omni_async.speech.codec_config import CodecConfig  # noqa: E402
from omni_async.speech.codec_plan import CALL_COST_MS, ROUND_PLANS, call_cost  # noqa: E402
from omni_async.speech.codec_stage import CodecStage  # noqa: E402

TALKER_MS = ((1, 5.31), (16, 6.54), (64, 7.04))  # ms a frame by running streams (H100, 1.7B, alone)


def talker_frame_ms(streams: int) -> float:
    xs, ys = zip(*TALKER_MS)
    return float(np.interp(math.log2(max(1, streams)), [math.log2(x) for x in xs], ys))


class TimedDecoder(CodecDecoder):
    """The tiny decoder's shapes, a call's modelled device time slept on the lane's thread,
    silence out; the device time summed."""

    def __init__(self, config: CodecConfig) -> None:
        super().__init__(config)
        self.busy_s = 0.0
        self.slowdown = 1.0  # wall time a call takes over its modelled time (beside the talker)
        self.lock = threading.Lock()

    def forward(self, codes, past, position):  # type: ignore[override]
        b, f = codes.shape[0], codes.shape[1]
        took = call_cost(b, f) / 1000.0
        time.sleep(took * self.slowdown)
        with self.lock:
            self.busy_s += took
        return torch.zeros(b, f * self.samples_per_frame), list(past)


async def run_arm(arm: str, args: argparse.Namespace, lengths: list[int]) -> dict:
    decoder = TimedDecoder.random(CodecConfig.tiny(), seed=0)
    decoder.slowdown = args.codec_slowdown
    stage = CodecStage(decoder, torch.device("cpu"), slots=args.streams, max_frames_per_round=args.max_frames,
                       first_chunk_frames=args.first_chunk_frames,
                       express=True, round_plan=arm)
    rng = random.Random(args.seed)
    running: dict[int, dict] = {}  # stream index -> its request's state
    done: list[dict] = []
    stop = asyncio.Event()
    codes = torch.zeros(args.frames_per_step, 16, dtype=torch.long)

    async def reader(i: int, req: dict) -> None:
        async for chunk in req["stream"].receive:
            if req["first"] is None:
                req["first"] = time.perf_counter()
        req["end"] = time.perf_counter()
        req["gap"] = req["stream"].playback.worst_gap_s
        done.append(req)
        running.pop(i, None)
        if req["n"] + 1 < args.requests_per_stream:
            start(i, req["n"] + 1)
        elif not running:
            stop.set()

    def start(i: int, n: int) -> None:
        req = {"n": n, "frames": rng.choice(lengths), "written": 0, "sent": time.perf_counter(), "first": None,
               "stream": stage.open(f"s{i}r{n}"), "prefilled": False}
        running[i] = req
        asyncio.get_running_loop().create_task(reader(i, req))

    async def talker() -> None:
        while not stop.is_set():
            rows = [r for r in running.values() if r["written"] < r["frames"]]
            if not rows:
                await asyncio.sleep(0.001)
                continue
            k = args.frames_per_step
            await asyncio.sleep(k * talker_frame_ms(len(rows)) * args.talker_slowdown / 1000.0)
            for r in rows:
                if not r["prefilled"]:  # its prompt's step writes no frame
                    r["prefilled"] = True
                    continue
                n = min(k, r["frames"] - r["written"])
                stage.push(r["stream"], codes[:n])
                r["written"] += n
                if r["written"] >= r["frames"]:
                    stage.end(r["stream"], "length")

    codec = asyncio.get_running_loop().create_task(stage.run())
    started = time.perf_counter()
    for i in range(args.streams):
        start(i, 0)
    talk = asyncio.get_running_loop().create_task(talker())
    stopped = asyncio.get_running_loop().create_task(stop.wait())
    await asyncio.wait([stopped, codec], return_when=asyncio.FIRST_COMPLETED)
    if codec.done():
        stopped.cancel()
        codec.result()  # the stage's loop ended: its error
        raise RuntimeError("the codec stage's loop ended")
    wall = time.perf_counter() - started
    talk.cancel()
    codec.cancel()
    for task in (talk, codec):
        try:
            await task
        except asyncio.CancelledError:
            pass
    audio_s = sum(r["frames"] for r in done) * 0.08
    ttfp = np.array([(r["first"] - r["sent"]) * 1000 for r in done if r["first"] is not None])
    gaps = np.array([r["gap"] * 1000 for r in done])
    shapes = stage.bulk_shapes.summary()
    return {"arm": arm, "requests": len(done), "wall_s": round(wall, 3), "audio_s_per_s": round(audio_s / wall, 1),
            "codec_busy_share": round(decoder.busy_s / wall, 3),
            "codec_ms_per_audio_s": round(decoder.busy_s * 1000 / audio_s, 2),
            "rounds": stage.rounds, "bulk_calls": shapes["calls"], "calls_per_round": round(shapes["calls"] / max(1, stage.rounds), 2),
            "frames_per_bulk_call": round(shapes["frames_wanted"] / max(1, shapes["calls"]), 1),
            "useful_share": shapes["useful_share"], "express_calls": stage.express_calls,
            "ttfp_ms_p50": round(float(np.percentile(ttfp, 50)), 1), "ttfp_ms_p99": round(float(np.percentile(ttfp, 99)), 1),
            "worst_gap_ms_p95": round(float(np.percentile(gaps, 95)), 1), "C100": round(float(np.mean(gaps <= 100)), 4),
            "by_shape": shapes["by_shape"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--requests-per-stream", type=int, default=3)
    ap.add_argument("--frames-per-step", type=int, default=8)
    ap.add_argument("--talker-slowdown", type=float, default=1.5, help="the talker's step time over its alone time")
    ap.add_argument("--codec-slowdown", type=float, default=2.0,
                    help="a call's wall time over its modelled alone time (the H100 timeline: ~2x beside the talker)")
    ap.add_argument("--first-chunk-frames", type=int, default=2, help="a stream's first chunk (the pipeline's default 2)")
    ap.add_argument("--max-frames", type=int, default=256, help="the codec round's frame budget (SpeechSchedule.codec_max_frames)")
    ap.add_argument("--arms", default=",".join(ROUND_PLANS))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lengths = [5 * len(s.split()) for s in (ROOT / "bench/data/tts_sentences.txt").read_text().splitlines() if s.strip()]
    results = []
    for r in range(args.repeats):
        for arm in args.arms.split(","):
            res = asyncio.run(run_arm(arm, args, lengths))
            res["repeat"] = r
            results.append(res)
            print(json.dumps({k: v for k, v in res.items() if k != "by_shape"}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "cost_ms": CALL_COST_MS, "talker_ms": TALKER_MS,
                                              "results": results}, indent=1))
        print("saved", args.out)


if __name__ == "__main__":
    main()

"""The Qwen3-Omni talker stage's frame rate at concurrency (issue 59): C streams at once,
each a talker prompt of ``--prompt`` rows and a thinker reply of ``--reply`` text rows,
``--frames`` frames each, greedy, random weights drawn on the device at the shapes of
transformers' default Qwen3-Omni talker config (talker: 20 MoE layers, hidden 1024, 128
experts top-8 of 384 channels, a shared expert of 2048... as transformers 5.25's
``Qwen3OmniMoeTalkerConfig`` defaults say; the code predictor: 5 layers, hidden 1024) with
``--groups`` codebooks (16: the released codec's count; transformers' default says 32).

Prints, per concurrency: wall s, frames/s (all streams), ms a talker step (wall / frames),
first-frame latency p50/p90 (submission to the first frame's delta; no codec: not TTFP),
RTF at 12.5 frames a second (wall / audio seconds of one stream), and the device's peak
memory; saves the JSON to ``--out``. On CUDA the frames replay the talker's frame graphs
and its prefills its prefill graphs, as the stage's defaults do.

    python bench/omni_talker_frames.py --device cuda --concurrency 1,8,32,64 --out bench/results/omni_talker_frames.json
    python bench/omni_talker_frames.py --smoke          # CPU, a tiny shape: checks it runs
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from omni_async.speech.omni_config import OmniTalkerConfig
from omni_async.speech.omni_stage import build_omni_talker_stage, talker_request
from omni_async.speech.omni_talker import TalkerPrompt

from omni_serving import CODEC_IDS, TALKER  # noqa: E402  (the end-to-end benchmark's shapes: one place)

FRAME_RATE = 12.5


def talker_config(groups: int, smoke: bool) -> OmniTalkerConfig:
    from transformers import Qwen3OmniMoeConfig

    raw = Qwen3OmniMoeConfig().to_dict()
    t = raw["talker_config"]
    t.update(CODEC_IDS)
    t["code_predictor_config"]["num_code_groups"] = groups
    t["text_config"].update(TALKER)  # transformers' defaults name no experts
    if smoke:
        t["text_config"].update(num_hidden_layers=2, num_experts=8, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                shared_expert_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        t["code_predictor_config"].update(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=16)
        t["thinker_hidden_size"] = 64
    cfg = OmniTalkerConfig.from_dict(raw)
    return dataclasses.replace(cfg, talker=dataclasses.replace(cfg.talker, dtype="bfloat16"))


async def level(stage, cfg: OmniTalkerConfig, streams: int, args) -> dict:
    h = cfg.talker.hidden_size
    gen = torch.Generator().manual_seed(streams)
    prompts = [TalkerPrompt(torch.randn(args.prompt, h, generator=gen), torch.randn(args.reply, h, generator=gen))
               for _ in range(streams)]
    engine = stage.engine
    first: list[float] = []
    frames: list[int] = []

    async def one(prompt: TalkerPrompt) -> None:
        t0 = time.perf_counter()
        handle = await engine.submit(**talker_request(stage.model, prompt, max_frames=args.frames))
        seen, got_first = 0, False
        async for delta in handle:
            seen += 0 if delta.hidden_states is None else delta.hidden_states.shape[0]
            if seen >= 2 and not got_first:  # the prefill's row, then frame 0's
                first.append(time.perf_counter() - t0)
                got_first = True
        frames.append(max(0, seen - 1))

    if torch.cuda.is_available() and args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    total = sum(frames)
    q = sorted(first)
    return {
        "streams": streams, "wall_s": round(wall, 3), "frames": total, "frames_per_s": round(total / wall, 1),
        "ms_per_step": round(1000 * wall / max(1, max(frames)), 2),
        "first_frame_p50_ms": round(1000 * statistics.median(q), 1) if q else None,
        "first_frame_p90_ms": round(1000 * q[min(len(q) - 1, int(0.9 * len(q)))], 1) if q else None,
        "rtf": round(wall / (max(1, max(frames)) / FRAME_RATE), 3),
        "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if args.device == "cuda" else None,
    }


async def main_async(args) -> dict:
    cfg = talker_config(args.groups, args.smoke)
    stage = build_omni_talker_stage(cfg, device=args.device, loop=args.loop, dtype=args.dtype)
    rows = []
    async with stage.engine:
        await level(stage, cfg, 1, argparse.Namespace(**{**vars(args), "frames": 4}))  # warm-up
        for c in args.concurrency:
            row = await level(stage, cfg, c, args)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return {"benchmark": "omni_talker_frames", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "machine": platform.node(), "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
            "torch": torch.__version__, "config": {k: v for k, v in vars(args).items()}, "levels": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--loop", default="overlap")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64])
    ap.add_argument("--prompt", type=int, default=100, help="talker prompt rows")
    ap.add_argument("--reply", type=int, default=100, help="thinker reply rows (trailing text)")
    ap.add_argument("--frames", type=int, default=150, help="frames a stream (12 s of audio)")
    ap.add_argument("--groups", type=int, default=16, help="codebooks a frame")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, few frames: checks the script runs")
    ap.add_argument("--out", default="bench/results/omni_talker_frames.json")
    args = ap.parse_args()
    if args.smoke:
        args.device, args.dtype, args.concurrency, args.frames, args.prompt, args.reply = "cpu", "float32", [1, 4], 6, 12, 4
    result = asyncio.run(main_async(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("saved", args.out)


if __name__ == "__main__":
    main()

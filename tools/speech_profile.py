"""Where a speech step's time goes: the talker stage alone (frames/s by batch, no codec),
the codec alone (ms per decoder call by streams and frames, eager and, on CUDA, through the
codec stage's graphs), and a torch.profiler table
of the talker's steps; on CUDA the code predictor's frame alone, graphed. A diagnosis tool, not a benchmark (bench/tts_serving.py is).

    python tools/speech_profile.py --model tts-1.7b --device cuda
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni_async.speech import SpeechParams, SpeechPipeline  # noqa: E402


async def talker_only(tts: SpeechPipeline, batch: int, frames: int) -> dict:
    """``batch`` requests of ``frames`` frames through the talker stage alone."""
    params = SpeechParams(max_frames=frames, ignore_eos=True, seed=1)
    before = tts.info()

    async def one(i: int) -> int:
        rows, sampling, metadata = tts._prompt(f"Sentence number {i} for the profile.", "ryan", "English", params)
        n = 0
        async for delta in tts.engine.stream(input_embeds=rows, sampling=sampling, metadata=metadata):
            n += len(delta.token_ids)
        return n

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(batch)))
    wall = time.perf_counter() - t0
    after = tts.info()
    steps = after["decode_steps"] - before["decode_steps"]
    return {"batch": batch, "frames": frames, "wall_s": round(wall, 3), "ms_per_frame_step": round(1000 * wall / frames, 3),
            "decode_steps": steps, "graph_replays": after["speech_frame_graph_replays"] - before["speech_frame_graph_replays"],
            "audio_s_per_s": round(batch * frames * 0.08 / wall, 1)}


def codec_calls(tts: SpeechPipeline, device: str) -> list[dict]:
    dec = tts.codec.decoder
    out = []
    for b in (1, 16, 64):
        for f in (2, 8, 16):
            states = [dec.new_state() for _ in range(b)]
            chunks = [torch.randint(0, 2048, (f, 16), device=device) for _ in range(b)]
            for _ in range(3):
                dec.decode_streams(chunks, states)
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            n = 5
            for _ in range(n):
                dec.decode_streams(chunks, states)
            if device == "cuda":
                torch.cuda.synchronize()
            ms = 1000 * (time.perf_counter() - t0) / n
            out.append({"streams": b, "frames": f, "ms_per_call": round(ms, 3), "audio_s_per_s": round(b * f * 0.08 / (ms / 1000), 1)})
            print("codec", out[-1], flush=True)
    return out


def codec_graphed(tts: SpeechPipeline, batches=(1, 16, 64), frames=(2, 4, 8, 16)) -> list[dict]:
    """The codec stage's own calls (its CUDA graphs, on its stream, slots opened as the
    stage opens them): ms a call by streams and frames, the device's time for a round."""
    stage = tts.codec
    out = []
    for b in batches:
        slots = [stage.slots.open() for _ in range(b)]
        try:
            for f in frames:
                codes = torch.randint(0, 2048, (b, f, 16), device=stage.device)
                with stage._on_codec_stream():
                    for _ in range(3):
                        stage.graphs.run(codes, slots)
                    torch.cuda.synchronize()
                    n = 10
                    t0 = time.perf_counter()
                    for _ in range(n):
                        stage.graphs.run(codes, slots)
                    torch.cuda.synchronize()
                ms = 1000 * (time.perf_counter() - t0) / n
                out.append({"streams": b, "frames": f, "ms_per_call": round(ms, 3), "ms_per_frame_of_each_stream": round(ms / f, 3),
                            "audio_s_per_s": round(b * f * 0.08 / (ms / 1000), 1)})
                print("codec graphed", out[-1], flush=True)
        finally:
            for slot in slots:
                stage.slots.close(slot)
    return out


def codec_variants(tts: SpeechPipeline, shapes=((64, 8), (16, 8), (1, 4)), repeats: int = 2) -> dict:
    """The codec's graphed call with its elementwise work as torch ops or fused (SnakeBeta in
    one pass, written after a causal convolution's past, the residual units' biases in the
    passes after their convolutions) and its dilation-9 convolutions as declared or over
    their input's phases: fresh slots and graphs per variant (the flags are read at capture), ms a call by
    (streams, frames), the variants interleaved ``repeats`` times; then torch.profiler's
    kernel table of the default variant's first shape."""
    from torch.profiler import ProfilerActivity, profile

    from omni_async.speech import codec_layers
    from omni_async.speech.codec_graphs import CodecGraphs
    from omni_async.speech.codec_slots import CodecSlots
    dec = tts.codec.decoder
    rows, table = [], ""
    stream = torch.cuda.Stream()
    default = (codec_layers.FUSED_SNAKE, codec_layers.POLYPHASE_DILATION)
    for repeat in range(repeats):
        for fused, phases in ((False, 0), (True, 0), (False, 9), (True, 9)):
            codec_layers.FUSED_SNAKE, codec_layers.POLYPHASE_DILATION = fused, phases
            with torch.cuda.stream(stream):
                slots = CodecSlots(dec, 64)
                graphs = CodecGraphs(slots, batches=tuple(sorted({b for b, _ in shapes})), frames=tuple(sorted({f for _, f in shapes})))
                opened = [slots.open() for _ in range(64)]
                for b, f in shapes:
                    codes = torch.randint(0, 2048, (b, f, 16), device="cuda")
                    for _ in range(3):
                        graphs.run(codes, opened[:b])
                    torch.cuda.synchronize()
                    n = 10
                    t0 = time.perf_counter()
                    for _ in range(n):
                        graphs.run(codes, opened[:b])
                    torch.cuda.synchronize()
                    ms = 1000 * (time.perf_counter() - t0) / n
                    rows.append({"fused": fused, "polyphase_dilation": phases, "repeat": repeat, "streams": b, "frames": f,
                                 "ms_per_call": round(ms, 3)})
                    print("codec variant", rows[-1], flush=True)
                    if repeat == 0 and (fused, phases) == default and (b, f) == shapes[0]:
                        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                            for _ in range(3):
                                graphs.run(codes, opened[:b])
                            torch.cuda.synchronize()
                        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
                        print(table, flush=True)
            del graphs, slots
            torch.cuda.empty_cache()
    codec_layers.FUSED_SNAKE, codec_layers.POLYPHASE_DILATION = default
    return {"variants": rows, "profile_table": table}


def draw_alone(rows_list=(1, 64), vocab: int = 2048) -> list[dict]:
    """The predictor's sampled draw kernel alone over bf16 logits: us a launch over the
    whole row's sort against the top-k cap's (the checkpoints' top_k 50 within a cap of 64),
    with 64-bit keys and 32-bit ones (``code_draw.SHORT_KEYS``)."""
    from omni_async.kernels import code_draw
    from omni_async.kernels.code_draw import draw_codes_kernel
    from omni_async.speech.sampling import TOP_K_CAP
    out, saved = [], code_draw.SHORT_KEYS
    for rows in rows_list:
        logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 3
        t, k, p = torch.full((rows,), 0.9, device="cuda"), torch.full((rows,), 50, device="cuda"), torch.ones(rows, device="cuda")
        seeds, base = torch.arange(rows, device="cuda"), torch.zeros(rows, dtype=torch.long, device="cuda")
        for cap in (0, TOP_K_CAP):
            for short in (False, True):
                code_draw.SHORT_KEYS = short
                for _ in range(3):
                    draw_codes_kernel(logits, t, k, p, seeds, base, 1, top_k_cap=cap)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                n = 200
                start.record()
                for _ in range(n):
                    draw_codes_kernel(logits, t, k, p, seeds, base, 1, top_k_cap=cap)
                end.record()
                torch.cuda.synchronize()
                out.append({"rows": rows, "top_k_cap": cap, "short_keys": short,
                            "us_per_launch": round(1000 * start.elapsed_time(end) / n, 2)})
                print("draw", out[-1], flush=True)
    code_draw.SHORT_KEYS = saved
    return out


def predictor_alone(tts: SpeechPipeline, batches: list[int], sampled: bool = True, kernels: bool = False) -> list[dict]:
    """The code predictor's frame (15 codes a row) alone, captured in a CUDA graph per
    batch and replayed: ms a frame (issue 60's goal: <= 3 ms at 64 rows on an H100).
    ``kernels``: torch.profiler's kernel table of three replays at each batch (calls / 3 =
    launches a frame)."""
    from omni_async.speech.sampling import TOP_K_CAP, PredictorSampling, draw_codes
    runner, speech = tts.stage.runner, tts.stage.model
    dev, hidden = runner.device, speech.config.talker.hidden_size
    out = []
    for b in batches:
        past = torch.randn((b, hidden), device=dev, dtype=speech.dtype)
        first = torch.randn((b, hidden), device=dev, dtype=speech.dtype)
        s = PredictorSampling(temperature=torch.full((b,), 0.9 if sampled else 0.0, device=dev), top_k=torch.full((b,), 50, device=dev),
                              top_p=torch.ones(b, device=dev), seeds=torch.arange(b, device=dev), sampled=sampled,
                              top_k_cap=TOP_K_CAP if sampled else 0)
        base = torch.arange(b, device=dev) * 16

        def frame():
            return speech.predictor.frame(past, first, lambda logits, group: draw_codes(logits, s, base, group), ops=runner.model.ops,
                                          use_kernel=runner.use_kernel)
        with torch.inference_mode():
            for _ in range(3):
                frame()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                frame()
            torch.cuda.current_stream().wait_stream(stream)
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
            n = 50
            t0 = time.perf_counter()
            for _ in range(n):
                graph.replay()
            torch.cuda.synchronize()
        r = {"batch": b, "sampled": sampled, "ms_per_frame": round(1000 * (time.perf_counter() - t0) / n, 3)}
        if kernels:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    graph.replay()
                torch.cuda.synchronize()
            events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
            r["kernels_per_frame"] = round(sum(e.count for e in events) / 3, 1)
            r["kernel_table"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
            print(r["kernel_table"], flush=True)
        out.append(r)
        print("predictor", r, flush=True)
    return out


async def main(args) -> None:
    tts = SpeechPipeline.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    res = {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "talker": [], "codec": []}
    async with tts:
        await talker_only(tts, 2, 8)  # warm-up
        for b in args.batches if args.frames else []:
            r = await talker_only(tts, b, args.frames)
            if args.steady:  # the same batch at twice the frames: the difference is frames without the prompts
                r2 = await talker_only(tts, b, 2 * args.frames)
                r["steady_ms_per_frame_step"] = round(1000 * (r2["wall_s"] - r["wall_s"]) / args.frames, 3)
                r["steady_audio_s_per_s"] = round(b * 0.08 * 1000 / r["steady_ms_per_frame_step"], 1)
            res["talker"].append(r)
            print("talker", r, flush=True)
        if args.profile and args.device == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                await talker_only(tts, args.batches[-1], 24)
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
            print(table)
            res["profile_table"] = table
        if args.device == "cuda" and not args.no_predictor:
            res["draw"] = draw_alone()
            res["predictor"] = predictor_alone(tts, args.batches, kernels=args.predictor_kernels)
        if args.device == "cuda" and tts.codec.graphs is not None:
            with torch.inference_mode():
                res["codec_graphed"] = codec_graphed(tts)
                if args.codec_variants:
                    res["codec_variants"] = codec_variants(tts)
        if not args.no_codec:
            with torch.inference_mode():
                res["codec"] = codec_calls(tts, args.device)
        res["info"] = {k: v for k, v in tts.info().items() if isinstance(v, (int, float, str))}
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tts-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    ap.add_argument("--frames", type=int, default=64, help="frames a request in the talker's timings (0: none)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--steady", action="store_true", help="also run each batch at twice the frames: ms a frame without the prompts")
    ap.add_argument("--no-codec", action="store_true", help="leave out the codec's eager calls")
    ap.add_argument("--no-predictor", action="store_true", help="leave out the predictor's and the draw's own timings")
    ap.add_argument("--predictor-kernels", action="store_true", help="CUDA: the predictor's kernel table at each batch")
    ap.add_argument("--codec-variants", action="store_true", help="CUDA: the codec's graphed call with its elementwise work fused or not, its dilation-9 convolutions over phases or not")
    ap.add_argument("--out", default=None)
    asyncio.run(main(ap.parse_args()))

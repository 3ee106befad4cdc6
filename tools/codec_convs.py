"""The speech codec's convolutions on the GPU: cuDNN against the Triton implicit GEMM, one
convolution at a time and in the graphed call (issue 54).

Why: the codec bounds 64 streams, its work is 96% convolutions (4.8 of 5.0 GFLOP a frame at the
released size), and a graphed call of 64 x 8 frames ran at about a tenth of the H100's bfloat16
rate. This answers, before ``codec_layers.TRITON_CONV`` may become a default, which path is
faster for each of the call's convolutions and for the call as a whole.

1. One eager call of ``--streams`` x ``--frames`` at the released size (random bfloat16 weights)
   records every causal convolution's input shape, weight and dilation.
2. Each distinct convolution alone (a fresh random input of its shape): cuDNN (``F.conv1d``),
   over its phases where dilated (``polyphase_conv1d``), and the Triton kernel under each of
   ``--tiles``; us a call (CUDA events, median of ``--repeats`` interleaved rounds), TFLOP/s,
   and each path's largest difference from cuDNN over cuDNN's largest value.
3. The graphed call (fresh slots and graphs per variant, captured under the setting): the
   default, and ``TRITON_CONV`` with the tile that summed fastest in 2; ms a call by (streams,
   frames), interleaved; the PCM's largest difference between the two.

    python tools/codec_convs.py --out $OUT/codec_convs.json
    python tools/codec_convs.py --tiles 64x128x32w4s3,128x128x32w8s3 --call-shapes 64x8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import machine_facts, save_json  # noqa: E402

from omni_async.kernels import conv1d as triton_conv  # noqa: E402
from omni_async.speech import codec_layers  # noqa: E402
from omni_async.speech.codec import CodecDecoder  # noqa: E402
from omni_async.speech.codec_config import CodecConfig  # noqa: E402
from omni_async.speech.codec_graphs import CodecGraphs  # noqa: E402
from omni_async.speech.codec_slots import CodecSlots  # noqa: E402


def parse_tile(spec: str) -> tuple[int, int, int, int, int]:
    """``64x128x32w4s3``: output channels x samples x reduction, warps, stages."""
    dims, rest = spec.split("w")
    warps, stages = rest.split("s")
    o, t, r = (int(v) for v in dims.split("x"))
    return o, t, r, int(warps), int(stages)


def record_convs(dec: CodecDecoder, streams: int, frames: int) -> list[dict[str, Any]]:
    """Every causal convolution of one eager call: input shape, weight, bias, dilation."""
    seen: list[dict[str, Any]] = []
    real = codec_layers.CausalConv.convolution

    def convolution(self, x, bias=True):
        seen.append({"shape": tuple(x.shape), "weight": self.conv.weight, "bias": self.conv.bias if bias else None,
                     "dilation": self.conv.dilation[0], "groups": self.conv.groups})
        return real(self, x, bias)

    slots = CodecSlots(dec, streams)
    opened = [slots.open() for _ in range(streams)]
    codes = torch.randint(0, 2048, (streams, frames, 16), device="cuda")
    codec_layers.CausalConv.convolution = convolution
    try:
        with torch.inference_mode():
            slots.run(codes, opened)
    finally:
        codec_layers.CausalConv.convolution = real
    torch.cuda.synchronize()
    return seen


def timed_us(fn, n: int) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return 1000 * start.elapsed_time(end) / n


def conv_table(seen: list[dict[str, Any]], tiles: list[str], repeats: int, n: int) -> dict[str, Any]:
    groups: dict[tuple, dict[str, Any]] = {}
    for c in seen:
        if c["groups"] != 1:
            continue
        key = (c["shape"], tuple(c["weight"].shape), c["dilation"], c["bias"] is not None)
        groups.setdefault(key, dict(c, count=0))["count"] += 1
    rows = []
    default_tile = triton_conv.TILE
    for (shape, wshape, d, has_bias), c in groups.items():
        x = torch.randn(shape, device="cuda", dtype=c["weight"].dtype)
        w, b = c["weight"], c["bias"]
        ref = F.conv1d(x, w, b, dilation=d)
        scale = ref.abs().max().item() or 1.0
        paths = {"cudnn": lambda: F.conv1d(x, w, b, dilation=d)}
        if d > 1:
            paths["phases"] = lambda: codec_layers.polyphase_conv1d(x, w, b, d)
        errors = {}
        for spec in tiles:
            def run(spec=spec):
                triton_conv.TILE = parse_tile(spec)
                try:
                    return triton_conv.conv1d(x, w, b, d)
                finally:
                    triton_conv.TILE = default_tile
            try:
                errors[spec] = (run() - ref).abs().max().item() / scale
                paths["triton_" + spec] = run
            except Exception as exc:  # a tile the compiler refuses is reported, not fatal
                print(f"  tile {spec} on {shape}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        samples: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(repeats):
            for name, fn in paths.items():
                samples[name].append(timed_us(fn, n))
        t_out = shape[-1] - (wshape[-1] - 1) * d
        flop = 2 * shape[0] * wshape[0] * wshape[1] * wshape[2] * t_out
        row = {"input": list(shape), "weight": list(wshape), "dilation": d, "count": c["count"], "gflop": flop / 1e9,
               "triton_rel_err": errors}
        for name, us in samples.items():
            med = statistics.median(us)
            row[name + "_us"] = round(med, 1)
            row[name + "_tflops"] = round(flop / (med * 1e-6) / 1e12, 1)
        rows.append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    totals = {}
    for name in {k[:-3] for r in rows for k in r if k.endswith("_us")}:
        if all(name + "_us" in r or name == "phases" for r in rows):
            totals[name] = round(sum(r.get(name + "_us", r["cudnn_us"]) * r["count"] for r in rows) / 1000, 3)
    best_tile = min((k for k in totals if k.startswith("triton_")), key=totals.get, default=None)
    return {"convs": rows, "total_ms_by_path": totals, "best_triton": best_tile}


def call_ab(dec: CodecDecoder, shapes: list[tuple[int, int]], tile: str | None, repeats: int) -> dict[str, Any]:
    variants = {"default": (False, triton_conv.TILE)}
    if tile is not None:
        variants["triton"] = (True, parse_tile(tile))
    before = (codec_layers.TRITON_CONV, triton_conv.TILE)
    rows, pcm = [], {}
    stream = torch.cuda.Stream()
    most = max(b for b, _ in shapes)
    for repeat in range(repeats):
        for name, (on, t) in variants.items():
            codec_layers.TRITON_CONV, triton_conv.TILE = on, t
            with torch.cuda.stream(stream):
                slots = CodecSlots(dec, most)
                graphs = CodecGraphs(slots, batches=tuple(sorted({b for b, _ in shapes})),
                                     frames=tuple(sorted({f for _, f in shapes})))
                opened = [slots.open() for _ in range(most)]
                for b, f in shapes:
                    codes = torch.randint(0, 2048, (b, f, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(b * 100 + f))
                    for _ in range(3):
                        graphs.run(codes, opened[:b])
                    torch.cuda.synchronize()
                    if repeat == 0 and (b, f) == shapes[0]:
                        for s in opened[:b]:  # the first chunk from fresh streams, for the audio comparison
                            slots.close(s)
                        opened[:b] = [slots.open() for _ in range(b)]
                        pcm[name] = graphs.run(codes, opened[:b]).float().clone()
                    t0 = time.perf_counter()
                    for _ in range(10):
                        graphs.run(codes, opened[:b])
                    torch.cuda.synchronize()
                    rows.append({"variant": name, "repeat": repeat, "streams": b, "frames": f,
                                 "ms_per_call": round(100 * (time.perf_counter() - t0), 3)})
                    print("call", rows[-1], flush=True)
            del graphs, slots
            torch.cuda.empty_cache()
    codec_layers.TRITON_CONV, triton_conv.TILE = before
    out: dict[str, Any] = {"calls": rows}
    if "triton" in pcm:
        out["pcm_max_abs_diff"] = (pcm["triton"] - pcm["default"]).abs().max().item()
        out["pcm_max_abs"] = pcm["default"].abs().max().item()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--tiles", default="64x128x32w4s3,128x128x32w4s3,128x128x64w8s3,64x256x32w8s3,128x64x64w4s4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--call-shapes", default="64x8,16x8,1x4")
    ap.add_argument("--no-call", action="store_true", help="the convolutions alone")
    ap.add_argument("--out", default="codec_convs.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("codec_convs: needs CUDA")
        return 2
    dec = CodecDecoder.random(CodecConfig.qwen3_tts_12hz(), device="cuda", dtype=torch.bfloat16)
    seen = record_convs(dec, args.streams, args.frames)
    table = conv_table(seen, [t for t in args.tiles.split(",") if t], args.repeats, args.iters)
    print("total ms a call by path:", table["total_ms_by_path"], "best:", table["best_triton"], flush=True)
    result: dict[str, Any] = {"tool": "codec_convs", "machine": machine_facts(), "args": vars(args), **table}
    save_json(args.out, result)
    if not args.no_call:
        best = table["best_triton"][len("triton_"):] if table["best_triton"] else None
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.call_shapes.split(",") if s]
        result["call"] = call_ab(dec, shapes, best, 2)
        result["call"]["tile"] = best
    print("saved", save_json(args.out, result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The codec's decoder calls by streams and chunk frames: the per-stream state path
(``decode_streams``: pasts stacked with ``torch.cat`` and sliced back each call), the slot
store called eagerly (``CodecSlots.run``) and its CUDA graphs (``CodecGraphs.run``), arms
interleaved; and what capturing the graphs costs (seconds, device memory).

Per (streams, frames): ms a call (median of ``--repeats``, the device synchronised around
each call), audio-s/s (seconds of audio a call makes over its time), and the graphed
call's audio against the eager slot call's (mean |difference| over mean |audio|). Capture:
every bucket up to the largest ``--streams`` and of the ``--frames`` captured up front,
largest first, with the seconds and the device memory reserved before and after (the
graphs share one pool, sized by the largest bucket); the slot store's bytes a stream.

    python bench/codec_calls.py --config real --device cuda --dtype bfloat16 --out bench/results/codec_calls_h100.json
    python bench/codec_calls.py --config tiny --device cpu --streams 1,4 --frames 1,4   # a smoke run

``--model code2wav`` measures Qwen3-Omni's Code2Wav (random weights at its released shape)
instead of the Qwen3-TTS speech-tokenizer decoder:

    python bench/codec_calls.py --model code2wav --device cuda --streams 1,16,64 --frames 16 --out bench/results/code2wav_calls_h100.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import machine_facts, parse_int_list, save_json  # noqa: E402
from omni_async.speech.code2wav import Code2Wav  # noqa: E402
from omni_async.speech.code2wav_config import Code2WavConfig  # noqa: E402
from omni_async.speech.codec import CodecDecoder  # noqa: E402
from omni_async.speech.codec_config import CodecConfig  # noqa: E402
from omni_async.speech.codec_graphs import BATCH_BUCKETS, CodecGraphs  # noqa: E402
from omni_async.speech.codec_slots import CodecSlots  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return 1000 * (time.perf_counter() - start)


def capture_cost(graphs: CodecGraphs, batches: tuple[int, ...], frames: tuple[int, ...], device: torch.device) -> dict[str, Any]:
    if not graphs.capture_graphs:
        return {"graphs": 0}
    sync(device)
    reserved = torch.cuda.memory_reserved(device)
    start = time.perf_counter()
    graphs.capture(batches=batches, frames=frames)
    seconds = time.perf_counter() - start
    return {"graphs": graphs.captures, "seconds": round(seconds, 3), "seconds_a_graph": round(seconds / max(1, graphs.captures), 4),
            "reserved_mb_before": round(reserved / 2**20, 1),
            "reserved_mb_after": round(torch.cuda.memory_reserved(device) / 2**20, 1),
            "added_mb": round((torch.cuda.memory_reserved(device) - reserved) / 2**20, 1)}


def random_decoder(model: str, size: str, device: torch.device, dtype: torch.dtype) -> Any:
    """The decoder measured: random weights at the released shape (or the tests' tiny one)."""
    if model == "code2wav":
        return Code2Wav.random(Code2WavConfig.tiny() if size == "tiny" else Code2WavConfig.qwen3_omni(),
                               device=device, dtype=dtype, seed=0)
    return CodecDecoder.random(CodecConfig.tiny() if size == "tiny" else CodecConfig.qwen3_tts_12hz(),
                               device=device, dtype=dtype, seed=0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("qwen3-tts", "code2wav"), default="qwen3-tts",
                    help="the Qwen3-TTS speech-tokenizer decoder, or Qwen3-Omni's Code2Wav")
    ap.add_argument("--config", choices=("tiny", "real"), default="real")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--streams", type=parse_int_list, default=[1, 8, 32, 64, 128])
    ap.add_argument("--frames", type=parse_int_list, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="codec_calls.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    decoder = random_decoder(args.model, args.config, device, dtype)
    config = decoder.config
    most = max(args.streams)
    eager_store, graphed_store = CodecSlots(decoder, most), CodecSlots(decoder, most)
    graphs = CodecGraphs(graphed_store)
    result: dict[str, Any] = {"machine": machine_facts(), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "model": args.model, "config": args.config, "dtype": str(dtype), "repeats": args.repeats,
                              "slot_bytes": graphed_store.bytes_per_slot(), "rows": []}
    result["capture"] = capture_cost(graphs, tuple(b for b in BATCH_BUCKETS if b <= most) or (most,),
                                     tuple(f for f in args.frames if f in graphs.frames), device)
    print(f"{result['device_name']} {args.model} {args.config} {dtype}: {result['slot_bytes'] / 2**20:.2f} MiB a stream's slot; "
          f"capture {result['capture']}")
    eager_slots = [eager_store.open() for _ in range(most)]
    graphed_slots = [graphed_store.open() for _ in range(most)]
    print(f"{'streams':>7} {'frames':>6} {'states ms':>9} {'slots ms':>9} {'graphs ms':>9} {'graphs/states':>13} "
          f"{'audio-s/s':>10} {'rel diff':>9}")
    with torch.inference_mode():
        for b in args.streams:
            for f in args.frames:
                codes = torch.randint(0, decoder.codebook_size, (b, f, decoder.num_quantizers), device=device)
                states = [decoder.new_state() for _ in range(b)]
                chunks = list(codes)
                arms: dict[str, Callable[[], Any]] = {
                    "states": lambda: decoder.decode_streams(chunks, states),
                    "slots": lambda: eager_store.run(codes, eager_slots[:b]),
                }
                if graphs.capture_graphs:
                    arms["graphs"] = lambda: graphs.run(codes, graphed_slots[:b])
                for fn in arms.values():  # warm-up (and a lazy capture, if any)
                    fn()
                times: dict[str, list[float]] = {k: [] for k in arms}
                for _ in range(args.repeats):
                    for name, fn in arms.items():
                        times[name].append(timed(fn, device))
                med = {k: statistics.median(v) for k, v in times.items()}
                diff = None
                if "graphs" in arms:
                    a = graphs.run(codes, graphed_slots[:b]).clone()
                    e = eager_store.run(codes, eager_slots[:b])
                    diff = float((a - e).abs().mean() / e.abs().mean().clamp(min=1e-6))
                audio_s = b * f * config.samples_per_frame / config.sample_rate
                best = min(med.values())
                row = {"streams": b, "frames": f, "ms": {k: round(v, 3) for k, v in med.items()},
                       "audio_s_per_s": {k: round(audio_s / (v / 1000), 1) for k, v in med.items()},
                       "graphs_over_states": round(med["graphs"] / med["states"], 3) if "graphs" in med else None,
                       "relative_diff": diff}
                result["rows"].append(row)
                print(f"{b:>7} {f:>6} {med['states']:>9.3f} {med['slots']:>9.3f} {med.get('graphs', float('nan')):>9.3f} "
                      f"{row['graphs_over_states'] or float('nan'):>13.3f} {audio_s / (best / 1000):>10.1f} "
                      f"{diff if diff is not None else float('nan'):>9.2e}")
    result["replays"] = graphs.replays
    print(f"\nsaved {save_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

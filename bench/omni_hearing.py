"""What hearing an audio costs Qwen3-Omni's thinker (issue 59, audio in): the log-mel
features (on the CPU, as the pipeline computes them) and the audio encoder (random weights
drawn on the device at the released audio tower's shape: 32 layers of width 1280, 20
heads, an MLP of 5120, rows of 2048 for Qwen3-Omni-30B-A3B's thinker; bf16) for audios of
``--seconds`` each, one request at a time and ``--batch`` audios in one request.

Prints, per audio length: the rows the thinker reads, features ms, encoder ms (device
time, synchronised), both together, and how many seconds of audio one second of hearing
covers; per batch, the same for one request of ``--batch`` audios; the device's peak
memory. Saves the JSON to ``--out``.

    python bench/omni_hearing.py --device cuda --seconds 1,5,10,30 --batch 8 --out bench/results/omni_hearing.json
    python bench/omni_hearing.py --smoke          # CPU, a tiny shape: checks it runs
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from omni_async.models.audio_encoder import AudioEncoder, AudioEncoderConfig
from omni_async.models.audio_features import LogMel, LogMelConfig

RATE = 16000
RELEASED = dict(num_mel_bins=128, d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
                output_dim=2048, n_window=50, n_window_infer=800, downsample_hidden_size=480, max_source_positions=1500)
SMOKE = dict(RELEASED, d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128, output_dim=64,
             downsample_hidden_size=16)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int) -> tuple[float, object]:
    """The median ms of ``fn()`` over ``repeats`` runs after one warm-up, and its result."""
    out = fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def measure(features: LogMel, encoder: AudioEncoder, waves: list[np.ndarray], args) -> dict:
    feat_ms, feats = timed(lambda: features.features(waves, RATE), "cpu", args.repeats)
    enc_ms, rows = timed(lambda: encoder.encode(feats), args.device, args.repeats)
    audio_s = sum(len(w) for w in waves) / RATE
    total = feat_ms + enc_ms
    return {"audios": len(waves), "audio_s": round(audio_s, 2), "rows": [int(r.shape[0]) for r in rows],
            "features_ms": round(feat_ms, 2), "encoder_ms": round(enc_ms, 2), "total_ms": round(total, 2),
            "audio_s_per_s": round(audio_s / (total / 1e3), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seconds", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 5.0, 10.0, 30.0])
    ap.add_argument("--batch", type=int, default=8, help="audios in one request (the batched row)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny encoder: checks the script runs")
    ap.add_argument("--out", default="bench/results/omni_hearing.json")
    args = ap.parse_args()
    if args.smoke:
        args.device, args.dtype, args.seconds, args.batch, args.repeats = "cpu", "float32", [1.0, 3.0], 2, 2
    dtype = getattr(torch, args.dtype)
    cfg = AudioEncoderConfig.from_dict(SMOKE if args.smoke else RELEASED)
    encoder = AudioEncoder.random(cfg, device=args.device, dtype=dtype, seed=0)
    features = LogMel(LogMelConfig(feature_size=cfg.num_mel_bins))
    rng = np.random.default_rng(0)
    rows = []
    for seconds in args.seconds:
        wave = (0.1 * rng.standard_normal(int(seconds * RATE))).astype(np.float32)
        row = {"seconds": seconds, **measure(features, encoder, [wave], args)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    batch = [(0.1 * rng.standard_normal(int(args.seconds[-1] * RATE))).astype(np.float32) for _ in range(args.batch)]
    batched = {"seconds": args.seconds[-1], **measure(features, encoder, batch, args)}
    print(json.dumps(batched), flush=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
    result = {"benchmark": "omni_hearing", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "machine": platform.node(), "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
              "torch": torch.__version__, "config": {**vars(args), "encoder": SMOKE if args.smoke else RELEASED},
              "single": rows, "batched": batched, "peak_gib": peak}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("saved", args.out)


if __name__ == "__main__":
    main()

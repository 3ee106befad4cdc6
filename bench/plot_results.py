"""Plot saved benchmark results: throughput and latency against concurrency (CPU, tiny),
decode step time against batch size and throughput against peers (H200).

    python bench/plot_results.py [--out bench/results/throughput_latency.png]

Needs matplotlib (not a dependency of the package).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LOOPS = ("normal", "overlap", "async_decode")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", default=str(RESULTS / "throughput.json"))
    ap.add_argument("--gpu", default=str(RESULTS / "gpu_suite_h200_2026-11-29_final.json"))
    ap.add_argument("--out", default=str(RESULTS / "throughput_latency.png"))
    args = ap.parse_args()
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))

    cpu = json.loads(Path(args.cpu).read_text())
    rows = cpu["summary"]
    for loop in LOOPS:
        pts = sorted((r["concurrency"], r) for r in rows if r["loop"] == loop)
        xs = [c for c, _ in pts]
        axes[0][0].plot(xs, [r["tokens_per_s"] for _, r in pts], marker="o", label=loop)
        axes[0][1].plot(xs, [r["itl_p50_ms"] for _, r in pts], marker="o", label=f"{loop} ITL p50")
        axes[0][1].plot(xs, [r["ttft_p50_ms"] for _, r in pts], marker="x", linestyle="--", label=f"{loop} TTFT p50")
    axes[0][0].set(title="tiny on 2-core CPU: throughput", xlabel="concurrent requests", ylabel="output tokens/s", xscale="log")
    axes[0][1].set(title="tiny on 2-core CPU: latency", xlabel="concurrent requests", ylabel="ms", xscale="log", yscale="log")

    gpu = json.loads(Path(args.gpu).read_text())["sections"]
    steps = gpu.get("steps", {})
    sizes = sorted(int(k) for k in steps if k.isdigit())
    axes[1][0].plot(sizes, [steps[str(b)]["bare_ms"] for b in sizes], marker="s", color="k", label="bare runner")
    for loop in LOOPS:
        axes[1][0].plot(sizes, [steps[str(b)][f"{loop}_ms"] for b in sizes], marker="o", label=loop)
    axes[1][0].set(title="Qwen2-0.5B shape, bf16, H200: decode step", xlabel="batch size", ylabel="ms per step", xscale="log")

    peers = gpu.get("peers", {})
    names, vals = [], []
    for loop in LOOPS:
        if f"omni_{loop}" in peers:
            names.append(f"omni {loop}")
            vals.append(peers[f"omni_{loop}"]["tok_s"])
    if "threaded_reference" in peers:
        names.append("threaded ref.")
        vals.append(peers["threaded_reference"]["tok_s"])
    hf = peers.get("transformers", {})
    for key, label in (("generate_tok_s", "HF generate"), ("generate_batch_tok_s", "HF generate_batch")):
        if key in hf:
            names.append(label)
            vals.append(hf[key])
    axes[1][1].barh(names, vals)
    axes[1][1].set(title="256 requests, prompts 64-512, 128 new tokens (H200)", xlabel="output tokens/s")
    for ax in (axes[0][0], axes[0][1], axes[1][0]):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

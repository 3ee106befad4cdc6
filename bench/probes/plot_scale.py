"""Plot W1024 throughput and GPU busy against ``max_running_requests`` (H200), from the
``scale`` sections of saved ``bench/gpu_saturation.py`` results.

    python bench/probes/plot_scale.py [--out bench/results/scale_h200.png] [RESULT.json ...]

GPU busy is NVML's mean utilisation over the run (its counter updates about every 1/6 s,
so it is a coarse witness; the CUDA-event figure in bench/RESULTS.md is the one to read).
Needs matplotlib (not a dependency of the package).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
DEFAULT = ("gpu_fastlaunch_h200.json", "gpu_tiers_h200.json")


def scale_of(path: Path) -> dict:
    data = json.loads(path.read_text())
    data = data.get("final", data)  # gpu_fastlaunch_h200.json nests its run
    return {int(k): v for k, v in data["sections"]["scale"].items() if k.isdigit()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="*", default=[str(RESULTS / name) for name in DEFAULT])
    ap.add_argument("--out", default=str(RESULTS / "scale_h200.png"))
    args = ap.parse_args()
    fig, (tput, busy) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in args.results:
        runs = scale_of(Path(name))
        xs = sorted(runs)
        label = Path(name).stem
        tput.plot(xs, [runs[x]["tok_s"] / 1000 for x in xs], marker="o", label=label)
        busy.plot(xs, [runs[x]["gpu_util_mean"] for x in xs], marker="o", label=label)
    tput.set(title="W1024 (1,024 requests, overlap): throughput", xlabel="max_running_requests",
             ylabel="output tokens/s (thousands)", xscale="log")
    busy.set(title="W1024: GPU busy (NVML mean)", xlabel="max_running_requests", ylabel="%",
             xscale="log", ylim=(0, 100))
    for ax in (tput, busy):
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks([64, 128, 256, 512], labels=["64", "128", "256", "512"])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print("saved", args.out)


if __name__ == "__main__":
    main()

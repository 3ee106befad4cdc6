"""Does a confined stream (``omni_async.runners.streams.confined_stream``: a CUDA green
context) hold its kernels to its SMs, for eager launches and for CUDA graphs captured
elsewhere and replayed on it? A diagnosis tool for the codec's ``codec_sms`` option.

Times a compute-bound matmul (8192 x 8192 x 8192, bf16) launched eagerly and replayed from
graphs (captured on a plain stream, and on the stream itself), on a plain stream and on
streams confined to a half and a quarter of the SMs: where confinement holds, the time
grows about as the SMs shrink. Measured on an H100 (torch 2.11, CUDA 13): eager launches
are confined, a graph captured on a plain stream and replayed on a confined one is not.

    python tools/confined_stream.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni_async.runners.streams import confined_stream  # noqa: E402


def timed(stream: torch.cuda.Stream, fn, repeats: int) -> float:
    """Median milliseconds of ``fn`` on ``stream``."""
    times = []
    with torch.cuda.stream(stream):
        fn()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
    return round(sorted(times)[len(times) // 2], 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    c = torch.empty_like(a)

    def work() -> None:
        torch.matmul(a, b, out=c)

    def captured(stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            work()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                work()
        torch.cuda.synchronize()
        return graph

    plain = torch.cuda.Stream(dev)
    elsewhere = captured(plain)
    rows = []
    for n in (None, sms // 2, sms // 4):
        stream = plain if n is None else confined_stream(dev, n)
        own = captured(stream)
        rows.append({"sms": n or sms, "eager_ms": timed(stream, work, args.repeats),
                     "graph_captured_plain_ms": timed(stream, elsewhere.replay, args.repeats),
                     "graph_captured_here_ms": timed(stream, own.replay, args.repeats),
                     "graph_captured_here_replayed_plain_ms": timed(plain, own.replay, args.repeats)})
        print(rows[-1], flush=True)
    out = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "rows": rows}
    print(json.dumps(out))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""Do two CUDA graphs captured on one stream race when replayed at once on two streams?

cuBLAS keeps a workspace per (handle, stream) and torch hands a GEMM the workspace of the
stream it is launched on, so a GEMM captured into a graph keeps the workspace of the stream
it was *captured* on, wherever the graph is replayed. A GEMM that uses the workspace (a
split-K reduction's partial sums) in two graphs captured on the same stream and replayed
together on two streams then writes the same scratch from both. This probe captures small
GEMMs of the engine's decode shapes (the code predictor's and a talker's, at 1 / 16 / 64
rows) into two graphs, on one capture stream and on two, replays the pairs together many
times on two streams, and counts results that differ from the same graph replayed alone.
It also lists the kernels of each GEMM (a split-K reduce among them is what races).

    python tools/graph_workspace.py [--iters 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch

# (rows, in features, out features): the 1.7B code predictor's down / o / qkv / gate_up
# projections and a talker's down projection.
SHAPES = [(m, k, n) for m in (1, 16, 64) for (k, n) in ((3072, 1024), (2048, 1024), (1024, 4096), (1024, 6144), (6144, 2048))]


def kernels_of(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:80] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def trial(m: int, k: int, n: int, iters: int, same_capture_stream: bool) -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(m * 7 + k + n)
    xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(2)]
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) / k**0.5 for _ in range(2)]
    outs = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    cap = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]
    graphs = []
    for i in range(2):
        s = cap[0] if same_capture_stream else cap[i]
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            for _ in range(2):
                torch.matmul(xs[i], ws[i].t(), out=outs[i])
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                torch.matmul(xs[i], ws[i].t(), out=outs[i])
        torch.cuda.current_stream(dev).wait_stream(s)
        graphs.append(g)
    refs = []
    for i in range(2):
        graphs[i].replay()
        torch.cuda.synchronize()
        refs.append(outs[i].clone())
    run = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]
    bad = [0, 0]
    for _ in range(iters):
        for i in range(2):
            run[i].wait_stream(torch.cuda.current_stream(dev))
        for i in range(2):
            with torch.cuda.stream(run[i]):
                graphs[i].replay()
        for i in range(2):
            torch.cuda.current_stream(dev).wait_stream(run[i])
        for i in range(2):
            bad[i] += int(not torch.equal(outs[i], refs[i]))
    torch.cuda.synchronize()
    return {"rows": m, "k": k, "n": n, "same_capture_stream": same_capture_stream, "iters": iters, "mismatched": bad}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    results = []
    for m, k, n in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        names = kernels_of(lambda: torch.matmul(x, w.t()))
        for same in (True, False):
            r = trial(m, k, n, args.iters, same)
            r["kernels"] = names
            results.append(r)
            print(f"rows {m:3d} k {k:5d} n {n:5d} capture {'one stream ' if same else 'two streams'}: "
                  f"mismatched {r['mismatched']} of {args.iters}   kernels: {'; '.join(names)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

"""What a prefill step costs the host against the device (H200 diagnostic).

The W256 prompts are admitted to the batch core and prefilled step by step (8,192
tokens a step, the CUDA default), driven synchronously. Before each launch a long
``torch.cuda._sleep`` is enqueued, so the whole step is queued before the GPU reaches it:
the CUDA events around it then time the device's own work, and the host's launch time is
read on its own. A step whose launch takes longer than its device time is host-bound
(the GPU waits for kernels). One launch is profiled with cProfile (top functions).

    python bench/probes/prefill_launch.py --out $OUT/prefill_launch.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _common and the benchmarks
from gpu_saturation import engine  # noqa: E402
from gpu_suite import QWEN05, make_checkpoint, workload  # noqa: E402

from omni_async import SamplingParams  # noqa: E402
from omni_async.core.request import Request, RequestData  # noqa: E402
from omni_async.core.runner_io import SchedulerOutput, SchedulerRequest  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="prefill_launch.json")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--sleep-ms", type=float, default=60.0)
    args = ap.parse_args()
    path = make_checkpoint(Path("/tmp/omni_bench/qwen05"), QWEN05)
    steps = []
    for rnd in range(2):  # the first round warms up (kernel compilation, allocator)
        eng = engine(path, "normal", args.rows)
        stack = eng.stack
        for i, p in enumerate(workload(args.rows, seed=1 + rnd)):
            req = Request(rid=f"r{i}", prompt_ids=p, sampling=SamplingParams(max_new_tokens=4, ignore_eos=True))
            req.data = RequestData(req=req)
            stack.core.add_request(req)
        prof = cProfile.Profile() if rnd else None
        while True:
            batch = stack.core.get_next_batch()
            if batch is None or batch.is_decode:
                break
            so = SchedulerOutput([SchedulerRequest(r.rid, r.data) for r in batch.reqs], batch)
            torch.cuda.synchronize()
            torch.cuda._sleep(int(args.sleep_ms * 1e-3 * 2e9))
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
            if prof is not None and len(steps) == 2:
                prof.enable()
            t0 = time.perf_counter()
            pending = stack.runner.launch(so)
            t1 = time.perf_counter()
            if prof is not None:
                prof.disable()
            ev1.record()
            queued_behind_sleep = not ev0.query()
            ev1.synchronize()
            out = stack.runner.collect(pending)
            stack.core.process_result(batch, out.token_ids, out.logprobs)
            if rnd:
                steps.append({"tokens": batch.num_tokens, "rows": batch.size, "launch_ms": 1000 * (t1 - t0),
                              "gpu_ms": ev0.elapsed_time(ev1), "launch_done_before_gpu_started": queued_behind_sleep})
                print(json.dumps(steps[-1]), flush=True)
        del eng, stack
        torch.cuda.empty_cache()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    print(text.getvalue()[:7000])
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "steps": steps, "profile": text.getvalue()[:20000]}
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

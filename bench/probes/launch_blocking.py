"""Does a decode launch wait for the device? (H200 diagnostic)

256 requests of the W256 distribution are driven through the batch core and the runner
synchronously until they all decode; then, several times, a long ``torch.cuda._sleep``
is enqueued and the next decode step launched behind it with ``sys.setprofile`` timing
every C call the launch makes. A launch that only enqueues returns in well under the
sleep; one that blocks names the call that waited.

    python bench/probes/launch_blocking.py --out $OUT/launch_blocking.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _common and the benchmarks
from gpu_saturation import engine  # noqa: E402
from gpu_suite import QWEN05, make_checkpoint, workload  # noqa: E402

from omni_async import SamplingParams  # noqa: E402
from omni_async.core.request import Request, RequestData  # noqa: E402
from omni_async.core.runner_io import SchedulerOutput, SchedulerRequest  # noqa: E402


class CallTimer:
    """Times C calls (and Python calls) made on this thread while active."""

    def __init__(self) -> None:
        self.stack: list[tuple[str, float]] = []
        self.total: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)

    def __call__(self, frame, event, arg) -> None:
        now = time.perf_counter()
        if event == "c_call":
            self.stack.append((f"{getattr(arg, '__qualname__', arg)} @ {Path(frame.f_code.co_filename).name}:{frame.f_lineno}", now))
        elif event in ("c_return", "c_exception") and self.stack:
            key, t0 = self.stack.pop()
            self.total[key] += now - t0
            self.count[key] += 1

    def top(self, n: int = 12) -> list:
        return [(k, round(1000 * v, 3), self.count[k]) for k, v in sorted(self.total.items(), key=lambda kv: -kv[1])[:n]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="launch_blocking.json")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--sleep-ms", type=float, default=100.0)
    ap.add_argument("--fuse", default="on", help="fuse_decode_steps: on (one launch per multi-step greedy decode) or off")
    args = ap.parse_args()
    path = make_checkpoint(Path("/tmp/omni_bench/qwen05"), QWEN05)
    eng = engine(path, "normal", args.rows, fuse=args.fuse == "on")
    stack = eng.stack
    for i, p in enumerate(workload(args.rows, seed=1)):
        req = Request(rid=f"r{i}", prompt_ids=p, sampling=SamplingParams(max_new_tokens=512, ignore_eos=True))
        req.data = RequestData(req=req)
        stack.core.add_request(req)

    def step(lookahead: bool = False):
        batch = stack.core.get_next_batch()
        so = SchedulerOutput([SchedulerRequest(r.rid, r.data) for r in batch.reqs], batch)
        return batch, stack.runner.launch(so, lookahead=lookahead and batch.is_decode)

    def finish(batch, pending) -> None:
        pending.event.synchronize()
        out = stack.runner.collect(pending)
        stack.core.process_result(batch, out.token_ids, out.logprobs)

    warm = 0
    while True:  # prefill everything, then a few decode steps
        batch, pending = step()
        finish(batch, pending)
        warm += batch.is_decode
        if warm >= 3:
            break
    trials = []
    sleep_cycles = int(args.sleep_ms * 1e-3 * 2e9)
    for t in range(args.trials):
        lookahead = bool(t % 2)
        torch.cuda.synchronize()
        # calibrate: how long does the sleep actually take on this GPU?
        torch.cuda._sleep(sleep_cycles)
        timer = CallTimer()
        t0 = time.perf_counter()
        sys.setprofile(timer)
        batch, pending = step(lookahead)
        sys.setprofile(None)
        launch_ms = 1000 * (time.perf_counter() - t0)
        still_running = not pending.event.query()
        t1 = time.perf_counter()
        finish(batch, pending)
        rest_ms = 1000 * (time.perf_counter() - t1)
        rec = {"trial": t, "lookahead": lookahead, "rows": batch.size, "decode": batch.is_decode,
               "row_steps_max": max(batch.row_steps) if getattr(batch, "row_steps", None) else 1,
               "launch_ms": round(launch_ms, 3), "sleep_still_running_after_launch": still_running,
               "wait_after_launch_ms": round(rest_ms, 3), "top_c_calls": timer.top()}
        trials.append(rec)
        print(json.dumps(rec), flush=True)
    # Launch times without the profiler: with the GPU idle, and with the step before
    # still running (the overlap loop's situation: scheduled on in-flight tokens).
    synced, inflight = [], []
    for _ in range(12):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b1, p1 = step()
        synced.append(1000 * (time.perf_counter() - t0))
        t0 = time.perf_counter()
        b2, p2 = step()
        inflight.append(1000 * (time.perf_counter() - t0))
        finish(b1, p1)
        finish(b2, p2)
    # Where a launch's host time goes: scheduling against the runner's launch, then a
    # cProfile of ten launches.
    sched_ms, launch_ms = [], []
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    for _ in range(10):
        t0 = time.perf_counter()
        batch = stack.core.get_next_batch()
        so = SchedulerOutput([SchedulerRequest(r.rid, r.data) for r in batch.reqs], batch)
        t1 = time.perf_counter()
        prof.enable()
        pending = stack.runner.launch(so)
        prof.disable()
        t2 = time.perf_counter()
        sched_ms.append(1000 * (t1 - t0))
        launch_ms.append(1000 * (t2 - t1))
        finish(batch, pending)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(35)
    print("schedule ms", [round(x, 2) for x in sched_ms], "launch ms (profiled)", [round(x, 2) for x in launch_ms])
    print(text.getvalue()[:9000])
    print("idle-GPU launch ms", [round(x, 2) for x in synced], flush=True)
    print("in-flight launch ms", [round(x, 2) for x in inflight], flush=True)
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": args.rows, "sleep_ms": args.sleep_ms,
           "trials": trials, "idle_gpu_launch_ms": synced, "in_flight_launch_ms": inflight}
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""A decode step's outcomes from the batch core to the readers' pending deltas, alone
(issue 42): ``Emission.on_step_output`` (the core's ``process_result``, then the stream
rows) with the engine's ``Router.deliver_step`` as its columns sink, into B
``RequestHandle``s without a tokenizer (the GPU benchmarks' case). Thread CPU ns per row
of a step of B rows and k forwards; no model, no runner, no event loop (wake-ups find
no waiting reader). Readers that keep up (each pending delta taken after every step,
outside the timing) or lag (nothing taken: rows merge). With ``--code`` given more than
once each checkout runs in its own process, interleaved per repeat (before/after).

    python bench/probes/step_outcomes.py --code /work/main --code . --labels main,after --k 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import add_checkout_options, checkouts, machine_facts, run_child, save_json, spread_summary  # noqa: E402

def one_run(batch: int, k: int, steps: int, lag: bool, logprobs: bool) -> dict[str, float]:
    from omni_async.client.completion import Completion
    from omni_async.client.handle import RequestHandle
    from omni_async.client.router import Router
    from omni_async.config import SamplingParams, SchedulerConfig
    from omni_async.core.batch_core import NativeBatchCore
    from omni_async.core.multi_step import DecodeSteps
    from omni_async.core.plan import settle
    from omni_async.core.request import Request, RequestData
    from omni_async.core.runner_io import ModelRunnerOutput
    from omni_async.kv.allocator import PageAllocator
    from omni_async.stage.emission import Emission
    from omni_async.stage.state import StageState

    config = settle(SchedulerConfig(max_running_requests=batch, max_prefill_tokens=1 << 16, chunked_prefill_size=1 << 16))
    tiers = DecodeSteps(((1, k),)) if k > 1 else DecodeSteps()
    new = steps * k + 8
    core = NativeBatchCore(config, PageAllocator(batch * (new + 256) // 8, 16), 4096, decode_steps=tiers)
    router = Router(abort_stage_request=lambda rid: None, event_loop=lambda: None)
    emission = Emission(core, lambda msgs: None, state=StageState())
    emission.columns_sink = router.deliver_step
    handles = []
    for i in range(batch):
        sp = SamplingParams(max_new_tokens=new, ignore_eos=True, return_logprob=logprobs)
        req = Request(rid=f"r{i}", prompt_ids=[3] * (64 + i % 64), sampling=sp)
        req.data = RequestData(req=req)
        emission.admit(req.data)
        handle = RequestHandle(req.rid, [Completion(0, req.rid, sp, None)], req.prompt_ids, router.hooks)
        router.open(handle)
        router.route(req.rid, handle)
        handles.append(handle)
        core.add_request(req)

    def output(b) -> ModelRunnerOutput:
        n = b.size * max(b.row_steps or [1])
        return ModelRunnerOutput([], [7] * n, [-0.5] * n if logprobs else None)

    while True:  # the prompts' prefill, untimed
        b = core.get_next_batch()
        if b.is_decode and b.size == batch and not core.waiting:
            break
        emission.on_step_output(b, output(b))
    took = 0.0
    for _ in range(steps):
        out = output(b)
        t0 = time.thread_time()
        emission.on_step_output(b, out)
        took += time.thread_time() - t0
        if not lag:
            for h in handles:
                h._collector.take()
        b = core.get_next_batch()
    assert all(len(h._completions[0].output_ids) >= steps * k for h in handles), "every row's tokens reached its handle"
    return {"ns_per_row": 1e9 * took / (steps * batch)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--cases", default="keep_up,lag,keep_up_logprobs", help="keep_up, lag, keep_up_logprobs, lag_logprobs")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    add_checkout_options(ap, "step_outcomes.json")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.steps, args.repeats = 16, 4, 1
    if args.child:
        print(json.dumps(one_run(args.batch, args.k, args.steps, "lag" in args.child, "logprobs" in args.child)))
        return 0
    here = Path(__file__).resolve()

    codes, labels = checkouts(args, here)
    cases = args.cases.split(",")
    runs: dict[str, list[float]] = {}
    child_args = ["--batch", str(args.batch), "--k", str(args.k), "--steps", str(args.steps)]
    for _ in range(args.repeats):
        for case in cases:
            for code, label in zip(codes, labels):
                runs.setdefault(f"{case}/{label}", []).append(run_child(here, code, [case, *child_args])["ns_per_row"])
    summary = spread_summary(runs, unit=" ns/row")
    if len(labels) == 2:  # paired ratios, repeat by repeat
        for case in cases:
            a, b = runs[f"{case}/{labels[0]}"], runs[f"{case}/{labels[1]}"]
            ratios = sorted(y / x for x, y in zip(a, b))
            summary[f"{case}/ratio {labels[1]}/{labels[0]}"] = {
                "median": round(statistics.median(ratios), 3), "min": round(ratios[0], 3), "max": round(ratios[-1], 3)}
            print(f"{case:>20} paired {labels[1]}/{labels[0]}: {statistics.median(ratios):.3f} [{ratios[0]:.3f}-{ratios[-1]:.3f}]")
    path = save_json(args.out, {"config": vars(args), "runs": runs, "summary": summary, "machine": machine_facts()})
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

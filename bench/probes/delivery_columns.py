"""Per-row cost of handing a step's rows to the request handles, two ways (issue 42).

A decode step of B rows, each with k new tokens, no tokenizer (the GPU benchmarks' case),
delivered to B ``RequestHandle``s through the engine's ``Router``:

- ``messages``: what the stage built per row before the columns sink (an
  ``OutgoingMessage`` and a ``StreamDelta``), routed by ``Router.deliver``;
- ``columns``: the step as ``StepTokens`` columns through ``Router.deliver_step`` (the
  engine's path since 2026-12-04), each row taking the completion's ``on_delta`` path.

A third form was tried and measured here (each plain row put straight into the
completion and the reader's pending delta, no ``StreamDelta`` while one is pending): no
gain over ``columns`` (987 against 997 ns/row keeping up, 1,202 against 1,173 lagging,
k=1), so it was not kept.

Readers that keep up (each pending delta taken after every step, outside the timing) and
readers that lag (nothing taken: rows merge). Variants interleaved per repeat; the figure
is thread CPU ns per row-step (the stage's side of building the rows included for ``messages``,
the appends of the columns for ``columns``). No model, no event loop: wake-ups find no
waiting reader.

    python bench/probes/delivery_columns.py --batch 256 --tokens 1,8 --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _common
from _common import machine_facts, save_json

from omni_async import SamplingParams
from omni_async.client.completion import Completion
from omni_async.client.handle import RequestHandle
from omni_async.client.router import Router
from omni_async.messages import OutgoingMessage, StepTokens, StreamDelta

VARIANTS = ("messages", "columns")


def make_router(batch: int) -> tuple[Router, list[RequestHandle], list[str]]:
    router = Router(abort_stage_request=lambda rid: None, event_loop=lambda: None)
    handles, rids = [], []
    sp = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)
    for i in range(batch):
        rid = f"req-{i}"
        handle = RequestHandle(rid, [Completion(0, rid, sp, None)], [1, 2, 3], router.hooks)
        router.open(handle)
        router.route(rid, handle)
        handles.append(handle)
        rids.append(rid)
    return router, handles, rids


def one_run(variant: str, batch: int, k: int, steps: int, lag: bool) -> float:
    """ns per row-step of ``steps`` deliveries."""
    router, handles, rids = make_router(batch)
    took = 0.0
    for step in range(steps):
        rows = [[(step * 7 + i + j) % 250 for j in range(k)] for i in range(batch)]
        t0 = time.thread_time()
        if variant == "messages":  # the stage's inline message per row, then the sink
            msgs = [OutgoingMessage(rid, "stream", StreamDelta(rid, toks, None, False, None)) for rid, toks in zip(rids, rows)]
            router.deliver(msgs)
        else:  # the stage's four appends per row, then the columns sink
            cols = StepTokens([], [], [], [])
            for rid, toks in zip(rids, rows):
                cols.request_ids.append(rid)
                cols.token_ids.append(toks)
                cols.logprobs.append(None)
                cols.finish_reasons.append(None)
            router.deliver_step(cols, [])
        took += time.thread_time() - t0
        if not lag:
            for h in handles:
                h._collector.take()
    want = steps * k
    assert all(len(h._completions[0].output_ids) == want for h in handles)
    return 1e9 * took / (steps * batch)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--tokens", default="1,8", help="tokens per row per step (k)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--smoke", action="store_true", help="a few small runs")
    ap.add_argument("--out", default="delivery_columns.json")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.steps, args.repeats = 16, 4, 1
    ks = [int(k) for k in args.tokens.split(",")]
    runs: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for k in ks:
            for lag in (False, True):
                for variant in VARIANTS:
                    key = f"k{k}/{'lag' if lag else 'keep_up'}/{variant}"
                    runs.setdefault(key, []).append(one_run(variant, args.batch, k, args.steps, lag))
    summary = {}
    print(f"{'case':>34} {'ns/row-step median':>19} {'min-max':>17}")
    for key, xs in runs.items():
        med = statistics.median(xs)
        summary[key] = {"median": round(med, 1), "min": round(min(xs), 1), "max": round(max(xs), 1)}
        print(f"{key:>34} {med:>19.1f} {min(xs):>8.1f}-{max(xs):<8.1f}")
    path = save_json(args.out, {"config": vars(args), "runs": runs, "summary": summary, "machine": machine_facts()})
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Engine-side cost of delivering a step's outputs to request handles, per token.

The stage hands the engine one batch of stream messages per step; the engine routes
each to its handle, detokenises incrementally, checks stop strings, merges the delta
into the handle's single slot and wakes each reader once. This measures that path
(the engine's ``Router.deliver``, the function the stage's sink calls) for B running requests over
S steps, next to a bare per-token ``asyncio.Queue`` hop (a floor: no processing), with readers
that keep up (a task per handle, woken every step) and readers that lag (nobody reads
until the end: deltas merge). No model runs: the messages are synthetic.

    python bench/probes/delivery.py --batch 32,256 --steps 64
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _common and the benchmarks
from _common import event_loop_name, machine_facts, parse_int_list, run_benchmark

from omni_async import Engine, SamplingParams
from omni_async.client.completion import Completion
from omni_async.client.handle import RequestHandle
from omni_async.messages import OutgoingMessage, StreamDelta
from omni_async.text.tokenizer import ByteTokenizer, HFTokenizer

CORPUS = ["naïve café 日本語 🙂 the thinker writes text and the talker speaks it", "Grüße, привет мир 中文"] * 8


def bytelevel_tokenizer() -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return HFTokenizer.from_object(tok, eos_token_ids=(), vocab_size=400)


def step_messages(rids: list[str], steps: int, vocab: int, seed: int) -> list[list[OutgoingMessage]]:
    rng = random.Random(seed)
    out = []
    for s in range(steps):
        last = s == steps - 1
        out.append([
            OutgoingMessage(r, "stream", StreamDelta(r, [rng.randrange(vocab)], finished=last, finish_reason="length" if last else None))
            for r in rids
        ])
    return out


async def run_engine_path(engine: Engine, tokenizer: Any, batch: int, steps: int, stops: list[str], readers: bool) -> float:
    engine.tokenizer = tokenizer
    sp = SamplingParams(max_new_tokens=steps, stop=stops)
    rids = [f"r{i}" for i in range(batch)]
    handles = []
    for rid in rids:
        handle = RequestHandle(rid, [Completion(0, rid, sp, tokenizer)], [1], engine._router.hooks)
        engine._router.route(rid, handle)
        handles.append(handle)
    vocab = tokenizer.vocab_size if tokenizer is not None else 256
    msgs = step_messages(rids, steps, vocab, seed=batch)

    async def read(h: RequestHandle) -> None:
        async for _ in h:
            pass

    tasks = [asyncio.ensure_future(read(h)) for h in handles] if readers else []
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    for batch_msgs in msgs:
        engine._router.deliver(batch_msgs)
        if readers:
            await asyncio.sleep(0)  # the readers run once per step
    engine._router.deliver([OutgoingMessage(r, "result", None) for r in rids])
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    engine._routes.clear()
    return elapsed


async def run_queue_baseline(batch: int, steps: int) -> float:
    """A floor for comparison: every message put on a per-handle asyncio.Queue and read
    by a task, with none of the engine's processing (no bookkeeping, no text)."""
    rids = [f"r{i}" for i in range(batch)]
    queues = {r: asyncio.Queue() for r in rids}
    msgs = step_messages(rids, steps, 256, seed=batch)

    async def read(q: asyncio.Queue) -> None:
        while True:
            msg = await q.get()
            if msg.type == "result":
                return

    tasks = [asyncio.ensure_future(read(queues[r])) for r in rids]
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    for batch_msgs in msgs:
        for m in batch_msgs:
            queues[m.request_id].put_nowait(m)
        await asyncio.sleep(0)
    for r in rids:
        queues[r].put_nowait(OutgoingMessage(r, "result", None))
    await asyncio.gather(*tasks)
    return time.perf_counter() - t0


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    engine = Engine.from_pretrained("tiny", loop="normal")  # not started: only its delivery path runs
    tokenizers = {"none": None, "byte": ByteTokenizer(), "bytelevel-bpe": bytelevel_tokenizer()}
    rows = []
    for batch in args.batch:
        for rep in range(args.repeats):
            tokens = batch * args.steps
            rows.append(dict(batch=batch, rep=rep, path="bare asyncio.Queue hop, no processing", readers="keep up",
                             us_per_token=1e6 * await run_queue_baseline(batch, args.steps) / tokens))
            for name, tok in tokenizers.items():
                for stops in ([], ["</answer>", "\n\n"]):
                    if stops and tok is None:
                        continue
                    for readers in (True, False):
                        t = await run_engine_path(engine, tok, batch, args.steps, stops, readers)
                        rows.append(dict(batch=batch, rep=rep, path=f"collector, text={name}" + (", 2 stops" if stops else ""),
                                         readers="keep up" if readers else "lag", us_per_token=1e6 * t / tokens))
    return {"benchmark": "delivery", "machine": machine_facts(), "event_loop": event_loop_name(),
            "steps": args.steps, "rows": rows}


def print_table(result: dict[str, Any]) -> None:
    best: dict[tuple, float] = {}
    for r in result["rows"]:
        key = (r["batch"], r["path"], r["readers"])
        best[key] = min(best.get(key, float("inf")), r["us_per_token"])
    print(f"{'batch':>5}  {'path':<40} {'readers':<8} {'us/token (best)':>15}")
    for (batch, path, readers), us in best.items():
        print(f"{batch:>5}  {path:<40} {readers:<8} {us:>15.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=parse_int_list, default=[32, 256])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--malloc", default="default", choices=["default", "steady"])
    p.add_argument("--out", default="delivery.json")
    return run_benchmark(p.parse_args(), main_async, print_table)


if __name__ == "__main__":
    raise SystemExit(main())

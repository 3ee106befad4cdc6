"""What the server spends per streamed token and per request body, outside the engine:
framing one completion chunk (the whole chunk object through ``json.dumps``, as the
server did before, against :class:`omni_async.server.wire.ChunkFrames`' envelope
serialised once) and parsing a token-id prompt's body (``json.loads`` against the
``orjson`` route), each followed by the request model's validation.

Repeats are interleaved (old, new, old, new ...); the table shows the median and range of
each and of the per-repeat ratio. Pure CPU work on the loop's thread: no model runs.

    python bench/serve_framing.py [--repeats 7] [--prompt-ids 1000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import timeit
from typing import Any

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's omni_async

from _common import machine_facts, save_json  # noqa: E402

from omni_async.messages import StreamDelta
from omni_async.server.protocol import CompletionRequest
from omni_async.server.responses import ResponseContext
from omni_async.server.wire import ChunkFrames, loads


def per_call_us(fn: Any, number: int) -> float:
    return timeit.timeit(fn, number=number) / number * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--prompt-ids", type=int, default=1000)
    p.add_argument("--out", default="serve_framing.json")
    args = p.parse_args()
    ctx = ResponseContext("completion", "tiny", None, logprobs=False)
    delta = StreamDelta(request_id="r", token_ids=[5], text=" hello")
    frames = ChunkFrames(ctx.id, ctx.chunk_object, ctx.created, ctx.model)
    body = json.dumps({"model": "tiny", "prompt": list(range(args.prompt_ids)), "max_tokens": 64, "stream": True}).encode()
    cases = {
        "chunk: json.dumps(whole chunk)": lambda: f"data: {json.dumps(ctx.chunk([ctx.delta_choice(delta, 0)]), ensure_ascii=False)}\n\n",
        "chunk: ChunkFrames.text": lambda: frames.text(0, delta.text),
        "body: json.loads + validate": lambda: CompletionRequest.model_validate(json.loads(body)),
        "body: wire.loads + validate": lambda: CompletionRequest.model_validate(loads(body)),
    }
    numbers = {"chunk": 20000, "body": 300}
    runs: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            runs[name].append(per_call_us(fn, numbers[name.split(":")[0]]))
    rows = []
    names = list(cases)
    for old, new in ((names[0], names[1]), (names[2], names[3])):
        ratios = [a / b for a, b in zip(runs[old], runs[new])]
        rows.append({
            "old": old, "new": new,
            "old_us": statistics.median(runs[old]), "old_range": [min(runs[old]), max(runs[old])],
            "new_us": statistics.median(runs[new]), "new_range": [min(runs[new]), max(runs[new])],
            "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
        })
    print("| what | before (us) | after (us) | before / after |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['old']} -> {r['new'].split(': ')[1]} | {r['old_us']:.1f} ({r['old_range'][0]:.1f}-{r['old_range'][1]:.1f}) | "
              f"{r['new_us']:.1f} ({r['new_range'][0]:.1f}-{r['new_range'][1]:.1f}) | {r['ratio']:.1f}x ({r['ratio_range'][0]:.1f}-{r['ratio_range'][1]:.1f}) |")
    print(f"\nsaved {save_json(args.out, {'benchmark': 'serve_framing', 'machine': machine_facts(), 'prompt_ids': args.prompt_ids, 'repeats': args.repeats, 'rows': rows, 'runs': runs})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

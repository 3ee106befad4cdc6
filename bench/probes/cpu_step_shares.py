#!/usr/bin/env python
"""Where a CPU decode step of SmolLM2-135M (the GGUF default) goes at 1 and 16 concurrent
requests: the decode stack's C++ call (the layers), the output head, the rest of the
model's forward (embedding, rotary tables, the torch ops around the stack), and what the
step thread does outside the forward (input prep, sampling, the loop).

Why: bench/cpu_stack_kernel.py times the stack alone on random weights; this splits a
real engine's decode steps, so the share each part takes says where to work. Each
request's wall time is split by wrapping the model's callables on the instance (no
profiler: its own cost would swamp the ~160 small torch ops). The stack's share is
further split by context length: ``--context-split`` re-times the same stack call with
the cache lengths cut to 1 (attention nearly free), so stack - that = attention.
Process CPU time is given beside wall time (the threads' spin included).
Results: bench/results/cpu_step_shares.json (``--out``).

    python bench/probes/cpu_step_shares.py --concurrency 1,16 --tokens 128
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import _common as C  # noqa: E402

import torch  # noqa: E402

from omni_async import Engine, SamplingParams  # noqa: E402
from omni_async.models.gguf import smollm2_path  # noqa: E402

PROMPT = "<|im_start|>user\nWhat is the capital of France? Answer briefly.<|im_end|>\n<|im_start|>assistant\n"


class Timer:
    """Wall and process-CPU seconds spent inside one wrapped callable."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self.calls = 0
        self.on = False

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall += time.perf_counter() - w
                self.cpu += time.process_time() - c
                self.calls += 1

        return timed


class AttentionSplit:
    """Times each stack call a second time with every row's context cut to one token:
    the difference is the attention over the cache (the GEMMs and row work do not
    depend on the context). The second call writes the same K/V slots again."""

    def __init__(self, stack: Any) -> None:
        self.stack, self.full, self.short, self.on = stack, 0.0, 0.0, False

    def __call__(self, x, cos, sin, kv, pages, lens, slots):  # noqa: ANN001, ANN204
        if not self.on:
            return self.stack(x, cos, sin, kv, pages, lens, slots)
        t0 = time.perf_counter()
        self.stack(x, cos, sin, kv, pages, torch.ones_like(lens), slots)
        self.short += time.perf_counter() - t0
        t0 = time.perf_counter()
        out = self.stack(x, cos, sin, kv, pages, lens, slots)
        self.full += time.perf_counter() - t0
        return out


async def measure(concurrency: int, tokens: int, context_split: bool) -> dict[str, Any]:
    engine = Engine.from_pretrained(str(smollm2_path()), kv_capacity_tokens=16 * (tokens + 600))
    async with engine:
        model = engine.stack.runner.model
        ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
        sampling = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
        await engine.generate(input_ids=ids, sampling=SamplingParams(max_new_tokens=8, ignore_eos=True))
        timers = {name: Timer() for name in ("forward", "stack", "head")}
        split = AttentionSplit(model.cpu_stack) if context_split and model.cpu_stack is not None else None
        inner_stack = split if split is not None else model.cpu_stack
        model.forward = timers["forward"].wrap(model.forward)
        if inner_stack is not None:
            model.cpu_stack = timers["stack"].wrap(inner_stack)
        model.lm_head.forward = timers["head"].wrap(model.lm_head.forward)
        for t in timers.values():
            t.on = True
        if split is not None:
            split.on = True
        load = C.loadavg()
        w0, c0 = time.perf_counter(), time.process_time()
        outs = await asyncio.gather(*[engine.generate(input_ids=ids, sampling=sampling) for _ in range(concurrency)])
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        info = dict(engine.scheduler.info())
    generated = sum(len(o.output_ids) for o in outs)
    steps = max(1, timers["stack"].calls or timers["forward"].calls)
    fwd, stk, head = timers["forward"], timers["stack"], timers["head"]
    stack_wall = (split.full if split is not None else stk.wall)
    extra = (stk.wall - split.full) if split is not None else 0.0  # the short calls, not part of a real step
    per_step = {
        "stack_ms": 1e3 * stack_wall / steps,
        "head_ms": 1e3 * head.wall / steps,
        "forward_other_ms": 1e3 * (fwd.wall - stk.wall - head.wall) / steps,
        "outside_forward_ms": 1e3 * (wall - fwd.wall) / steps,
        "step_ms": 1e3 * (wall - extra) / steps,
    }
    if split is not None:
        per_step["attention_ms"] = 1e3 * (split.full - split.short) / steps
        per_step["stack_without_attention_ms"] = 1e3 * split.short / steps
    return {
        "concurrency": concurrency, "tokens": tokens, "generated": generated, "steps": steps, "forwards": fwd.calls,
        "tok_s": None if split is not None else generated / wall, "cpu_s": cpu, "wall_s": wall, "per_step": per_step,
        "first_answer": engine.tokenizer.decode(outs[0].output_ids[:12]), "loadavg_before": load, "loadavg_after": C.loadavg(),
        "info": {k: info.get(k) for k in ("dtype", "quantization", "cpu_threads", "cpu_attention_kernel", "cpu_fused_ops")},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=C.parse_int_list, default=[1, 16])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: the engine's)")
    p.add_argument("--context-split", action="store_true", help="also time each stack call with the context cut to 1 token")
    p.add_argument("--out", default="cpu_step_shares.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = []
    for n in args.concurrency:
        r = asyncio.run(measure(n, args.tokens, args.context_split))
        runs.append(r)
        s = r["per_step"]
        parts = ", ".join(f"{k[:-3]} {v:.2f}" for k, v in s.items())
        print(f"c{n}: {r['steps']} steps, ms/step: {parts}; tok/s {r['tok_s'] and round(r['tok_s'], 1)}; "
              f"cpu/wall {r['cpu_s'] / r['wall_s']:.2f}; load {r['loadavg_before']}; {r['info']}; {r['first_answer']!r}", flush=True)
    C.save_json(args.out, {"benchmark": "cpu_step_shares", "runs": runs, "machine": C.machine_facts(), "args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())

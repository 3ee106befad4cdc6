"""Single-stream latency of the fused decoder (issue 18), on the CUDA machine.

Side by side in one process, repeats interleaved, ``fused_kernels`` off ("ref") and on
("fused") on the Qwen2-0.5B shape (bf16, random weights):

- ``ops``: each elementwise op of a layer, 24 calls captured in one CUDA graph, through
  the torch reference, the Triton kernels and ``torch.compile`` (Inductor): us per call;
- ``steps``: a decode step's graph replay (GPU time, back to back) at batch 1/8/64/256,
  kernels per step (torch.profiler), and the runner's whole step (launch, sampling,
  wait, collect) at batch 1/8;
- ``itl``: one request's inter-token latency through ``Engine.stream``;
- ``prefill``: tokens/s for 1 x 4096 and 16 x 512 prompts, against a GEMM+attention
  roofline at ``--peak-tflops`` (nominal H200 dense bf16 ~790, as measured here);
- ``base``: the graph replay and kernel count of another checkout (``--base-root``, e.g.
  the main branch), in a subprocess.

    python bench/fused_latency.py --out bench/results/fused_latency.json [--sections ops,steps,...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

QWEN05 = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
              intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)
VARIANTS = ("ref", "fused")


def log(*a):
    print(*a, flush=True)


def spread(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def make_checkpoint(folder: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        cfg = Qwen2Config(bos_token_id=1, eos_token_id=None, pad_token_id=0, **QWEN05)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(folder)
        del model
        torch.cuda.empty_cache()
    return folder


def graph_ms(fn, reps: int = 100) -> float:
    """GPU ms per call of ``fn`` (a graph replay), back to back, events around the run."""
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def kernels_per_call(fn, calls: int = 5) -> float:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    n = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Memcpy"))
    return n / calls


# ------------------------------------------------------------------ ops


def section_ops(compile_too: bool):
    from omni_async.kernels.fused import FusedOps
    from omni_async.kv.cache import PagedKVCache
    from omni_async.kernels.reference import ReferenceOps
    from omni_async.models.decoder import RMSNorm

    dev, dt = torch.device("cuda"), torch.bfloat16
    h, inter, nh, nkv, d = 896, 4864, 14, 2, 64
    ref, fused = ReferenceOps(), FusedOps()
    impls = {"reference": ref, "triton": fused}
    if compile_too:
        comp = ReferenceOps()
        comp.add_norm = torch.compile(ref.add_norm, dynamic=False)
        comp.silu_mul = torch.compile(ref.silu_mul, dynamic=False)
        comp.rope_store = torch.compile(ref.rope_store, dynamic=False)
        impls["inductor"] = comp
    norm = RMSNorm(h, 1e-6).to(dev, dt)
    kv = PagedKVCache(num_layers=1, num_pages=512, page_size=16, num_kv_heads=nkv, head_dim=d, dtype=dt, device=dev)
    out = {}
    for t in (1, 256):
        x, delta = torch.randn(t, h, device=dev, dtype=dt), torch.randn(t, h, device=dev, dtype=dt)
        gu = torch.randn(t, 2 * inter, device=dev, dtype=dt)
        qkv = torch.randn(t, (nh + 2 * nkv) * d, device=dev, dtype=dt)
        q, k, v = qkv.split([nh * d, nkv * d, nkv * d], -1)
        q, k, v = q.view(t, nh, d), k.view(t, nkv, d), v.view(t, nkv, d)
        ang = torch.rand(t, d // 2, device=dev) * 100
        cos, sin = torch.cat((ang, ang), -1).cos().to(dt), torch.cat((ang, ang), -1).sin().to(dt)
        slots = torch.randperm(512 * 16, device=dev)[:t]
        calls = {
            "add_norm": lambda o: o.add_norm(x, delta, norm),
            "silu_mul": lambda o: o.silu_mul(gu),
            "rope_store": lambda o: o.rope_store(q, k, v, cos, sin, kv, 0, slots),
        }
        for op, call in calls.items():
            graphs = {}
            for name, impl in impls.items():
                try:
                    for _ in range(3):
                        call(impl)
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        for _ in range(24):
                            call(impl)
                    graphs[name] = g
                except Exception as exc:  # record and go on
                    out[f"{op}/t{t}/{name}"] = {"error": repr(exc)[:300]}
            times = {name: [] for name in graphs}
            for _ in range(3):
                for name, g in graphs.items():
                    times[name].append(graph_ms(g.replay, 50) * 1000 / 24)
            for name, ts in times.items():
                out[f"{op}/t{t}/{name}"] = {"us_per_call": spread(ts), "kernels_per_call": kernels_per_call(graphs[name].replay, 2) / 24}
            log("ops", op, t, {n: round(statistics.median(ts), 2) for n, ts in times.items()})
    return out


# ------------------------------------------------------------------ steps


def build(path: Path, fused: bool | None, max_running: int = 256, **extra):
    from omni_async.backends.native.builder import build_native_stack
    from omni_async.config import SchedulerConfig

    kw = dict(kv_capacity_tokens=1 << 17, max_running_requests=max_running, cuda_graph_max_len=4096, **extra)
    if fused is not None:
        kw["fused_kernels"] = fused
    return build_native_stack(str(path), SchedulerConfig(**kw), device="cuda", dtype="bfloat16")


def replay_fn(stack, bs: int, ctx: int = 256):
    graphs, dev, ps = stack.runner.graphs, stack.device, stack.kv.page_size
    pages = ctx // ps
    ids = torch.randint(2, 1000, (bs,), device=dev)
    pos = torch.full((bs,), ctx - 1, device=dev)
    slots = torch.full((bs,), graphs.scratch_page * ps, device=dev)
    tables = torch.arange(1, pages + 1, device=dev).repeat(bs, 1)
    lens = torch.full((bs,), ctx, device=dev)
    return lambda: graphs.replay(ids, pos, slots, tables, lens)


SAMPLED = dict(temperature=0.8, top_p=0.9, top_k=50, seed=3)


def runner_step_ms(stack, bs: int, steps: int = 40, sampled: bool = False) -> float:
    """The runner alone: launch (inputs, replay, sampling, host copy), wait, collect;
    greedy rows, or with ``sampled`` temperature + top-k + top-p rows."""
    from omni_async import SamplingParams
    from omni_async.core.request import Request, RequestData
    from omni_async.core.runner_io import SchedulerOutput, SchedulerRequest

    core, runner = stack.core, stack.runner
    for i in range(bs):
        r = Request(rid=f"s{time.monotonic_ns()}-{i}", prompt_ids=[2 + i % 500] * 128,
                    sampling=SamplingParams(max_new_tokens=steps + 8, ignore_eos=True, **(SAMPLED if sampled else {})), eos_token_ids=())
        r.data = RequestData(req=r)
        core.add_request(r)
    times = []
    while (batch := core.get_next_batch()) is not None:
        so = SchedulerOutput([SchedulerRequest(r.rid, r.data) for r in batch.reqs], batch)
        t0 = time.perf_counter()
        pending = runner.launch(so)
        pending.event.synchronize()
        out = runner.collect(pending)
        if batch.is_decode and batch.size == bs:
            times.append(time.perf_counter() - t0)
        core.process_result(batch, out.token_ids, out.logprobs)
    return 1000 * statistics.median(times[5:])


def section_steps(stacks, sizes=(1, 8, 64, 256)):
    out = {}
    for bs in sizes:
        fns = {v: replay_fn(stacks[v], bs) for v in VARIANTS}
        times = {v: [] for v in VARIANTS}
        for _ in range(3):
            for v in VARIANTS:
                times[v].append(graph_ms(fns[v]))
        row = {f"{v}_replay_ms": spread(times[v]) for v in VARIANTS}
        row.update({f"{v}_kernels": kernels_per_call(fns[v]) for v in VARIANTS})
        if bs <= 8:
            for kind in ("greedy", "sampled"):
                runner = {v: [] for v in VARIANTS}
                for _ in range(3):
                    for v in VARIANTS:
                        runner[v].append(runner_step_ms(stacks[v], bs, sampled=kind == "sampled"))
                row.update({f"{v}_runner_step_{kind}_ms": spread(runner[v]) for v in VARIANTS})
        out[str(bs)] = row
        log("steps bs", bs, {k: (round(x["median"], 3) if isinstance(x, dict) else x) for k, x in row.items()})
    return out


def section_profile(stacks, bs: int = 1, top: int = 14):
    """Where a decode step's GPU time goes, by kernel name (summed over 20 replays)."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for v in VARIANTS:
        fn = replay_fn(stacks[v], bs)
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        totals: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                t = totals.setdefault(e.name[:90], [0.0, 0])
                t[0] += e.time_range.elapsed_us() / 20
                t[1] += 1 / 20
        rows = sorted(totals.items(), key=lambda kv: -kv[1][0])
        out[v] = [{"kernel": k, "us_per_step": round(t, 2), "count_per_step": c} for k, (t, c) in rows[:top]]
        out[v + "_total_us"] = sum(t for t, _ in totals.values())
        log("profile", v, round(out[v + "_total_us"], 1), [(r["kernel"][:40], r["us_per_step"], r["count_per_step"]) for r in out[v][:8]])
    return out


def section_block_n(stacks, sizes=(1, 64)):
    """The fused step's replay with the decode attention kernel at other block sizes."""
    from omni_async.kernels import paged_decode

    stack, out = stacks["fused"], {}
    default = paged_decode.DECODE_BLOCK_N
    for block_n in (32, 64, 128, 256):
        paged_decode.DECODE_BLOCK_N = block_n
        stack.runner.graphs.graphs.clear()
        stack.runner.graphs.pool = None
        stack.runner.sampling_graphs.graphs.clear()  # they read the old graphs' logits
        stack.runner.graphs.capture_all()
        out[str(block_n)] = {str(bs): spread([graph_ms(replay_fn(stack, bs, ctx)) for _ in range(3)]) for bs in sizes for ctx in (256,)}
        out[str(block_n) + "_ctx2048"] = spread([graph_ms(replay_fn(stack, 1, 2048)) for _ in range(3)])
        log("block_n", block_n, {k: round(v["median"], 3) for k, v in out[str(block_n)].items()}, round(out[str(block_n) + "_ctx2048"]["median"], 3))
    paged_decode.DECODE_BLOCK_N = default
    stack.runner.sampling_graphs.graphs.clear()
    stack.runner.graphs.graphs.clear()
    stack.runner.graphs.pool = None
    stack.runner.graphs.capture_all()
    return out


# ------------------------------------------------------------------ inter-token latency


async def _itl(engine, new: int = 96) -> float | None:
    """Median time per token after the first 8; a delta that carries several tokens
    (its consumer lagged and the collector merged them) counts its gap once per token."""
    from omni_async import SamplingParams

    gaps, last = [], None
    async for delta in engine.stream(input_ids=[5 + i for i in range(128)], sampling=SamplingParams(max_new_tokens=new, ignore_eos=True)):
        now = time.perf_counter()
        n = max(1, len(delta.token_ids))
        if last is not None:
            gaps.extend([(now - last) / n] * n)
        last = now
    return 1000 * statistics.median(gaps[8:]) if len(gaps) > 8 else None


def section_itl(path: Path):
    import uvloop

    from omni_async import Engine

    async def run():
        out = {}
        for loop in ("normal", "overlap", "async_decode"):
            engines = {v: Engine.from_pretrained(str(path), device="cuda", dtype="bfloat16", loop=loop, kv_capacity_tokens=1 << 15,
                                                 max_running_requests=8, fused_kernels=v == "fused") for v in VARIANTS}
            times = {v: [] for v in VARIANTS}
            async with engines["ref"], engines["fused"]:
                for _ in range(3):
                    for v in VARIANTS:
                        times[v].append(await _itl(engines[v]))
            times = {v: [t for t in ts if t is not None] or [float("nan")] for v, ts in times.items()}
            out[loop] = {f"{v}_itl_ms": spread(times[v]) for v in VARIANTS}
            log("itl", loop, {v: round(statistics.median(times[v]), 3) for v in VARIANTS})
            del engines
            torch.cuda.empty_cache()
        return out

    return uvloop.run(run())


# ------------------------------------------------------------------ prefill


def prefill_flops(seqs: int, length: int, shape=QWEN05) -> float:
    h, L, inter, v = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"], shape["vocab_size"]
    nh, nkv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = h // nh
    per_layer = h * (nh + 2 * nkv) * d + nh * d * h + 3 * h * inter
    tokens = seqs * length
    gemm = 2 * per_layer * L * tokens + 2 * h * v * seqs  # the head only on each sequence's last token
    attn = 4 * nh * d * L * seqs * length * (length + 1) / 2  # causal QK^T and PV
    return gemm + attn


def prefill_ms(stack, seqs: int, length: int) -> float:
    from omni_async import SamplingParams
    from omni_async.core.request import Request, RequestData
    from omni_async.core.runner_io import SchedulerOutput, SchedulerRequest

    core, runner = stack.core, stack.runner
    for i in range(seqs):
        r = Request(rid=f"p{time.monotonic_ns()}-{i}", prompt_ids=[(7 * j + i) % 150000 + 2 for j in range(length)],
                    sampling=SamplingParams(max_new_tokens=1, ignore_eos=True), eos_token_ids=())
        r.data = RequestData(req=r)
        core.add_request(r)
    total = 0.0
    while (batch := core.get_next_batch()) is not None:
        so = SchedulerOutput([SchedulerRequest(r.rid, r.data) for r in batch.reqs], batch)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pending = runner.launch(so)
        pending.event.synchronize()
        total += time.perf_counter() - t0
        out = runner.collect(pending)
        core.process_result(batch, out.token_ids, out.logprobs)
    return 1000 * total


def section_prefill(stacks, peak_tflops: float):
    out = {}
    for seqs, length in ((1, 4096), (16, 512)):
        for v in VARIANTS:
            prefill_ms(stacks[v], seqs, length)  # warm-up (Triton compiles for this shape)
        times = {v: [] for v in VARIANTS}
        for _ in range(3):
            for v in VARIANTS:
                times[v].append(prefill_ms(stacks[v], seqs, length))
        flops = prefill_flops(seqs, length)
        floor_ms = flops / (peak_tflops * 1e12) * 1000
        row = {"flops": flops, "roofline_ms": floor_ms, "peak_tflops": peak_tflops}
        for v in VARIANTS:
            med = statistics.median(times[v])
            row[f"{v}_ms"] = spread(times[v])
            row[f"{v}_tok_s"] = seqs * length / med * 1000
            row[f"{v}_roofline_ratio"] = floor_ms / med
        out[f"{seqs}x{length}"] = row
        log("prefill", seqs, length, {k: (round(x["median"], 2) if isinstance(x, dict) else round(x, 3)) for k, x in row.items()})
    return out


# ------------------------------------------------------------------ another checkout


def base_steps(path: Path, sizes=(1, 8, 64, 256)) -> dict:
    """Run inside the other checkout: replay ms (3 repeats) and kernels per step."""
    stack = build(path, None)
    out = {}
    for bs in sizes:
        fn = replay_fn(stack, bs)
        out[str(bs)] = {"replay_ms": spread([graph_ms(fn) for _ in range(3)]), "kernels": kernels_per_call(fn)}
        if bs <= 8:
            out[str(bs)]["runner_step_ms"] = spread([runner_step_ms(stack, bs) for _ in range(3)])
    return out


def section_base(path: Path, root: Path):
    code = (f"import sys, json; sys.path.insert(0, {str(root)!r}); sys.path.insert(1, {str(Path(__file__).parent)!r});"
            f"import fused_latency as f; from pathlib import Path; print('BASE' + json.dumps(f.base_steps(Path({str(path)!r}))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=400, cwd=str(root))
    for line in proc.stdout.splitlines():
        if line.startswith("BASE"):
            res = json.loads(line[4:])
            log("base", {k: (round(v["replay_ms"]["median"], 3), v["kernels"]) for k, v in res.items()})
            return res
    return {"error": proc.stderr[-3000:]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/fused_latency.json")
    ap.add_argument("--sections", default="ops,profile,steps,block_n,itl,prefill,base")
    ap.add_argument("--checkpoint", default=str(Path(tempfile.gettempdir()) / "qwen05-bf16"))
    ap.add_argument("--base-root", default=None)
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    sections = args.sections.split(",")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sections": {}}
    path = make_checkpoint(Path(args.checkpoint))

    def record(name, fn):
        t0 = time.perf_counter()
        try:
            results["sections"][name] = fn()
        except Exception as exc:  # record and go on with the other sections
            import traceback

            traceback.print_exc()
            results["sections"][name] = {"error": repr(exc)}
        results["sections"][name + "_wall_s"] = time.perf_counter() - t0
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))

    if "base" in sections and args.base_root:
        record("base", lambda: section_base(path, Path(args.base_root)))
    if "ops" in sections:
        record("ops", lambda: section_ops(not args.no_compile))
    if {"steps", "prefill", "profile", "block_n"} & set(sections):
        stacks = {v: build(path, v == "fused", chunked_prefill_size=0, max_prefill_tokens=8192) for v in VARIANTS}
        assert stacks["fused"].runner.fused and not stacks["ref"].runner.fused
        if "profile" in sections:
            record("profile", lambda: section_profile(stacks))
        if "steps" in sections:
            record("steps", lambda: section_steps(stacks))
        if "block_n" in sections:
            record("block_n", lambda: section_block_n(stacks))
        if "prefill" in sections:
            record("prefill", lambda: section_prefill(stacks, args.peak_tflops))
        del stacks
        torch.cuda.empty_cache()
    if "itl" in sections:
        record("itl", lambda: section_itl(path))
    log(json.dumps(results["sections"].get("steps", {}), default=str)[:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU benchmark suite (run on the CUDA machine): correctness of the CUDA paths against
the CPU reference, ways of awaiting completion, step efficiency per loop against the
bare runner, throughput against transformers, the bandwidth floor, co-location lag,
idle cost and wake-up, and the threaded reference design as a baseline.

Every figure of one kind is measured side by side in one run. Results are printed and
saved as JSON (``--out``). Each section is independent: one that fails records its
error and the rest go on.

    python bench/gpu_suite.py --out results.json [--sections a,b,...] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import datetime
import glob
import json
import os
import platform
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omni_async import Engine, SamplingParams  # noqa: E402
from omni_async.backends.native.builder import build_native_stack  # noqa: E402
from omni_async.config import SchedulerConfig  # noqa: E402
from omni_async.core.request import Request, RequestData  # noqa: E402
from omni_async.core.runner_io import SchedulerOutput, SchedulerRequest  # noqa: E402

RESULTS: dict = {"sections": {}}
QWEN05 = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
              intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)
SMALL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=704, vocab_size=2048, max_position_embeddings=4096, tie_word_embeddings=False,
             initializer_range=0.3)


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def log(*a):
    print(*a, flush=True)


def save(out):
    Path(out).write_text(json.dumps(RESULTS, indent=2, default=str))


def make_checkpoint(folder: Path, shape: dict, dtype=torch.bfloat16, seed=0, device: str = "cuda") -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(seed)
    cfg = Qwen2Config(bos_token_id=1, eos_token_id=None, pad_token_id=0, **shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return folder


def prompts(n, vocab, lo, hi, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


async def ticker_lags(stop: asyncio.Event, lags: list, period=0.001):
    """Lag of a 1 ms ticker, read with perf_counter (the loop's clock is ~1 ms coarse)."""
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(period)
        lags.append(max(0.0, time.perf_counter() - t - period))


# ------------------------------------------------------------------ A. correctness


async def _greedy(path, device, loop, dtype, ps, n, **kw):
    eng = Engine.from_pretrained(str(path), device=device, loop=loop, dtype=dtype, **kw)
    async with eng:
        res = await asyncio.gather(*[eng.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=n, ignore_eos=True)) for p in ps])
    return [r.output_ids for r in res], eng


def kernel_check():
    """The Triton paged decode kernel against a float64 reference on random inputs."""
    from omni_async.kernels.paged_decode import paged_decode_attention

    out = {}
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for heads, kv_heads, dim in ((14, 2, 64), (8, 2, 32), (32, 8, 128), (4, 4, 64)):
            ps, bsz = 16, 6
            lens = [1, 17, 64, 300, 777, 1500][:bsz]
            pages_needed = [-(-n // ps) for n in lens]
            total_pages = sum(pages_needed) + 7
            perm = torch.randperm(total_pages, generator=gen).tolist()
            tables = torch.zeros(bsz, max(pages_needed), dtype=torch.long)
            at = 0
            for i, n in enumerate(pages_needed):
                tables[i, :n] = torch.tensor(perm[at:at + n])
                at += n
            kc = torch.randn(total_pages * ps, kv_heads, dim, generator=gen)
            vc = torch.randn(total_pages * ps, kv_heads, dim, generator=gen)
            q = torch.randn(bsz, heads, dim, generator=gen)
            scale = dim ** -0.5
            ref = torch.empty(bsz, heads, dim, dtype=torch.float64)
            for i, n in enumerate(lens):
                pos = torch.arange(n)
                slots = tables[i][pos // ps] * ps + pos % ps
                k = kc[slots].double().repeat_interleave(heads // kv_heads, 1)
                v = vc[slots].double().repeat_interleave(heads // kv_heads, 1)
                att = torch.einsum("hd,nhd->hn", q[i].double(), k) * scale
                ref[i] = torch.einsum("hn,nhd->hd", att.softmax(-1), v)
            got = paged_decode_attention(q.to("cuda", dtype), kc.to("cuda", dtype), vc.to("cuda", dtype), tables.cuda(),
                                         torch.tensor(lens).cuda(), ps, scale)
            err = (got.double().cpu() - ref).abs().max().item()
            out[f"{str(dtype)[6:]}_h{heads}_kv{kv_heads}_d{dim}"] = err
    log("A kernel max abs err", out)
    return out


def extend_kernel_check():
    """The Triton paged extend kernel against a float64 reference: several sequences
    with prefixes already cached and new tokens in one launch."""
    from omni_async.kernels.paged_extend import paged_extend_attention

    out = {}
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        for heads, kv_heads, dim in ((14, 2, 64), (8, 2, 32), (32, 8, 128)):
            ps = 16
            seqs = [(0, 37), (20, 5), (130, 200), (0, 1), (64, 64)]  # (prefix, new)
            totals = [p + n for p, n in seqs]
            pages_needed = [-(-t // ps) for t in totals]
            total_pages = sum(pages_needed) + 3
            perm = torch.randperm(total_pages, generator=gen).tolist()
            tables = torch.zeros(len(seqs), max(pages_needed), dtype=torch.long)
            at = 0
            for i, n in enumerate(pages_needed):
                tables[i, :n] = torch.tensor(perm[at:at + n])
                at += n
            kc = torch.randn(total_pages * ps, kv_heads, dim, generator=gen)
            vc = torch.randn(total_pages * ps, kv_heads, dim, generator=gen)
            q = torch.randn(sum(n for _, n in seqs), heads, dim, generator=gen)
            scale = dim ** -0.5
            ref = torch.empty(q.shape, dtype=torch.float64)
            starts, s0 = [], 0
            for i, (p, n) in enumerate(seqs):
                starts.append(s0)
                pos = torch.arange(p + n)
                slots = tables[i][pos // ps] * ps + pos % ps
                k = kc[slots].double().repeat_interleave(heads // kv_heads, 1)
                v = vc[slots].double().repeat_interleave(heads // kv_heads, 1)
                qq = q[s0:s0 + n].double()
                att = torch.einsum("qhd,khd->hqk", qq, k) * scale
                mask = torch.arange(p + n)[None, :] <= (p + torch.arange(n))[:, None]
                att = att.masked_fill(~mask, float("-inf"))
                ref[s0:s0 + n] = torch.einsum("hqk,khd->qhd", att.softmax(-1), v)
                s0 += n
            got = paged_extend_attention(
                q.to("cuda", dtype), kc.to("cuda", dtype), vc.to("cuda", dtype), tables.cuda(),
                torch.tensor(starts).cuda(), torch.tensor([n for _, n in seqs]).cuda(), torch.tensor([p for p, _ in seqs]).cuda(),
                max(n for _, n in seqs), ps, scale,
            )
            out[f"{str(dtype)[6:]}_h{heads}_kv{kv_heads}_d{dim}"] = (got.double().cpu() - ref).abs().max().item()
    log("A extend kernel max abs err", out)
    return out


def section_correctness(tmp: Path):
    import omni_async.runners.native as native

    small = make_checkpoint(tmp / "small", SMALL, dtype=torch.float32)
    ps = prompts(12, SMALL["vocab_size"], 4, 200, seed=3)
    out = {"paged_decode_kernel_max_abs_err": kernel_check(), "paged_extend_kernel_max_abs_err": extend_kernel_check()}
    cpu, _ = asyncio.run(_greedy(small, "cpu", "normal", "float32", ps, 32))
    real = native.triton_available
    for kernel in (True, False):
        native.triton_available = real if kernel else (lambda device=None: False)
        for loop in ("normal", "overlap", "async_decode"):
            for graphs in (True, False):
                toks, eng = asyncio.run(_greedy(small, "cuda", loop, "float32", ps, 32, cuda_graphs=graphs, kv_capacity_tokens=65536,
                                                chunked_prefill_size=48, max_prefill_tokens=96))
                same = sum(a == b for a, b in zip(toks, cpu))
                replays = eng.stack.runner.graphs.replays if eng.stack.runner.graphs else 0
                key = f"fp32_{loop}_graphs={graphs}_kernel={kernel}"
                out[key] = {"requests_equal_to_cpu": f"{same}/{len(ps)}", "graph_replays": replays, "kernel": eng.stack.runner.use_kernel}
                log("A", key, out[key])
    native.triton_available = real
    # bf16 on CUDA against fp32 on CPU: the first-step logits of one prefill
    from omni_async.models.loader import load_model
    from omni_async.kv.attention import AttentionContext
    from omni_async.kv.cache import PagedKVCache

    def logits(device, dtype):
        lm = load_model(str(small), dtype=dtype, device=device)
        cfg = lm.config
        kv = PagedKVCache(num_layers=cfg.num_layers, num_pages=32, page_size=16, num_kv_heads=cfg.num_kv_heads,
                          head_dim=cfg.head_dim, dtype=next(lm.model.parameters()).dtype, device=torch.device(device))
        ids = torch.tensor(ps[0], device=device)
        n = ids.numel()
        slots = torch.arange(n, device=device)
        ctx = AttentionContext(is_decode=False, slot_mapping=slots, logits_rows=torch.tensor([n - 1], device=device),
                               seq_slices=[(0, n, 0)], seq_kv_slots=[slots])
        return lm.model(ids, torch.arange(n, device=device), kv, ctx).float().cpu()

    ref = logits("cpu", "float32")
    for dt in ("float32", "bfloat16", "float16"):
        got = logits("cuda", dt)
        err = (got - ref).abs().max().item()
        out[f"prefill_logits_max_abs_err_{dt}"] = err
        out[f"prefill_argmax_equal_{dt}"] = bool(got.argmax() == ref.argmax())
        log("A logits", dt, "max abs err", err)
    return out


# ------------------------------------------------------------------ B. awaiting completion


class HostFuncWaiter:
    """cudaLaunchHostFunc through ctypes: a host callback enqueued after the step
    resolves an asyncio future from the driver's thread."""

    def __init__(self):
        lib = None
        cands = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libcudart.so*"))
        cands += glob.glob(os.path.join(sys.prefix, "lib", "python*", "site-packages", "nvidia", "cuda_runtime", "lib", "libcudart.so*"))
        cands += ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
        for c in cands:
            try:
                lib = ctypes.CDLL(c)
                break
            except OSError:
                continue
        if lib is None:
            raise RuntimeError("libcudart not found")
        self.lib = lib
        self.CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
        self.lib.cudaLaunchHostFunc.argtypes = [ctypes.c_void_p, self.CB, ctypes.c_void_p]
        self.lib.cudaLaunchHostFunc.restype = ctypes.c_int
        self._keep = {}

    def enqueue(self, loop, fut):
        key = id(fut)

        def cb(_):
            loop.call_soon_threadsafe(_resolve, fut)
            self._keep.pop(key, None)

        c = self.CB(cb)
        self._keep[key] = c
        stream = torch.cuda.current_stream().cuda_stream
        rc = self.lib.cudaLaunchHostFunc(ctypes.c_void_p(stream), c, None)
        if rc != 0:
            raise RuntimeError(f"cudaLaunchHostFunc returned {rc}")


def _resolve(fut):
    if not fut.done():
        fut.set_result(None)


def _graph_fixture(stack, bs):
    graphs = stack.runner.graphs
    dev = stack.device
    ps = stack.kv.page_size
    pages = 16
    ids = torch.randint(2, 1000, (bs,), device=dev)
    pos = torch.full((bs,), pages * ps - 1, device=dev)
    slots = torch.full((bs,), graphs.scratch_page * ps, device=dev)
    tables = torch.arange(pages, device=dev).repeat(bs, 1)
    lens = torch.full((bs,), pages * ps, device=dev)
    return lambda: graphs.replay(ids, pos, slots, tables, lens)


def section_await(path: Path, steps: int):
    from omni_async.stage.executor import EventWaiter

    config = SchedulerConfig(kv_capacity_tokens=65536, max_running_requests=64, cuda_graph_max_len=1024)
    stack = build_native_stack(str(path), config, device="cuda", dtype="bfloat16")
    replay = _graph_fixture(stack, 8)
    for _ in range(20):
        replay()
    torch.cuda.synchronize()
    hostfunc = HostFuncWaiter()
    out = {}

    async def run(mode):
        loop = asyncio.get_running_loop()
        lags: list = []
        stop = asyncio.Event()
        tick = asyncio.create_task(ticker_lags(stop, lags))
        await asyncio.sleep(0.05)
        waiter = EventWaiter(mode) if mode in ("poll", "thread") else None
        cpu0, t0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            logits = replay()
            tok = torch.argmax(logits, -1)
            if mode == "blocking":
                torch.cuda.synchronize()
            elif mode == "hostfunc":
                fut = loop.create_future()
                hostfunc.enqueue(loop, fut)
                await fut
            else:
                ev = torch.cuda.Event(blocking=(mode == "thread"))
                ev.record()
                await waiter.wait(ev)
            tok.tolist()
            await asyncio.sleep(0)  # let the ticker in, as a real loop iteration would
        wall = (time.perf_counter() - t0) / steps
        cpu = (time.process_time() - cpu0) / steps
        stop.set()
        await tick
        if waiter:
            waiter.close()
        return {"step_ms": 1000 * wall, "cpu_ms_per_step": 1000 * cpu, "ticker_lag_p50_ms": 1000 * pct(lags, 50),
                "ticker_lag_p99_ms": 1000 * pct(lags, 99), "ticker_ticks": len(lags)}

    import uvloop

    for mode in ("blocking", "poll", "thread", "hostfunc", "poll", "blocking"):
        r = uvloop.run(run(mode))
        key = mode if mode not in out else mode + "_again"
        out[key] = r
        log("B", key, r)
    base = min(out["blocking"]["step_ms"], out["blocking_again"]["step_ms"])
    for k, v in out.items():
        v["added_ms_vs_blocking"] = v["step_ms"] - base
    return out


# ------------------------------------------------------------------ C/E. steps and the floor


def bare_step_ms(stack, bs, reps=50):
    """The runner alone, synchronously: schedule with the batch core, launch, wait,
    extract; no event loop, no scheduler."""
    core, runner = stack.core, stack.runner
    reqs = []
    for i in range(bs):
        r = Request(rid=f"bare{i}", prompt_ids=[2 + i % 500] * 128, sampling=SamplingParams(max_new_tokens=reps + 10, ignore_eos=True), eos_token_ids=())
        r.data = RequestData(req=r)
        core.add_request(r)
        reqs.append(r)
    times = []
    while True:
        batch = core.get_next_batch()
        if batch is None:
            break
        so = SchedulerOutput([SchedulerRequest(r.rid, r.data) for r in batch.reqs], batch)
        t0 = time.perf_counter()
        pending = runner.launch(so)
        pending.event.synchronize()
        out = runner.collect(pending)
        dt = time.perf_counter() - t0
        if batch.is_decode and batch.size == bs:
            times.append(dt)
        core.process_result(batch, out.token_ids, out.logprobs)
    return 1000 * statistics.median(times[5:]) if len(times) > 6 else None


def runner_host_us(stack, bs, reps=40):
    """Host time of the runner alone per decode step, per row: ``launch`` (inputs from
    the slot state, hooks, graph replay, device sampling, one non-blocking copy; it
    returns without waiting for the device) and ``collect`` (after the event), both
    timed on the host with the device's completion awaited in between, untimed."""
    core, runner = stack.core, stack.runner
    for i in range(bs):
        r = Request(rid=f"host{i}", prompt_ids=[3 + i % 500] * 128, sampling=SamplingParams(max_new_tokens=reps + 10, ignore_eos=True), eos_token_ids=())
        r.data = RequestData(req=r)
        core.add_request(r)
    launch, collect = [], []
    while True:
        batch = core.get_next_batch()
        if batch is None:
            break
        so = SchedulerOutput([SchedulerRequest(r.rid, r.data) for r in batch.reqs], batch)
        t0 = time.perf_counter()
        pending = runner.launch(so)
        t1 = time.perf_counter()
        if pending.event is not None:
            pending.event.synchronize()
        t2 = time.perf_counter()
        out = runner.collect(pending)
        t3 = time.perf_counter()
        if batch.is_decode and batch.size == bs:
            launch.append((t1 - t0) * 1e6 / bs)
            collect.append((t3 - t2) * 1e6 / bs)
        core.process_result(batch, out.token_ids, out.logprobs)
    if len(launch) <= 6:
        return {}
    return {"launch_us_per_row": statistics.median(launch[5:]), "collect_us_per_row": statistics.median(collect[5:])}


async def loop_step_ms(path, loop, bs, new=64):
    eng = Engine.from_pretrained(str(path), device="cuda", loop=loop, dtype="bfloat16", kv_capacity_tokens=262144, max_running_requests=max(bs, 8), cuda_graph_max_len=1024)
    gaps = []
    async with eng:
        ps = prompts(bs, 150000, 128, 128, seed=bs)

        async def one(i, p):
            last = None
            k = 0
            async for _d in eng.stream(input_ids=p, sampling=SamplingParams(max_new_tokens=new, ignore_eos=True)):
                now = time.perf_counter()
                k += 1
                if last is not None and k > 8 and i == 0:
                    gaps.append(now - last)
                last = now

        await asyncio.gather(*(one(i, p) for i, p in enumerate(ps)))
    return 1000 * statistics.median(gaps)


def section_steps(path: Path, sizes):
    import uvloop

    out = {}
    for bs in sizes:
        config = SchedulerConfig(kv_capacity_tokens=262144, max_running_requests=max(bs, 8), cuda_graph_max_len=1024)
        stack = build_native_stack(str(path), config, device="cuda", dtype="bfloat16")
        bare = bare_step_ms(stack, bs)
        host = runner_host_us(stack, bs)
        del stack
        torch.cuda.empty_cache()
        row = {"bare_ms": bare, **host}
        for loop in ("normal", "overlap", "async_decode"):
            ms = uvloop.run(loop_step_ms(path, loop, bs))
            row[f"{loop}_ms"] = ms
            row[f"{loop}_ratio"] = ms / bare if bare else None
        out[str(bs)] = row
        log("C bs", bs, row)
    return out


def section_floor(path: Path, steps: dict):
    n = 512 * 1024 * 1024
    a = torch.empty(n, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    reps = 20
    for _ in range(reps):
        b.copy_(a)
    torch.cuda.synchronize()
    bw = 2 * n * 4 * reps / (time.perf_counter() - t0)  # bytes read + written per second
    del a, b
    from omni_async.models.loader import load_model

    lm = load_model(str(path), dtype="bfloat16", device="cuda")
    weight_bytes = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    del lm
    torch.cuda.empty_cache()
    floor_ms = 1000 * weight_bytes / bw
    out = {"copy_bandwidth_GBps": bw / 1e9, "weight_bytes": weight_bytes, "floor_ms": floor_ms}
    one = steps.get("1") if isinstance(steps, dict) else None
    if one:
        for k in ("bare_ms", "normal_ms", "overlap_ms", "async_decode_ms"):
            if one.get(k):
                out[f"{k}_over_floor"] = one[k] / floor_ms
    log("E", out)
    return out


# ------------------------------------------------------------------ D. throughput against peers


def workload(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2, 150000) for _ in range(rng.randint(64, 512))] for _ in range(n)]


async def omni_throughput(path, loop, reqs, new):
    eng = Engine.from_pretrained(str(path), device="cuda", loop=loop, dtype="bfloat16", kv_capacity_tokens=262144,
                                 max_running_requests=256, max_prefill_tokens=8192, chunked_prefill_size=8192, cuda_graph_max_len=1024)
    lags: list = []
    ttft, itl = [], []
    async with eng:
        await eng.generate(input_ids=[5] * 64, sampling=SamplingParams(max_new_tokens=4))  # warm-up
        stop = asyncio.Event()
        tick = asyncio.create_task(ticker_lags(stop, lags))
        t0 = time.perf_counter()

        async def one(p):
            t_sub = time.perf_counter()
            last = None
            async for _d in eng.stream(input_ids=p, sampling=SamplingParams(max_new_tokens=new, ignore_eos=True)):
                now = time.perf_counter()
                if last is None:
                    ttft.append(now - t_sub)
                else:
                    itl.append(now - last)
                last = now

        await asyncio.gather(*(one(p) for p in reqs))
        wall = time.perf_counter() - t0
        stop.set()
        await tick
    return {"wall_s": wall, "tok_s": len(reqs) * new / wall, "ttft_p50_ms": 1000 * pct(ttft, 50), "ttft_p99_ms": 1000 * pct(ttft, 99),
            "itl_p50_ms": 1000 * pct(itl, 50), "itl_p99_ms": 1000 * pct(itl, 99),
            "ticker_lag_p50_ms": 1000 * pct(lags, 50), "ticker_lag_p99_ms": 1000 * pct(lags, 99)}


def hf_generate_throughput(path, reqs, new, batch=64):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        for s in range(0, len(reqs), batch):
            chunk = reqs[s : s + batch]
            width = max(map(len, chunk))
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for i, p in enumerate(chunk):
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    out = {"generate_wall_s": wall, "generate_tok_s": len(reqs) * new / wall}
    try:
        from transformers import GenerationConfig

        gc = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate_batch(inputs=[list(p) for p in reqs], generation_config=gc)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        out.update({"generate_batch_wall_s": wall, "generate_batch_tok_s": len(reqs) * new / wall})
    except Exception as exc:  # noqa: BLE001
        out["generate_batch_error"] = repr(exc)
    del model
    torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------ F/G. idle, wake-up, threaded baseline


async def omni_idle_and_wakeup(path, idle_s, n_wake):
    eng = Engine.from_pretrained(str(path), device="cuda", loop="async_decode", dtype="bfloat16", kv_capacity_tokens=65536)
    runner = eng.stack.runner
    launches: list = []
    orig = runner.launch

    def traced(so, **kw):
        launches.append(time.perf_counter())
        return orig(so, **kw)

    runner.launch = traced
    async with eng:
        await eng.generate(input_ids=[3] * 16, sampling=SamplingParams(max_new_tokens=2))
        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.sleep(idle_s)
        idle = (time.process_time() - cpu0) / (time.perf_counter() - t0)
        wake = []
        for i in range(n_wake):
            await asyncio.sleep(0.01)
            launches.clear()
            t_sub = time.perf_counter()
            await eng.generate(input_ids=[3, i + 4], sampling=SamplingParams(max_new_tokens=1))
            wake.append(launches[0] - t_sub)
    return {"idle_cpu_fraction_of_core": idle, "wakeup_p50_us": 1e6 * pct(wake, 50), "wakeup_p99_us": 1e6 * pct(wake, 99)}


class ThreadedReference:
    """The reference design as a baseline: a thread that drains a queue.Queue inbox,
    sleeps 1 ms when idle, and blocks on the device; the asyncio side drains the outbox
    with a blocking get in an executor (0.1 s timeout)."""

    def __init__(self, path):
        config = SchedulerConfig(kv_capacity_tokens=262144, max_running_requests=256, max_prefill_tokens=8192, chunked_prefill_size=8192, cuda_graph_max_len=1024)
        self.stack = build_native_stack(str(path), config, device="cuda", dtype="bfloat16")
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.running = True
        self.launch_times: list = []
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        core, runner = self.stack.core, self.stack.runner
        while self.running:
            while True:
                try:
                    core.add_request(self.inbox.get_nowait())
                except queue.Empty:
                    break
            batch = core.get_next_batch()
            if batch is None:
                time.sleep(0.001)
                continue
            so = SchedulerOutput([SchedulerRequest(r.rid, r.data) for r in batch.reqs], batch)
            self.launch_times.append(time.perf_counter())
            pending = runner.launch(so)
            torch.cuda.synchronize()
            out = runner.collect(pending)
            for oc in core.process_result(batch, out.token_ids, out.logprobs):
                if oc.token is not None:
                    self.outbox.put((oc.req.rid, oc.token, oc.finished))

    def submit(self, rid, ids, n):
        r = Request(rid=rid, prompt_ids=list(ids), sampling=SamplingParams(max_new_tokens=n, ignore_eos=True), eos_token_ids=())
        r.data = RequestData(req=r)
        self.inbox.put(r)

    def close(self):
        self.running = False
        self.thread.join()


async def threaded_baseline(path, reqs, new, idle_s, n_wake):
    ref = ThreadedReference(path)
    loop = asyncio.get_running_loop()
    lags: list = []
    stop = asyncio.Event()
    tick = asyncio.create_task(ticker_lags(stop, lags))
    waiters: dict = {}

    async def drain():
        while True:
            try:
                item = await loop.run_in_executor(None, ref.outbox.get, True, 0.1)
            except queue.Empty:
                if stop.is_set():
                    return
                continue
            rid, _tok, fin = item
            w = waiters.get(rid)
            if w is not None:
                w["n"] += 1
                if w["first"] is None:
                    w["first"] = time.perf_counter()
                if fin:
                    w["done"].set()

    drainer = asyncio.create_task(drain())

    async def one(rid, p, n):
        waiters[rid] = {"n": 0, "first": None, "done": asyncio.Event(), "t": time.perf_counter()}
        ref.submit(rid, p, n)
        await waiters[rid]["done"].wait()
        return waiters[rid]

    await one("warm", [5] * 64, 4)
    t0 = time.perf_counter()
    await asyncio.gather(*(one(f"r{i}", p, new) for i, p in enumerate(reqs)))
    wall = time.perf_counter() - t0
    lag_busy = list(lags)
    lags.clear()
    cpu0, t1 = time.process_time(), time.perf_counter()
    await asyncio.sleep(idle_s)
    idle = (time.process_time() - cpu0) / (time.perf_counter() - t1)
    wake = []
    for i in range(n_wake):
        await asyncio.sleep(0.01)
        n0 = len(ref.launch_times)
        t_sub = time.perf_counter()
        await one(f"w{i}", [3, i + 4], 1)
        wake.append(ref.launch_times[n0] - t_sub)
    stop.set()
    await tick
    await drainer
    ref.close()
    return {"tok_s": len(reqs) * new / wall, "wall_s": wall, "ticker_lag_p50_ms": 1000 * pct(lag_busy, 50),
            "ticker_lag_p99_ms": 1000 * pct(lag_busy, 99), "idle_cpu_fraction_of_core": idle,
            "wakeup_p50_us": 1e6 * pct(wake, 50), "wakeup_p99_us": 1e6 * pct(wake, 99)}


def section_peers(path: Path, n_req: int, new: int, idle_s: float, n_wake: int):
    import uvloop

    reqs = workload(n_req)
    out = {}
    for loop in ("normal", "overlap", "async_decode"):
        out[f"omni_{loop}"] = uvloop.run(omni_throughput(path, loop, reqs, new))
        log("D", loop, out[f"omni_{loop}"])
    out["omni_idle"] = uvloop.run(omni_idle_and_wakeup(path, idle_s, n_wake))
    log("F", out["omni_idle"])
    out["threaded_reference"] = uvloop.run(threaded_baseline(path, reqs, new, idle_s, n_wake))
    log("G", out["threaded_reference"])
    out["transformers"] = hf_generate_throughput(path, reqs, new)
    log("D hf", out["transformers"])
    best = max(out[f"omni_{l}"]["tok_s"] for l in ("normal", "overlap", "async_decode"))
    hf = out["transformers"]
    out["ratios"] = {
        "best_omni_over_generate": best / hf["generate_tok_s"],
        "best_omni_over_generate_batch": best / hf["generate_batch_tok_s"] if "generate_batch_tok_s" in hf else None,
        "best_omni_over_threaded": best / out["threaded_reference"]["tok_s"],
        "threaded_idle_cpu_over_omni": out["threaded_reference"]["idle_cpu_fraction_of_core"] / max(1e-9, out["omni_idle"]["idle_cpu_fraction_of_core"]),
        "threaded_wakeup_over_omni": out["threaded_reference"]["wakeup_p50_us"] / out["omni_idle"]["wakeup_p50_us"],
    }
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_results.json")
    ap.add_argument("--sections", default="correctness,await,steps,floor,peers")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    RESULTS["machine"] = {
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    }
    try:
        import transformers

        RESULTS["machine"]["transformers"] = transformers.__version__
    except ImportError:
        pass
    tmp = Path(tempfile.gettempdir()) / "omni_bench"
    tmp.mkdir(exist_ok=True)
    wanted = args.sections.split(",")
    q = args.quick
    qwen = None

    def run(name, fn):
        t0 = time.perf_counter()
        try:
            RESULTS["sections"][name] = fn()
        except Exception:  # noqa: BLE001
            RESULTS["sections"][name] = {"error": traceback.format_exc()}
            log("section", name, "failed:\n", traceback.format_exc())
        RESULTS["sections"].setdefault(name, {})
        if isinstance(RESULTS["sections"][name], dict):
            RESULTS["sections"][name]["section_s"] = time.perf_counter() - t0
        save(args.out)

    if "correctness" in wanted:
        run("correctness", lambda: section_correctness(tmp))
    if any(s in wanted for s in ("await", "steps", "floor", "peers")):
        qwen = make_checkpoint(tmp / "qwen05", QWEN05)
    if "await" in wanted:
        run("await", lambda: section_await(qwen, 100 if q else 300))
    if "steps" in wanted:
        run("steps", lambda: section_steps(qwen, [1, 8] if q else [1, 8, 32, 64, 128, 256]))
    if "floor" in wanted:
        run("floor", lambda: section_floor(qwen, RESULTS["sections"].get("steps", {})))
    if "peers" in wanted:
        run("peers", lambda: section_peers(qwen, 64 if q else 256, 32 if q else 128, 2.0 if q else 10.0, 10 if q else 50))
    log(json.dumps(RESULTS, indent=1, default=str)[:6000])


if __name__ == "__main__":
    main()

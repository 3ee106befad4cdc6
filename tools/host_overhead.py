"""Host cost per running request per step, with the device taken out (issue 12).

The real Engine, stage, batch core, persistent input batch, sampling bookkeeping,
collect, emission, handles and one streaming consumer task per request, over the
built-in ``tiny`` model whose device step is replaced by a null one: decode steps go
through a stand-in for the CUDA graphs that copies the inputs into static buffers like
a replay does and "samples" a token computed from the input token and position in one
tensor op; prefill steps return the same way without a forward. Decode launches run
inline on the loop thread (the CUDA path's ``step_launch="auto"``), prefill on the
worker thread. What is left is the host's part of the GPU workload of
``bench/gpu_saturation.py`` (256 streamed requests, prompts 64-512, 128 new tokens,
greedy, no tokenizer): the time per generated token is the host cost per
request-step, since the null device costs (almost) nothing.

Every loop gets an unmeasured warm-up pass, then repeats interleaved. With ``--code``
given more than once, each checkout runs in its own process and the processes are
interleaved too (a before/after comparison in one run). Per run: us per token, tok/s,
CPU time per token, wall time, a 1 ms ticker's lag (p50/p99/max) and the cyclic GC's
passes and pauses, under each GC mode (``--gc default,tuned``: Python's own, and what
``gc_freeze=True, gc_gen0_threshold=10000`` do), switched per run in one process.
Tokens of every loop are checked equal. ``--profile`` adds a cProfile top list.

``--requests 256,1024`` runs NV256's shape instead (issue 42): that many requests submitted
at once, prompts of 100-1,024 ids, ``--nv-new`` new tokens each (NV256's 100-1,024 by
default: a few seconds a run on the null device), at most ``--max-running`` running (512, the H200's default at the 0.5B shape), so at
1,024 the rest wait and prefill steps come between decode steps as requests finish. Per
run it also reports the host's milliseconds per decode step and per prefill step (wall time
from scheduling a step to scheduling the next, by the kind of the first: exact in the
normal loop) and per prompt token of the prefill steps.

    python tools/host_overhead.py --batches 256,64 --repeats 3
    python tools/host_overhead.py --requests 256,1024 --loops overlap --decode-steps 8 --fused --gc tuned --profile
    python tools/host_overhead.py --code /tmp/before --code . --labels before,after
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent / "bench"  # _common
LOOPS = ("normal", "overlap", "async_decode")


# ------------------------------------------------------------------ the null device


def install_null_device(engine, device_s: float = 0.0, fused: bool = False, prefill_s_per_token: float = 0.0) -> None:
    """Swap the engine's device work for a null step: decode through a stand-in for the
    captured graphs, prefill without a forward, decode launches inline on the loop.
    ``fused``: a multi-step decode goes through the fused launch's host path as on the
    GPU (one stand-in replay for its k forwards), not k one-forward replays.
    ``device_s``: the modelled device's time per decode forward; ``prefill_s_per_token``:
    its time per token of a prefill step (0: a prefill step costs one decode forward)."""
    import torch

    from omni_async.stage.executor import InlineStepExecutor
    from omni_async.runners.cuda_graphs import GraphOutputs
    from omni_async.runners.types import BatchResult

    sched = engine.scheduler
    runner = sched.runner
    vocab = runner.model.config.vocab_size
    cap = 1024

    def fake_tokens(ids, pos):
        # A pure function of (input token, position): every loop yields the same tokens.
        return (ids * 7 + pos * 13 + 1) % (vocab - 3) + 3

    class NullGraphs:
        """What ``DecodeGraphs`` does on the host for one replay: copy the step's
        inputs into static buffers; the "graph" is one elementwise op."""

        max_batch = cap

        def __init__(self) -> None:
            self.input_ids = torch.zeros(cap, dtype=torch.long)
            self.positions = torch.zeros(cap, dtype=torch.long)
            self.slot_mapping = torch.zeros(cap, dtype=torch.long)
            self.block_tables = torch.zeros((cap, 64), dtype=torch.long)
            self.kv_lens = torch.zeros(cap, dtype=torch.long)
            self.logits = torch.zeros((cap, vocab))
            self.ok = torch.ones(cap, dtype=torch.bool)
            self.hidden = torch.zeros((cap, 1))
            self.replays = 0
            self.counted = 0  # replays already charged to a step's device time
            self.device_s_total = 0.0  # the modelled device's busy time, all steps
            self.free_at = 0.0  # when the modelled device finishes what is queued
            self.prefill_tokens = 0  # extend tokens launched since the last completion event
            # The modelled device's idle time before each step, by the kind of the step
            # that ran before the gap (True: decode): where the host made it wait.
            self.idle_after = {True: 0.0, False: 0.0}
            self.last_decode = True

        def bucket_for(self, bs: int) -> int | None:
            return bs if bs <= cap else None

        def fits(self, bs: int, pages: int) -> bool:
            return bs <= cap and pages <= self.block_tables.shape[1]

        def replay(self, input_ids, positions, slot_mapping, block_tables, kv_lens, cond=None):
            bs = input_ids.shape[0]
            self.input_ids[:bs].copy_(input_ids)
            self.positions[:bs].copy_(positions)
            self.slot_mapping[:bs].copy_(slot_mapping)
            self.block_tables[:bs, : block_tables.shape[1]].copy_(block_tables)
            self.kv_lens[:bs].copy_(kv_lens)
            self.replays += 1
            return GraphOutputs(self.logits[:bs], self.hidden[:bs], fake_tokens(self.input_ids[:bs], self.positions[:bs]), self.ok[:bs])

    class NullEvent:
        """A CUDA event stand-in: done ``device_s`` per forward after the later of its
        launch and the step before it (one queue, as on a device). With no modelled
        device time it is never done at the first two queries, so the loop's cooperative
        wait yields once per step as it does while a real step runs; with a modelled
        device it is done when its time has come, as a CUDA event is (a query that says
        "not yet" for a step already done would send the loop's event waiter to sleep
        for a whole step's expected time, an idle device that a real one does not see)."""

        def __init__(self) -> None:
            forwards = graphs.replays - graphs.counted
            tokens, graphs.prefill_tokens = graphs.prefill_tokens, 0
            graphs.counted = graphs.replays
            busy = device_s * forwards + prefill_s_per_token * tokens if prefill_s_per_token and tokens else device_s * max(1, forwards)
            graphs.device_s_total += busy
            now = time.perf_counter()
            if graphs.free_at and now > graphs.free_at:
                graphs.idle_after[graphs.last_decode] += now - graphs.free_at
            graphs.last_decode = not tokens
            graphs.free_at = self.done_at = max(now, graphs.free_at) + busy
            self.queries = 0

        def query(self) -> bool:
            self.queries += 1
            return (modelled or self.queries > 2) and time.perf_counter() >= self.done_at

        def synchronize(self) -> None:
            while not self.query():
                pass

    graphs = NullGraphs()
    modelled = bool(device_s or prefill_s_per_token)
    base_cls = type(runner)

    class NullDeviceRunner(base_cls):  # type: ignore[misc, valid-type]
        def forward(self, fb):
            if fb.block_tables is not None and self.graphs is not None:
                return super().forward(fb)
            graphs.prefill_tokens += fb.input_ids.shape[0]
            rows = fb.ctx.logits_rows
            tokens = fake_tokens(fb.input_ids.index_select(0, rows), fb.positions.index_select(0, rows))
            n = tokens.shape[0]
            return BatchResult(logits=graphs.logits[:n], graph_greedy=(tokens, graphs.ok[:n]))

        def record_completion(self):
            return NullEvent()

    runner.__class__ = NullDeviceRunner
    runner.graphs = graphs
    if fused and runner.fused_decode is not None:
        install_null_fused(runner, graphs, fake_tokens, cap)
    executor = InlineStepExecutor(event_waiter=sched.executor.event_waiter)
    sched.executor = sched.stepper.executor = executor


def install_null_fused(runner, graphs, fake_tokens, cap: int) -> None:
    """Multi-step decodes through the fused launch's host path (``plan_fused``, the
    ``[B, 5]`` inputs, ``publish_steps``), its replay replaced by the host calls the CUDA
    path makes around a replay (:func:`replay_host_calls`); the k forwards' tokens, the
    device's work, come from :func:`fake_steps` (equal to the one-forward replays')."""
    import torch

    from omni_async.runners.fused_decode import POSITION

    fused = runner.fused_decode
    static = StaticInputs(cap)
    vocab = runner.model.config.vocab_size

    def null_run(fb, slots, eager_ctx):
        fused.launches += 1
        inputs, newest = replay_host_calls(static, fb, slots)
        out = np.ones((2, fb.steps, inputs.shape[0]), dtype=np.int64)
        out[0] = fake_steps(newest.numpy(), fb.host[:, POSITION], fb.steps, vocab)
        graphs.replays += fb.steps  # the modelled device's forwards
        fb.inputs_dev = inputs
        return torch.from_numpy(out), None

    fused.run = null_run
    route_fused_launches(runner)


class StaticInputs:
    """A fused graph's static input buffers (``FusedDecode.capture``'s), on the CPU."""

    def __init__(self, cap: int, pages: int = 64) -> None:
        import torch

        self.inputs = torch.zeros((cap, 5), dtype=torch.long)
        self.newest = torch.zeros(cap, dtype=torch.long)
        self.tables = torch.zeros((cap, pages), dtype=torch.long)
        self.fp = torch.ones((cap, 5), dtype=torch.float32)
        self.ip = torch.zeros((cap, 3), dtype=torch.long)


def replay_host_calls(static: StaticInputs, fb, slots):
    """The torch calls ``FusedDecode.run`` makes on the host for a graph replay: the
    ``[B, 5]`` inputs copied into the static buffer, the rows' page tables and newest
    tokens gathered into theirs, and (a sampled step) their settings; the replay itself
    is not modelled (a ``cudaGraphLaunch``, its host cost not measurable here). Returns
    the static inputs and newest tokens. The device's work is not the host's: a stand-in
    that computed k forwards' tokens in torch ops (~70 calls at k = 8) charged the host
    ~150-250 us a step that the CUDA path does not spend."""
    import torch

    from omni_async.runners.fused_decode import SLOT

    n = fb.host.shape[0]
    inputs = static.inputs[:n]
    inputs.copy_(torch.from_numpy(fb.host))
    idx = inputs[:, SLOT]
    width = min(slots.table_dev.shape[1], static.tables.shape[1])
    torch.index_select(slots.table_dev[:, :width], 0, idx, out=static.tables[:n, :width])
    torch.index_select(slots.last_token, 0, idx, out=static.newest[:n])
    if not fb.mode.greedy:
        torch.index_select(slots.fp_dev, 0, idx, out=static.fp[:n])
        torch.index_select(slots.ip_dev, 0, idx, out=static.ip[:n])
    return inputs, static.newest[:n]


_STEP_COEFFS: dict[tuple[int, int], "np.ndarray"] = {}


def fake_steps(first, positions, k: int, vocab: int):
    """``[k, B]`` tokens of the null device's ``fake_tokens`` applied k times in turn
    (forward j reads the token forward j - 1 gave, at position ``positions + j``), in
    closed form: the recurrence is linear modulo ``vocab - 3``, so four numpy operations
    whatever k, not k rounds of torch calls (the device's work, not the host's)."""
    m = vocab - 3
    coeffs = _STEP_COEFFS.get((k, m))
    if coeffs is None:  # u_j = t_j - 3: u_1 = 7 t_0 + 13 p + 1, u_{j+1} = 7 u_j + 13 p + 13 j + 22 (mod m)
        a, b, c = [1], [0], [0]
        for j in range(1, k):
            a.append(7 * a[-1] % m)
            b.append((7 * b[-1] + 1) % m)
            c.append((7 * c[-1] + 13 * j + 22) % m)
        coeffs = _STEP_COEFFS[(k, m)] = np.array([a, b, c], dtype=np.int64)[:, :, None]
    p13 = (13 * np.asarray(positions, dtype=np.int64)) % m
    u1 = (7 * np.asarray(first, dtype=np.int64) + p13 + 1) % m
    return (coeffs[0] * u1 + coeffs[1] * p13 + coeffs[2]) % m + 3


def route_fused_launches(runner) -> None:
    """Send the runner's multi-step decodes through the fused launch's planning, as on
    CUDA (a runner whose forward a probe replaced would otherwise count as overriding a
    hook, which keeps multi-step decodes off the fused launch)."""
    from omni_async.runners.fused_split import plan_fused

    def fused_batch(batch, rows, sidx, capture=False):
        def rest(sub, sub_rows, sub_sidx):
            return runner._unfused_decode(sub, sub_rows, sub_sidx, capture)

        return plan_fused(runner.fused_decode, runner.inputs, batch, rows, sidx, False, rest)

    runner._fused_batch = fused_batch


# ------------------------------------------------------------------ one process, one checkout


def workload(n: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(64, 512))] for _ in range(n)]


def nv_workload(n: int, seed: int, vocab: int, new: tuple[int, int]) -> tuple[list[list[int]], list[int]]:
    """NV256's shape: prompts of 100-1,024 ids, then each request's new tokens drawn from
    ``new`` (NV256's 100-1,024 by default)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    return prompts, [rng.randint(*new) for _ in range(n)]


class StepClock:
    """Wall time from scheduling one step to scheduling the next, charged to the kind of
    the first (prefill or decode), and the prompt tokens of the prefill steps: with the
    null device that interval is the host's work for the step (exact in the normal loop,
    where nothing overlaps; in the lookahead loops, and for the normal loop's steps
    launched early (``BatchCore.schedule_early``, counted when scheduled), the next step is
    scheduled before this one is processed, so the split between kinds is approximate)."""

    def __init__(self, stepper) -> None:
        self.stepper, self.inner = stepper, stepper.next_batch
        self._reset()
        stepper.next_batch = self
        early = getattr(stepper.core, "schedule_early", None)
        if early is not None:  # the normal loop's steps launched before the step ahead is processed
            stepper.core.schedule_early = lambda batch, tokens: self.seen(early(batch, tokens))

    def __call__(self):
        return self.seen(self.inner())

    def seen(self, batch):
        if batch is not None:
            now = time.perf_counter()
            if self.last is not None:
                t, decode = self.last
                self.s[decode] += now - t
                self.n[decode] += 1
            self.last = (now, batch.is_decode)
            if not batch.is_decode:
                self.prompt_tokens += sum(n for n, kept in zip(batch.extend_lens, batch.samples_kept) if n > 1 or not kept)
        return batch

    def take(self) -> dict:
        """This run's figures; the clock restarts."""
        out = {"decode_step_ms": 1e3 * self.s[True] / max(1, self.n[True]),
               "prefill_step_ms": 1e3 * self.s[False] / max(1, self.n[False]),
               "prefill_us_per_prompt_token": 1e6 * self.s[False] / max(1, self.prompt_tokens),
               "clock_decode_steps": self.n[True], "clock_prefill_steps": self.n[False]}
        self._reset()
        return out

    def _reset(self) -> None:
        self.last: tuple[float, bool] | None = None
        self.s, self.n, self.prompt_tokens = {True: 0.0, False: 0.0}, {True: 0, False: 0}, 0


class GcWatch:
    """Passes of the cyclic GC during a run, with their pauses, by generation."""

    def __init__(self) -> None:
        self.passes = [0, 0, 0]
        self.pause_s = [0.0, 0.0, 0.0]
        self.max_pause_s = 0.0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        took = time.perf_counter() - self._t0
        g = info["generation"]
        self.passes[g] += 1
        self.pause_s[g] += took
        self.max_pause_s = max(self.max_pause_s, took)

    def __enter__(self) -> "GcWatch":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


async def ticker(stop: asyncio.Event, lags: list[float], period: float = 0.001) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(period)
        lags.append(max(0.0, time.perf_counter() - t - period))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else 0.0


async def run_workload(engine, reqs: list[list[int]], new: int | list[int]) -> tuple[dict, list[list[int]]]:
    from omni_async import SamplingParams

    news = new if isinstance(new, list) else [new] * len(reqs)
    assert (await engine.flush_cache())["success"]  # repeats send the same prompts: start cold
    lags: list[float] = []
    stop = asyncio.Event()
    tick = asyncio.create_task(ticker(stop, lags))

    async def one(p: list[int], n: int) -> list[int]:
        out: list[int] = []
        async for d in engine.stream(input_ids=p, sampling=SamplingParams(max_new_tokens=n, ignore_eos=True)):
            out.extend(d.token_ids)
        return out

    steps0, all0 = engine.scheduler.stats.decode_steps, engine.scheduler.stats.steps
    graphs = engine.scheduler.runner.graphs
    busy0 = graphs.device_s_total
    idle0 = dict(graphs.idle_after)
    graphs.free_at = 0.0  # nothing is in flight between runs: the wait before this run is not idle time
    with GcWatch() as gcw:
        cpu0, t0 = time.process_time(), time.perf_counter()
        clock = getattr(engine.scheduler.stepper.next_batch, "take", None)
        clock and clock()  # the steps before this run are not its own
        outs = await asyncio.gather(*(one(p, n) for p, n in zip(reqs, news)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    stop.set()
    await tick
    tokens = sum(len(o) for o in outs)
    return {
        "us_per_token": 1e6 * wall / tokens,
        # CPU time of the process (every thread) per token: steadier than wall time on a
        # shared machine, where waiting for a core shows up in wall time only.
        "cpu_us_per_token": 1e6 * cpu / tokens,
        "tok_s": tokens / wall,
        "wall_s": wall,
        "tokens": tokens,
        "cpu_over_wall": cpu / wall,
        "decode_steps": engine.scheduler.stats.decode_steps - steps0,
        "steps": engine.scheduler.stats.steps - all0,
        # With --device-us: the modelled device's busy fraction of the wall (GPU busy).
        "device_busy": (graphs.device_s_total - busy0) / wall,
        "device_idle_after_decode_ms": 1e3 * (graphs.idle_after[True] - idle0[True]),
        "device_idle_after_prefill_ms": 1e3 * (graphs.idle_after[False] - idle0[False]),
        "ticker_p50_ms": 1e3 * pct(lags, 50),
        "ticker_p99_ms": 1e3 * pct(lags, 99),
        "ticker_max_ms": 1e3 * max(lags, default=0.0),
        "gc_passes": gcw.passes,
        "gc_pause_ms": [round(1e3 * s, 3) for s in gcw.pause_s],
        "gc_max_pause_ms": 1e3 * gcw.max_pause_s,
        **(clock() if clock else {}),
    }, outs


def make_engine(loop: str, batch: int, device_s: float, decode_steps: int = 1, fused: bool = False, kv_per_row: int = 700,
                prefill_s_per_token: float = 0.0):
    from omni_async import Engine

    eng = Engine.from_pretrained(
        "tiny", loop=loop, max_running_requests=batch, kv_capacity_tokens=batch * kv_per_row,
        max_prefill_tokens=8192, chunked_prefill_size=8192, max_queued_requests=8192, decode_steps=decode_steps,
    )
    eng.tokenizer = None  # as in the GPU workload (a random checkpoint has no tokenizer)
    install_null_device(eng, device_s, fused, prefill_s_per_token)
    StepClock(eng.scheduler.stepper)
    return eng


def apply_gc_mode(mode: str) -> None:
    """``tuned``: what ``gc_freeze=True, gc_gen0_threshold=10000`` do at engine load,
    applied per run so both modes run side by side; ``default``: Python's own."""
    if mode == "tuned":
        gc.set_threshold(10_000, 10, 10)
        gc.collect()
        gc.freeze()
    elif mode == "default":
        gc.unfreeze()
        gc.set_threshold(700, 10, 10)
    else:
        raise ValueError(f"unknown GC mode {mode!r}")


async def child_main(args) -> dict:
    """One checkout, every loop: a warm-up pass, then ``--child-repeats`` measured runs."""
    import torch

    torch.set_num_threads(1)
    import omni_async

    loops = args.loops.split(",")
    out: dict = {"package": str(Path(omni_async.__file__).parent), "batches": {}}
    nv = bool(args.requests)
    nv_new = tuple(int(x) for x in args.nv_new.split(","))
    for batch in [int(b) for b in (args.requests or args.batches).split(",")]:
        ks = [int(k) for k in args.decode_steps.split(",")]
        # NV shape: --max-running rows at most, KV for each of them at its longest
        running, kv_row = (args.max_running, 1024 + nv_new[1]) if nv else (batch, 700)
        engines = {(loop if len(ks) == 1 else f"{loop}/k{k}"): make_engine(loop, running, args.device_us * 1e-6, k, args.fused, kv_row, args.prefill_us_per_token * 1e-6)
                   for k in ks for loop in loops}
        reqs, new = nv_workload(batch, batch, 250, nv_new) if nv else (workload(batch, seed=batch, vocab=250), args.new)
        for eng in engines.values():
            await eng.start()
            await run_workload(eng, workload(min(batch, 64), seed=9, vocab=250), 16)
        gcs = args.gc.split(",")
        runs: dict[str, list[dict]] = {}
        tokens: dict[str, list[list[int]]] = {}
        for _ in range(args.child_repeats):
            for mode in gcs:
                for loop in engines:
                    key = f"{loop}/{mode}" if len(gcs) > 1 else loop
                    apply_gc_mode(mode)
                    r, toks = await run_workload(engines[loop], reqs, new)
                    runs.setdefault(key, []).append(r)
                    tokens.setdefault(key, toks)
        apply_gc_mode("default")
        ref = next(iter(tokens.values()), [])
        out["batches"][str(batch)] = {
            "runs": runs,
            "loops_equal": all(tokens[loop] == ref for loop in tokens),
            "token_digest": zlib.crc32(json.dumps(ref).encode()),
        }
        if args.profile:
            apply_gc_mode(gcs[-1])
            out["batches"][str(batch)]["profile"] = await profile_runs(engines, reqs, new, args.profile_top, args.profile_sort)
            apply_gc_mode("default")
        for eng in engines.values():
            await eng.aclose()
    return out


async def profile_runs(engines: dict, reqs: list[list[int]], new: int | list[int], top: int, sort: str = "tottime") -> dict[str, str]:
    import cProfile
    import io
    import pstats

    texts = {}
    for loop, eng in engines.items():
        prof = cProfile.Profile()
        prof.enable()
        await run_workload(eng, reqs, new)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(sort).print_stats(top)
        texts[loop] = s.getvalue()
    return texts


# ------------------------------------------------------------------ the parent: interleaving


def run_child(code: str, args) -> dict:
    cmd = [
        sys.executable, str(HERE / "host_overhead.py"), "--child", "--batches", args.batches, "--loops", args.loops,
        "--new", str(args.new), "--child-repeats", "1",
        "--device-us", str(args.device_us), "--prefill-us-per-token", str(args.prefill_us_per_token), "--decode-steps", args.decode_steps,
        "--requests", args.requests, "--nv-new", args.nv_new, "--max-running", str(args.max_running),
    ] + (["--fused"] if args.fused else [])
    cmd += ["--gc", args.gc]
    env = dict(os.environ, PYTHONPATH=str(Path(code).resolve()))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(Path(code).resolve()))
    if proc.returncode != 0:
        raise RuntimeError(f"child under {code} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summary(xs: list[float]) -> dict:
    med = statistics.median(xs)
    return {"median": round(med, 3), "min": round(min(xs), 3), "max": round(max(xs), 3),
            "spread_pct": round(100 * (max(xs) - min(xs)) / med, 1) if med else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="256,64")
    ap.add_argument("--loops", default=",".join(LOOPS))
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--requests", default="", help="NV256-shaped runs of these many requests instead of --batches (e.g. 256,1024)")
    ap.add_argument("--nv-new", default="100,1024", help="with --requests: new tokens per request, lo,hi (NV256's)")
    ap.add_argument("--max-running", type=int, default=512, help="with --requests: max_running_requests")
    ap.add_argument("--device-us", type=float, default=0.0, help="null device's time per forward (0: none)")
    ap.add_argument("--prefill-us-per-token", type=float, default=0.0, help="null device's time per prefill token (0: a prefill step is one forward)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fused", action="store_true", help="multi-step decodes through the fused launch's host path (the GPU's)")
    ap.add_argument("--decode-steps", default="1", help="decode_steps values, side by side (variants loop/kN)")
    ap.add_argument("--code", action="append", help="checkout to import omni_async from (repeatable)")
    ap.add_argument("--labels", default="", help="comma-separated labels of the --code checkouts")
    ap.add_argument("--gc", default="default,tuned", help="GC modes side by side (default: Python's; tuned: frozen heap, gen0 threshold 10000)")
    ap.add_argument("--profile", action="store_true", help="one more cProfile'd run per loop (first checkout, one process)")
    ap.add_argument("--profile-top", type=int, default=30)
    ap.add_argument("--profile-sort", default="tottime", help="pstats sort key (tottime, cumulative)")
    ap.add_argument("--out", default="host_overhead.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-repeats", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(BENCH))
    from _common import machine_facts, run_async, save_json

    if args.child:
        print(json.dumps(run_async(child_main(args))))
        return 0
    codes = args.code or [str(HERE.parent)]
    labels = args.labels.split(",") if args.labels else [Path(c).resolve().name for c in codes]
    per: dict[str, list[dict]] = {label: [] for label in labels}
    for rep in range(args.repeats):
        for code, label in zip(codes, labels):
            r = run_child(code, args)
            per[label].append(r)
            for b, br in r["batches"].items():
                line = "  ".join(f"{loop} {runs[0]['us_per_token']:.2f}/{runs[0]['cpu_us_per_token']:.2f}"
                                 f" busy {runs[0].get('device_busy', 0.0):.2f}"
                                 for loop, runs in br["runs"].items())
                print(f"rep {rep} {label:>8} batch {b:>4}: us/token wall/cpu {line}  equal={br['loops_equal']}", flush=True)
    result: dict = {"config": vars(args), "labels": labels, "runs": per, "summary": {}}
    print(f"\n{'label':>8} {'batch':>5} {'loop':>20} {'us/token median (min-max)':>28} {'spread':>7} {'cpu us/token':>12} "
          f"{'tick p99 ms':>11} {'tick max':>8} {'gc2 passes':>10} {'gc max ms':>9} {'busy':>5} {'host ms/step':>12}")
    for label in labels:
        for b in per[label][0]["batches"]:
            for loop in per[label][0]["batches"][b]["runs"]:
                runs = [r["batches"][b]["runs"][loop][0] for r in per[label]]
                s = summary([x["us_per_token"] for x in runs])
                c = summary([x["cpu_us_per_token"] for x in runs])
                result["summary"][f"{label}/{b}/{loop}"] = {
                    "us_per_token": s, "cpu_us_per_token": c, "tok_s": summary([x["tok_s"] for x in runs]),
                    "ticker_p99_ms": summary([x["ticker_p99_ms"] for x in runs]),
                    "ticker_max_ms": max(x["ticker_max_ms"] for x in runs),
                    "gc_gen2_passes": [x["gc_passes"][2] for x in runs],
                    "gc_max_pause_ms": max(x["gc_max_pause_ms"] for x in runs),
                    "loops_equal": all(r["batches"][b]["loops_equal"] for r in per[label]),
                    "device_busy": summary([x.get("device_busy", 0.0) for x in runs]),
                    # The modelled device's idle time per step (prefill and decode): the host's
                    # share of a step where nothing overlaps it (the normal loop).
                    **{k: summary([x.get(k, 0.0) for x in runs]) for k in ("decode_step_ms", "prefill_step_ms", "prefill_us_per_prompt_token",
                                                                        "device_idle_after_decode_ms", "device_idle_after_prefill_ms")},
                    "steps_decode_prefill": [(x.get("clock_decode_steps"), x.get("clock_prefill_steps")) for x in runs],
                    "host_ms_per_step": summary([1e3 * max(0.0, x["wall_s"] * (1 - x.get("device_busy", 0.0))) / max(1, x.get("steps", x["decode_steps"])) for x in runs]),
                }
                print(f"{label:>8} {b:>5} {loop:>20} {s['median']:>10.2f} ({s['min']:.2f}-{s['max']:.2f}) "
                      f"{s['spread_pct']:>6}% {c['median']:>12.2f} {statistics.median(x['ticker_p99_ms'] for x in runs):>11.2f} "
                      f"{max(x['ticker_max_ms'] for x in runs):>8.1f} {max(x['gc_passes'][2] for x in runs):>10} "
                      f"{max(x['gc_max_pause_ms'] for x in runs):>9.2f} "
                      f"{result['summary'][f'{label}/{b}/{loop}']['device_busy']['median']:>5.2f} "
                      f"{result['summary'][f'{label}/{b}/{loop}']['host_ms_per_step']['median']:>12.3f}")
                sm = result["summary"][f"{label}/{b}/{loop}"]
                print(f"{'':>8} {'':>5} {'':>20}   ms per decode step {sm['decode_step_ms']['median']:.3f} ({sm['decode_step_ms']['min']:.3f}-"
                      f"{sm['decode_step_ms']['max']:.3f}), per prefill step {sm['prefill_step_ms']['median']:.3f} ({sm['prefill_step_ms']['min']:.3f}-"
                      f"{sm['prefill_step_ms']['max']:.3f}), us per prompt token {sm['prefill_us_per_prompt_token']['median']:.3f}, "
                      f"steps (decode, prefill) {sm['steps_decode_prefill'][0]}")
                if args.device_us or args.prefill_us_per_token:
                    print(f"{'':>8} {'':>5} {'':>20}   modelled device idle after decode steps {sm['device_idle_after_decode_ms']['median']:.1f} ms "
                          f"({sm['device_idle_after_decode_ms']['min']:.1f}-{sm['device_idle_after_decode_ms']['max']:.1f}), after prefill steps "
                          f"{sm['device_idle_after_prefill_ms']['median']:.1f} ms ({sm['device_idle_after_prefill_ms']['min']:.1f}-"
                          f"{sm['device_idle_after_prefill_ms']['max']:.1f})")
    digests = {label: {b: br["token_digest"] for b, br in per[label][0]["batches"].items()} for label in labels}
    result["token_digests"] = digests
    print("token digests (equal across checkouts when the tokens are):", digests)
    if args.profile:
        prof_args = argparse.Namespace(**{**vars(args), "profile": True, "child_repeats": 0, "gc": "tuned"})
        env_code = codes[-1]
        sys.path.insert(0, str(Path(env_code).resolve()))
        result["profile"] = {b: br["profile"] for b, br in run_async(child_main(prof_args))["batches"].items()}
        for b, texts in result["profile"].items():
            for loop, text in texts.items():
                print(f"\n===== cProfile batch {b} {loop} =====\n" + "\n".join(text.splitlines()[:args.profile_top + 12]))
    result["machine"] = machine_facts()
    print(f"\nsaved {save_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Co-located stages on one device: a thinker streaming into a talker through
``TwoStagePipeline``, against each stage alone on the same requests.

The workload: random-weight bf16 checkpoints of a thinker (Qwen2-1.5B shape, or Llama-8B
with ``--thinker-shape llama-8b``) and a talker (Qwen2-0.5B shape), built on the fly;
``--conversations`` (128) conversations, thinker prompts of 100-512 tokens and 256 new
tokens; the talker is deferred until 3 thinker chunks have arrived, then writes 512
tokens; temperature 0.7, ignore_eos; each stage ``max_running_requests=256``, an explicit
KV size (or ``--shares``, each stage's ``memory_budget``), prefill budget 16384/8192.

The arms (``--modes``), per loop, repeats interleaved (repeat 1: every loop's arms, then
repeat 2, ...):
- ``pipeline_hidden`` (the default talker): the thinker captures its hidden states for
  every request and the talker reads them, one per thinker token, through its
  ``thinker_to_talker_proj`` (random); its prompt is BOS and one placeholder per row of
  the first 3 chunks, and each later position waits for its row;
- ``pipeline_tokens``: the token-only talker (prompt: BOS and the thinker's tokens so
  far), the thinker without capture;
- ``thinker`` / ``thinker_hidden``: the thinker alone without / with hidden capture;
- ``talker``: the talker alone (prompt: BOS and 3 tokens).
Each run builds its stages, serves, closes, and records: wall time, each stage's tokens
and tok/s, time to first token (p50/p90) of each stage, GPU busy (NVML, sampled in a
thread), and ``torch.cuda.memory_allocated()`` before building, after closing (no
``gc.collect()``) and after a ``gc.collect()``. The JSON is saved after every run.

    python bench/colocate.py --out bench/results/colocate_hidden_h200.json [--loops normal,overlap,async_decode]
        [--repeats 3] [--conversations 128] [--thinker-shape qwen2-1.5b|llama-8b] [--shares 0.5,0.3]
        [--modes pipeline_hidden,pipeline_tokens,thinker,thinker_hidden,talker]
    python bench/colocate.py --smoke --out bench/results/colocate_smoke_cpu.json   # tiny shapes, CPU
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import pstats
import gc
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import LOOPS, machine_facts, parse_loops, percentile, save_json  # noqa: E402

from omni_async import SamplingParams  # noqa: E402
from omni_async.pipeline.colocate import HIDDEN_ROWS, build_stage_scheduler  # noqa: E402
from omni_async.messages import IncomingMessage, RequestPayload  # noqa: E402
from omni_async.pipeline import TwoStagePipeline  # noqa: E402

QWEN_COMMON = dict(family="qwen2", max_position_embeddings=32768, rope_theta=1_000_000.0)
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2-1.5b": dict(QWEN_COMMON, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "qwen2-0.5b": dict(QWEN_COMMON, hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "llama-8b": dict(family="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192, rope_theta=500_000.0,
                     tie_word_embeddings=False),
    # --smoke: small enough for a CPU run in seconds.
    "smoke-thinker": dict(family="qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=128, vocab_size=512, max_position_embeddings=2048, tie_word_embeddings=True),
    "smoke-talker": dict(family="qwen2", hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=64, vocab_size=512, max_position_embeddings=2048, tie_word_embeddings=True),
}


def log(*a: Any) -> None:
    print(*a, flush=True)


def make_checkpoint(folder: Path, shape_name: str, dtype: torch.dtype, device: str, seed: int) -> Path:
    """A random-weight checkpoint of ``shape_name`` in ``folder`` (kept: later runs reuse
    it), written with transformers' save_pretrained; no tokenizer (input_ids only)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if (folder / "config.json").exists():
        return folder
    shape = dict(SHAPES[shape_name])
    family = shape.pop("family")
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    cfg = config_cls(bos_token_id=1, eos_token_id=2, pad_token_id=0, **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(cfg).to(dtype)
    model.save_pretrained(folder)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return folder


class GpuBusy:
    """NVML utilisation (percent of time a kernel ran), sampled every ``period`` s in a
    thread; nothing on a machine without NVML."""

    def __init__(self, enabled: bool, period: float = 0.02) -> None:
        self.samples: list[int] = []
        self.period = period
        self._stop = threading.Event()
        self._handle = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        if enabled:
            try:
                import pynvml  # pip install nvidia-ml-py (the [bench] extra)
            except ImportError:
                log("GPU busy not measured: pynvml missing (pip install nvidia-ml-py)")
                return
            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())

    def _run(self) -> None:
        while self._handle is not None and not self._stop.is_set():
            self.samples.append(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
            self._stop.wait(self.period)

    def __enter__(self) -> "GpuBusy":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mean(self) -> float | None:
        return statistics.mean(self.samples) if self.samples else None


def memory_allocated(device: str) -> int | None:
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.memory_allocated())


# ------------------------------------------------------------------ the workload


def workload(args: argparse.Namespace, thinker_vocab: int, talker_bos: int) -> dict[str, list]:
    rng = random.Random(args.seed)
    thinker = [[rng.randrange(3, thinker_vocab) for _ in range(rng.randint(args.prompt_min, args.prompt_max))]
               for _ in range(args.conversations)]
    talker = [[talker_bos] + [rng.randrange(3, thinker_vocab) for _ in range(3)] for _ in range(args.conversations)]
    return {"thinker": thinker, "talker": talker}


def thinker_sampling(args: argparse.Namespace, i: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=args.thinker_new, temperature=args.temperature, seed=i, ignore_eos=True)


def talker_sampling(args: argparse.Namespace, i: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=args.talker_new, temperature=args.temperature, seed=100_000 + i, ignore_eos=True)


def stage_limits(args: argparse.Namespace, kv_tokens: int | None) -> dict[str, Any]:
    limits: dict[str, Any] = {"max_running_requests": args.max_running}
    if kv_tokens:
        limits["kv_capacity_tokens"] = kv_tokens
    if args.device.startswith("cuda"):
        limits.update(max_prefill_tokens=args.max_prefill, chunked_prefill_size=args.chunked_prefill)
    limits.update(args.set)
    return limits


def parse_settings(text: str) -> dict[str, Any]:
    """``name=value,...`` SchedulerConfig fields for both stages (true/false, ints, floats,
    strings), e.g. ``own_cuda_stream=false,event_wait=thread``."""
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        name, _, raw = item.partition("=")
        value: Any = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for cast in (int, float):
                try:
                    value = cast(raw)
                    break
                except ValueError:
                    pass
        out[name.strip()] = value
    return out


def stage_stats(name: str, submitted: dict[str, float], first: dict[str, float], ends: list[float],
                tokens: int, t0: float) -> dict[str, Any]:
    ttft = [first[r] - submitted[r] for r in first]
    span = (max(ends) - t0) if ends else None
    return {
        f"{name}_tokens": tokens,
        f"{name}_span_s": span,
        f"{name}_tok_s": tokens / span if span else None,
        f"{name}_ttft_p50_ms": _ms(percentile(ttft, 50)),
        f"{name}_ttft_p90_ms": _ms(percentile(ttft, 90)),
    }


def _ms(x: float | None) -> float | None:
    return None if x is None else 1000 * x


COUNTERS = ("steps", "fused", "graph", "lookahead", "device_wait", "iterations", "timeout", "tokens_out", "max_running")


def stage_counters(info: dict[str, Any]) -> dict[str, Any]:
    """The stage's step counters (steps, lookahead, fused launches and captures, how the
    device was awaited), to see how a run's steps went."""
    return {k: v for k, v in info.items() if any(c in k for c in COUNTERS) and isinstance(v, (int, float, str))}


async def run_alone(args: argparse.Namespace, stage: str, path: Path, loop: str, prompts: list[list[int]],
                    capture_hidden: bool = False) -> dict:
    """One stage by itself: every request sent at once, its outbox drained.
    ``capture_hidden``: the stage captures hidden states for every request (as the
    pipeline's thinker does for a hidden-fed talker)."""
    kv = args.kv_thinker if stage == "thinker" else args.kv_talker
    share = args.shares[0] if stage == "thinker" else args.shares[1]
    sched, _stack = build_stage_scheduler(str(path), device=args.device, loop=loop, dtype=args.dtype,
                                          seed=0 if stage == "thinker" else 1, memory_budget=share,
                                          capture_hidden=capture_hidden, **stage_limits(args, kv))
    sampling = thinker_sampling if stage == "thinker" else talker_sampling
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    ends: list[float] = []
    tokens = 0
    async with sched:
        with GpuBusy(args.device.startswith("cuda")) as busy:
            t0 = time.perf_counter()
            for i, ids in enumerate(prompts):
                rid = f"{stage}-{i}"
                submitted[rid] = time.perf_counter()
                sched.inbox.send_nowait(IncomingMessage(rid, "new_request", RequestPayload(rid, ids, sampling(args, i))))
            open_ids = set(submitted)
            async for msg in sched.outbox:
                now = time.perf_counter()
                if msg.type == "stream":
                    first.setdefault(msg.request_id, now)
                    tokens += len(msg.data.token_ids)
                elif msg.type == "error":
                    raise RuntimeError(f"{msg.request_id}: {msg.data!r}")
                else:
                    ends.append(now)
                    open_ids.discard(msg.request_id)
                    if not open_ids:
                        break
            wall = time.perf_counter() - t0
        counters = stage_counters(sched.info())
    return {"wall_s": wall, "gpu_busy_mean": busy.mean, **stage_stats(stage, submitted, first, ends, tokens, t0),
            f"{stage}_info": counters}


async def run_pipeline(args: argparse.Namespace, paths: dict[str, Path], loop: str, prompts: list[list[int]],
                       talker_inputs: str = "hidden") -> dict:
    """Both stages in one event loop on one device, the thinker's chunks streamed in;
    ``talker_inputs``: the talker reads the thinker's hidden states or its tokens."""
    limits = {"thinker_limits": stage_limits(args, args.kv_thinker), "talker_limits": stage_limits(args, args.kv_talker)}
    pipe = TwoStagePipeline.from_pretrained(str(paths["thinker"]), str(paths["talker"]), device=args.device, loop=loop,
                                            shares=tuple(args.shares), dtype=args.dtype,
                                            capture_hidden=talker_inputs == "hidden", talker_inputs=talker_inputs,
                                            talker_min_chunks=3, buffer=1024, **limits)
    hidden_rows: list[int] = []
    submitted: dict[str, float] = {}
    first = {"thinker": {}, "talker": {}}  # type: dict[str, dict[str, float]]
    ends: dict[str, list[float]] = {"thinker": [], "talker": []}
    tokens = {"thinker": 0, "talker": 0}

    async def one(i: int, ids: list[int]) -> None:
        rid = f"conv-{i}"
        submitted[rid] = time.perf_counter()
        handle = await pipe.submit(rid, RequestPayload(rid, ids, thinker_sampling(args, i)),
                                   RequestPayload(rid, [], talker_sampling(args, i)))
        async for ev in handle:
            now = time.perf_counter()
            if ev.kind == "stream":
                first[ev.stage].setdefault(rid, now)
                tokens[ev.stage] += len(ev.data.token_ids)
            else:
                ends[ev.stage].append(now)
                if ev.stage == "talker" and HIDDEN_ROWS in ev.data.extra:
                    hidden_rows.append(ev.data.extra[HIDDEN_ROWS])

    async with pipe:
        with GpuBusy(args.device.startswith("cuda")) as busy:
            t0 = time.perf_counter()
            await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
            wall = time.perf_counter() - t0
        counters = {"thinker_info": stage_counters(pipe.first.info()), "talker_info": stage_counters(pipe.second.info())}
    out: dict[str, Any] = {"wall_s": wall, "gpu_busy_mean": busy.mean, **counters,
                           "talker_hidden_rows": sum(hidden_rows) if hidden_rows else None}
    for stage in ("thinker", "talker"):
        out.update(stage_stats(stage, submitted, first[stage], ends[stage], tokens[stage], t0))
    return out


async def one_run(args: argparse.Namespace, mode: str, loop: str, paths: dict[str, Path], work: dict) -> dict:
    before = memory_allocated(args.device)
    started = time.perf_counter()
    if mode.startswith("pipeline"):
        run = await run_pipeline(args, paths, loop, work["thinker"], talker_inputs=mode.split("_")[1])
    else:
        stage = mode.split("_")[0]
        run = await run_alone(args, stage, paths[stage], loop, work[stage], capture_hidden=mode == "thinker_hidden")
    run["build_serve_close_s"] = time.perf_counter() - started
    run["mem_before_bytes"] = before
    run["mem_after_close_bytes"] = memory_allocated(args.device)  # no gc.collect() before this
    if args.leak_report:
        run["live_device_tensors"] = live_device_tensors()
    gc.collect()
    run["mem_after_gc_bytes"] = memory_allocated(args.device)
    return {"mode": mode, "loop": loop, **run}


def live_device_tensors(top: int = 8) -> list[dict[str, Any]]:
    """The largest CUDA tensors still alive, with what refers to them (one level): what a
    closed engine may have left behind."""
    found = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                found.append(obj)
        except Exception:
            continue
    found.sort(key=lambda t: t.untyped_storage().nbytes(), reverse=True)
    out = []
    for t in found[:top]:
        refs = [type(r).__name__ + (f":{sorted(r)[:6]}" if isinstance(r, dict) else "") for r in gc.get_referrers(t)
                if r is not found][:4]
        out.append({"shape": list(t.shape), "dtype": str(t.dtype), "bytes": t.untyped_storage().nbytes(), "referrers": refs})
    return out


# ------------------------------------------------------------------ summary and main


MODES = ("pipeline_hidden", "pipeline_tokens", "thinker", "thinker_hidden", "talker")
# Each pipeline arm against the stages it runs, alone: (its thinker arm, the talker).
ARMS = {"pipeline_hidden": "thinker_hidden", "pipeline_tokens": "thinker"}


def summarize(runs: list[dict], loops: list[str]) -> dict[str, Any]:
    """Per loop: medians over the repeats, and per repeat (its runs ran back to back) the
    ratios the goals are stated in: the thinker's tok/s with hidden capture over without,
    and for each pipeline arm the sum of its stages alone over the pipeline."""
    out: dict[str, Any] = {}
    for loop in loops:
        by_repeat: dict[int, dict[str, dict]] = {}
        for r in runs:
            if r["loop"] == loop and not r.get("warmup"):
                by_repeat.setdefault(r["repeat"], {})[r["mode"]] = r
        reps = list(by_repeat.values())
        if not reps:
            continue

        def med(mode: str, key: str) -> float | None:
            xs = [m[mode][key] for m in reps if mode in m and m[mode].get(key) is not None]
            return statistics.median(xs) if xs else None

        leaks = [r["mem_after_close_bytes"] - r["mem_before_bytes"] for m in reps for r in m.values()
                 if r.get("mem_after_close_bytes") is not None]
        capture = [m["thinker_hidden"]["thinker_tok_s"] / m["thinker"]["thinker_tok_s"] for m in reps
                   if "thinker" in m and "thinker_hidden" in m]
        s: dict[str, Any] = {
            "repeats": len(reps),
            "thinker_alone_tok_s": med("thinker", "thinker_tok_s"),
            "thinker_hidden_alone_tok_s": med("thinker_hidden", "thinker_tok_s"),
            "hidden_capture_ratio": statistics.median(capture) if capture else None,
            "hidden_capture_ratio_all": capture,
            "thinker_alone_ttft_p50_ms": med("thinker", "thinker_ttft_p50_ms"),
            "talker_alone_wall_s": med("talker", "wall_s"),
            "talker_alone_tok_s": med("talker", "talker_tok_s"),
            "gpu_busy_thinker_alone": med("thinker", "gpu_busy_mean"),
            "gpu_busy_thinker_hidden_alone": med("thinker_hidden", "gpu_busy_mean"),
            "gpu_busy_talker_alone": med("talker", "gpu_busy_mean"),
            "mem_left_after_close_max_bytes": max(leaks) if leaks else None,
        }
        for arm, thinker_arm in ARMS.items():
            full = [m for m in reps if arm in m and thinker_arm in m and "talker" in m]
            ratios = [(m[thinker_arm]["wall_s"] + m["talker"]["wall_s"]) / m[arm]["wall_s"] for m in full]
            s[arm] = {
                "wall_s": med(arm, "wall_s"),
                "wall_s_all": [m[arm]["wall_s"] for m in reps if arm in m],
                "sum_over_pipeline": statistics.median(ratios) if ratios else None,
                "sum_over_pipeline_all": ratios,
                "thinker_tok_s": med(arm, "thinker_tok_s"),
                "talker_tok_s": med(arm, "talker_tok_s"),
                "talker_ttft_p50_ms": med(arm, "talker_ttft_p50_ms"),
                "talker_ttft_p90_ms": med(arm, "talker_ttft_p90_ms"),
                "talker_ttft_p50_ms_all": [m[arm]["talker_ttft_p50_ms"] for m in reps if arm in m],
                "gpu_busy": med(arm, "gpu_busy_mean"),
                "talker_hidden_rows": med(arm, "talker_hidden_rows"),
            }
        out[loop] = s
    return out


def print_table(result: dict[str, Any]) -> None:
    def f(x: Any, spec: str = ".2f") -> str:
        return "-" if x is None else format(x, spec)

    log("\n| loop | thinker alone tok/s | with hidden capture tok/s | ratio (each repeat) | thinker TTFT alone ms "
        "| talker alone s | GPU busy % (thinker, +capture, talker) | left after close MB |")
    log("|---|---|---|---|---|---|---|---|")
    for loop, s in result["summary"].items():
        left = s["mem_left_after_close_max_bytes"]
        log(f"| {loop} | {f(s['thinker_alone_tok_s'], '.0f')} | {f(s['thinker_hidden_alone_tok_s'], '.0f')} "
            f"| **{f(s['hidden_capture_ratio'])}** ({', '.join(f(r) for r in s['hidden_capture_ratio_all'])}) "
            f"| {f(s['thinker_alone_ttft_p50_ms'], '.0f')} | {f(s['talker_alone_wall_s'])} "
            f"| {f(s['gpu_busy_thinker_alone'], '.0f')}, {f(s['gpu_busy_thinker_hidden_alone'], '.0f')}, "
            f"{f(s['gpu_busy_talker_alone'], '.0f')} | {f(None if left is None else left / 1e6, '.1f')} |")
    log("\n| loop | talker reads | pipeline s | sum alone / pipeline (each repeat) | talker TTFT p50 / p90 ms "
        "| goal: thinker TTFT + 100 ms | GPU busy % | thinker / talker tok/s in the pipeline | rows read |")
    log("|---|---|---|---|---|---|---|---|---|")
    for loop, s in result["summary"].items():
        goal = None if s["thinker_alone_ttft_p50_ms"] is None else s["thinker_alone_ttft_p50_ms"] + 100
        for arm in ARMS:
            a = s[arm]
            if a["wall_s"] is None:
                continue
            log(f"| {loop} | {arm.split('_')[1]} | {f(a['wall_s'])} | **{f(a['sum_over_pipeline'])}** "
                f"({', '.join(f(r) for r in a['sum_over_pipeline_all'])}) | {f(a['talker_ttft_p50_ms'], '.0f')} / "
                f"{f(a['talker_ttft_p90_ms'], '.0f')} | {f(goal, '.0f')} | {f(a['gpu_busy'], '.0f')} "
                f"| {f(a['thinker_tok_s'], '.0f')} / {f(a['talker_tok_s'], '.0f')} | {f(a['talker_hidden_rows'], '.0f')} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loops", type=parse_loops, default=list(LOOPS), help="comma-separated: normal,overlap,async_decode")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", type=lambda t: [m for m in t.split(",") if m], default=list(MODES),
                   help="comma-separated arms: " + ",".join(MODES))
    p.add_argument("--conversations", type=int, default=128)
    p.add_argument("--thinker-shape", default="qwen2-1.5b", choices=["qwen2-1.5b", "llama-8b"])
    p.add_argument("--talker-shape", default="qwen2-0.5b", choices=["qwen2-0.5b"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shares", default=None,
                   help="thinker,talker memory_budget (fractions of the device, e.g. 0.5,0.3); the KV sizes below are then checked against them")
    p.add_argument("--kv-thinker", type=int, default=131072, help="thinker kv_capacity_tokens (0: from --shares)")
    p.add_argument("--kv-talker", type=int, default=131072, help="talker kv_capacity_tokens (0: from --shares)")
    p.add_argument("--set", type=parse_settings, default={},
                   help="SchedulerConfig fields for both stages, e.g. own_cuda_stream=false,event_wait=thread")
    p.add_argument("--variants", type=lambda t: [parse_settings(v) for v in t.split(";")], default=[{}],
                   help="';'-separated --set variants run side by side, interleaved in each repeat, "
                        "e.g. 'event_wait=poll;event_wait=auto'")
    p.add_argument("--leak-report", action="store_true", help="after each run, the largest CUDA tensors still alive")
    p.add_argument("--profile", default=None, help="cProfile the first pipeline runs of each loop into PROFILE.<loop>.<arm>.txt")
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--max-prefill", type=int, default=16384)
    p.add_argument("--chunked-prefill", type=int, default=8192)
    p.add_argument("--prompt-min", type=int, default=100)
    p.add_argument("--prompt-max", type=int, default=512)
    p.add_argument("--thinker-new", type=int, default=256)
    p.add_argument("--talker-new", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoints", default=str(Path(tempfile.gettempdir()) / "omni-colocate"),
                   help="where the random checkpoints are written (and reused)")
    p.add_argument("--no-warmup", action="store_true", help="skip the unmeasured warm-up pipeline run per loop")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, few short conversations, one repeat")
    p.add_argument("--out", default=None, help="results JSON (a bare name goes under bench/results/)")
    args = p.parse_args(argv)
    args.dtype = "bfloat16"
    args.shapes = {"thinker": args.thinker_shape, "talker": args.talker_shape}
    if args.smoke:
        args.device, args.dtype = "cpu", "float32"
        args.shapes = {"thinker": "smoke-thinker", "talker": "smoke-talker"}
        args.repeats = min(args.repeats, 1)
        args.conversations = min(args.conversations, 6)
        args.prompt_min, args.prompt_max, args.thinker_new, args.talker_new = 8, 24, 12, 16
        args.kv_thinker = args.kv_talker = 4096
        args.max_running = 16
    args.shares = [float(x) for x in args.shares.split(",")] if args.shares else [None, None]
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown:
        p.error(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    return args


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    torch_dtype = getattr(torch, args.dtype)
    root = Path(args.checkpoints)
    paths = {stage: make_checkpoint(root / f"{shape}-{args.dtype}", shape, torch_dtype, args.device, seed=i)
             for i, (stage, shape) in enumerate(args.shapes.items())}
    work = workload(args, SHAPES[args.shapes["thinker"]]["vocab_size"], talker_bos=1)
    config = {k: v for k, v in vars(args).items() if k not in ("out",)}
    result: dict[str, Any] = {"benchmark": "colocate", "config": config, "machine": machine_facts(), "runs": [], "summary": {}}
    if args.device.startswith("cuda"):
        result["machine"]["gpu"] = torch.cuda.get_device_name()
    result["mem_at_start_bytes"] = memory_allocated(args.device)

    if not args.no_warmup:  # kernels compiled, graphs' code paths warm: not measured
        warm = argparse.Namespace(**{**vars(args), "conversations": min(8, args.conversations)})
        for loop in args.loops:
            arm = next((m for m in args.modes if m.startswith("pipeline")), args.modes[0])
            run = await one_run(warm, arm, loop, paths, workload(warm, SHAPES[args.shapes["thinker"]]["vocab_size"], 1))
            result["runs"].append({**run, "repeat": -1, "warmup": True})
            log(f"warm-up {loop}: {run['wall_s']:.2f} s")
    base_set = dict(args.set)
    labels = []
    for repeat in range(args.repeats):
        for variant in args.variants:  # variants interleaved within each repeat
            args.set = {**base_set, **variant}
            tag = ",".join(f"{k}={v}" for k, v in variant.items())
            for loop in args.loops:
                label = f"{loop} [{tag}]" if tag else loop
                if label not in labels:
                    labels.append(label)
                for mode in args.modes:
                    profile = args.profile and mode.startswith("pipeline") and repeat == 0
                    with profiled(f"{args.profile}.{loop}.{mode}.txt" if profile else None):
                        run = {**await one_run(args, mode, loop, paths, work), "repeat": repeat}
                    run.update(loop=label, variant=variant)
                    result["runs"].append(run)
                    log(f"repeat {repeat} {label:12s} {mode:8s} wall {run['wall_s']:.2f} s  "
                        f"talker TTFT p50 {run.get('talker_ttft_p50_ms') or 0:.0f} ms  GPU {run['gpu_busy_mean'] or 0:.0f}%  "
                        f"mem after close {run['mem_after_close_bytes']} (after gc {run['mem_after_gc_bytes']})")
                    result["summary"] = summarize(result["runs"], labels)
                    if args.out:
                        save_json(args.out, result)
    args.set = base_set
    result["summary"] = summarize(result["runs"], labels)
    if args.out:
        save_json(args.out, result)
    return result


@contextlib.contextmanager
def profiled(path: str | None):
    """cProfile of the event loop's thread (every stage's host work, the router, the
    readers) over one run, the top functions by own time written to ``path``."""
    if path is None:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        with open(path, "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(45)
            pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(45)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import uvloop

        result = uvloop.run(main_async(args))
    except ImportError:  # pragma: no cover
        result = asyncio.run(main_async(args))
    print_table(result)
    if args.out:
        log(f"\nsaved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

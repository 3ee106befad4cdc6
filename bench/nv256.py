"""NV256: nano-vllm's ``bench.py`` workload, whose figures for vLLM are published.

Python ``random`` seeded 0; 256 prompts of ``randint(100, 1024)`` ids, each id
``randint(0, 10000)``; then per request ``max_tokens = randint(100, 1024)`` (133,966
output tokens); temperature 0.6, ``ignore_eos``; every request submitted at once;
Qwen2-0.5B shape, bf16, random weights. Output tok/s per loop, for:

- ``defaults``: ``Engine.from_pretrained(path, device="cuda", dtype="bfloat16", loop=...)``
  and nothing else, and ``tuned`` (``--tuned``, JSON of SchedulerConfig fields);
- ``sampled`` (temperature 0.6) and ``greedy`` (the same requests at temperature 0);
- three repeats interleaved (every engine once per repeat), median and range;
- NVML GPU busy (percent of time a kernel ran, sampled every 20 ms), the process's CPU
  time over wall time, median time to first token, and the fused launches from
  ``info()`` (all, and those that sampled);
- ``--requests 1024 --seed 1``: the same distribution at 1,024 requests (``--scale`` adds
  it to the run);
- ``latency``: one stream, a 100-token prompt, 512 new tokens, greedy: inter-token
  latency in the overlap and normal loops;
- ``--hf``: transformers ``generate`` on the same prompts (batches of ``--hf-batch``,
  each padded to its longest; tokens past a request's own ``max_tokens`` not counted).

``--smoke`` runs it all on CPU with a tiny random Qwen2 and a scaled-down workload.

    python bench/nv256.py [--sections nv,latency] [--loops overlap,async_decode,normal]
        [--variants defaults,tuned] [--modes sampled,greedy] [--repeats 3] [--scale] [--hf]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
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

from _common import LOOPS, machine_facts, package_source, save_json  # noqa: E402

from omni_async import Engine, SamplingParams  # noqa: E402
from omni_async.backends.native.builder import build_off_this_thread  # noqa: E402

QWEN05 = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
              intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)
# Llama-3-8B's shape (no biases, untied head): the large end of a thinker.
LLAMA8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, max_position_embeddings=32768, tie_word_embeddings=False)
# Qwen3-30B-A3B's shape (128 experts of 768 channels, 8 a token, ~3.3B active of 30.5B).
# Its 61 GB checkpoint does not fit the GPU machine's disk beside the rest: the folder
# holds config.json and random_weights.json, and the weights are drawn on the device.
QWEN3_A3B = dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                 norm_topk_prob=True, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False)
SHAPES = {"qwen05": ("qwen2", QWEN05), "llama8b": ("llama", LLAMA8B), "qwen3moe": ("qwen3_moe", QWEN3_A3B)}
SMOKE_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=1024, max_position_embeddings=2048, tie_word_embeddings=True)




class Workload:
    """NV256's requests (or its scaled-down smoke version): prompts first, then each
    request's ``max_tokens``, drawn from one ``random.Random(seed)`` in nano-vllm's order."""

    def __init__(self, n: int, seed: int, prompt_len=(100, 1024), id_max=10000, new_tokens=(100, 1024)) -> None:
        rng = random.Random(seed)
        self.prompts = [[rng.randint(0, id_max) for _ in range(rng.randint(*prompt_len))] for _ in range(n)]
        self.max_tokens = [rng.randint(*new_tokens) for _ in range(n)]
        self.n, self.seed = n, seed

    def describe(self) -> dict:
        return {"requests": self.n, "seed": self.seed, "prompt_tokens": sum(map(len, self.prompts)),
                "output_tokens": sum(self.max_tokens)}


def log(*a: Any) -> None:
    print(*a, flush=True)


def spread(xs: list[float]) -> dict | None:
    xs = [x for x in xs if x is not None]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None


class GpuBusy:
    """NVML utilisation (percent of time a kernel ran) every ``period`` s; nothing
    without CUDA or pynvml (the ``nvidia-ml-py`` package)."""

    def __init__(self, period: float = 0.02) -> None:
        self.samples: list[int] = []
        self.period = period
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if torch.cuda.is_available():
            try:
                import pynvml

                pynvml.nvmlInit()
                handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
                self._read = lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
                self._thread = threading.Thread(target=self._run, daemon=True)
            except Exception as exc:  # no NVML: the run still counts, without GPU busy
                log(f"NVML unavailable ({exc}); GPU busy not sampled")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self._read())
            self._stop.wait(self.period)

    def __enter__(self) -> "GpuBusy":
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def mean(self) -> float | None:
        return statistics.mean(self.samples) if self.samples else None


def free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_checkpoint(folder: Path, shape: dict, dtype: torch.dtype, device: str, family: str = "qwen2") -> Path:
    """A random-weight Qwen2 (or Llama) checkpoint of ``shape`` (written once, then
    reused); for Qwen3-MoE its config and ``random_weights.json`` (drawn at load)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3MoeConfig

    from omni_async.models.random_weights import RANDOM_WEIGHTS_FILE

    if family == "qwen3_moe" and not (folder / "config.json").exists():
        Qwen3MoeConfig(bos_token_id=1, eos_token_id=None, pad_token_id=0, dtype=dtype, **shape).save_pretrained(folder)
        (folder / RANDOM_WEIGHTS_FILE).write_text(json.dumps({"seed": 0, "std": 0.02}))
    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        config_class = LlamaConfig if family == "llama" else Qwen2Config
        cfg = config_class(bos_token_id=1, eos_token_id=None, pad_token_id=0, **shape)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        model.save_pretrained(folder)
        del model
        free_device()
    return folder


# ------------------------------------------------------------------ omni-async runs


async def run_nv(eng: Engine, wl: Workload, temperature: float) -> dict:
    """Every request at once, streamed; tokens, wall, TTFT, GPU busy, CPU over wall."""
    assert (await eng.flush_cache()).get("success")  # repeats send the same prompts
    ttft: list[float] = []

    async def one(prompt: list[int], new: int) -> int:
        sp = SamplingParams(max_new_tokens=new, temperature=temperature, ignore_eos=True)
        t0, n = time.perf_counter(), 0
        async for d in eng.stream(input_ids=prompt, sampling=sp):
            if not n and d.token_ids:
                ttft.append(time.perf_counter() - t0)
            n += len(d.token_ids)
        return n

    before = eng.scheduler.info()
    cpu0, t0 = time.process_time(), time.perf_counter()
    with GpuBusy() as gpu:
        counts = await asyncio.gather(*(one(p, m) for p, m in zip(wl.prompts, wl.max_tokens)))
        wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    after = eng.scheduler.info()
    tokens = sum(counts)
    assert tokens == sum(wl.max_tokens), (tokens, sum(wl.max_tokens))
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in
             ("decode_steps", "fused_decode_launches", "fused_decode_sampled", "fused_decode_replays", "fused_decode_late_captures")}
    return {"tok_s": tokens / wall, "wall_s": wall, "tokens": tokens, "gpu_busy_mean": gpu.mean, "cpu_over_wall": cpu / wall,
            "ttft_median_s": statistics.median(ttft), **delta}


def engine_kwargs(args: argparse.Namespace, variant: str) -> dict:
    base: dict[str, Any] = {"device": args.device, "dtype": args.dtype}
    return base if variant == "defaults" else {**base, **json.loads(args.tuned)}


async def section_nv(args: argparse.Namespace, path: Path, wl: Workload) -> dict:
    """Repeats interleaved: each repeat builds every (variant, loop) engine once and runs
    each mode on it; median and range per (variant, loop, mode)."""
    runs: dict[str, list[dict]] = {}
    for rep in range(args.repeats):
        for variant in args.variants:
            for loop in args.loops:
                eng = Engine.from_pretrained(str(path), loop=loop, **engine_kwargs(args, variant))
                limit = eng.scheduler.config.max_running_requests
                async with eng:
                    await eng.generate(input_ids=wl.prompts[0][:32], sampling=SamplingParams(max_new_tokens=8))  # warm-up
                    for mode in args.modes:
                        r = await run_nv(eng, wl, 0.6 if mode == "sampled" else 0.0)
                        r["max_running_requests"] = limit
                        runs.setdefault(f"{variant}/{loop}/{mode}", []).append(r)
                        log(f"  rep {rep} {variant:8s} {loop:12s} {mode:7s} {r['tok_s']:9.0f} tok/s  gpu {r['gpu_busy_mean']}"
                            f"  cpu/wall {r['cpu_over_wall']:.2f}  ttft {r['ttft_median_s']:.3f}s  fused {r['fused_decode_launches']}"
                            f" (sampled {r['fused_decode_sampled']})  running<={limit}")
                del eng
                free_device()
    summary = {key: {m: spread([r[m] for r in rs]) for m in ("tok_s", "gpu_busy_mean", "cpu_over_wall", "ttft_median_s")}
               for key, rs in runs.items()}
    return {"workload": wl.describe(), "summary": summary, "runs": runs}


async def section_latency(args: argparse.Namespace, path: Path, prompt_len: int, new: int) -> dict:
    """One stream, greedy: inter-token latency (median gap, and the mean over the run)."""
    prompt = [random.Random(7).randint(0, 10000 if not args.smoke else 1000) for _ in range(prompt_len)]
    out: dict[str, list[dict]] = {}
    for _rep in range(args.repeats):
        for loop in ("overlap", "normal"):
            eng = Engine.from_pretrained(str(path), loop=loop, **engine_kwargs(args, "defaults"))
            async with eng:
                await eng.generate(input_ids=prompt[:16], sampling=SamplingParams(max_new_tokens=8))  # warm-up
                stamps: list[float] = []
                async for d in eng.stream(input_ids=prompt, sampling=SamplingParams(max_new_tokens=new, ignore_eos=True)):
                    stamps.extend([time.perf_counter()] * len(d.token_ids))
            gaps = [b - a for a, b in zip(stamps, stamps[1:])]
            out.setdefault(loop, []).append({"itl_median_ms": 1000 * statistics.median(gaps),
                                             "itl_mean_ms": 1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1)})
            log(f"  latency {loop:8s} itl median {out[loop][-1]['itl_median_ms']:.3f} ms  mean {out[loop][-1]['itl_mean_ms']:.3f} ms")
            del eng
            free_device()
    return {"prompt_tokens": prompt_len, "new_tokens": new,
            "summary": {loop: {m: spread([r[m] for r in rs]) for m in ("itl_median_ms", "itl_mean_ms")} for loop, rs in out.items()},
            "runs": out}


def section_hf(args: argparse.Namespace, path: Path, wl: Workload) -> dict:
    """transformers ``generate`` (sampled, temperature 0.6), for the record."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(args.device).eval()
    t0, useful = time.perf_counter(), 0
    order = sorted(range(wl.n), key=lambda i: len(wl.prompts[i]))  # similar lengths together: less padding
    for start in range(0, wl.n, args.hf_batch):
        idx = order[start:start + args.hf_batch]
        width = max(len(wl.prompts[i]) for i in idx)
        ids = torch.tensor([[0] * (width - len(wl.prompts[i])) + wl.prompts[i] for i in idx], device=args.device)
        mask = torch.tensor([[0] * (width - len(wl.prompts[i])) + [1] * len(wl.prompts[i]) for i in idx], device=args.device)
        new = max(wl.max_tokens[i] for i in idx)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=True,
                           temperature=0.6, top_k=0, top_p=1.0, pad_token_id=0)
        useful += sum(wl.max_tokens[i] for i in idx)
    if args.device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    del model
    free_device()
    log(f"  transformers generate: {useful / wall:.0f} useful tok/s ({wall:.1f} s, batch {args.hf_batch})")
    return {"tok_s": useful / wall, "wall_s": wall, "batch": args.hf_batch, "tokens": useful}


def print_table(result: dict) -> None:
    for name, sec in result["sections"].items():
        if "summary" not in sec:
            continue
        log(f"\n{name}")
        for key, metrics in sec["summary"].items():
            parts = [f"{m} {v['median']:.4g} [{v['min']:.4g}, {v['max']:.4g}]" for m, v in metrics.items() if v]
            log(f"  {key:34s} " + "  ".join(parts))


def facts() -> dict:
    """Machine and source facts, less local paths and other processes' command lines (how
    many were busy is kept)."""
    machine, source = machine_facts(), package_source()
    machine["busy_processes_at_start"] = len(machine.get("busy_processes_at_start") or [])
    for d in (machine, source):
        d.pop("omni_async_path", None)
    return {"machine": machine, "source": source}


async def main_async(args: argparse.Namespace) -> dict:
    family, shape = SHAPES[args.shape]
    shape, device = (SMOKE_SHAPE, "cpu") if args.smoke else (shape, "cuda")
    default_folder = "nv-qwen2-smoke" if args.smoke else ("nv-qwen2-05b-bf16" if args.shape == "qwen05" else f"nv-{args.shape}-bf16")
    folder = Path(args.checkpoint or Path(tempfile.gettempdir()) / default_folder)
    # Written on a thread of its own: torch's parallel ops would leave this thread an
    # OpenMP team beside the engines' step thread's, which slows every CPU op (builder.py).
    path = build_off_this_thread(lambda: make_checkpoint(folder, shape, getattr(torch, args.dtype), device,
                                                          "qwen2" if args.smoke else family))
    if args.smoke:
        scale = dict(prompt_len=(10, 40), id_max=1000, new_tokens=(5, 24))
        workloads = [Workload(8, 0, **scale)] + ([Workload(16, 1, **scale)] if args.scale else [])
        latency = (20, 48)
    else:
        workloads = [Workload(args.requests, args.seed)] + ([Workload(1024, 1)] if args.scale else [])
        latency = (100, 512)
    result: dict[str, Any] = {"bench": "nv256", "args": vars(args), "shape": shape, **facts(), "sections": {}}
    for wl in workloads:
        if "nv" in args.sections:
            name = f"nv{wl.n}_seed{wl.seed}"
            log(f"{name}: {wl.describe()}")
            result["sections"][name] = await section_nv(args, path, wl)
            save_json(args.out, result)
        if args.hf or "hf" in args.sections:
            result["sections"][f"hf{wl.n}_seed{wl.seed}"] = section_hf(args, path, wl)
            save_json(args.out, result)
    if "latency" in args.sections:
        result["sections"]["latency_b1"] = await section_latency(args, path, *latency)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random Qwen2, scaled-down workload")
    ap.add_argument("--sections", default="nv,latency", help="nv, latency, hf (as --hf)")
    ap.add_argument("--loops", default="overlap,async_decode,normal")
    ap.add_argument("--variants", default="defaults,tuned")
    ap.add_argument("--modes", default="sampled,greedy")
    ap.add_argument("--tuned", default=None, help='JSON: the tuned variant\'s engine fields (default {"max_running_requests": 256}; '
                    'with --smoke {"decode_steps": 4}, which runs the fused launch on CPU)')
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", action="store_true", help="also 1,024 requests with seed 1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf", action="store_true", help="also transformers generate on the same prompts")
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--shape", default="qwen05", choices=sorted(SHAPES), help="model shape (random bf16 weights)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch.set_num_threads (default: torch's; 1 with --smoke, which a shared CPU box needs)")
    args = ap.parse_args()
    threads = args.torch_threads or (1 if args.smoke else None)
    if threads:
        torch.set_num_threads(threads)
    args.loops = [x for x in args.loops.split(",") if x]
    assert all(x in LOOPS for x in args.loops), args.loops
    args.variants = [x for x in args.variants.split(",") if x]
    args.modes = [x for x in args.modes.split(",") if x]
    args.tuned = args.tuned or ('{"decode_steps": 4}' if args.smoke else '{"max_running_requests": 256}')
    args.device = "cpu" if args.smoke else "cuda"
    args.dtype = "float32" if args.smoke else "bfloat16"
    args.out = args.out or ("nv256_smoke.json" if args.smoke else f"nv{args.requests}_seed{args.seed}.json")
    result = asyncio.run(main_async(args))
    print_table(result)
    log(f"\nsaved {save_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

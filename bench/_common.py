"""Helpers shared by the benchmark scripts: machine facts, percentiles, JSON output,
prompts, and a random Llama checkpoint for the "bigger model" runs.

Not a test module and not part of the package: the scripts import it as a sibling
(``python bench/<script>.py`` puts ``bench/`` on ``sys.path``).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
LOOPS = ("normal", "overlap", "async_decode")


# ----------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no data."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    frac = pos - lo
    return float(xs[lo] + (xs[hi] - xs[lo]) * frac)


def median_or_none(values: Iterable[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return float(statistics.median(xs)) if xs else None


def ms(x: float | None) -> float | None:
    return None if x is None else x * 1000.0


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


# ----------------------------------------------------------------- machine facts


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(
            ["git", *args], cwd=REPO_DIR, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except Exception:
        return None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def machine_facts() -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "cuda_available": torch.cuda.is_available(),
        "switch_interval_s": sys.getswitchinterval(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--", "omni_async")),
    }
    for mod in ("uvloop", "anyio", "transformers"):
        try:
            facts[mod] = __import__(mod).__version__
        except Exception:
            facts[mod] = None
    try:
        from importlib.metadata import version

        facts["omni_async"] = version("omni-async")
    except Exception:
        facts["omni_async"] = None
    return facts


def save_json(name_or_path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    path = Path(name_or_path)
    if not path.is_absolute() and path.parent == Path("."):
        path = RESULTS_DIR / path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def run_async(coro: Any) -> Any:
    """Run under uvloop when installed (as the CLI does), else plain asyncio."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        import asyncio

        return asyncio.run(coro)
    return uvloop.run(coro)


def event_loop_name() -> str:
    import asyncio

    loop = asyncio.get_running_loop()
    return f"{type(loop).__module__}.{type(loop).__name__}"


# ----------------------------------------------------------------- workloads


def make_prompts(n: int, seed: int, min_len: int = 32, max_len: int = 128, vocab: int = 256) -> list[list[int]]:
    """``n`` prompts of random byte tokens, lengths uniform in [min_len, max_len]."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def parse_int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_loops(text: str) -> list[str]:
    loops = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in loops if x not in LOOPS]
    if bad:
        raise SystemExit(f"unknown loop(s) {bad}; choose from {', '.join(LOOPS)}")
    return loops


def write_random_llama(
    hidden_size: int = 512,
    num_layers: int = 8,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    intermediate_size: int = 1408,
    vocab_size: int = 32000,
    seed: int = 0,
    folder: str | None = None,
) -> tuple[str, dict[str, Any]]:
    """Write a random-weight Llama checkpoint with transformers' save_pretrained and
    return (folder, a description). No tokenizer: drive it with input_ids."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    n_params = sum(p.numel() for p in model.parameters())
    folder = folder or tempfile.mkdtemp(prefix="omni-bench-llama-")
    model.save_pretrained(folder, safe_serialization=True)
    desc = {
        "kind": "random Llama (transformers save_pretrained)",
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "params": n_params,
        "path": folder,
    }
    return folder, desc


TINY_DESC = {
    "kind": "built-in tiny (Llama-shaped, random)",
    "hidden_size": 128,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 384,
    "vocab_size": 320,
}

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
import threading
import time
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


# ----------------------------------------------------------------- host load

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds() -> tuple[float, float] | None:
    """(busy, steal) CPU seconds summed over all cores, from /proc/stat. Busy counts
    user+nice+system+irq+softirq; steal (time the hypervisor ran someone else while
    this VM wanted the CPU) is kept apart."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    busy = vals[0] + vals[1] + vals[2] + vals[5] + vals[6]
    return busy / _CLK_TCK, vals[7] / _CLK_TCK


class HostLoad:
    """How busy the machine was during a window, split into this process and the rest.

    The box these benchmarks run on may be shared (other sessions' tests, installs);
    ``others_cores`` says how many cores other processes used on average meanwhile, so a
    disturbed run can be told apart."""

    def __init__(self) -> None:
        import time

        self._time = time
        self.t0 = time.perf_counter()
        self.cpu0 = _cpu_seconds()
        self.own0 = time.process_time()

    def stop(self) -> dict[str, float | None]:
        wall = self._time.perf_counter() - self.t0
        own = self._time.process_time() - self.own0
        cpu1 = _cpu_seconds()
        if self.cpu0 is None or cpu1 is None or wall <= 0:
            return {"own_cores": own / wall if wall > 0 else None, "others_cores": None, "steal_cores": None}
        busy = cpu1[0] - self.cpu0[0]
        return {
            "own_cores": own / wall,
            "host_busy_cores": busy / wall,
            "others_cores": max(0.0, (busy - own) / wall),
            "steal_cores": (cpu1[1] - self.cpu0[1]) / wall,
        }


async def wait_quiet(max_wait_s: float, threshold_cores: float = 0.2, window_s: float = 0.5) -> float | None:
    """Wait (up to ``max_wait_s``) for a window in which other processes use less than
    ``threshold_cores``; return the last measured others' load. 0 disables."""
    import asyncio

    if max_wait_s <= 0:
        return None
    import time

    end = time.perf_counter() + max_wait_s
    others = None
    while True:
        h = HostLoad()
        await asyncio.sleep(window_s)
        others = h.stop()["others_cores"]
        if others is None or others < threshold_cores or time.perf_counter() >= end:
            return others


def loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def busy_processes(min_pcpu: float = 5.0) -> list[str]:
    """Other processes using CPU right now (a 0.3 s sample of /proc), for the record."""
    import time

    def snap() -> dict[int, tuple[int, str]]:
        out = {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                stat = (d / "stat").read_text()
                rest = stat[stat.rfind(")") + 2 :].split()
                ticks = int(rest[11]) + int(rest[12])
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                out[int(d.name)] = (ticks, cmd[:120])
            except (OSError, ValueError, IndexError):
                continue
        return out

    a = snap()
    time.sleep(0.3)
    b = snap()
    busy = []
    for pid, (t1, cmd) in b.items():
        if pid in a:
            pcpu = 100.0 * (t1 - a[pid][0]) / _CLK_TCK / 0.3
            if pcpu >= min_pcpu:
                busy.append(f"{pcpu:.0f}% {cmd}")
    return busy


# ----------------------------------------------------------------- allocator

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def steady_malloc(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> dict[str, Any]:
    """Pin glibc malloc's mmap and trim thresholds (what ``MALLOC_MMAP_THRESHOLD_`` /
    ``MALLOC_TRIM_THRESHOLD_`` do), which turns off their dynamic adjustment.

    Why: with the defaults, the multi-MB temporaries of a CPU forward are sometimes
    mmapped and unmapped (or trimmed) on every step, depending on the allocator's
    history in the process. A run then spends up to half its CPU time in the kernel
    zero-filling pages (~150 minor faults per generated token on the tiny model at
    C=64) and is up to ~1.8x slower than an identical run next to it, whichever loop it
    uses. Pinning the thresholds makes the page faults vanish and runs repeatable.
    Use ``--malloc default`` to measure the untouched allocator.
    """
    import ctypes
    import ctypes.util

    out: dict[str, Any] = {"mode": "steady", "mmap_threshold": mmap_threshold, "trim_threshold": trim_threshold}
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok1 = libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(mmap_threshold))
        ok2 = libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(trim_threshold))
        out["applied"] = bool(ok1) and bool(ok2)
    except (OSError, AttributeError) as exc:
        out["applied"] = False
        out["error"] = repr(exc)
    return out


def apply_malloc_mode(mode: str) -> dict[str, Any]:
    if mode == "steady":
        return steady_malloc()
    return {
        "mode": "default",
        "env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
    }


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


def package_source() -> dict[str, Any]:
    """Which omni_async was imported: the repo's (editable install) or a snapshot put
    first on PYTHONPATH (e.g. ``git archive HEAD omni_async | tar -x -C /tmp/snap``,
    with the commit id written to ``/tmp/snap/SNAPSHOT_COMMIT``)."""
    import hashlib

    import omni_async

    pkg = Path(omni_async.__file__).resolve().parent
    h = hashlib.sha1()
    for f in sorted(pkg.rglob("*.py")):
        h.update(str(f.relative_to(pkg)).encode())
        h.update(f.read_bytes())
    marker = pkg.parent / "SNAPSHOT_COMMIT"
    return {
        "omni_async_path": str(pkg),
        "omni_async_from_repo": pkg.is_relative_to(REPO_DIR),
        "omni_async_snapshot_commit": marker.read_text().strip() if marker.is_file() else None,
        "omni_async_tree_sha1": h.hexdigest(),
    }


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
        "git_dirty_omni_async": bool(_git("status", "--porcelain", "--", "omni_async")),
        **package_source(),
        "loadavg_at_start": loadavg(),
        "busy_processes_at_start": busy_processes(),
    }
    from importlib.metadata import version

    for dist in ("omni-async", "uvloop", "anyio", "transformers", "numpy"):
        try:
            facts[dist.replace("-", "_")] = version(dist)
        except Exception:
            facts[dist.replace("-", "_")] = None
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


def run_benchmark(args: Any, main_async: Any, print_table: Any) -> int:
    """The shared ``main`` of the benchmark scripts: allocator mode, torch threads, run
    on uvloop, print the table, save the JSON."""
    args.malloc_info = apply_malloc_mode(args.malloc)
    if getattr(args, "torch_threads", None):
        import torch

        torch.set_num_threads(args.torch_threads)
    result = run_async(main_async(args))
    print_table(result)
    print(f"\nsaved {save_json(args.out, result)}")
    return 0


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


def run_child(script: Path, code: str, child_args: Sequence[str]) -> dict[str, Any]:
    """``script --child ...`` in a fresh process whose ``omni_async`` is ``code``'s checkout
    (first on the path, run from its root); the JSON object the child printed last. The
    probes that compare checkouts (``--code A --code B``) call it once per checkout per
    repeat, interleaved, so load drifts hit every checkout alike."""
    root = str(Path(code).resolve())
    out = subprocess.run([sys.executable, str(script), "--child", *child_args], env=dict(os.environ, PYTHONPATH=root),
                         capture_output=True, text=True, check=True, cwd=root)
    return json.loads(out.stdout.strip().splitlines()[-1])


def spread_summary(series: dict[str, list[float]], digits: int = 1, unit: str = "") -> dict[str, dict[str, float]]:
    """Median, min and max of each named series, printed one line each and returned."""
    summary = {}
    for key, xs in series.items():
        summary[key] = {"median": round(statistics.median(xs), digits), "min": round(min(xs), digits), "max": round(max(xs), digits)}
        print(f"{key:>36}{unit}: median {statistics.median(xs):9.{digits}f}  [{min(xs):.{digits}f}, {max(xs):.{digits}f}]")
    return summary


def add_checkout_options(ap: Any, out: str) -> None:
    """The options of a probe that compares checkouts: ``--code`` (repeatable; default
    this checkout), ``--labels``, ``--smoke`` and ``--out``."""
    ap.add_argument("--code", action="append", help="a checkout to measure (repeat for several; default: this one)")
    ap.add_argument("--labels", default="", help="comma-separated names of the checkouts (default: their folder names)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=out)


def checkouts(args: Any, script: Path) -> tuple[list[str], list[str]]:
    """``--code`` and ``--labels`` resolved: the checkouts (this one by default) and their names."""
    codes = args.code or [str(next(d for d in script.resolve().parents if (d / "omni_async").is_dir()))]
    return codes, args.labels.split(",") if args.labels else [Path(c).resolve().name for c in codes]


class GpuSampler:
    """NVML utilisation every 10 ms, and this process's peak GPU memory as NVML sees it (the
    CUDA context and the libraries' workspaces with torch's pool); nothing without NVML."""

    def __init__(self) -> None:
        self.samples: list[int] = []
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0))
        except Exception:
            self.nvml = None

    def _run(self) -> None:
        pid = os.getpid()
        while not self._stop.is_set():
            try:
                self.samples.append(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
                for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
                    if p.pid == pid and p.usedGpuMemory:
                        self.peak_bytes = max(self.peak_bytes, int(p.usedGpuMemory))
            except Exception:
                pass
            time.sleep(0.01)

    def __enter__(self) -> "GpuSampler":
        self.samples.clear()
        if self.nvml is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def busy(self) -> float | None:
        return round(statistics.mean(self.samples), 1) if self.samples else None

"""Where a fresh process's first run loses its time: the measurements ``first_run.py``
takes in each child around its two runs (issue 60 item 4).

- counters (always; reading them costs nothing): the CUDA caching allocator's
  ``torch.cuda.memory_stats()`` (segments allocated, ``num_alloc_retries``, reserved bytes),
  the pinned host allocator's ``torch.cuda.host_memory_stats()`` (``num_host_alloc``: blocks
  created with ``cudaHostAlloc``), and the stage's own counters from ``model_info``
  (steps, graphs captured late), each as the run's difference;
- phases (always): seconds of the engine's build by part, by wrapping the functions that
  do them (a checkout without one of them just lacks that phase);
- a profile (``--profile``): ``torch.profiler`` with CPU and CUDA activities over each
  run, summed by name (count, self time, longest call) without building the profiler's
  own event tree. The host's ops are those of the thread that launches (the loop thread
  on CUDA; on the CPU the forwards run on a worker thread the profiler does not see); the
  CUDA runtime and driver calls are every thread's. An op's self time includes the CUDA
  API calls it made. A profiled run is slower than a plain one: compare its first run
  with its second, not with a plain run's.

Imported by the child (``bench/`` is on its path); nothing here imports ``omni_async``.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections import defaultdict
from typing import Any, Iterable

# The engine's build by part: (module, attribute path); a phase missing from a checkout is skipped.
PHASES = (
    ("omni_async.backends.native.builder", "load_model"),
    ("omni_async.backends.native.builder", "kv_cache"),
    ("omni_async.backends.native.stack", "warm_up"),
    ("omni_async.runners.kernel_warmup", "KernelWarmup.run"),
    ("omni_async.backends.native.stack", "warm_host_copies"),
    ("omni_async.runners.native", "NativeModelRunner.enable_cuda_graphs"),
    ("omni_async.runners.cuda_graphs", "DecodeGraphs.capture_all"),
    ("omni_async.runners.fused_decode", "FusedDecode.capture"),
    ("omni_async.runners.graph_sampling", "SamplingGraphs.__init__"),
)

# Allocator counters shown in the table (all changed ones stay in the JSON).
SHOWN_COUNTERS = (
    ("segment.all.allocated", "cudaMalloc segments"),
    ("num_alloc_retries", "alloc retries"),
    ("num_sync_all_streams", "sync all streams"),
    ("reserved_bytes.all.current", "reserved growth MiB"),
    ("reserved_bytes.all.peak", "reserved peak MiB"),
    ("allocated_bytes.all.peak", "allocated peak MiB"),
    ("host.num_host_alloc", "pinned blocks made"),
    ("host.host_alloc_time.total", "pinned alloc us"),
    ("gc.gen2.passes", "full GC passes"),
    ("gc.gen2.ms", "full GC ms"),
)
MIB_KEYS = {"reserved_bytes.all.current", "reserved_bytes.all.peak", "allocated_bytes.all.peak"}
PEAK_KEYS = {"reserved_bytes.all.peak", "allocated_bytes.all.peak"}  # reset before each run: the run's own peak

# CUDA API calls listed whenever a run makes them, whatever their rank.
WATCHED = ("cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaFreeHost", "cudaHostRegister", "cuMemAlloc", "cuModuleLoad",
           "cuLibraryLoad", "cuModuleGetFunction", "cuLibraryGetKernel", "cudaGraphInstantiate", "cudaGraphLaunch",
           "Synchronize", "cudaFuncGetAttributes", "cuKernelGetFunction", "cudaGetFuncBySymbol")
API_KINDS = {"cuda_runtime": "api", "cuda_driver": "api", "cuda_sync": "sync"}
HOST_KINDS = {"cpu_op": "op", "user_annotation": "op", "python_function": "py"}


# ---------------------------------------------------------------- phases


class Phases:
    """Wraps each function of :data:`PHASES` that exists with a timer (CUDA synchronised
    at its end, so a phase's device work counts in it): ``{name: {calls, seconds}}``."""

    def __init__(self) -> None:
        self.times: dict[str, dict[str, float]] = {}

    def install(self, targets: Iterable[tuple[str, str]] = PHASES) -> "Phases":
        for module_name, path in targets:
            try:
                owner: Any = importlib.import_module(module_name)
                *parents, attr = path.split(".")
                for name in parents:
                    owner = getattr(owner, name)
                fn = getattr(owner, attr)
            except (ImportError, AttributeError):
                continue
            setattr(owner, attr, self._timed(path, fn))
        return self

    def _timed(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _sync()
                slot = self.times.setdefault(name, {"calls": 0, "seconds": 0.0})
                slot["calls"] += 1
                slot["seconds"] += time.perf_counter() - t0

        return timed


def _sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# ---------------------------------------------------------------- Python's GC


class GcWatch:
    """Python's cyclic GC passes by generation (``gc.callbacks``): a full pass walks every
    container alive, torch's and the model's included (tens to hundreds of ms, see
    ``omni_async/client/heap.py``), and whether one falls in a run depends on what the
    build left uncollected."""

    def __init__(self) -> None:
        import gc

        self.passes = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        g, dt = info.get("generation", 2), time.perf_counter() - self._t0
        self.passes[g] += 1
        self.seconds[g] += dt
        self.longest[g] = max(self.longest[g], dt)

    def snapshot(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for g in range(3):
            out[f"gc.gen{g}.passes"] = self.passes[g]
            out[f"gc.gen{g}.ms"] = 1000 * self.seconds[g]
        return out

    def reset_longest(self) -> None:
        self.longest = [0.0, 0.0, 0.0]

    def longest_ms(self) -> float:
        """The longest full pass since :meth:`reset_longest` (ms)."""
        return 1000 * self.longest[2]


# ---------------------------------------------------------------- counters


def device_counters() -> dict[str, float]:
    """The caching allocator's and the pinned host allocator's statistics, flat ({} on
    the CPU or before CUDA is initialised)."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    out = {k: float(v) for k, v in torch.cuda.memory_stats().items() if isinstance(v, (int, float))}
    try:  # a torch without the pinned allocator's statistics: the device's alone
        out.update({f"host.{k}": float(v) for k, v in torch.cuda.host_memory_stats().items() if isinstance(v, (int, float))})
    except (AttributeError, RuntimeError):
        pass
    return out


def reset_peaks() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """``after - before`` for every numeric key that changed (a peak key: its value after)."""
    out = {}
    for key, value in after.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        was = before.get(key)
        d = value if key in PEAK_KEYS else value - (was if isinstance(was, (int, float)) else 0)
        if d:
            out[key] = d
    return out


# ---------------------------------------------------------------- the profile


class RunProfile:
    """``torch.profiler`` over one run, CPU and (where there is one) CUDA activities;
    :meth:`summary` sums its events by (kind, name)."""

    def __init__(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile, supported_activities

        activities = [a for a in (ProfilerActivity.CPU, ProfilerActivity.CUDA) if a in supported_activities()]
        if not torch.cuda.is_available():
            activities = [ProfilerActivity.CPU]
        config = None
        try:  # Python's GC passes and CUDA's synchronisations as events, where this torch has them
            from torch._C._profiler import _ExperimentalConfig

            config = _ExperimentalConfig(record_python_gc_info=True, enable_cuda_sync_events=True)
        except (ImportError, TypeError):
            pass
        self.prof = profile(activities=activities, experimental_config=config)
        self.seconds_to_parse = 0.0

    def __enter__(self) -> "RunProfile":
        self.prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.prof.__exit__(*exc)

    def summary(self) -> dict[str, dict[str, Any]]:
        """``{"kind name": {kind, name, count, self_us, total_us, max_us}}``."""
        t0 = time.perf_counter()
        events = self.prof.profiler.kineto_results.events()
        out = summarise(((_activity(e), e.name(), e.start_thread_id(), e.start_ns(), e.duration_ns()) for e in events))
        self.seconds_to_parse = time.perf_counter() - t0
        return out


def _activity(event: Any) -> str:
    """The event's Kineto activity; from its device and name where this torch lacks it."""
    if hasattr(event, "activity_type"):
        return event.activity_type()
    if str(event.device_type()).endswith("CPU"):
        return "cuda_runtime" if event.name().startswith(("cuda", "cu")) else "cpu_op"
    return "kernel"


def summarise(events: Iterable[tuple[str, str, int, int, int]]) -> dict[str, dict[str, Any]]:
    """Events ``(activity, name, thread, start_ns, duration_ns)`` summed by kind and name:
    ``op`` (host ops: self time, their children's taken out, nested per thread), ``api``
    and ``sync`` (CUDA runtime and driver calls, leaves), ``gpu`` (kernels, copies),
    ``py`` and the rest under their activity's name."""
    rows: dict[str, dict[str, Any]] = {}
    nested: dict[int, list[list[Any]]] = defaultdict(list)
    for activity, name, thread, start, dur in events:
        kind = HOST_KINDS.get(activity) or API_KINDS.get(activity)
        if kind is None:
            kind = "gpu" if activity.startswith(("kernel", "gpu_")) else activity
        if kind == "op":
            nested[thread].append([start, dur, name, 0])
            continue
        _add(rows, kind, name, dur, dur)
    for spans in nested.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack: list[list[Any]] = []
        for span in spans:
            while stack and stack[-1][0] + stack[-1][1] <= span[0]:
                stack.pop()
            if stack:
                stack[-1][3] += span[1]
            stack.append(span)
        for start, dur, name, children in spans:
            _add(rows, "op", name, max(0, dur - children), dur)
    return rows


def _add(rows: dict[str, dict[str, Any]], kind: str, name: str, self_ns: int, total_ns: int) -> None:
    row = rows.get(f"{kind} {name}")
    if row is None:
        row = rows[f"{kind} {name}"] = {"kind": kind, "name": name, "count": 0, "self_us": 0.0, "total_us": 0.0, "max_us": 0.0}
    row["count"] += 1
    row["self_us"] += self_ns / 1000
    row["total_us"] += total_ns / 1000
    row["max_us"] = max(row["max_us"], total_ns / 1000)


def compare(first: dict[str, dict[str, Any]], second: dict[str, dict[str, Any]], top: int = 25) -> list[dict[str, Any]]:
    """Rows for the side-by-side table: the ``top`` host ops and CUDA calls by the first
    run's self time, the ``top // 2`` that lost most against the second run, and every
    watched CUDA call either run made; most lost first."""
    empty = {"count": 0, "self_us": 0.0, "max_us": 0.0}
    keys = set(first) | set(second)
    host = [k for k in keys if (first.get(k) or second.get(k))["kind"] in ("op", "api", "sync", "py")]
    lost = {k: first.get(k, empty)["self_us"] - second.get(k, empty)["self_us"] for k in host}
    chosen = set(sorted(host, key=lambda k: -first.get(k, empty)["self_us"])[:top])
    chosen |= set(sorted(host, key=lambda k: -lost[k])[: top // 2])
    chosen |= {k for k in host if any(w in k for w in WATCHED)}
    out = []
    for k in sorted(chosen, key=lambda k: -lost[k]):
        f, s = first.get(k, empty), second.get(k, empty)
        row = (first.get(k) or second.get(k))
        out.append({"kind": row["kind"], "name": row["name"], "first_count": f["count"], "first_self_ms": f["self_us"] / 1000,
                    "first_max_ms": f["max_us"] / 1000, "second_count": s["count"], "second_self_ms": s["self_us"] / 1000,
                    "second_max_ms": s["max_us"] / 1000, "lost_ms": lost[k] / 1000})
    return out


def gpu_totals(summary: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Device time (ms) and launches of the run's kernels and copies."""
    rows = [r for r in summary.values() if r["kind"] == "gpu"]
    return {"gpu_ms": sum(r["self_us"] for r in rows) / 1000, "gpu_events": sum(r["count"] for r in rows),
            "gpu_names": len(rows)}


# ---------------------------------------------------------------- printing


def counters_line(first: dict[str, float], second: dict[str, float], info_first: dict[str, float],
                  info_second: dict[str, float]) -> str:
    """One line: the shown allocator counters and the stage's late captures, first/second."""
    parts = []
    for key, label in SHOWN_COUNTERS:
        a, b = first.get(key, 0.0), second.get(key, 0.0)
        if key in MIB_KEYS:
            a, b = a / 2**20, b / 2**20
        parts.append(f"{label} {a:.0f}/{b:.0f}")
    for key in ("fused_decode_late_captures",):
        parts.append(f"{key} {info_first.get(key, 0):.0f}/{info_second.get(key, 0):.0f}")
    return "    first/second: " + ", ".join(parts)


def phases_line(phases: dict[str, dict[str, float]]) -> str:
    return "    build phases: " + (", ".join(f"{k} {v['seconds']:.2f} s" + (f" x{v['calls']:.0f}" if v["calls"] > 1 else "")
                                             for k, v in phases.items()) or "none timed")


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The side-by-side table's lines."""
    out = [f"    {'kind':<5} {'name':<52} {'1st n':>7} {'1st ms':>9} {'1st max':>8} {'2nd n':>7} {'2nd ms':>9} {'2nd max':>8}"
           f" {'lost ms':>9}"]
    for r in rows:
        name = r["name"] if len(r["name"]) <= 52 else r["name"][:49] + "..."
        out.append(f"    {r['kind']:<5} {name:<52} {r['first_count']:>7} {r['first_self_ms']:>9.1f} {r['first_max_ms']:>8.2f}"
                   f" {r['second_count']:>7} {r['second_self_ms']:>9.1f} {r['second_max_ms']:>8.2f} {r['lost_ms']:>+9.1f}")
    return out


def parse_env(items: list[str] | None, labels: list[str]) -> dict[str, dict[str, str]]:
    """``--env KEY=VALUE`` (every child) and ``--env LABEL:KEY=VALUE`` (that label's):
    ``{label: {key: value}}`` for each label."""
    out: dict[str, dict[str, str]] = {label: {} for label in labels}
    for item in items or []:
        head, eq, value = item.partition("=")
        if not eq or not head:
            raise SystemExit(f"--env {item!r}: expected KEY=VALUE or LABEL:KEY=VALUE")
        label, colon, key = head.rpartition(":")
        if colon and label not in out:
            raise SystemExit(f"--env {item!r}: no label {label!r} (labels: {', '.join(labels)})")
        for name in [label] if colon else labels:
            out[name][key] = value
    return out

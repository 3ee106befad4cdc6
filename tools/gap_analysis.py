"""Where the device sits idle, and what the host was doing then (``gpu_gaps.py``'s analysis).

Pure Python over plain tuples, so it is tested on synthetic events
(``tests/test_gpu_gaps_tool.py``) and runs on whatever the profiler gave:

- ``device_ops``: ``(start_ns, end_ns, step)`` per kernel / copy / set on the device, ``step``
  the index of the step whose launch enqueued it (-1 when unknown);
- ``loop_ranges`` / ``worker_ranges``: ``(start_ns, end_ns, name)`` of the probe's ranges on
  the loop thread and on the launch worker (nested within a thread);
- ``steps``: one dict per launched step, in launch order: ``kind`` ("decode" / "prefill"),
  ``rows``, ``k`` (forwards a row), ``tokens``, ``launch`` (start_ns, end_ns);
- ``window``: (start_ns, end_ns) of the run: first submission to last token.

A gap is a stretch of the window with no device op running, at least ``min_gap_ns`` long. It
is attributed to the innermost loop-thread range open when the device ran dry (``start``),
when it resumed (``end``), and split over the ranges that were innermost during it
(``during``); its phase is that of the last decode step launched before it.
"""

from __future__ import annotations

import bisect
from typing import Any, Iterable, Sequence

NO_RANGE = "-"  # the loop thread inside none of the probe's ranges
ROW_BUCKETS = ((16, "<16"), (64, "16-63"), (128, "64-127"), (256, "128-255"))


def quantile(xs: Sequence[float], q: float) -> float | None:
    """Linear-interpolated quantile, ``q`` in [0, 1]; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def rows_bucket(rows: int) -> str:
    for bound, name in ROW_BUCKETS:
        if rows < bound:
            return name
    return "256+"


def union(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, merged intervals (touching ones merge)."""
    out: list[list[int]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1][1] = e
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def clip(intervals: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def idle_gaps(busy: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The complement of ``busy`` (merged, clipped) within ``[lo, hi]``: every idle stretch."""
    gaps, t = [], lo
    for s, e in busy:
        if s > t:
            gaps.append((t, s))
        t = max(t, e)
    if hi > t:
        gaps.append((t, hi))
    return gaps


class Innermost:
    """A thread's timeline as segments ``(start, end, name)`` of its innermost open range,
    from nested ranges (an improperly nested one closes where it ends; the latest opened
    still-open range is the innermost)."""

    def __init__(self, ranges: Iterable[tuple[int, int, str]]) -> None:
        marks: list[tuple[int, int, int, str]] = []  # (time, order, id, name): ends sort before starts at a tie
        for i, (s, e, name) in enumerate(ranges):
            if e > s:
                marks.append((s, 1, i, name))
                marks.append((e, 0, i, name))
        marks.sort()
        self.segments: list[tuple[int, int, str]] = []
        stack: list[tuple[int, str]] = []
        last = None
        for t, is_start, i, name in marks:
            if stack and last is not None and t > last:
                self.segments.append((last, t, stack[-1][1]))
            if is_start:
                stack.append((i, name))
            else:
                for j in range(len(stack) - 1, -1, -1):
                    if stack[j][0] == i:
                        del stack[j]
                        break
            last = t
        self._starts = [s for s, _, _ in self.segments]

    def at(self, t: int) -> str:
        """The innermost range open at ``t`` (a range is open on ``[start, end)``)."""
        i = bisect.bisect_right(self._starts, t) - 1
        if i >= 0 and self.segments[i][1] > t:
            return self.segments[i][2]
        return NO_RANGE

    def split(self, lo: int, hi: int) -> dict[str, int]:
        """How ``[lo, hi)`` divides over the innermost ranges (NO_RANGE for the rest)."""
        out: dict[str, int] = {}
        covered = 0
        i = max(0, bisect.bisect_right(self._starts, lo) - 1)
        while i < len(self.segments) and self.segments[i][0] < hi:
            s, e, name = self.segments[i]
            ov = min(e, hi) - max(s, lo)
            if ov > 0:
                out[name] = out.get(name, 0) + ov
                covered += ov
            i += 1
        if hi - lo > covered:
            out[NO_RANGE] = out.get(NO_RANGE, 0) + (hi - lo - covered)
        return out


def _summary(lengths: list[int], wall_ns: int) -> dict[str, Any]:
    total = sum(lengths)
    return {"count": len(lengths), "idle_ms": total / 1e6, "share_of_run": total / wall_ns if wall_ns else None,
            "median_us": (quantile(lengths, 0.5) or 0) / 1e3, "p90_us": (quantile(lengths, 0.9) or 0) / 1e3}


def _grouped(keyed: list[tuple[str, int]], wall_ns: int) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[int]] = {}
    for key, n in keyed:
        groups.setdefault(key, []).append(n)
    return {k: _summary(v, wall_ns) for k, v in sorted(groups.items(), key=lambda kv: -sum(kv[1]))}


class Phases:
    """The run's phase at a time: before the first decode launch ("startup"), then by the rows
    of the last decode step launched ("steady" from ``tail_rows`` rows, else "tail")."""

    def __init__(self, steps: list[dict[str, Any]], tail_rows: int) -> None:
        dec = sorted((st["launch"][0], st["rows"]) for st in steps if st["kind"] == "decode")
        self._t = [t for t, _ in dec]
        self._rows = [r for _, r in dec]
        self.tail_rows = tail_rows

    def rows_at(self, t: int) -> int | None:
        i = bisect.bisect_right(self._t, t) - 1
        return self._rows[i] if i >= 0 else None

    def at(self, t: int) -> str:
        rows = self.rows_at(t)
        return "startup" if rows is None else "steady" if rows >= self.tail_rows else "tail"


def _step_tables(steps: list[dict[str, Any]], device_ops: list[tuple[int, int, int]], gap_at: dict[int, int],
                 hi: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Per step: device busy (union of its ops), host launch-to-launch, the launch's own time,
    and the idle gap right after its last op. Decode steps grouped by rows; prefill steps listed."""
    ops: dict[int, list[tuple[int, int]]] = {}
    for s, e, step in device_ops:
        ops.setdefault(step, []).append((s, e))
    order = sorted(range(len(steps)), key=lambda i: steps[i]["launch"][0])
    nxt = {i: (steps[j]["launch"][0] if j is not None else hi) for i, j in zip(order, order[1:] + [None])}
    decode: dict[str, dict[str, list[float]]] = {}
    prefill: list[dict[str, Any]] = []
    for i, st in enumerate(steps):
        mine = union(ops.get(i, []))
        row = {"device_ms": sum(e - s for s, e in mine) / 1e6,
               "host_ms": (nxt[i] - st["launch"][0]) / 1e6,
               "launch_ms": (st["launch"][1] - st["launch"][0]) / 1e6,
               "gap_after_ms": gap_at.get(mine[-1][1], 0) / 1e6 if mine else 0.0}
        if st["kind"] == "decode":
            g = decode.setdefault(f"{rows_bucket(st['rows'])} k={st.get('k', 1)}", {})
            for key, v in row.items():
                g.setdefault(key, []).append(v)
        else:
            prefill.append({"step": i, "rows": st["rows"], "tokens": st.get("tokens"), **row})
    table = {}
    for key, g in sorted(decode.items(), key=lambda kv: (kv[0].split()[0], kv[0])):
        n = len(g["device_ms"])
        table[key] = {"steps": n, **{f"{m}_median": quantile(v, 0.5) for m, v in g.items()},
                      "device_ms_total": sum(g["device_ms"]), "host_ms_total": sum(g["host_ms"]),
                      "gap_after_ms_total": sum(g["gap_after_ms"])}
    return table, prefill


def _crossing(before: int, after: int | None, kinds: dict[int, str], at_start: bool) -> str:
    """Whether a gap lies inside one step's device work or between two steps (and their kinds)."""
    a = "run start" if at_start else kinds.get(before, "unattributed")
    b = "end of run" if after is None else kinds.get(after, "unattributed")
    if before == after and before >= 0:
        return f"inside a {a} step"
    return f"{a} -> {b}"


def analyse(device_ops: list[tuple[int, int, int]], loop_ranges: list[tuple[int, int, str]],
            worker_ranges: list[tuple[int, int, str]], steps: list[dict[str, Any]], window: tuple[int, int],
            *, min_gap_ns: int = 5_000, tail_rows: int = 64,
            syncs: list[tuple[int, int, str]] | None = None) -> dict[str, Any]:
    """Busy fraction, every idle gap of at least ``min_gap_ns`` attributed (see the module's
    docstring), and the per-step tables."""
    lo, hi = window
    wall = hi - lo
    busy = clip(union((s, e) for s, e, _ in device_ops), lo, hi)
    busy_ns = sum(e - s for s, e in busy)
    all_gaps = idle_gaps(busy, lo, hi)
    gaps = [(s, e) for s, e in all_gaps if e - s >= min_gap_ns]
    loop, worker, phases = Innermost(loop_ranges), Innermost(worker_ranges), Phases(steps, tail_rows)
    sync = Innermost(syncs or [])
    op_step = {s: step for s, _, step in device_ops}  # the op that ends a gap, by its start
    end_step = {e: step for _, e, step in device_ops}  # the op that opens one, by its end
    kinds = {i: st["kind"] for i, st in enumerate(steps)}
    by_start, by_pair, by_phase, by_next, by_worker, by_rows, by_cross, by_sync = [], [], [], [], [], [], [], []
    during: dict[str, int] = {}
    for s, e in gaps:
        n = e - s
        a, b = loop.at(s), loop.at(e)
        by_start.append((a, n))
        by_pair.append((f"{a} -> {b}", n))
        by_phase.append((phases.at(s), n))
        rows = phases.rows_at(s)
        by_rows.append(("startup" if rows is None else rows_bucket(rows), n))
        before, after = end_step.get(s, -1), op_step.get(e, -1) if e < hi else None
        by_next.append((kinds.get(after, "unattributed") if after is not None else "end of run", n))
        by_cross.append((_crossing(before, after, kinds, s == lo), n))
        by_worker.append((worker.at(e), n))
        by_sync.append((sync.at(s), n))
        for name, ov in loop.split(s, e).items():
            during[name] = during.get(name, 0) + ov
    phase_wall: dict[str, int] = {}
    cuts = sorted({lo, hi, *(t for t in phases._t if lo < t < hi)})
    for a, b in zip(cuts, cuts[1:]):
        p = phases.at(a)
        phase_wall[p] = phase_wall.get(p, 0) + (b - a)
    phase_idle = {k: v["idle_ms"] for k, v in _grouped(by_phase, wall).items()}
    gap_at = {s: e - s for s, e in all_gaps}
    decode_table, prefill = _step_tables(steps, device_ops, gap_at, hi)
    return {
        "wall_ms": wall / 1e6, "busy_ms": busy_ns / 1e6, "busy_fraction": busy_ns / wall if wall else None,
        "idle_ms": (wall - busy_ns) / 1e6, "gaps": _summary([e - s for s, e in gaps], wall),
        "idle_below_min_gap_ms": sum(e - s for s, e in all_gaps if e - s < min_gap_ns) / 1e6,
        "min_gap_us": min_gap_ns / 1e3,
        "by_start": _grouped(by_start, wall), "by_start_end": _grouped(by_pair, wall),
        "during_ms": {k: v / 1e6 for k, v in sorted(during.items(), key=lambda kv: -kv[1])},
        "by_phase": {p: {"wall_ms": phase_wall.get(p, 0) / 1e6, "idle_ms": phase_idle.get(p, 0.0),
                         "idle_share_of_phase": phase_idle.get(p, 0.0) * 1e6 / phase_wall[p] if phase_wall.get(p) else None}
                     for p in ("startup", "steady", "tail") if p in phase_wall or p in phase_idle},
        "by_next_step": _grouped(by_next, wall), "by_rows": _grouped(by_rows, wall),
        "by_crossing": _grouped(by_cross, wall), "by_worker_at_end": _grouped(by_worker, wall),
        "by_blocking_call_at_start": _grouped(by_sync, wall),
        "decode_steps": decode_table, "prefill_steps": prefill,
        "steps": {"decode": sum(1 for st in steps if st["kind"] == "decode"), "prefill": len(prefill)},
    }


# ------------------------------------------------------------------ the probe's printed tables


def _row(name: str, g: dict[str, Any], width: int = 44) -> str:
    return (f"    {name[:width]:{width}s} {g['idle_ms']:9.2f} ms {100 * (g['share_of_run'] or 0):6.2f}%  n={g['count']:6d}"
              f"  med {g['median_us']:8.1f} us  p90 {g['p90_us']:8.1f} us")


def print_loop(loop: str, mode: str, r: dict[str, Any], top: int = 14) -> None:
    g, p, q = r["gaps"], r["plain"], r["profiled"]
    print(f"\n== {loop} {mode}: plain {p['tok_s']:.0f} tok/s (NVML busy {p['gpu_busy_mean']}), profiled {q['tok_s']:.0f} tok/s"
          f" (NVML {q['gpu_busy_mean']}); profiler stop {r['profile']['profiler_stop_s']:.1f} s, extract"
          f" {r['profile']['extract_s']:.1f} s, analyse {r['profile']['analyse_s']:.1f} s")
    print(f"  run {g['wall_ms']:.1f} ms, device busy {g['busy_ms']:.1f} ms = {100 * (g['busy_fraction'] or 0):.1f}%;"
          f" idle {g['idle_ms']:.1f} ms ({g['gaps']['count']} gaps >= {g['min_gap_us']:g} us: {g['gaps']['idle_ms']:.1f} ms,"
          f" median {g['gaps']['median_us']:.1f} us, p90 {g['gaps']['p90_us']:.1f} us; smaller gaps {g['idle_below_min_gap_ms']:.1f} ms)")
    for title, key in (("idle by the loop's innermost range when the device ran dry", "by_start"),
                       ("idle by range at start -> range at end", "by_start_end"),
                       ("idle inside a step or between steps (kinds)", "by_crossing"),
                       ("idle by the rows of the last decode step launched", "by_rows"),
                       ("idle by the worker's range when the device resumed", "by_worker_at_end"),
                       ("idle by the blocking CUDA call (sync) the host was in when the device ran dry", "by_blocking_call_at_start")):
        print(f"  {title}:")
        for name, row in list(g[key].items())[:top]:
            print(_row(name, row))
    print("  idle split over the loop's innermost ranges during the gaps (ms): "
          + ", ".join(f"{k} {v:.1f}" for k, v in list(g["during_ms"].items())[:top]))
    print("  by phase: " + "; ".join(f"{k}: wall {v['wall_ms']:.1f} ms, idle {v['idle_ms']:.1f} ms"
                                      f" ({100 * (v['idle_share_of_phase'] or 0):.1f}%)" for k, v in g["by_phase"].items()))
    calls = r["profile"].get("runtime_calls") or {}
    if calls:
        print("  CUDA calls by host time: " + ", ".join(f"{k} {v['count']}x {v['ms']:.1f} ms" for k, v in list(calls.items())[:10]))
    print("  decode steps by rows (medians, ms): steps  device  host(launch->launch)  launch  gap-after | totals device / host / gap-after")
    for key, d in g["decode_steps"].items():
        print(f"    {key:14s} {d['steps']:5d} {d['device_ms_median']:8.3f} {d['host_ms_median']:8.3f} {d['launch_ms_median']:8.3f}"
              f" {d['gap_after_ms_median']:8.3f} | {d['device_ms_total']:8.1f} {d['host_ms_total']:8.1f} {d['gap_after_ms_total']:7.1f}")
    pf = g["prefill_steps"]
    if pf:
        tot = {k: sum(x[k] for x in pf) for k in ("device_ms", "host_ms", "launch_ms", "gap_after_ms")}
        print(f"  prefill steps: {len(pf)}, rows {sum(x['rows'] for x in pf)}, tokens {sum(x['tokens'] or 0 for x in pf)};"
              f" device {tot['device_ms']:.1f} ms, host (launch->launch) {tot['host_ms']:.1f} ms, launch {tot['launch_ms']:.1f} ms,"
              f" gap after {tot['gap_after_ms']:.1f} ms")
        for x in pf[:8]:
            print(f"    step {x['step']:5d} rows {x['rows']:4d} tokens {x['tokens']:6d} device {x['device_ms']:7.2f}"
                  f" host {x['host_ms']:7.2f} launch {x['launch_ms']:7.2f} gap after {x['gap_after_ms']:6.2f} ms")


def print_summary(result: dict[str, Any], top: int = 3) -> None:
    print("\nsummary: loop/mode, tok/s plain [NVML busy] / profiled [NVML], device busy in the trace, top idle (start -> end range;"
          " inside or between steps)")
    for loop, per in result["loops"].items():
        for mode, r in per.items():
            if not isinstance(r, dict) or "gaps" not in r:
                continue
            g, p, q = r["gaps"], r["plain"], r["profiled"]
            heads = lambda key: "; ".join(f"{k} {v['idle_ms']:.0f} ms" for k, v in list(g[key].items())[:top])  # noqa: E731
            print(f"  {loop}/{mode}: {p['tok_s']:.0f} [{p['gpu_busy_mean']}] / {q['tok_s']:.0f} [{q['gpu_busy_mean']}],"
                  f" busy {100 * (g['busy_fraction'] or 0):.1f}% of {g['wall_ms']:.0f} ms | {heads('by_start_end')} | {heads('by_crossing')}")

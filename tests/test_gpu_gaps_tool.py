"""The analysis of tools/gpu_gaps.py on synthetic events whose gaps are known: device
busy, every idle gap attributed to the loop thread's innermost range at its start and end, its
phase and the step that ended it, and the per-step tables."""

from __future__ import annotations

import pytest

from .conftest import load_script

U = 1_000  # one microsecond in ns


def _load(name: str):
    return load_script(f"tools/{name}.py", f"tool_{name}")


@pytest.fixture(scope="module")
def ga():
    return _load("gap_analysis")


# A prefill (step 0, launched on the worker), two 8-forward decode steps of 100 rows (1, 2),
# one 4-forward step of 10 rows (3). Idle: 0-10 (startup), 100-150, 350-352 (under 5 us),
# 400-600, 700-720 (inside step 3), 900-1000 (the last processing), in us.
DEVICE = [(10 * U, 100 * U, 0), (150 * U, 300 * U, 1), (300 * U, 350 * U, 1), (352 * U, 400 * U, 2),
          (600 * U, 700 * U, 3), (720 * U, 900 * U, 3)]
LOOP = [
    (0, 8 * U, "idle"),
    (8 * U, 140 * U, "step.sync"), (20 * U, 120 * U, "wait.device"), (120 * U, 140 * U, "process"),
    (140 * U, 420 * U, "step.ahead"), (140 * U, 150 * U, "launch.decode"), (340 * U, 351 * U, "launch.decode"),
    (360 * U, 420 * U, "process"),
    (420 * U, 590 * U, "schedule"), (595 * U, 610 * U, "launch.decode"), (900 * U, 1000 * U, "deliver"),
]
WORKER = [(2 * U, 12 * U, "launch.prefill")]
STEPS = [
    {"kind": "prefill", "rows": 4, "k": 1, "tokens": 400, "launch": (2 * U, 12 * U)},
    {"kind": "decode", "rows": 100, "k": 8, "tokens": 100, "launch": (140 * U, 150 * U)},
    {"kind": "decode", "rows": 100, "k": 8, "tokens": 100, "launch": (340 * U, 351 * U)},
    {"kind": "decode", "rows": 10, "k": 4, "tokens": 10, "launch": (595 * U, 610 * U)},
]


@pytest.fixture(scope="module")
def res(ga):
    return ga.analyse(DEVICE, LOOP, WORKER, STEPS, (0, 1000 * U), min_gap_ns=5 * U)


def test_busy_is_the_union_of_device_ops_over_the_run(res):
    assert res["busy_ms"] == pytest.approx(0.618)
    assert res["busy_fraction"] == pytest.approx(0.618)
    assert res["gaps"]["count"] == 5
    assert res["idle_below_min_gap_ms"] == pytest.approx(0.002)


def test_each_gap_goes_to_the_innermost_range_at_its_start_and_end(res):
    assert {k: round(v["idle_ms"] * 1000) for k, v in res["by_start"].items()} == {
        "idle": 10, "wait.device": 50, "process": 200, "deliver": 100, "-": 20}
    assert {k: v["count"] for k, v in res["by_start_end"].items()} == {
        "idle -> step.sync": 1, "wait.device -> step.ahead": 1, "process -> launch.decode": 1, "deliver -> -": 1, "- -> -": 1}
    # The 400-600 us gap, split over what the loop thread did during it.
    during = {k: round(v * 1000) for k, v in res["during_ms"].items()}
    assert during["schedule"] == 170 and during["process"] == 20 + 20 and during["-"] == 5 + 20


def test_gaps_by_phase_next_step_and_worker(res):
    phase = {k: (round(v["wall_ms"] * 1000), round(v["idle_ms"] * 1000)) for k, v in res["by_phase"].items()}
    assert phase == {"startup": (140, 60), "steady": (455, 200), "tail": (405, 120)}
    assert {k: round(v["idle_ms"] * 1000) for k, v in res["by_next_step"].items()} == {
        "decode": 270, "end of run": 100, "prefill": 10}
    assert {k: round(v["idle_ms"] * 1000) for k, v in res["by_crossing"].items()} == {
        "run start -> prefill": 10, "prefill -> decode": 50, "decode -> decode": 200, "inside a decode step": 20,
        "decode -> end of run": 100}
    assert {k: round(v["idle_ms"] * 1000) for k, v in res["by_rows"].items()} == {"startup": 60, "64-127": 200, "<16": 120}
    assert res["by_worker_at_end"]["launch.prefill"]["count"] == 1


def test_step_tables(res):
    dec = res["decode_steps"]
    assert set(dec) == {"64-127 k=8", "<16 k=4"}
    big = dec["64-127 k=8"]
    assert big["steps"] == 2
    assert big["device_ms_total"] == pytest.approx(0.200 + 0.048)
    assert big["host_ms_total"] == pytest.approx(0.200 + 0.255)  # launch to the next launch
    assert big["gap_after_ms_total"] == pytest.approx(0.002 + 0.200)
    (pf,) = res["prefill_steps"]
    assert (pf["rows"], pf["tokens"]) == (4, 400)
    assert pf["device_ms"] == pytest.approx(0.090) and pf["host_ms"] == pytest.approx(0.138)
    assert pf["launch_ms"] == pytest.approx(0.010) and pf["gap_after_ms"] == pytest.approx(0.050)


def test_innermost_ranges_when_nesting_breaks(ga):
    tl = ga.Innermost([(0, 10, "outer"), (2, 6, "a"), (4, 8, "b")])  # b opens inside a, outlives it
    assert [tl.at(t) for t in (1, 3, 5, 7, 9, 10)] == ["outer", "a", "b", "b", "outer", ga.NO_RANGE]
    assert tl.split(0, 12) == {"outer": 4, "a": 2, "b": 4, ga.NO_RANGE: 2}


def test_no_device_work_is_one_gap(ga):
    r = ga.analyse([], [(0, 50 * U, "idle")], [], [], (0, 100 * U))
    assert r["busy_fraction"] == 0 and r["gaps"]["count"] == 1
    assert r["by_start_end"] == {"idle -> -": r["by_start_end"]["idle -> -"]}
    assert r["by_phase"]["startup"]["idle_ms"] == pytest.approx(0.1)


def test_clock_offset_pairs_ranges_by_name_in_order():
    gaps = _load("gpu_gaps")
    mine = [(100, 150, "iteration"), (160, 170, "schedule"), (180, 200, "process")]
    # The profiler saw one more range (still open when it stopped), and its clock is 1,000 ahead.
    ann = [(1100, "iteration"), (1150, "idle"), (1161, "schedule"), (1180, "process")]
    assert gaps.clock_offset(ann, mine) == (1000, 3)


class _FakeEvent:
    """What both kinds of profiler event answer: times, correlation id, name."""

    def __init__(self, start: int, dur: int, corr: int, name: str) -> None:
        self._s, self._d, self._c, self._n = start, dur, corr, name

    def start_ns(self) -> int:
        return self._s

    def duration_ns(self) -> int:
        return self._d

    def correlation_id(self) -> int:
        return self._c

    def name(self) -> str:
        return self._n


class _Ev(_FakeEvent):
    def __init__(self, kind: str, start: int, dur: int = 0, corr: int = 0, name: str = "") -> None:
        super().__init__(start, dur, corr, name)
        self._k = kind

    def activity_type(self) -> str:
        return self._k


class _Prof:
    def __init__(self, events: list[_Ev]) -> None:
        results = type("R", (), {"events": lambda _self: events})()
        self.profiler = type("P", (), {"kineto_results": results})()


def test_device_ops_are_tied_to_the_launch_their_runtime_call_fell_in():
    gaps = _load("gpu_gaps")
    rl = gaps.RangeLog()
    # Our log (perf_counter): a decode launch on the loop thread, a prefill launch on the worker.
    rl.loop = [(100 * U, 200 * U, "launch.decode")]
    rl.worker = [(300 * U, 400 * U, "launch.prefill")]
    rl.steps = [{"kind": "decode", "rows": 5, "k": 1, "tokens": 5, "launch": (100 * U, 200 * U)},
                {"kind": "prefill", "rows": 1, "k": 1, "tokens": 50, "launch": (300 * U, 400 * U)}]
    off = 7_000 * U  # the profiler's clock ahead of perf_counter
    events = [
        _Ev("user_annotation", 100 * U + off, 100 * U, name="oa.launch.decode"),
        _Ev("cuda_runtime", 150 * U + off, U, corr=11),   # in the decode launch
        _Ev("cuda_driver", 350 * U + off, U, corr=12),    # in the prefill launch (worker thread)
        _Ev("cuda_runtime", 250 * U + off, U, corr=13),   # between launches (a copy in collect)
        _Ev("kernel", 160 * U + off, 30 * U, corr=11), _Ev("gpu_memcpy", 190 * U + off, 5 * U, corr=11),
        _Ev("kernel", 360 * U + off, 50 * U, corr=12), _Ev("gpu_memset", 260 * U + off, 2 * U, corr=13),
        _Ev("gpu_user_annotation", 100 * U + off, 400 * U, corr=11),  # not device work
        _Ev("cuda_runtime", 500 * U + off, 10 * U, corr=14, name="cudaStreamSynchronize"),
    ]
    ops, meta = gaps.kineto_view(_Prof(events), rl, cuda=True)
    assert sorted(ops) == [(160 * U + off, 190 * U + off, 0), (190 * U + off, 195 * U + off, 0),
                           (260 * U + off, 262 * U + off, -1), (360 * U + off, 410 * U + off, 1)]
    assert meta["annotations_paired"] == 1 and meta["clock_offset_ns"] == off
    assert meta["device_ops_tied_to_a_step"] == 3
    assert rl.worker == [(300 * U + off, 400 * U + off, "launch.prefill")]  # moved onto the profiler's clock
    assert rl.syncs == [(500 * U + off, 510 * U + off, "cudaStreamSynchronize")]
    assert meta["runtime_calls"]["cudaStreamSynchronize"] == {"count": 1, "ms": 0.01}


class _OldEv(_FakeEvent):
    """An event from a torch whose events do not name their activity type."""

    def __init__(self, on_device: bool, start: int, dur: int, corr: int, name: str) -> None:
        super().__init__(start, dur, corr, name)
        self._dev = on_device

    def device_type(self):
        import torch

        return torch.profiler.DeviceType.CUDA if self._dev else torch.profiler.DeviceType.CPU


def test_events_without_activity_types_are_told_apart_by_device_and_name():
    gaps = _load("gpu_gaps")
    rl = gaps.RangeLog()
    rl.loop = [(100 * U, 200 * U, "launch.decode")]
    rl.steps = [{"kind": "decode", "rows": 5, "k": 1, "tokens": 5, "launch": (100 * U, 200 * U)}]
    events = [_OldEv(False, 100 * U, 100 * U, 1, "oa.launch.decode"),  # our range (its id: the op's)
              _OldEv(False, 120 * U, 5 * U, 2, "aten::copy_"),
              _OldEv(False, 150 * U, U, 2, "cudaGraphLaunch"),  # CUPTI's id 2: an op's id may collide
              _OldEv(True, 160 * U, 30 * U, 2, "void gemm_kernel"),
              _OldEv(True, 100 * U, 100 * U, 2, "oa.launch.decode")]  # the annotation's GPU mirror
    ops, meta = gaps.kineto_view(_Prof(events), rl, cuda=True)
    assert ops == [(160 * U, 190 * U, 0)]
    assert meta["annotations_paired"] == 1


def test_a_gap_that_opens_while_the_host_blocks_in_a_sync_goes_to_that_call(ga):
    r = ga.analyse(DEVICE, LOOP, WORKER, STEPS, (0, 1000 * U), min_gap_ns=5 * U,
                   syncs=[(395 * U, 405 * U, "cudaStreamSynchronize"), (690 * U, 699 * U, "cudaEventSynchronize")])
    assert {k: round(v["idle_ms"] * 1000) for k, v in r["by_blocking_call_at_start"].items()} == {
        "cudaStreamSynchronize": 200, "-": 10 + 50 + 20 + 100}

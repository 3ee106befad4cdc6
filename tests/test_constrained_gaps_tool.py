"""tools/constrained_gaps.py end to end on the CPU: the bench's tiny model, both arms profiled,
the runner's forwards and sampling seen as ranges, every constrained output valid."""

from __future__ import annotations

import asyncio
import types

from .conftest import load_script


def test_the_probe_profiles_each_arm_and_sees_the_runner_ranges(tmp_path):
    tool = load_script("tools/constrained_gaps.py", "tool_constrained_gaps")
    args = types.SimpleNamespace(smoke=True, device="cpu", model=None, arms=["free", "all"], requests=8, optimistic="default",
                                 grammar_backend="default", min_gap_us=5.0, trace_dir=None,
                                 checkpoint_dir=str(tmp_path), out=str(tmp_path / "gaps.json"))
    result = asyncio.run(tool.main_async(args))
    for arm in ("free", "all"):
        r = result["arms"][arm]
        assert r["gaps"]["wall_ms"] > 0 and 0 < r["gaps"]["busy_fraction"] <= 1
        assert r["host_ranges"]["worker.fwd.launch"]["count"] >= 1
        assert r["host_ranges"]["worker.fwd.sample"]["count"] >= 1
    assert result["arms"]["all"]["profiled"]["valid"] == result["arms"]["all"]["profiled"]["constrained"] == 8
    assert (tmp_path / "gaps.json").exists()

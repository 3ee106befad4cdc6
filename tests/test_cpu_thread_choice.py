"""The CPU thread count is chosen for the machine's load: every CPU torch uses on an idle
machine, fewer as the load average rises, one when oversubscribed; what the caller or the
environment fixed is kept; ``info()`` says how many and why."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from omni_async import SchedulerConfig
from omni_async.core.plan import CheckpointFacts, DeviceFacts, plan_stage
from omni_async.errors import ConfigError

TINY = CheckpointFacts(num_layers=2, num_kv_heads=2, head_dim=16, hidden_size=64, intermediate_size=128, vocab_size=300, max_position_embeddings=4096)


def _plan(config: SchedulerConfig | None = None, **facts):
    return plan_stage(config or SchedulerConfig(), DeviceFacts(**{"type": "cpu", "free_bytes": 1 << 33, **facts}), TINY)


@pytest.mark.parametrize(
    "cpus, load, torch_threads, expected",
    [
        (2, 0.1, 2, 2),  # idle: every thread torch has
        (2, 1.0, 2, 1),  # one competing process on two cores
        (2, 5.0, 2, 1),  # oversubscribed
        (16, 4.0, 16, 12),  # the idle cores
        (16, 0.0, 8, 8),  # never more than torch's own (a caller's set_num_threads)
        (4, 3.6, 4, 1),
    ],
)
def test_the_count_follows_the_load(cpus, load, torch_threads, expected):
    plan = _plan(cpus=cpus, load_average=load, intra_op_threads=torch_threads)
    assert plan.cpu_threads == expected
    assert plan.config.cpu_threads == expected
    assert f"load average {load:.2f} on {cpus} CPUs" in plan.cpu_threads_reason


def test_oversubscribed_is_said():
    assert "oversubscribed" in _plan(cpus=2, load_average=3.0, intra_op_threads=2).cpu_threads_reason


def test_asked_and_environment_counts_are_kept():
    asked = _plan(SchedulerConfig(cpu_threads=3), cpus=2, load_average=9.0, intra_op_threads=2)
    assert asked.cpu_threads == 3 and "as asked" in asked.cpu_threads_reason
    env = _plan(cpus=2, load_average=9.0, intra_op_threads=2, threads_env="OMP_NUM_THREADS=2")
    assert env.cpu_threads == 2 and "OMP_NUM_THREADS=2" in env.cpu_threads_reason
    unknown = _plan(cpus=2, load_average=None, intra_op_threads=2)
    assert unknown.cpu_threads == 2 and "cannot be read" in unknown.cpu_threads_reason


def test_cuda_and_tensor_parallel_stages_leave_the_threads_alone():
    cuda = plan_stage(SchedulerConfig(), DeviceFacts(type="cuda", free_bytes=1 << 34, graph_buckets=(1, 2, 4)), TINY)
    assert cuda.cpu_threads is None
    assert _plan(SchedulerConfig(tensor_parallel_size=2), cpus=2, load_average=5.0, intra_op_threads=2).cpu_threads is None


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_a_bad_count_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="cpu_threads"):
        SchedulerConfig(cpu_threads=bad)


SCRIPT = textwrap.dedent(
    """
    import asyncio, json, os, sys, torch
    from omni_async import Engine, SamplingParams

    asked = None if sys.argv[1] == "auto" else int(sys.argv[1])

    async def main():
        async with await Engine.load("tiny", kv_capacity_tokens=4096, cpu_threads=asked) as engine:
            await engine.generate(input_ids=[1, 2, 3] * 40, sampling=SamplingParams(max_new_tokens=4, ignore_eos=True))
            info = (await engine.model_info())["data"]
            # The build thread's own team winds down after it ends (slowly on a loaded
            # machine); the step thread's stays while the engine is open: the fewest seen.
            tasks = []
            for _ in range(60):
                tasks.append(len(os.listdir("/proc/self/task")))
                await asyncio.sleep(0.05)
            tasks = min(tasks)
        print(json.dumps({"threads": info["cpu_threads"], "reason": info["cpu_threads_reason"], "torch": torch.get_num_threads(), "tasks": tasks}))

    asyncio.run(main())
    """
)


def _engine_in_a_fresh_process(asked: str) -> dict:
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", SCRIPT, asked], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/task").exists() or (os.cpu_count() or 1) < 2, reason="counts a team's threads on 2+ CPUs")
def test_the_count_reaches_the_step_thread():
    """With one thread the step thread runs its ops alone; with two it starts an OpenMP
    team (one more OS thread), so the count is the one the steps ran with."""
    one, two = _engine_in_a_fresh_process("1"), _engine_in_a_fresh_process("2")
    assert one["threads"] == one["torch"] == 1 and "as asked" in one["reason"]
    assert two["threads"] == two["torch"] == 2
    assert two["tasks"] > one["tasks"], (one, two)


def test_the_default_reports_its_choice():
    auto = _engine_in_a_fresh_process("auto")
    assert auto["reason"].startswith("load average") or "cannot be read" in auto["reason"], auto
    assert 1 <= auto["threads"] == auto["torch"]

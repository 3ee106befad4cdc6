"""Building an engine on CPU leaves the caller's thread without an OpenMP team.

A thread that runs a parallel torch op keeps an OpenMP team for its life; a second team
next to the step thread's makes every torch op of every CPU step pay a thread wake-up
(bench/RESULTS.md). So importing omni_async and loading a model must not run parallel
torch work on the caller's thread. Checked in a fresh process by counting its threads."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads through /proc")

SCRIPT = textwrap.dedent(
    """
    import os
    import time
    import torch

    def threads():
        return len(os.listdir("/proc/self/task"))

    base = threads()
    import omni_async
    from omni_async import Engine
    after_import = threads()
    # Every CPU (not a count chosen for the machine's load, which may be one): the probe
    # op below must be able to make a team.
    engine = Engine.from_pretrained("tiny", kv_capacity_tokens=1 << 16, cpu_threads=os.cpu_count())
    # The build thread's own team winds down after it ends (slowly on a loaded machine);
    # a team of this thread would stay, so wait for the count to settle, bounded.
    deadline = time.monotonic() + 10
    while threads() > base and time.monotonic() < deadline:
        time.sleep(0.05)
    after_load = threads()
    torch.zeros(1 << 20).add_(1)  # a parallel op here does make a team: the count can see one
    after_op = threads()
    print(base, after_import, after_load, after_op)
    """
)


def test_import_and_load_leave_the_callers_thread_without_a_team():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=300)
    base, after_import, after_load, after_op = map(int, out.stdout.split()[-4:])
    assert after_import == base, out.stdout
    assert after_load == base, out.stdout
    assert after_op > after_load, "the probe op made no team: this check cannot see one"

"""A decode step whose rows are the previous step's at an index array
(``ScheduledBatch.carried``, from the running set's columns) takes their slots from that
step's slot array by the same mask (``InputBatch._lookup``), not by a lookup per request.
Through the engine, in every loop, with rows ending (length, stop ids, aborts), joining
after prefills and retracted under KV pressure, each such step's slots must be the ones
the lookup by request gives, and the mask must be taken."""

from __future__ import annotations

import numpy as np
import pytest

from omni_async.runners.input_batch import InputBatch

from .conftest import LOOPS
from .test_early_launch import engine_mix, run_engine


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # conftest: tiny steps beside the loop thread


@pytest.mark.parametrize("limits", [
    dict(decode_steps=4),
    dict(page_size=8, kv_capacity_tokens=8 * 40, max_running_requests=10, decode_steps=4),
], ids=["multi_step", "small_kv"])
async def test_slots_by_the_mask_equal_the_lookup_by_request(limits, monkeypatch):
    lookup, seen = InputBatch._lookup, {"carried": 0, "hinted": 0}

    def both(self, reqs, epochs, carried=None):
        before = self.carried_steps
        got = lookup(self, reqs, epochs, carried)
        if carried is not None:
            seen["hinted"] += 1
            seen["carried"] += self.carried_steps - before
            ref = lookup(self, reqs, epochs, None)
            assert got[1] == ref[1] and np.array_equal(got[0], ref[0])
        return got

    monkeypatch.setattr(InputBatch, "_lookup", both)
    mix = engine_mix(5, 18, [7, 11])
    for loop in LOOPS:
        await run_engine(loop, mix, aborts={3: 4, 10: 6}, **limits)  # (KV freed: run_engine checks)
    assert seen["carried"] > 0 and seen["carried"] >= seen["hinted"] // 2

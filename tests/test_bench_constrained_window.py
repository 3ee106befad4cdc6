"""bench/constrained.py's free rows' window: a quarter run's decode steps split at the
moment its last free request finished. Constrained rows sample one token of a fused
multi-step launch where free rows sample k, so they fall behind and run on alone after
the free rows: the run's decode steps are not the steps its free rows took (issue 61's
"twice the decode steps" was mostly that tail)."""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance")

from omni_async import Engine  # noqa: E402

from .conftest import load_script  # noqa: E402


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/constrained.py", "bench_constrained_window")


def test_the_window_and_its_tail_add_up_to_the_run(bench):
    info0 = {"steps": 10, "decode_steps": 4, "fused_decode_launches": 2}
    at_end = {"steps": 30, "decode_steps": 20, "fused_decode_launches": 12, "grammar_between_forwards": 7}
    run = {"steps": 50, "decode_steps": 36, "fused_decode_launches": 10, "grammar_between_forwards": 21}
    w = bench.free_window(info0, at_end, run, 0.4)
    assert (w["steps"], w["decode_steps"], w["fused_decode_launches"], w["grammar_between_forwards"]) == (20, 16, 10, 7)
    assert (w["tail_steps"], w["tail_decode_steps"], w["tail_fused_decode_launches"]) == (30, 20, 0)
    assert w["tail_grammar_between_forwards"] == 14 and w["step_ms"] == pytest.approx(20.0)


async def test_a_quarter_runs_constrained_rows_alone_after_its_free_rows(bench):
    """Equal lengths, four forwards a step: the free rows take as many decode steps as in
    the free arm (the free rows keep their k forwards beside the masked ones), and the
    quarter's other steps come after the last free row."""
    async with Engine.from_pretrained("tiny", device="cpu", loop="overlap", decode_steps=4) as engine:
        work = [([(5 * i + j) % 200 + 1 for j in range(8 + i % 3)], 48) for i in range(8)]
        replay = bench.GrammarReplay(engine.tokenizer, engine.scheduler.info().get("grammar_backend"))
        try:
            free = await bench.run_arm(engine, work, "free", replay)
            quarter = await bench.run_arm(engine, work, "quarter", replay)
        finally:
            replay.close()
    fw, qw = free["free_window"], quarter["free_window"]
    assert fw["tail_decode_steps"] <= 1  # (a lookahead step launched beside the last free row's)
    assert qw["decode_steps"] + qw["tail_decode_steps"] == quarter["counters"]["decode_steps"]
    assert qw["decode_steps"] <= fw["decode_steps"] + 1
    assert qw["tail_decode_steps"] > 0 and quarter["equal_lengths"]

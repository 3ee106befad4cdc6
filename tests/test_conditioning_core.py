"""The batch core's rule for conditioned requests (a talker fed by a thinker's rows):
a position is computed only once its row arrived or the producer finished. Pure Python
over the native batch core: no model, rows are stand-ins with a shape."""

from __future__ import annotations

from omni_async.config import SamplingParams, SchedulerConfig
from omni_async.core.batch import ForwardMode
from omni_async.core.plan import settle
from omni_async.core.batch_core import NativeBatchCore
from omni_async.core.conditioning import StepConditioning
from omni_async.core.multi_step import DecodeSteps
from omni_async.core.request import Request
from omni_async.kv.allocator import PageAllocator


class Rows:
    """What the core sees of a chunk of rows: its length."""

    def __init__(self, n: int) -> None:
        self.shape = (n, 8)


def core(*, steps: int = 1, pages: int = 64, **cfg) -> NativeBatchCore:
    config = SchedulerConfig(max_running_requests=8, **cfg)
    tiers = DecodeSteps(((1, steps),)) if steps > 1 else DecodeSteps()
    return NativeBatchCore(settle(config), PageAllocator(pages, 4), 1024, decode_steps=tiers)  # the CPU prefill budget


def talker(rid: str, prompt_len: int, rows: int, *, max_new: int = 20) -> Request:
    """A talker request: BOS and one placeholder per thinker row so far (position p >= 1
    takes row p - 1)."""
    req = Request(rid=rid, prompt_ids=[1] * prompt_len, sampling=SamplingParams(max_new_tokens=max_new))
    req.conditioning = StepConditioning(start=1)
    if rows:
        req.conditioning.add(Rows(rows))
    return req


def finish_step(c: NativeBatchCore, batch, token: int = 7) -> None:
    tokens = [token] * (batch.size * max(batch.row_steps or [1]))
    c.process_result(batch, tokens)


def test_decode_waits_for_the_row_of_its_next_position():
    c = core()
    req = talker("t", 4, 3)  # positions 0..3 ready (rows 0..2)
    c.add_request(req)
    prefill = c.get_next_batch()
    assert prefill.mode == ForwardMode.EXTEND and prefill.extend_lens == [4]
    finish_step(c, prefill)
    assert req.num_cached == 4 and len(req.output_ids) == 1
    # position 4 needs row 3: not there yet, so no step at all (the loop idles)
    assert c.get_next_batch() is None
    assert c.has_work() and req in c.running
    req.conditioning.add(Rows(2))  # rows 3, 4
    for _ in range(2):
        step = c.get_next_batch()
        assert step.mode == ForwardMode.DECODE and step.reqs == [req]
        finish_step(c, step)
    assert c.get_next_batch() is None
    req.conditioning.close()  # the thinker finished: every later position runs (zero rows)
    step = c.get_next_batch()
    assert step is not None and step.reqs == [req]


def test_a_waiting_row_does_not_hold_back_the_others():
    c = core()
    slow, plain = talker("slow", 3, 2), Request(rid="p", prompt_ids=[5, 6], sampling=SamplingParams(max_new_tokens=20))
    c.add_request(slow)
    c.add_request(plain)
    finish_step(c, c.get_next_batch())
    step = c.get_next_batch()
    assert step.reqs == [plain]  # slow waits for row 2, plain decodes
    finish_step(c, step)
    slow.conditioning.add(Rows(1))
    assert c.get_next_batch().reqs == [slow, plain]


def test_multi_step_rows_take_only_the_positions_whose_rows_arrived():
    c = core(steps=4)
    req = talker("t", 3, 2)
    other = Request(rid="p", prompt_ids=[5, 6], sampling=SamplingParams(max_new_tokens=20))
    c.add_request(req)
    c.add_request(other)
    finish_step(c, c.get_next_batch())
    req.conditioning.add(Rows(2))  # rows 2, 3: positions 3, 4
    step = c.get_next_batch()
    assert step.row_steps == [2, 4]
    finish_step(c, step)
    assert len(req.output_ids) == 3 and req.num_cached == 5
    req.conditioning.add(Rows(10))
    assert c.get_next_batch().row_steps == [4, 4]


def test_prefill_takes_the_ready_positions_then_waits_without_blocking_others():
    """A prompt longer than its rows (a builder may make one): the ready part is
    prefilled, the rest waits as the chunked request; a plain request still runs (in
    steps of its own: no running decode rides along here)."""
    c = core(mixed_prefill=False)
    req = talker("t", 6, 2)  # positions 0..2 ready
    c.add_request(req)
    first = c.get_next_batch()
    assert first.extend_lens == [3] and first.samples_kept == [False]
    finish_step(c, first)
    plain = Request(rid="p", prompt_ids=[5, 6], sampling=SamplingParams(max_new_tokens=20))
    c.add_request(plain)
    nxt = c.get_next_batch()
    assert nxt.reqs == [plain] and nxt.extend_lens == [2]
    finish_step(c, nxt)
    req.conditioning.add(Rows(3))  # through position 5: the rest of the prompt
    nxt = c.get_next_batch()  # the plain request sat out a prefill step: its decode first
    assert nxt.mode == ForwardMode.DECODE and nxt.reqs == [plain]
    finish_step(c, nxt)
    nxt = c.get_next_batch()
    assert nxt.mode == ForwardMode.EXTEND and nxt.reqs == [req] and nxt.extend_lens == [3]
    assert nxt.samples_kept == [True]


def test_retracted_request_reprefills_only_what_has_rows():
    c = core()
    req = talker("t", 3, 2)
    c.add_request(req)
    finish_step(c, c.get_next_batch())
    req.conditioning.add(Rows(1))
    finish_step(c, c.get_next_batch())  # position 3 computed, sampled the 2nd token
    assert req.num_cached == 4 and len(req.output_ids) == 2
    c.retract_requests([req])
    # sequence of 5: positions 0..3 have rows (or none needed), position 4 waits for row 3
    again = c.get_next_batch()
    assert again.extend_lens == [4] and again.samples_kept == [False]
    finish_step(c, again)
    assert c.get_next_batch() is None
    req.conditioning.add(Rows(1))
    last = c.get_next_batch()
    assert last.extend_lens == [1] and last.samples_kept == [True]


def test_conditioned_requests_never_share_kv_through_the_prefix_cache():
    c = core(enable_prefix_cache=True)
    a = talker("a", 12, 11, max_new=1)
    c.add_request(a)
    finish_step(c, c.get_next_batch())
    assert a.finished() and a.prefix_epoch is None
    b = talker("b", 12, 11, max_new=1)  # the same placeholder ids
    c.add_request(b)
    batch = c.get_next_batch()
    assert batch.prefix_lens == [0] and batch.extend_lens == [12]
    assert b.prefix_epoch is None and b.cached_tokens == 0
    plain = Request(rid="p", prompt_ids=[1] * 12, sampling=SamplingParams(max_new_tokens=1))
    c.add_request(plain)
    assert c.get_next_batch().prefix_lens == [0]  # nothing of theirs was indexed either

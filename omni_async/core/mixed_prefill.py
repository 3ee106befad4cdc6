"""Mixed prefill and decode: running requests ride in a prefill step as one-token rows
(``SchedulerConfig.mixed_prefill``), so their streams keep going while prompts arrive
instead of stalling behind every prefill step (vLLM schedules decodes first and fills the
token budget with prefill; SGLang's mixed chunk)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .jump_steps import still_due
from .multi_step import decoding_rows
from .request import Request

# A prefill turn while the running set is full waits for 1/PREFILL_FREE_SHARE of its
# slots to be free, or PREFILL_MAX_DEFERRALS decode steps (refill_due).
PREFILL_FREE_SHARE = 32
PREFILL_MAX_DEFERRALS = 4

if TYPE_CHECKING:
    from .batch import ScheduledBatch
    from .core_state import CoreState


def mixed_decodes(core: "CoreState", rows: list[tuple[Request, int]]) -> list[Request]:
    """Running requests that ride in this prefill step as one-token rows
    (``SchedulerConfig.mixed_prefill``), so that their streams keep going while
    prompts arrive instead of waiting behind every prefill step. None when mixing is
    off, the runner declines it, a row retries after a failed step (it runs alone),
    or their next pages do not fit now: they then decode in the next decode step,
    where retraction can make room."""
    if not core.config.mixed_prefill or not core.running or any(r.step_failures for r, _ in rows):
        return []
    if not core.mixed_allowed() or still_due(core.jump_due):
        return []  # (a row with forced tokens to compute is not one token: its decode step takes it)
    core.running = [r for r in core.running if r.finish_reason is None]
    decoding = decoding_rows(core.running, core.context_length)[0]
    ps = core.page_size
    need = sum(max(0, -(-(r.num_cached + 1) // ps) - len(r.pages)) for r in decoding)
    return decoding if need <= core.kv.available_pages else []

def add_decode_rows(core: "CoreState", batch: "ScheduledBatch", decoding: list[Request]) -> None:
    """One-token extend rows of running requests, as a decode step schedules them:
    their next page, their in-flight input (-1, read on the device from the step
    before), one more token in flight."""
    ps, allocate = core.page_size, core.kv.allocate
    core.mixed_decode_rows += len(decoding)
    for req in decoding:
        cached = req.num_cached
        need = -(-(cached + 1) // ps) - len(req.pages)
        if need > 0:
            req.pages.extend(allocate(need))
        if req.num_inflight:
            batch.inflight_inputs.append((len(batch.input_ids), req))
            batch.input_ids.append(-1)
        else:
            batch.input_ids.append((req.output_ids or req.prompt_ids)[-1])
        core.add_row(batch, req, 1, True)
        req.num_cached = cached + 1
        req.num_inflight += 1


def jump_step(core: "CoreState", decoding: list[Request], due: dict[int, Request]) -> "ScheduledBatch":
    """A decode step that runs one forward per row, as an extend step: the rows whose
    forced tokens (:mod:`omni_async.structured.jump`) wait for their KV compute them and
    sample after the last, as one extend row each; the other running requests ride in
    it as one-token rows, as in a mixed prefill step."""
    from .batch import ForwardMode

    batch = core.new_batch(ForwardMode.EXTEND)
    jumping = [r for r in decoding if id(r) in due]
    others = [r for r in decoding if id(r) not in due]
    if others:
        add_decode_rows(core, batch, others)
        core.mixed_decode_rows -= len(others)  # counted as the jump steps' rows, not mixed prefill's
    ps, allocate = core.page_size, core.kv.allocate
    for req in jumping:
        cached, n = req.num_cached, req.seq_len - req.num_cached
        need = -(-(cached + n) // ps) - len(req.pages)
        if need > 0:
            req.pages.extend(allocate(need))
        batch.input_ids.extend(req.fill_ids()[cached:])
        core.add_row(batch, req, n, True)
        req.num_cached = cached + n
        req.num_inflight += 1
    core.jump_steps += 1
    return batch


def prefill_turn(core: "CoreState") -> bool:
    """Whether the next step may be a prefill step: requests wait, and the step before was
    not a prefill step that the running requests sat out. So a running stream waits for
    one prefill step at most, never a run of them (a burst of long prompts is several
    chunks), and the prompts still start within a decode step; a decode step that cannot
    run gives its turn back. Without mixing this is how prompts and decodes share the
    device: the decodes keep their fused multi-step launches (a mixed step is one eager
    forward for every running row; at 512 running rows on the H200 that cost NV256's
    1,024-request run 27%, bench/RESULTS.md).

    While the running set is nearly full, a turn also waits for a few free slots
    (:func:`refill_due`), so that requests finishing one or two a step are replaced by one
    prefill step of several prompts rather than a prefill step of one each."""
    if not (core.waiting or core.chunked) or (core.decodes_waited and core.running):
        return False
    return refill_due(core)


def refill_due(core: "CoreState") -> bool:
    """A prefill turn while the running set is full but for fewer than 1/32 of its slots
    (16 of 512) is deferred, for at most ``PREFILL_MAX_DEFERRALS`` decode steps, so that
    it takes several prompts. A prefill step of one or two prompts costs the device a few
    ms while the host's processing of the decode step before it, at hundreds of rows,
    takes longer: the device waited after each one (NV256 at 1,024 requests on the null
    device with a modelled device, bench/RESULTS.md 2026-12-04 night: ~120 prefill
    steps, most of one to a few prompts, and the device idle after them). With 32 slots
    or fewer, and for a request partway through its prefill, nothing is deferred."""
    limit = core.config.max_running_requests
    free = limit - len(core.running)
    if core.chunked is not None or free * PREFILL_FREE_SHARE >= limit or core.prefill_deferrals >= PREFILL_MAX_DEFERRALS:
        core.prefill_deferrals = 0
        return True
    core.prefill_deferrals += 1
    return False

"""The persistent slot state against a straightforward per-step rebuild, over random
joins, page growth, finishes and retractions (CPU)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from omni_async import SamplingParams
from omni_async.core.request import Request
from omni_async.runners.input_batch import InputBatch
from omni_async.runners.sampling import RowSampling, SeedSource, batch_from_rows

VOCAB = 50
PAGE = 4


def random_params(rng: random.Random) -> SamplingParams:
    greedy = rng.random() < 0.4
    return SamplingParams(
        max_new_tokens=64,
        min_new_tokens=rng.choice([0, 0, 3, 8]),
        temperature=0.0 if greedy else rng.choice([0.5, 1.0, 1.7]),
        top_k=rng.choice([0, 0, 5, 60]),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        min_p=rng.choice([0.0, 0.0, 0.1]),
        seed=rng.choice([None, rng.randrange(1 << 40)]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        suppress_tokens=rng.sample(range(VOCAB), rng.choice([0, 0, 2, 5])),
        stop_token_ids=rng.sample(range(VOCAB), rng.choice([0, 1, 3])),
        return_logprob=rng.random() < 0.3,
        logprobs_mode=rng.choice(["processed", "raw"]),
    )


class Sim:
    """Requests whose state changes the way the batch core changes it."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.reqs: list[Request] = []
        self.next_page = 0
        self.n = 0
        self.seeds = SeedSource(seed)
        self.base: dict[int, int] = {}
        self.last: dict[int, int] = {}  # req.rid -> newest published token

    def new_request(self) -> None:
        self.n += 1
        req = Request(rid=f"r{self.n}", prompt_ids=[1, 2], sampling=random_params(self.rng), eos_token_ids=(VOCAB - 1,))
        req.output_ids = [self.rng.randrange(VOCAB) for _ in range(self.rng.choice([0, 0, 4]))]
        self.reqs.append(req)

    def base_seed(self, req: Request) -> int | None:
        if req.sampling.seed is not None:
            return None
        return self.base.setdefault(req.rid, self.seeds.draw())

    def pages(self, k: int) -> list[int]:
        self.next_page += k
        return list(range(self.next_page - k, self.next_page))

    def mutate(self) -> None:
        rng = self.rng
        for req in list(self.reqs):
            r = rng.random()
            if r < 0.08:
                req.finish_reason = "stop"
                self.reqs.remove(req)
            elif r < 0.14:  # retraction: pages released (a new list), a new epoch
                req.pages = []
                req.epoch += 1
                self.last.pop(req.rid, None)  # it re-joins through a prefill
            elif r < 0.5:
                req.pages.extend(self.pages(rng.choice([1, 1, 3])))
        while len(self.reqs) < 6 or rng.random() < 0.3:
            self.new_request()
        for req in self.reqs:
            if not req.pages:
                req.pages.extend(self.pages(1))


def expected_tables(reqs, counts, pad: int) -> np.ndarray:
    widest = max(max(counts), 1)
    return np.array([r.pages[:c] + [pad] * (widest - c) for r, c in zip(reqs, counts)], dtype=np.int64)


@pytest.mark.parametrize("seed", range(6))
def test_slot_state_matches_a_rebuild(seed):
    sim = Sim(seed)
    ib = InputBatch(PAGE, VOCAB, torch.device("cpu"), slots=2, pages=1)
    if seed % 2:
        ib.set_pad_page(999)
    gen_index: dict[int, int] = {}
    for step in range(60):
        sim.mutate()
        rows = sim.rng.sample(sim.reqs, sim.rng.randint(1, len(sim.reqs)))
        counts = [len(r.pages) for r in rows]
        # The batch shares the page lists; a later append must not change this step.
        slot_rows = ib.assign(rows, [r.epoch for r in rows], [r.pages for r in rows], counts, sim.base_seed)
        assert len(set(slot_rows.slots.tolist())) == len(rows), "two rows share a slot"
        want = expected_tables(rows, counts, ib.pad_page)
        assert np.array_equal(ib.block_tables(slot_rows).numpy(), want), step

        sidx = np.array([gen_index.setdefault(r.rid, len(r.output_ids)) for r in rows], dtype=np.int64)
        got = ib.sampling_batch(slot_rows, sidx, torch.from_numpy(sidx))
        ref_rows = [
            RowSampling(r.sampling, r.rid, int(i), r.output_ids, sorted(r.stop_ids()), sim.base_seed(r))
            for r, i in zip(rows, sidx)
        ]
        ref = batch_from_rows(ref_rows, VOCAB, torch.device("cpu"), any(r.sampling.return_logprob for r in rows))
        for name in ("temperature", "top_k", "top_p", "min_p", "seeds", "sample_indices"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), (step, name)
        for name in ("num_sampled", "use_top_k", "use_top_p", "use_min_p", "want_logprobs"):
            assert getattr(got, name) == getattr(ref, name), (step, name)
        assert (got.sampled_rows is None) == (ref.sampled_rows is None)
        if ref.sampled_rows is not None:
            assert torch.equal(got.sampled_rows, ref.sampled_rows)
        assert (got.ban is None) == (ref.ban is None)
        if ref.ban is not None:
            assert torch.equal(got.ban, ref.ban), step
        assert (got.penalty is None) == (ref.penalty is None)
        if ref.penalty is not None:
            penalised = ref.penalty != 1
            assert torch.equal(got.penalty, ref.penalty)
            assert torch.equal(got.seen[penalised], ref.seen[penalised]), step
        assert (got.raw_logprobs is None) == (ref.raw_logprobs is None)

        # Decode inputs in flight: each slot's newest token is the one published last.
        inflight = [r for r in rows if r.rid in sim.last]
        tokens = torch.tensor([sim.rng.randrange(VOCAB) for _ in rows])
        if inflight:
            at = [rows.index(r) for r in inflight]
            seen_last = ib.last_token.index_select(0, slot_rows.slots_dev[at])
            assert seen_last.tolist() == [sim.last[r.rid] for r in inflight]
        ib.publish(slot_rows.slots_dev, tokens)
        for r, t in zip(rows, tokens.tolist()):
            r.output_ids.append(t)
            sim.last[r.rid] = t
            gen_index[r.rid] = len(r.output_ids)
    live = len(sim.reqs)
    assert ib.slots_in_use <= 2 * live + 8, "finished requests' slots are reclaimed"


def test_finished_requests_are_released_within_a_few_steps():
    import gc
    import weakref

    ib = InputBatch(PAGE, VOCAB, torch.device("cpu"), slots=8, pages=1)
    reqs = [Request(rid=f"f{i}", prompt_ids=[1], sampling=SamplingParams(), pages=[i]) for i in range(4)]
    ib.assign(reqs, [0] * 4, [r.pages for r in reqs], [1] * 4, lambda r: 1)
    gone = weakref.ref(reqs[0])
    reqs[0].finish_reason = "stop"
    rest = reqs[1:]
    del reqs
    for _ in range(8):
        ib.assign(rest, [0] * 3, [r.pages for r in rest], [1] * 3, lambda r: 1)
    gc.collect()
    assert gone() is None, "the runner still holds a finished request"
    assert ib.slots_in_use == 3


def test_shared_page_list_growth_after_scheduling_is_ignored():
    ib = InputBatch(PAGE, VOCAB, torch.device("cpu"), slots=1, pages=1)
    req = Request(rid="a", prompt_ids=[1], sampling=SamplingParams())
    req.pages = [7]
    rows = ib.assign([req], [0], [req.pages], [1], lambda r: 1)
    req.pages.extend([8, 9])  # the next step's growth, scheduled before this one ran
    assert ib.block_tables(rows).tolist() == [[7]]
    rows = ib.assign([req], [0], [req.pages], [3], lambda r: 1)
    assert ib.block_tables(rows).tolist() == [[7, 8, 9]]


def test_repeated_rows_keep_their_slots_through_growth_retraction_and_a_reused_list():
    """The same rows step after step (the previous step's slots reused), pages grown one
    at a time and several at once, a retraction among them, and the caller's row list
    mutated in place between steps (as the core reuses its lists): tables and slots
    stay those of a rebuild."""
    ib = InputBatch(PAGE, VOCAB, torch.device("cpu"), slots=2, pages=1)
    reqs = [Request(rid=f"s{i}", prompt_ids=[1], sampling=SamplingParams(), pages=[10 * i]) for i in range(5)]
    rows = list(reqs)  # one list object, as the core hands it out
    slots_seen: dict[str, int] = {}
    for step in range(12):
        if step == 4:  # a retraction: new epoch, a fresh page list
            reqs[2].epoch += 1
            reqs[2].pages = [500]
        if step == 7:  # the list mutated in place: a row leaves, another takes its place
            rows[1] = Request(rid="late", prompt_ids=[1], sampling=SamplingParams(), pages=[700])
        for j, r in enumerate(rows):
            if (step + j) % 3 == 0:
                r.pages.append(1000 + 10 * step + j)
            if step == 9 and j == 0:
                r.pages.extend([2000, 2001, 2002])
        counts = [len(r.pages) for r in rows]
        got = ib.assign(rows, [r.epoch for r in rows], [r.pages for r in rows], counts, lambda r: 1)
        assert len(set(got.slots.tolist())) == len(rows), step
        assert np.array_equal(ib.block_tables(got).numpy(), expected_tables(rows, counts, ib.pad_page)), step
        for r, slot in zip(rows, got.slots.tolist()):
            if r.rid in slots_seen and not (step == 4 and r is reqs[2]):
                assert slots_seen[r.rid] == slot, (step, r.rid)  # a row that stays keeps its slot
            slots_seen[r.rid] = slot


def test_a_steps_sampling_mode_is_the_union_of_what_its_rows_ask():
    """The mode from the slots' join-time flags equals the one computed from their
    settings (the fused launch's graph key)."""
    from omni_async.runners.fused_sampling import SamplingMode, sampling_mode
    from omni_async.runners.input_batch import MIN_NEW, MIN_P, PENALTY, TEMP, TOP_K, TOP_P, HAS_STOP, HAS_SUPPRESS

    rng = random.Random(7)
    ib = InputBatch(PAGE, VOCAB, torch.device("cpu"), slots=2, pages=1)
    reqs = [Request(rid=f"m{i}", prompt_ids=[1], sampling=random_params(rng), pages=[i], eos_token_ids=(VOCAB - 1,))
            for i in range(40)]
    rows = ib.assign(reqs, [0] * len(reqs), [r.pages for r in reqs], [1] * len(reqs), lambda r: 1)
    modes = set()
    for trial in range(200):
        pick = np.array(sorted(rng.sample(range(len(reqs)), rng.randint(1, 4))))
        s = rows.slots[pick]
        sidx = np.array([rng.randrange(10) for _ in pick], dtype=np.int64)
        fp, ip, flags = ib.fp[s], ib.ip[s], ib.flags[s]
        sampled = fp[:, TEMP] != 0
        want = SamplingMode(
            sampled=bool(sampled.any()),
            sort=bool((sampled & (((ip[:, TOP_K] > 0) & (ip[:, TOP_K] < VOCAB)) | (fp[:, TOP_P] < 1))).any()),
            min_p=bool((sampled & (fp[:, MIN_P] > 0)).any()), penalty=bool((fp[:, PENALTY] != 1).any()),
            suppress=bool(flags[:, HAS_SUPPRESS].any()), stop=bool((flags[:, HAS_STOP] & (sidx < ip[:, MIN_NEW])).any()),
        )
        assert sampling_mode(flags, ib.ip, s, sidx) == want, trial
        modes.add(want)
    assert len(modes) > 8, "the trials cover many modes"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device's stream is what must not be waited for")
def test_admitting_and_publishing_never_wait_for_the_device():
    """A step's tokens marked seen (repetition penalty) and a new request's masks written
    without a blocking copy: ``mask[rows, cols] = True`` copies a host True to the device
    and waits for every step queued on the stream, which held the launching thread for a
    whole in-flight step on an H100. Under CUDA's sync check in error mode, any wait raises."""
    dev = torch.device("cuda")
    ib = InputBatch(PAGE, VOCAB, dev, slots=4, pages=1)
    params = SamplingParams(repetition_penalty=1.3, suppress_tokens=[3, 4], stop_token_ids=[9])
    reqs = [Request(rid=f"p{i}", prompt_ids=[1], sampling=params, pages=[i]) for i in range(3)]
    step, steps = torch.tensor([5, 6, 7], device=dev), torch.tensor([[10, 11, 12], [13, 14, 15]], device=dev)
    torch.cuda.synchronize()  # (a blocking copy, like the two above, raises in error mode)
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows = ib.assign(reqs, [0] * 3, [r.pages for r in reqs], [1] * 3, lambda r: 1)
        ib.publish(rows.slots_dev, step)
        ib.publish_steps(rows.slots_dev, steps)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    seen = ib.masks["seen"][rows.slots_dev].cpu()
    for i, tokens in enumerate(([5, 10, 13], [6, 11, 14], [7, 12, 15])):
        assert seen[i].nonzero().flatten().tolist() == tokens
    assert ib.masks["suppress"][rows.slots_dev].cpu()[:, [3, 4]].all()
    assert ib.last_token[rows.slots_dev].cpu().tolist() == [13, 14, 15]

"""The codec's slot store (omni_async.speech.codec_slots) and its bucketed, padded calls
(omni_async.speech.codec_graphs without capture: the path a CUDA graph replays, run
eagerly), on the tiny decoder with random weights on the CPU: streams opening, decoding in
interleaved chunks of the graphs' lengths and closing, slots reused, the store growing in
the middle, give each stream the one-shot decode's samples; padding rows never touch a
stream's state; the codec stage's chunks are powers of two and still make the one-shot
decode. tests/test_codec_cuda.py replays the graphs on a GPU."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch

from omni_async.errors import InvalidRequestError
from omni_async.speech.codec import CodecDecoder
from omni_async.speech.codec_config import CodecConfig
from omni_async.speech.codec_graphs import FRAME_BUCKETS, CodecGraphs
from omni_async.speech.codec_slots import CodecSlots
from omni_async.speech.codec_stage import CodecStage

from .codec_gate import eventually

F32_TOL = 2e-5  # as tests/test_codec.py: float32 rounding between splits and batchings


@pytest.fixture(scope="module")
def codec() -> CodecDecoder:
    return CodecDecoder.random(CodecConfig.tiny(), seed=0)


def random_codes(frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2048, (frames, 16), generator=g)


def one_shot(codec: CodecDecoder, codes: torch.Tensor) -> torch.Tensor:
    return codec.decode(codes[None])[0]


class Caller:
    """The two ways to call the store: the eager call, and the padded bucketed call."""

    def __init__(self, codec: CodecDecoder, padded: bool, capacity: int) -> None:
        self.slots = CodecSlots(codec, capacity)
        self.graphs = CodecGraphs(self.slots, capture=False) if padded else None

    def run(self, codes: torch.Tensor, slots: list[int]) -> torch.Tensor:
        return (self.graphs or self.slots).run(codes, slots)


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded"])
def test_interleaved_streams_opening_and_closing_give_the_one_shot_decode(codec, padded):
    """Seven streams, at most four at once, over a store of two slots: each round some
    streams take a chunk of 1, 2, 4, 8 or 16 frames (one call per length), new ones open
    as others finish, the store grows while streams are mid-way, and a finished stream's
    slot goes to the next. One stream is longer than the 72-frame attention window."""
    caller = Caller(codec, padded, capacity=2)
    store = caller.slots
    rng = random.Random(7)
    lengths = [23, 90, 11, 37, 5, 30, 18]
    waiting = [(i, random_codes(n, seed=100 + i)) for i, n in enumerate(lengths)]
    live: dict[int, dict] = {}  # stream -> its codes, slot, next frame, pieces
    opened: list[int] = []
    finished = 0
    while waiting or live:
        while waiting and len(live) < 4:
            i, codes = waiting.pop(0)
            slot = store.open()
            opened.append(slot)
            live[i] = {"codes": codes, "slot": slot, "at": 0, "pieces": []}
        movers = [i for i in live if rng.random() < 0.7] or list(live)
        by_length: dict[int, list[int]] = {}
        for i in movers:
            left = live[i]["codes"].shape[0] - live[i]["at"]
            n = max(f for f in FRAME_BUCKETS if f <= left and f <= rng.choice(FRAME_BUCKETS)) if left else 0
            if n:
                by_length.setdefault(n, []).append(i)
        for n, rows in by_length.items():
            chunks = torch.stack([live[i]["codes"][live[i]["at"]:live[i]["at"] + n] for i in rows])
            pcm = caller.run(chunks, [live[i]["slot"] for i in rows])
            assert pcm.shape == (len(rows), n * 1920) and pcm.dtype == torch.float32
            for j, i in enumerate(rows):
                live[i]["pieces"].append(pcm[j].clone())
                live[i]["at"] += n
        for i in [i for i in live if live[i]["at"] == live[i]["codes"].shape[0]]:
            s = live.pop(i)
            audio = torch.cat(s["pieces"])
            assert float((audio - one_shot(codec, s["codes"])).abs().max()) < F32_TOL, i
            _, position = store.rows(s["slot"])
            assert int(position) == s["codes"].shape[0]
            store.close(s["slot"])
            finished += 1
    assert finished == len(lengths) and store.in_use() == 0
    assert store.generation >= 1 and store.capacity >= 4  # it grew with streams mid-way
    assert len(set(opened)) < len(opened)  # and slots were reused


def test_a_reused_slot_starts_from_silence(codec):
    """A slot given back holds its last stream's past until it is opened again: the next
    stream must not hear it."""
    store = CodecSlots(codec, 1)
    first, second = random_codes(12, seed=1), random_codes(12, seed=2)
    slot = store.open()
    store.run(first[None], [slot])
    store.close(slot)
    again = store.open()
    assert again == slot
    audio = torch.cat([store.run(second[None, :4], [again])[0], store.run(second[None, 4:], [again])[0]])
    assert float((audio - one_shot(codec, second)).abs().max()) < F32_TOL


def test_padding_rows_never_touch_a_streams_state(codec):
    """Three streams in a bucket of four: the padding row reads and writes the scratch slot
    only. An open stream outside the call and a free slot keep every value; the three get
    what an unpadded call gives them."""
    caller = Caller(codec, padded=True, capacity=8)
    plain = CodecSlots(codec, 8)
    store = caller.slots
    codes = [random_codes(6, seed=20 + i) for i in range(4)]
    slots = [store.open() for _ in range(4)]
    plain_slots = [plain.open() for _ in range(4)]
    caller.run(torch.stack([c[:2] for c in codes]), slots)  # four: no padding
    plain.run(torch.stack([c[:2] for c in codes]), plain_slots)
    idle_before = store.rows(slots[3])
    free_before = store.rows(7)
    scratch_before = store.rows(store.scratch)
    pcm = caller.run(torch.stack([c[2:6] for c in codes[:3]]), slots[:3])  # three in a bucket of four
    want = plain.run(torch.stack([c[2:6] for c in codes[:3]]), plain_slots[:3])
    assert pcm.shape == want.shape == (3, 4 * 1920)
    assert float((pcm - want).abs().max()) < F32_TOL
    for before, after in ((idle_before, store.rows(slots[3])), (free_before, store.rows(7))):
        assert all(torch.equal(a, b) for a, b in zip(before[0], after[0])) and torch.equal(before[1], after[1])
    scratch_after = store.rows(store.scratch)
    assert any(not torch.equal(a, b) for a, b in zip(scratch_before[0], scratch_after[0]))  # the padding ran there
    for i in range(3):
        past, position = store.rows(slots[i])
        want_past, want_position = plain.rows(plain_slots[i])
        assert int(position) == int(want_position) == 6
        assert all(float((a - b).abs().max()) < F32_TOL for a, b in zip(past, want_past))


def test_two_holders_of_graphs_pad_on_their_own_scratch_rows_and_slots_reserved_apart_from_zeroing(codec):
    """A store with two scratch rows (the codec stage's two lanes): each holder of graphs
    pads on its own row and never on the other's, through a grow (the rows move with the
    capacity). ``reserve`` takes the lowest free slot without touching the device and never
    grows (None when full); ``reset`` zeroes it; ``open`` is both, growing when full."""
    store = CodecSlots(codec, 2, scratch_rows=2)
    bulk, express = CodecGraphs(store, capture=False), CodecGraphs(store, capture=False, scratch_row=1)
    assert (bulk.scratch, express.scratch) == (2, 3)
    a = store.open()
    store.run(random_codes(2, seed=60)[None], [a])
    store.close(a)
    b = store.reserve()
    assert b == a and int(store.rows(b)[1]) == 2  # taken, its rows still the last stream's
    store.reset(b)
    assert int(store.rows(b)[1]) == 0 and all(not t.any() for t in store.rows(b)[0])
    c = store.reserve()
    assert store.reserve() is None and store.capacity == 2  # full: reserve does not grow
    d = store.open()  # grows: the scratch rows move with the capacity
    assert store.capacity == 4 and (bulk.scratch, express.scratch) == (4, 5)
    store.reset(c)
    for graphs, other in ((bulk, express), (express, bulk)):
        mine, theirs = store.rows(graphs.scratch), store.rows(other.scratch)
        three = torch.stack([random_codes(1, seed=62 + i) for i in range(3)])
        graphs.run(three, [b, c, d])  # three in a bucket of four: one padding row
        assert int(store.rows(graphs.scratch)[1]) == int(mine[1]) + 1  # the padding ran on its own row
        after = store.rows(other.scratch)
        assert all(torch.equal(x, y) for x, y in zip(theirs[0], after[0])) and torch.equal(theirs[1], after[1])


def test_a_batch_past_the_largest_bucket_runs_as_several_calls(codec):
    store = CodecSlots(codec, 4)
    graphs = CodecGraphs(store, capture=False, batches=(1, 2))
    codes = [random_codes(2, seed=30 + i) for i in range(3)]
    slots = [store.open() for _ in codes]
    pcm = graphs.run(torch.stack(codes), slots)
    assert graphs.eager_calls == 2  # 2 + 1 rows
    for i, c in enumerate(codes):
        assert float((pcm[i] - one_shot(codec, c)).abs().max()) < F32_TOL
    other = graphs.run(torch.stack([random_codes(3, seed=40 + i) for i in range(3)]), slots)  # 3 frames: no bucket
    assert other.shape == (3, 3 * 1920) and graphs.eager_calls == 3


def test_bad_calls_are_typed_errors_and_change_nothing(codec):
    store = CodecSlots(codec, 2)
    a, b = store.open(), store.open()
    chunk = random_codes(2, seed=50)
    with pytest.raises(InvalidRequestError, match="twice"):
        store.run(torch.stack([chunk, chunk]), [a, a])
    with pytest.raises(InvalidRequestError, match="not open"):
        store.run(chunk[None], [3])
    with pytest.raises(InvalidRequestError, match="chunks for"):
        store.run(chunk[None], [a, b])
    with pytest.raises(InvalidRequestError, match=r"\[B, F, 16\]"):
        store.run(chunk, [a])
    with pytest.raises(InvalidRequestError, match="integers"):
        store.run(chunk[None].float(), [a])
    store.close(b)
    with pytest.raises(InvalidRequestError, match="not open"):
        store.close(b)
    with pytest.raises(InvalidRequestError, match="not open"):
        CodecGraphs(store, capture=False).run(chunk[None], [b])
    assert int(store.rows(a)[1]) == 0  # nothing ran


async def _collect(stream) -> list:
    return [chunk async for chunk in stream.receive]


async def test_the_stage_sends_power_of_two_chunks_that_make_the_one_shot_decode(codec):
    """Chunk targets round down to a power of two (first 3 -> 2, at most 13 -> 8) and an
    ended stream's leftover goes out as one chunk, its call padded with zero codes to a
    power of two (the decoder is causal: the padding changes no real sample); each
    stream's chunks make its one-shot decode, and every slot is back once the streams end."""
    stage = CodecStage(codec, torch.device("cpu"), first_chunk_frames=8, max_chunk_frames=8, slots=1)
    runner = asyncio.create_task(stage.run())
    try:
        codes = random_codes(15, seed=60)
        s = stage.open("fifteen")
        stage.push(s, codes)
        stage.end(s, "length")
        chunks = await _collect(s)
        assert [len(c.codes) for c in chunks] == [8, 7]
        assert stage.bulk_shapes.calls == {(1, 8): 2} and stage.frames_padded == 1 and stage.frames_decoded == 15
        assert chunks[-1].finished and chunks[-1].finish_reason == "length"
        assert not any(c.finished for c in chunks[:-1])
        np.testing.assert_allclose(np.concatenate([c.audio for c in chunks]), one_shot(codec, codes).numpy(), atol=F32_TOL)

        stage = CodecStage(codec, torch.device("cpu"), first_chunk_frames=3, max_chunk_frames=13, slots=1)
        runner.cancel()
        runner = asyncio.create_task(stage.run())
        all_codes = [random_codes(n, seed=70 + n) for n in (29, 17, 40)]
        streams = [stage.open(f"s{i}") for i in range(3)]
        readers = [asyncio.create_task(_collect(s)) for s in streams]
        for start in range(0, 40, 3):  # the talker's frames arrive three at a time
            for s, c in zip(streams, all_codes):
                if start < len(c):
                    stage.push(s, c[start:start + 3])
            await asyncio.sleep(0.005)
        for s in streams:
            stage.end(s, "stop")
        for reader, c in zip(readers, all_codes):
            chunks = await reader
            sizes = [len(x.codes) for x in chunks]
            assert sum(sizes) == len(c) and chunks[-1].finished
            assert all(n in (1, 2, 4, 8) for n in sizes[:-1]) and sizes[-1] <= 8, sizes  # (the last: any length, its call padded)
            assert sizes[0] == 2
            audio = np.concatenate([x.audio for x in chunks])
            np.testing.assert_allclose(audio, one_shot(codec, c).numpy(), atol=F32_TOL)
        assert stage.active() == 0 and stage.slots.in_use() == 0
        assert stage.slots.capacity >= 3  # three streams at once in a store of one: it grew
    finally:
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner


async def test_a_stream_closed_early_gives_its_slot_to_the_next(codec):
    stage = CodecStage(codec, torch.device("cpu"), first_chunk_frames=2, max_chunk_frames=2, slots=1)
    runner = asyncio.create_task(stage.run())
    try:
        left = stage.open("left")
        stage.push(left, random_codes(20, seed=80))
        first = await left.receive.receive()
        assert len(first.codes) == 2
        stage.close(left)
        for _ in range(100):  # a call may still be in flight: the slot comes back after it
            if stage.slots.in_use() == 0:
                break
            await asyncio.sleep(0.01)
        assert stage.slots.in_use() == 0 and stage.active() == 0
        codes = random_codes(9, seed=81)
        s = stage.open("next")
        stage.push(s, codes)
        stage.end(s, "stop")
        chunks = await _collect(s)
        assert [len(c.codes) for c in chunks] == [2, 2, 2, 2, 1]
        np.testing.assert_allclose(np.concatenate([c.audio for c in chunks]), one_shot(codec, codes).numpy(), atol=F32_TOL)
        assert stage.slots.capacity == 1  # the slot came back and was reused: no grow
    finally:
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner


async def test_a_rounds_frame_budget_splits_a_burst_and_serves_first_chunks_first(codec):
    """Six streams ready with long chunks at once and a budget of 16 frames a round: no
    round decodes more than 16 frames, every stream still makes its one-shot decode, and a
    stream that has not had its first chunk is served ahead of streams already playing (the
    express lane off: it would take the first chunks the budget leaves beside the round)."""
    stage = CodecStage(codec, torch.device("cpu"), first_chunk_frames=8, max_chunk_frames=8, slots=8, max_frames_per_round=16,
                       express=False)
    all_codes = [random_codes(24, seed=90 + i) for i in range(6)]
    streams = [stage.open(f"burst{i}") for i in range(6)]
    for s, c in zip(streams, all_codes):
        stage.push(s, c[:8])  # every stream ready before the stage runs: one burst of 48 frames
    runner = asyncio.create_task(stage.run())
    try:
        firsts = [await s.receive.receive() for s in streams]
        assert all(len(c.codes) == 8 for c in firsts)
        await eventually(lambda: stage.rounds >= 3)  # a call's chunks go out as it ends, before its round is counted
        assert stage.largest_round_frames == 16 and stage.rounds == 3
        late = stage.open("late")
        late_codes = random_codes(8, seed=99)
        for s, c in zip(streams, all_codes):  # the playing streams' next chunks and the newcomer's first, together
            stage.push(s, c[8:24])
        stage.push(late, late_codes)
        stage.end(late, "stop")
        first_of_late = await late.receive.receive()
        # the newcomer went out in the first round after the pushes: at most one other chunk beside it
        assert stage.rounds <= 4 and len(first_of_late.codes) == 8
        for s in streams:
            stage.end(s, "length")
        for s, c, first in zip(streams, all_codes, firsts):
            rest = await _collect(s)
            audio = np.concatenate([first.audio] + [x.audio for x in rest])
            np.testing.assert_allclose(audio, one_shot(codec, c).numpy(), atol=F32_TOL)
        assert stage.largest_round_frames == 16
        assert stage.active() == 0 and stage.slots.in_use() == 0
    finally:
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner

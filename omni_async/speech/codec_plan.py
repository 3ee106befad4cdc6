"""Which chunks a codec round decodes, and in which calls (the codec stage's rounds,
:mod:`~omni_async.speech.codec_stage`).

Chunks follow the listener: a stream's first chunk is ``first_chunk_frames`` (a short
wait for the first sound); each later one is at most half of the audio the listener has
buffered and not yet played, so it is written and decoded before that audio runs out
whenever the talker is faster than real time, and chunks grow (fewer decoder calls) as
the buffer does, up to ``max_chunk_frames``. Lengths are powers of two (1, 2, 4, 8, 16, 32
frames by default): each target is rounded down to one, and an ended stream's leftover
goes out as its binary pieces (7 frames as 4, 2, 1) in successive calls.

A round takes the streams whose next chunk is due (its target length is waiting: "ready"),
most urgent first within the round's budgets. How those chunks become decoder calls is the
plan:

- ``"by-length"``: one call per chunk length, each stream taking its target. Streams of
  different ages want different lengths, so a round at 64 streams made about four calls of
  ~37 frames each on the H100 (bench/RESULTS.md).
- ``"merged"``: one call of a length L shared by every ready stream with L frames waiting
  (some take fewer than their target, which only sends their audio in more pieces) and
  filled with streams not yet due that also have L frames waiting, within the frame budget;
  ready streams with fewer than L frames waiting keep calls by their length. L is the
  length whose round decodes the most frames per modelled device time.

Why a cost model: a graphed codec call's time on the H100 is mostly not its frames. Over
twelve (streams, frames) shapes a call took about 2.8 ms + 0.040 ms a stream + 0.046 ms a
frame + 0.037 ms a (stream x frame) of its padded batch (least squares, within ~15%;
``results/codec_variants_1.7b_h100_eb9a01e.json``): four calls of 37 frames cost about twice
one call of the same frames. The plan only ranks rounds with it; ``tools/codec_rounds.py``
replays the stage's rounds under it, and the GPU decides (``bench/tts_serving.py``).
"""

from __future__ import annotations

from typing import Callable

from .codec_graphs import padded_batches
from .codec_streams import CodecStream, power_of_two

__all__ = ["CALL_COST_MS", "ROUND_PLANS", "call_cost", "chunk_target", "plan_calls", "within_budget"]

ROUND_PLANS = ("by-length", "merged")
# A graphed call's modelled time, ms: per call, per stream of its bucket, per frame, per
# (stream x frame) of its bucket (the H100's, above).
CALL_COST_MS = (2.83, 0.040, 0.046, 0.0366)

Calls = list[tuple[int, list[CodecStream]]]  # (frames of each chunk, the call's streams)


def chunk_target(stream: CodecStream, first_len: int, first_chunk_frames: int, max_chunk_frames: int,
                 frame_seconds: float) -> int:
    """Frames of the stream's next chunk: ``first_len`` before its first audio; later at
    most half the audio its listener still has buffered (its player's slack), at least
    ``first_chunk_frames``, at most ``max_chunk_frames``, rounded down to a power of two."""
    if stream.first_audio_at is None:
        return first_len
    buffered = stream.playback.slack() / frame_seconds
    return power_of_two(int(min(max_chunk_frames, max(first_chunk_frames, buffered // 2))))


def call_cost(streams: int, frames: int) -> float:
    """The modelled time of one call of ``streams`` chunks of ``frames`` (its batch padded
    to the graphs' bucket; past the largest bucket, several calls)."""
    a, per_stream, per_frame, per_cell = CALL_COST_MS
    return sum(a + per_stream * b + per_frame * frames + per_cell * b * frames for b in padded_batches(streams))


def plan_calls(ready: list[tuple[CodecStream, int]], spare: list[CodecStream], plan: str, max_streams: int | None,
               max_frames: int | None, max_chunk: int, urgency: Callable[[CodecStream], float]) -> Calls:
    """A round's calls: ``ready`` (each due stream and its target, within the budgets),
    ``spare`` (streams with frames waiting but not due, none in a call, most urgent first);
    no chunk past ``max_chunk`` frames; ordered by their most urgent stream (a first chunk
    before every playing stream's)."""
    if plan == "merged":
        room = None if max_streams is None else max(0, max_streams - len(ready))
        calls = merged(ready, spare[:room] if room is not None else spare, max_frames, max_chunk)
    else:
        calls = by_length(ready)
    return sorted(calls, key=lambda call: min(urgency(s) for s in call[1]))


def by_length(ready: list[tuple[CodecStream, int]]) -> Calls:
    groups: dict[int, list[CodecStream]] = {}
    for s, n in ready:
        groups.setdefault(n, []).append(s)
    return list(groups.items())


def merged(ready: list[tuple[CodecStream, int]], spare: list[CodecStream], max_frames: int | None, max_chunk: int) -> Calls:
    """The round of the most frames per modelled time over the shared lengths L (powers of
    two up to the longest ready chunk or the most frames a ready stream has waiting, at
    most ``max_chunk``). Every
    ready stream is in it: at L when it :func:`joins` that call, else in a call of its own
    length. Within ``max_frames`` (counting padding)
    when L = 1 fits, which it always does (each ready chunk is >= 1 frame)."""
    budget = max_frames if max_frames is not None else float("inf")
    longest = min(power_of_two(max_chunk), max(max(n, s.pending_frames) for s, n in ready))
    best: tuple[float, Calls] | None = None
    length = 1
    while length <= longest:
        shared = [s for s, _ in ready if joins(s, length)]
        calls = by_length([(s, n) for s, n in ready if not joins(s, length)])
        frames = sum(min(length, s.pending_frames) for s in shared) + sum(n * len(group) for n, group in calls)
        room = length * len(shared) + sum(n * len(group) for n, group in calls)
        if room <= budget:
            for s in spare:
                if room + length > budget:
                    break
                if s.pending_frames >= length and s.first_audio_at is not None:
                    shared.append(s)
                    frames, room = frames + length, room + length
            if shared:
                calls.append((length, shared))
            score = frames / sum(call_cost(len(group), n) for n, group in calls)
            if best is None or score > best[0]:
                best = (score, calls)
        length *= 2
    assert best is not None
    return best[1]


def joins(stream: CodecStream, length: int) -> bool:
    """Whether a ready stream's chunk goes in a merged round's shared call of ``length``:
    not a first chunk (a new stream's first sound waits for no long call: its own small
    call goes first), and ``length`` frames waiting or ended (its last frames padded)."""
    return stream.first_audio_at is not None and (stream.pending_frames >= length or stream.ended)


def within_budget(ready: list[tuple[CodecStream, int]], max_streams: int | None, max_frames: int | None,
                  frame_seconds: float) -> list[tuple[CodecStream, int]]:
    """The most urgent of ``ready`` (streams and their chunks' frames) within a round's
    budgets of streams and frames (at least one)."""
    over_streams = max_streams is not None and len(ready) > max_streams
    over_frames = max_frames is not None and sum(n for _, n in ready) > max_frames
    if not (over_streams or over_frames):
        return ready
    kept: list[tuple[CodecStream, int]] = []
    frames = 0
    for s, n in sorted(ready, key=lambda item: item[0].urgency(frame_seconds)):
        if kept and ((max_streams is not None and len(kept) >= max_streams) or (max_frames is not None and frames + n > max_frames)):
            break
        kept.append((s, n))
        frames += n
    return kept

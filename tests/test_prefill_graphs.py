"""The talker's short prefills run as decode rows (``speech/prefill_graphs.py``): a
prompt's uncached positions as decode rows over their request's page table compute the
prefill's causal attention, because paged attention writes every row's key and value
before any row attends. On CUDA those rows replay a graph; here, on a CPU, the same rows
run eagerly, and the codes must be the extend path's: several requests in one prefill,
prompts of different lengths, a prompt whose prefix is cached, the three loops."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omni_async.speech import SpeechParams, SpeechPipeline
from omni_async.speech.prefill_graphs import PrefillGraphs

TEXTS = ["Hello there.", "A somewhat longer sentence for the talker to speak, with a clause.", "Short one", "Hello there."]
VOICES = ["ryan", "vivian", "serena", "ryan"]


async def _codes(loop: str, rows: bool, params: SpeechParams, buckets: tuple[int, ...] | None = None) -> tuple[list[torch.Tensor], int]:
    async with SpeechPipeline.from_pretrained("tiny", loop=loop) as tts:
        runner = tts.stage.runner
        if rows:
            runner.prefill_graphs = PrefillGraphs(runner, scratch_page=runner.kv.num_pages - 1, max_pages=64,
                                                  **({"buckets": buckets} if buckets else {}))
        together = await asyncio.gather(*(tts.synthesize(t, voice=v, params=params) for t, v in zip(TEXTS, VOICES)))
        again = await tts.synthesize(TEXTS[1], voice=VOICES[1], params=params)  # its prompt's pages cached now
        graphs = runner.prefill_graphs
        runs = 0 if graphs is None else graphs.runs
        pieced = 0 if graphs is None else graphs.pieced
    return [r.codes for r in together] + [again.codes], (runs, pieced)


@pytest.mark.parametrize("loop", ["normal", "overlap", "async_decode"])
@pytest.mark.parametrize("params", [SpeechParams(max_frames=10, temperature=0.0, ignore_eos=True),
                                    SpeechParams(max_frames=10, temperature=0.9, seed=5, ignore_eos=True)], ids=["greedy", "seeded"])
async def test_prefills_as_decode_rows_write_the_extend_paths_codes(loop, params):
    extend, (none, _) = await _codes(loop, False, params)
    rows, (runs, pieced) = await _codes(loop, True, params)
    assert none == 0 and runs >= 2 and pieced == 0  # every prefill step of the second run went through the rows
    for a, b in zip(extend, rows):
        assert a.shape == (10, 16)
        assert torch.equal(a, b)


async def test_a_prefill_past_the_largest_bucket_runs_as_pieces_with_the_extend_paths_codes():
    """Buckets of 8 and 16 rows: every prompt (tens of rows) is split across pieces, and
    the requests starting together share pieces; each piece's keys are cached before a
    later piece attends to them."""
    params = SpeechParams(max_frames=8, temperature=0.9, seed=3, ignore_eos=True)
    extend, _ = await _codes("overlap", False, params)
    pieces, (runs, pieced) = await _codes("overlap", True, params, buckets=(8, 16))
    assert runs >= 2 and pieced >= 1  # prompts of tens of rows: past the 16-row bucket
    for a, b in zip(extend, pieces):
        assert torch.equal(a, b)

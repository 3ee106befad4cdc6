"""``omni-async pipeline-demo``: a thinker streaming tokens and hidden states into a
talker in one event loop."""

from __future__ import annotations

from typing import Any

from ..scheduler import AsyncOmniScheduler
from .colocate import HIDDEN_ROWS, TALKER_MIN_CHUNKS
from .two_stage import TwoStagePipeline

THINKER_TOKENS = 24
TALKER_TOKENS = 16


def _legend(args: Any, conversations: int) -> None:
    """Say what the lines below are before they start."""
    thinker, talker = getattr(args, "thinker", "tiny"), getattr(args, "talker", "tiny")
    print(
        f"{conversations} conversations, each a thinker ({thinker}) writing {THINKER_TOKENS} tokens and a talker "
        f"({talker}) that starts once {TALKER_MIN_CHUNKS} thinker chunks have arrived and writes {TALKER_TOKENS}; "
        f"both stages share one event loop on {args.device} (loop={args.loop or 'auto'}); sampled at temperature 0.8."
        + (" The built-in tiny models have random weights: their token ids are noise." if "tiny" in (thinker, talker) else "")
    )
    print("Each line: milliseconds since start, conversation, stage, then either '+[ids]' (the tokens that step "
          "streamed; a thinker chunk also shows how many hidden rows it hands the talker: one per token) or 'result: N "
          "tokens' (the talker's also says how many thinker hidden rows it consumed).")
    print()


def _summary(events: dict[str, dict[str, list[float]]], elapsed: float) -> None:
    """Per conversation and stage: tokens, first and last token's time."""
    print("\nSummary (ms since start):")
    total = 0
    for rid, stages in events.items():
        parts = []
        for stage, (count, first, last) in stages.items():
            total += int(count)
            parts.append(f"{stage} {int(count)} tokens, first at {first:.1f}, done at {last:.1f}")
        print(f"  {rid}: " + "; ".join(parts))
    print(f"{total} tokens from {len(events)} conversations in {elapsed:.2f} s")

async def run_pipeline_demo(args: Any) -> int:
    """A thinker streams tokens and per-step hidden states to a talker that starts once 3
    chunks have arrived; both outputs stream. ``--thinker`` / ``--talker`` name
    checkpoints (default: the built-in tiny, the talker with another seed)."""
    import asyncio
    import time

    from ..config import SamplingParams
    from ..messages import RequestPayload

    pipe = TwoStagePipeline.from_pretrained(
        getattr(args, "thinker", "tiny"), getattr(args, "talker", "tiny"), device=args.device, loop=args.loop,
        shares=(getattr(args, "thinker_share", None), getattr(args, "talker_share", None)), dtype=getattr(args, "dtype", None),
    )
    thinker_stack, _ = pipe.stacks
    tok = thinker_stack.loaded.tokenizer
    bos = thinker_stack.loaded.config.bos_token_id
    prompts = ["Tell me a story about a loop.", "What does the talker say?"]
    # conversation -> stage -> [tokens, first token's ms, last event's ms]
    events: dict[str, dict[str, list[float]]] = {f"conv-{i}": {} for i in range(len(prompts))}
    _legend(args, len(prompts))
    async with pipe:
        start = time.perf_counter()

        async def one(i: int, prompt: str) -> None:
            rid = f"conv-{i}"
            ids = tok.encode(prompt) if tok is not None else [bos or 1, *range(10 + i, 30 + i)]
            first = RequestPayload(rid, ids, SamplingParams(max_new_tokens=THINKER_TOKENS, temperature=0.8, seed=i, ignore_eos=True))
            second = RequestPayload(rid, [], SamplingParams(max_new_tokens=TALKER_TOKENS, temperature=0.8, seed=100 + i, ignore_eos=True))
            handle = await pipe.submit(rid, first, second)
            async for ev in handle:
                t = 1000 * (time.perf_counter() - start)
                seen = events[rid].setdefault(ev.stage, [0, t, t])
                seen[2] = t
                if ev.kind == "stream":
                    seen[0] += len(ev.data.token_ids)
                    rows = getattr(ev.data, "hidden_states", None)
                    note = f" +{int(rows.shape[0])} hidden rows" if rows is not None else ""
                    print(f"{t:7.1f} ms  {rid} {ev.stage:7s} +{ev.data.token_ids}{note}")
                else:
                    consumed = ev.data.extra.get(HIDDEN_ROWS)
                    note = f", consumed {consumed} thinker hidden rows" if consumed is not None else ""
                    print(f"{t:7.1f} ms  {rid} {ev.stage:7s} {ev.kind}: {len(ev.data.output_ids)} tokens{note}")

        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        elapsed = time.perf_counter() - start
    _summary(events, elapsed)
    return 0




def make_talker(
    loop: str, device: str = "cpu", min_chunks: int = TALKER_MIN_CHUNKS, inputs: str = "tokens", conditioning_size: int = 128
) -> AsyncOmniScheduler:
    """A talker stage over the tiny model (seed 1), deferred until ``min_chunks`` thinker
    chunks have arrived. ``inputs="tokens"``: its prompt is those thinker tokens, later
    chunks are collected on its request data; ``"hidden"``: it reads the thinker's hidden
    states (rows of ``conditioning_size``, the tiny thinker's by default), see
    :func:`.colocate.talker_request_builder`."""
    from .colocate import build_talker

    sched, _stack = build_talker(
        "tiny", min_chunks=min_chunks, inputs=inputs, conditioning_size=conditioning_size, device=device, loop=loop, seed=1
    )
    return sched

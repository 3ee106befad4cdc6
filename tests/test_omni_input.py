"""The Omni pipeline's input builder (``speech/omni_input.py``): text rows wanted by many
replies at once come from shared passes, each reply gets its own rows in order, and a pass
that fails fails only the replies that asked in it: later passes go on."""

from __future__ import annotations

import anyio
import pytest
import torch

from omni_async.speech.omni_input import TalkerInput

pytestmark = pytest.mark.anyio


def rows_of(tokens: list[int]) -> torch.Tensor:
    """A row per token: the token's value and its square (so a wrong split shows)."""
    if -1 in tokens:
        raise ValueError("token -1 has no row")
    t = torch.tensor(tokens, dtype=torch.float32)
    return torch.stack((t, t * t), dim=1)


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "thread"])
async def test_rows_wanted_together_come_from_one_pass_each_split_in_order(threaded):
    feed = TalkerInput(torch.device("cpu"), rows_of, threaded=threaded)
    got: dict[int, torch.Tensor] = {}
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(feed.run)

            async def reply(i: int) -> None:
                got[i] = await feed.text_rows([10 * i + j for j in range(i + 1)])

            async with anyio.create_task_group() as replies:
                for i in range(5):
                    replies.start_soon(reply, i)
            tg.cancel_scope.cancel()
    finally:
        feed.close()
    for i in range(5):
        assert got[i].tolist() == rows_of([10 * i + j for j in range(i + 1)]).tolist()
    assert feed.replies_served == 5 and feed.passes < 5


async def test_a_failed_pass_fails_the_replies_in_it_and_later_passes_go_on():
    feed = TalkerInput(torch.device("cpu"), rows_of, threaded=True)
    outcomes: dict[str, object] = {}
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(feed.run)

            async def reply(name: str, tokens: list[int]) -> None:
                try:
                    outcomes[name] = (await feed.text_rows(tokens)).tolist()
                except ValueError as exc:
                    outcomes[name] = exc

            async with anyio.create_task_group() as replies:  # asked together: one pass
                replies.start_soon(reply, "bad", [-1])
                replies.start_soon(reply, "beside", [3])
            await reply("later", [4, 5])
            tg.cancel_scope.cancel()
    finally:
        feed.close()
    assert isinstance(outcomes["bad"], ValueError) and isinstance(outcomes["beside"], ValueError)
    assert outcomes["later"] == [[4.0, 16.0], [5.0, 25.0]]


def prompts_of(items: list[int]) -> list[object]:
    """A 'prompt' per item, its square; a negative item fails alone (its error in its place)."""
    return [ValueError(f"no prompt for {i}") if i < 0 else i * i for i in items]


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "thread"])
async def test_prompts_wanted_together_come_from_one_pass_and_a_bad_one_fails_alone(threaded):
    feed = TalkerInput(torch.device("cpu"), rows_of, threaded=threaded, prompts_of=prompts_of)
    outcomes: dict[int, object] = {}
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(feed.run)

            async def reply(i: int) -> None:
                try:
                    outcomes[i] = await feed.prompt(i)
                except ValueError as exc:
                    outcomes[i] = exc

            async with anyio.create_task_group() as replies:
                for i in (3, -2, 5, 7):
                    replies.start_soon(reply, i)
            tg.cancel_scope.cancel()
    finally:
        feed.close()
    assert outcomes[3] == 9 and outcomes[5] == 25 and outcomes[7] == 49
    assert isinstance(outcomes[-2], ValueError)
    assert feed.prompt_passes == 1 and feed.prompts_built == 4 and feed.passes == 0

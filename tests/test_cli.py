"""The command line, run as real subprocesses (``python -m omni_async.cli``).

All commands are started together once per module (each spends most of its time importing
torch), then each test checks one of them.
"""

from __future__ import annotations

import ast
import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest

from omni_async import Engine, SamplingParams

REPO = Path(__file__).resolve().parents[1]

COMMANDS = {
    "generate": ["generate", "--model", "tiny", "--input-ids", "1,2,3", "--max-new-tokens", "4"],
    "generate-prompt": ["generate", "--model", "tiny", "--prompt", "héllo", "--max-new-tokens", "5"],
    "demo": ["demo", "--requests", "3", "--max-new-tokens", "8"],
    "bad-token-id": ["generate", "--model", "tiny", "--input-ids", "99999"],
    "over-context": ["generate", "--model", "tiny", "--input-ids", ",".join(["1"] * 4097), "--max-new-tokens", "5"],
    "bad-max-new-tokens": ["generate", "--model", "tiny", "--input-ids", "1,2,3", "--max-new-tokens", "0"],
    "bad-model": ["generate", "--model", str(REPO / "no-such-model-folder"), "--input-ids", "1,2,3"],
    "non-int-input-ids": ["generate", "--model", "tiny", "--input-ids", "1,x,3"],
}


@pytest.fixture(scope="module")
def cli_runs() -> dict[str, subprocess.CompletedProcess]:
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "omni_async.cli", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in COMMANDS.items()
    }
    done = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"omni-async {name} timed out:\n{out}\n{err}")
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


def _field(stdout: str, name: str) -> str:
    m = re.search(rf"^{name}: (.*)$", stdout, re.MULTILINE)
    assert m, f"no {name!r} line in:\n{stdout}"
    return m.group(1)


async def _in_process(**kwargs):
    engine = Engine.from_pretrained("tiny", loop="normal")
    async with engine:
        return await engine.generate(**kwargs)


def test_generate_input_ids(cli_runs):
    run = cli_runs["generate"]
    assert run.returncode == 0, run.stderr
    output_ids = ast.literal_eval(_field(run.stdout, "output_ids"))
    finish = _field(run.stdout, "finish_reason")
    expected = asyncio.run(_in_process(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=4)))
    assert output_ids == expected.output_ids
    assert finish == expected.finish_reason
    assert finish == "stop" or len(output_ids) == 4
    assert ast.literal_eval(_field(run.stdout, "text")) == expected.text
    assert "Traceback" not in run.stderr


def test_generate_prompt(cli_runs):
    run = cli_runs["generate-prompt"]
    assert run.returncode == 0, run.stderr
    expected = asyncio.run(_in_process(prompt="héllo", sampling=SamplingParams(max_new_tokens=5)))
    assert ast.literal_eval(_field(run.stdout, "output_ids")) == expected.output_ids
    assert ast.literal_eval(_field(run.stdout, "text")) == expected.text


def test_demo(cli_runs):
    run = cli_runs["demo"]
    assert run.returncode == 0, run.stderr
    m = re.search(
        r"^3 concurrent requests on tiny \(cpu, loop=normal\): (\d+) tokens in ([\d.]+) s = ([\d.]+) tokens/s; "
        r"median time to first token ([\d.]+) ms$",
        run.stdout,
        re.MULTILINE,
    )
    assert m, run.stdout
    total, tps = int(m.group(1)), float(m.group(3))
    assert 3 <= total <= 24 and tps > 0
    # The first two streams are shown (--show 2): each ends exactly once, with at most 8 tokens.
    for i in (0, 1):
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith(f"[req {i}] +")]
        assert 1 <= len(lines) <= 8
        assert sum("<done>" in ln for ln in lines) == 1 and lines[-1].endswith("<done>")
        tokens = [t for ln in lines for t in ast.literal_eval(re.match(r"\[req \d+\] \+(\[[^\]]*\])", ln).group(1))]
        assert all(0 <= t < 320 for t in tokens)
    assert "Traceback" not in run.stderr


# name -> (error type, parts of the message)
BAD = {
    "bad-token-id": ("InvalidRequestError", ["input_ids[0] = 99999", "outside the vocabulary"]),
    "over-context": ("RequestRejectedError", ["prompt has 4097 tokens", "context length is 4096", "over by 2"]),
    "bad-max-new-tokens": ("InvalidRequestError", ["max_new_tokens"]),
    "bad-model": ("ModelLoadError", ["no config.json"]),
    "non-int-input-ids": ("InvalidRequestError", ["input"]),
}
XFAIL: dict[str, str] = {}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=XFAIL[n])) if n in XFAIL else n for n in BAD],
)
def test_bad_input_exits_with_typed_error(cli_runs, name):
    run = cli_runs[name]
    etype, parts = BAD[name]
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert "Traceback" not in run.stderr, run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {etype}: "), run.stderr
    for part in parts:
        assert part in line, line
    assert "output_ids" not in run.stdout

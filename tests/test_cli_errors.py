"""The command line's first minutes: arguments, paths, optional packages and sampling
flags are checked before anything loads, every failure is one line on stderr with exit
status 2 (usage) or 1 (runtime), and the help and the demos say what they show.

Most cases run ``main(argv)`` in process (they end before a model loads); the demos run
as subprocesses, started together once per module.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from omni_async import Engine
from omni_async.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _keep_logging():
    """main() points the root logger at stderr; give the test run its handlers back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if a command gets as far as loading a model."""

    async def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(Engine, "load", refuse)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse: usage errors and --help
        code = exit_.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _usage_error(err: str, command: str) -> str:
    """argparse's answer: the command's usage, then one error line."""
    assert err.startswith(f"usage: omni-async {command}"), err
    return err.strip().splitlines()[-1]


# --- usage errors answered by argparse ------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-3"])
def test_demo_requests_must_be_at_least_one(capsys, value):
    code, _, err = _run(capsys, "demo", "--model", "tiny", "--requests", value)
    assert code == 2
    assert _usage_error(err, "demo") == f"omni-async demo: error: argument --requests: expected an integer >= 1, got '{value}'"


def test_serve_port_abc_names_the_port_not_a_function(capsys):
    code, _, err = _run(capsys, "serve", "--port", "abc")
    assert code == 2
    line = _usage_error(err, "serve")
    assert line == "omni-async serve: error: argument --port: port must be an integer in 1..65535, got 'abc'"


def test_step_timeout_garbage_names_the_values_it_takes(capsys):
    code, _, err = _run(capsys, "generate", "--prompt", "hi", "--step-timeout-s", "soon")
    assert code == 2
    assert "expected seconds, auto or none, got 'soon'" in err and "parse_step_timeout" not in err


def test_a_bad_environment_variable_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setenv("OMNI_ASYNC_PORT", "abc")
    code, _, err = _run(capsys, "serve")
    assert code == 2
    assert _one_error_line(err) == "omni-async: error: OMNI_ASYNC_PORT='abc': port must be an integer in 1..65535, got 'abc'"


@pytest.mark.parametrize("flag", ["--backend", "--kv-capacity-tokens", "--engine-seed"])
def test_pipeline_demo_refuses_flags_it_does_not_use(capsys, flag):
    code, _, err = _run(capsys, "pipeline-demo", flag, "1")
    assert code == 2
    assert _usage_error(err, "pipeline-demo").endswith(f"unrecognized arguments: {flag} 1")


def test_pipeline_demo_model_points_to_thinker_and_talker(capsys):
    code, _, err = _run(capsys, "pipeline-demo", "--model", "/some/folder")
    assert code == 2
    assert _usage_error(err, "pipeline-demo").endswith("takes its checkpoints from --thinker and --talker, not --model")


# --- help -------------------------------------------------------------------------------


def _help(capsys, *argv: str) -> str:
    code, out, _ = _run(capsys, *argv, "--help")
    assert code == 0
    return out


def test_pipeline_demo_help_offers_only_what_it_uses(capsys):
    text = _help(capsys, "pipeline-demo")
    for flag in ("--model", "--backend", "--kv-capacity-tokens", "--engine-seed", "--max-running-requests"):
        assert flag not in text, flag
    for flag in ("--thinker", "--talker", "--thinker-share", "--talker-share", "--device", "--loop", "--dtype", "--log-level"):
        assert flag in text, flag


def test_top_level_help_is_plain_text(capsys):
    text = _help(capsys)
    assert "``" not in text and "`" not in text, text
    for command in ("demo", "generate", "serve", "pipeline-demo"):
        assert command in text


def _flag_help(text: str, flag: str) -> str:
    m = re.search(rf"^  {re.escape(flag)}\b.*?(?=^  -|\Z)", text, re.MULTILINE | re.DOTALL)
    assert m, flag
    return " ".join(m.group(0).split())


def test_dtype_help_says_bfloat16_where_the_cpu_has_it(capsys):
    text = _flag_help(_help(capsys, "generate"), "--dtype")
    assert "float32 on CPU" not in text
    assert "bfloat16" in text and "avx512_bf16" in text and "float32 otherwise" in text


def test_top_p_has_help(capsys):
    text = _flag_help(_help(capsys, "generate"), "--top-p")
    description = text.split("(default", 1)[0].replace("--top-p TOP_P", "")
    assert len(description.split()) >= 5, text


# --- checked before anything loads ------------------------------------------------------


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["generate", "--model", "/nope.gguf", "--prompt", "hi"], "error: ModelLoadError: --model /nope.gguf: no such .gguf file"),
        (["generate", "--model", "/no/such/folder", "--prompt", "hi"], "error: ModelLoadError: --model /no/such/folder: no such folder or .gguf file"),
        (["serve", "--model", str(REPO / "tests")], f"error: ModelLoadError: --model {REPO / 'tests'}: no config.json in that folder"),
        (["pipeline-demo", "--thinker", "/nonexistent"], "error: ModelLoadError: --thinker /nonexistent: no such folder or .gguf file"),
        (["pipeline-demo", "--talker", "/nonexistent.gguf"], "error: ModelLoadError: --talker /nonexistent.gguf: no such .gguf file"),
        (["generate", "--model", "tiny", "--prompt", "hi", "--temperature", "-1"], "error: InvalidRequestError: invalid sampling: temperature must be in [0, 100]"),
        (["demo", "--model", "tiny", "--top-p", "0"], "error: InvalidRequestError: invalid sampling: top_p must be in (0, 1]"),
        (["generate", "--model", "tiny", "--prompt", "hi", "--max-new-tokens", "0"], "error: InvalidRequestError: invalid sampling: max_new_tokens"),
        (["generate", "--model", "tiny", "--prompt", "hi", "--page-size", "0"], "error: ConfigError: page_size must be an integer >= 1"),
        (["generate", "--model", "tiny", "--prompt", "hi", "--device", "tpu"], "error: ConfigError: --device tpu: expected cpu, cuda or cuda:N"),
    ],
)
def test_bad_arguments_fail_in_one_line_before_loading(capsys, no_load, argv, expected):
    code, out, err = _run(capsys, *argv)
    assert code == 2
    line = _one_error_line(err)
    assert line.startswith(expected), line
    assert out == ""


def test_cuda_without_a_cuda_device_fails_before_loading(capsys, no_load):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = _run(capsys, "generate", "--model", "tiny", "--prompt", "hi", "--device", "cuda")
    assert code == 2
    assert _one_error_line(err).startswith("error: ConfigError: --device cuda: this machine has no usable CUDA device")


def test_a_missing_optional_package_fails_before_loading(capsys, no_load):
    from omni_async.backends.sglang import SGLANG_VERSION, sglang_version

    if sglang_version() == SGLANG_VERSION:
        pytest.skip("SGLang is installed here")
    code, _, err = _run(capsys, "generate", "--backend", "sglang", "--model", str(REPO), "--prompt", "hi")
    assert code == 2
    line = _one_error_line(err)
    assert line.startswith(f"error: SGLangUnavailableError: --backend sglang needs SGLang {SGLANG_VERSION}"), line
    assert "scripts/install_sglang.sh" in line


def test_serve_without_its_extra_fails_before_loading(capsys, no_load, monkeypatch):
    """The serve extra, as a machine with the core install alone would lack it."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    code, _, err = _run(capsys, "serve", "--model", "tiny")
    assert code == 2
    assert _one_error_line(err) == (
        "error: ConfigError: omni-async serve needs the serve extra (fastapi not installed): pip install -e '.[serve]' in the checkout, or bash scripts/setup.sh"
    )


def test_a_fault_while_running_is_one_line_with_status_1(capsys, monkeypatch):
    async def broken(*args, **kwargs):
        raise RuntimeError("disk on fire\nsecond line")

    monkeypatch.setattr(Engine, "load", broken)
    code, _, err = _run(capsys, "generate", "--model", "tiny", "--prompt", "hi")
    assert code == 1
    lines = err.strip().splitlines()
    assert lines == ["error: RuntimeError: disk on fire second line", "(run with --log-level DEBUG for the traceback)"], err


# --- the demos say what they show --------------------------------------------------------

DEMOS = {
    "demo-tiny": ["demo", "--model", "tiny", "--requests", "8", "--max-new-tokens", "3"],
    "pipeline-demo": ["pipeline-demo"],
}


@pytest.fixture(scope="module")
def demo_runs() -> dict[str, subprocess.CompletedProcess]:
    procs = {
        name: subprocess.Popen([sys.executable, "-m", "omni_async.cli", *argv], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, argv in DEMOS.items()
    }
    done = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


def test_tiny_banner_points_to_a_real_model(demo_runs):
    run = demo_runs["demo-tiny"]
    assert run.returncode == 0, run.stderr
    banner = run.stdout.splitlines()[0]
    assert "RANDOM weights" in banner and "Leave --model out (smollm2)" in banner, banner
    assert "checkpoint folder>" not in banner


def test_demo_prints_every_answer(demo_runs):
    run = demo_runs["demo-tiny"]
    completed = run.stdout.split("Completed text:", 1)[1]
    shown = re.findall(r"^  \[req (\d+)\] .+ -> .+$", completed, re.MULTILINE)
    assert shown == [str(i) for i in range(8)], run.stdout


def test_pipeline_demo_has_a_legend_and_a_summary(demo_runs):
    run = demo_runs["pipeline-demo"]
    assert run.returncode == 0, run.stderr
    head, _, rest = run.stdout.partition("\n\n")
    assert head.startswith("2 conversations, each a thinker (tiny)") and "Each line:" in head, run.stdout
    assert "random weights" in head
    body, _, summary = rest.partition("Summary (ms since start):")
    assert all(re.match(r"^ *[\d.]+ ms  conv-\d (thinker|talker) ", ln) for ln in body.strip().splitlines()), body
    for conv in ("conv-0", "conv-1"):
        assert re.search(rf"^  {conv}: thinker 24 tokens, first at [\d.]+, done at [\d.]+; talker 16 tokens", summary, re.MULTILINE), summary
    assert re.search(r"^80 tokens from 2 conversations in [\d.]+ s$", summary, re.MULTILINE), summary

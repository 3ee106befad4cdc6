"""What the command line answers a person who mistypes: a misspelt flag named as such
with the closest one, two-line usage errors, a --max-new-tokens the context cannot hold
refused rather than shortened, every command in --help; and --help and the pytest plugin
answer without importing torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest

from omni_async import Engine, SamplingParams
from omni_async.cli import main
from omni_async.errors import LengthLimitWarning

COMMANDS = ("demo", "generate", "serve", "serve-ray", "pipeline-demo")


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def test_a_misspelt_flag_is_unknown_with_a_suggestion(capsys):
    code, _, err = _run(capsys, "generate", "--promt", "hello")
    assert code == 2
    assert "unrecognized arguments: --promt hello (did you mean --prompt?)" in err
    assert "is required" not in err


def test_usage_errors_are_two_lines(capsys):
    for argv in (["serve", "--bogus"], ["serve", "--port", "abc"], ["generate"], ["demo", "--requests", "0"]):
        code, _, err = _run(capsys, *argv)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 2, (argv, err)
        assert lines[0].startswith(f"usage: omni-async {argv[0]}") and "--help" in lines[0]
        assert lines[1].startswith(f"omni-async {argv[0]}: error: ")


def test_generate_needs_one_input(capsys):
    code, _, err = _run(capsys, "generate", "--model", "tiny")
    assert code == 2 and "one of --prompt, --messages or --input-ids is required" in err


def test_an_unrelated_flag_gets_no_suggestion(capsys):
    _, _, err = _run(capsys, "serve", "--bogus")
    assert err.strip().endswith("unrecognized arguments: --bogus")


def test_help_describes_every_command(capsys):
    """Every command the parser takes (its usage's choices) is named in the description."""
    import re

    code, out, _ = _run(capsys, "--help")
    assert code == 0
    choices = re.search(r"\{([a-z,-]+)\}", out).group(1).split(",")
    assert set(COMMANDS) <= set(choices)
    description = " ".join(out.split("\n\n", 1)[1].split())
    for command in choices:
        assert re.search(rf"\b{re.escape(command)} \(", description), command


@pytest.mark.parametrize("command", ["generate", "demo"])
def test_max_new_tokens_past_the_context_is_refused(capsys, command):
    extra = ["--prompt", "hello"] if command == "generate" else ["--requests", "2"]
    code, out, err = _run(capsys, command, "--model", "tiny", "--max-new-tokens", "1000000", *extra)
    assert code == 2, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: RequestRejectedError: --max-new-tokens 1000000: this model's maximum context length is")
    assert "lower --max-new-tokens" in line


async def test_the_python_api_warns_when_it_shortens_max_new_tokens():
    async with await Engine.load("tiny", kv_capacity_tokens=8192, context_length=64) as engine:
        with pytest.warns(LengthLimitWarning, match="maximum context length is 64 tokens; the prompt has 4") as caught:
            result = await engine.generate(input_ids=[1, 2, 3, 4], sampling=SamplingParams(max_new_tokens=10**9, ignore_eos=True))
        assert caught[0].message.served == 60 and len(result.output_ids) == 60
        with warnings.catch_warnings():
            warnings.simplefilter("error", LengthLimitWarning)  # one that fits says nothing
            await engine.generate(input_ids=[1, 2, 3, 4], sampling=SamplingParams(max_new_tokens=60, ignore_eos=True))


PROBE = textwrap.dedent(
    """
    import sys
    {code}
    print("torch" in sys.modules)
    """
)


def _imports_torch(code: str) -> bool:
    out = subprocess.run([sys.executable, "-c", PROBE.format(code=code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1] == "True"


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["speak", "--help"], ["generate", "--promt", "x"]])
def test_help_and_usage_errors_do_not_import_torch(argv):
    assert not _imports_torch(f"from omni_async.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass")


def test_the_pytest_plugin_does_not_import_torch():
    assert not _imports_torch("import omni_async, omni_async.testing")
    assert _imports_torch("from omni_async import Engine")  # the probe can see an import

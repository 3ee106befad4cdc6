"""Command-line usage, in process (argparse answers before any model loads): flag
descriptions and choices in --help, usage errors with the command's own usage."""

from __future__ import annotations

import dataclasses
import re

import pytest

from omni_async import SchedulerConfig
from omni_async.cli import main

CHOICES = {
    "--quantization": "{q4,q8,int8,none}",
    "--event-wait": "{auto,poll,thread}",
    "--step-launch": "{auto,thread,inline}",
    "--dtype": "{float32,bfloat16,float16}",
    "--backend": "{native,sglang}",
}


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


@pytest.fixture
def serve_help(capsys) -> str:
    code, out, _ = _run(capsys, "serve", "--help")
    assert code == 0
    return out


def _flag_help(text: str, flag: str) -> str:
    """The help text of one flag: from its line to the next flag's."""
    m = re.search(rf"^  {re.escape(flag)}\b.*?(?=^  -|\Z)", text, re.MULTILINE | re.DOTALL)
    assert m, flag
    return " ".join(m.group(0).split())


def test_every_engine_limit_flag_has_a_description(serve_help):
    for f in dataclasses.fields(SchedulerConfig):
        if f.name == "loop":
            continue
        flag = "--" + f.name.replace("_", "-")
        text = _flag_help(serve_help, flag)
        description = text.split("[env", 1)[0]
        # past the flag and its metavar, words of its own
        words = [w for w in re.sub(r"\{[^}]*\}", "", description).split() if not w.startswith("-") and not w.isupper()]
        assert len(words) >= 3, (flag, text)


def test_choice_flags_show_their_choices(serve_help):
    for flag, shown in CHOICES.items():
        assert shown in _flag_help(serve_help, flag), flag


def test_model_help_names_smollm2_and_gguf(serve_help):
    text = _flag_help(serve_help, "--model")
    assert "smollm2" in text and ".gguf" in text


def test_an_unknown_flag_prints_the_commands_usage(capsys):
    code, _, err = _run(capsys, "serve", "--bogus")
    assert code == 2
    assert err.startswith("usage: omni-async serve") and "unrecognized arguments: --bogus" in err


@pytest.mark.parametrize("port", ["70000", "0", "-1"])
def test_a_port_out_of_range_is_a_usage_error(capsys, port):
    code, _, err = _run(capsys, "serve", "--port", port)
    assert code == 2 and "usage: omni-async serve" in err and "port must be in 1..65535" in err


def test_step_timeout_takes_auto_none_or_seconds():
    from omni_async.cli import build_parser
    from omni_async.cli_options import engine_limits

    parser = build_parser()
    assert "step_timeout_s" not in engine_limits(parser.parse_args(["generate", "--input-ids", "1"]))
    for text, value in (("none", None), ("2.5", 2.5), ("auto", "auto")):
        args = parser.parse_args(["generate", "--input-ids", "1", "--step-timeout-s", text])
        assert args.step_timeout_s == value
    assert SchedulerConfig(step_timeout_s=2.5).step_timeout_s == 2.5

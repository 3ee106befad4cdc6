"""Every command of ``omni-async`` is named by ``--help`` and by docs/command-line.md, so a
command added later cannot go unmentioned (both once said four commands of five)."""

from __future__ import annotations

import re
from pathlib import Path

from omni_async.cli import build_parser

DOC = Path(__file__).resolve().parents[1] / "docs" / "command-line.md"
NUMBERS = {4: "four", 5: "five", 6: "six", 7: "seven"}


def _commands() -> list[str]:
    """The commands as the usage line lists them: ``{demo,generate,...}``."""
    return re.search(r"\{([a-z,-]+)\}", build_parser().format_usage()).group(1).split(",")


def test_help_and_the_docs_name_every_command():
    commands = _commands()
    assert {"demo", "generate", "serve", "serve-ray", "pipeline-demo"} <= set(commands)
    text = build_parser().description  # what --help says of the commands (its usage line lists their names only)
    doc = DOC.read_text()
    for command in commands:
        assert re.search(rf"\b{re.escape(command)}\b(?!-)", text), f"--help does not name {command}"
        assert f"`omni-async {command}" in doc, f"docs/command-line.md does not describe {command}"
    assert f"has {NUMBERS[len(commands)]} commands" in doc

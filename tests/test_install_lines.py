"""Every install line the docs and the package's messages give works on a fresh clone:
omni-async is not on the package index, so a line installs the checkout (``pip install -e
'.[extra]'``) or runs a setup script, and every extra it names is one pyproject declares."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
SCRIPTS = {p.name for p in (ROOT / "scripts").glob("*.sh")}


def _sources() -> list[Path]:
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "omni_async").rglob("*.py"), *(ROOT / "scripts").glob("*.sh")]
    return [f for f in files if f.is_file()]


def _install_lines() -> list[tuple[str, str]]:
    out = []
    for path in _sources():
        for line in path.read_text(encoding="utf-8").splitlines():
            if "pip install" in line or "setup.sh" in line or "install_" in line:
                out.append((str(path.relative_to(ROOT)), line))
    return out


def test_the_scan_finds_the_install_lines():
    files = {f for f, _ in _install_lines()}
    assert {"README.md", "docs/serving.md", "omni_async/cli_options.py"} <= files


def test_no_line_installs_omni_async_from_the_index():
    bad = [(f, line) for f, line in _install_lines() if re.search(r"pip install\s+['\"]?omni-async\b", line)]
    assert not bad, bad


def test_every_extra_named_exists():
    for f, line in _install_lines():
        for group in re.findall(r"-e\s+['\"]?\.\[([^\]]+)\]", line):
            for extra in group.split(","):
                assert extra.strip() in EXTRAS, (f, line)


def test_every_script_named_exists():
    for f, line in _install_lines():
        for name in re.findall(r"scripts/([\w.-]+\.sh)", line):
            assert name in SCRIPTS, (f, line)

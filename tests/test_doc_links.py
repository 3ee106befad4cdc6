"""The docs' links lead somewhere: every relative link in README.md and docs/ names a
file that exists (and a heading of it, when it names one); and docs/testing.md's
configuration for pytest-asyncio's auto mode runs an async test without a warning."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*)$", re.MULTILINE)


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_relative_link_resolves():
    broken = []
    for page in _pages():
        text = re.sub(r"```.*?```|`[^`\n]*`", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)  # code is not a link
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target):
                continue  # http:, https:, mailto:
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in {_slug(h) for h in HEADING.findall(file.read_text(encoding="utf-8"))}:
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_the_link_check_sees_links():
    assert len(LINK.findall((ROOT / "README.md").read_text())) >= 10


def test_the_auto_mode_configuration_runs_without_warnings(tmp_path):
    text = (ROOT / "docs" / "testing.md").read_text()
    toml = re.search(r"```toml\n(.*?)```", text, re.DOTALL).group(1)
    assert 'asyncio_mode = "auto"' in toml
    (tmp_path / "pyproject.toml").write_text(toml)
    (tmp_path / "test_app.py").write_text("async def test_async_without_a_mark():\n    assert True\n")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error::pytest.PytestDeprecationWarning", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout and "warning" not in out.stdout.lower(), out.stdout

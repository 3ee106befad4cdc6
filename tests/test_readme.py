"""Every code block of README.md runs, so none goes stale.

A block runs unless the line above its fence is ``<!-- readme-test: skip (why) -->``
(set-up, installs, GPU-only or long-running commands). ``python`` blocks run as scripts
in a subprocess; ``bash`` blocks run line by line, with ``.venv/bin/python`` and
``.venv/bin/omni-async`` meaning this test run's interpreter and the checkout's package.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SKIP = re.compile(r"^<!-- readme-test: skip \((?P<why>[^)]+)\) -->$")
FENCE = re.compile(r"^```(?P<lang>\w*)$")
TEST_COMMAND = ".venv/bin/python -m pytest -q -p no:cacheprovider"


@dataclass
class Block:
    lang: str
    line: int  # of the opening fence, 1-based
    code: str
    skip: str | None  # why it does not run


def blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group("lang"):
            i += 1
            continue
        start = i
        i += 1
        while not lines[i].startswith("```"):
            i += 1
        marker = SKIP.match(lines[start - 1]) if start else None
        found.append(Block(m.group("lang"), start + 1, "\n".join(lines[start + 1 : i]) + "\n", marker and marker.group("why")))
        i += 1
    return found


BLOCKS = blocks(README.read_text())


def _cases(lang: str) -> list:
    return [
        pytest.param(b, id=f"README.md:{b.line}", marks=[pytest.mark.skip(reason=b.skip)] if b.skip else [])
        for b in BLOCKS
        if b.lang == lang
    ]


def test_the_readme_has_runnable_blocks_and_every_skip_says_why():
    assert {b.lang for b in BLOCKS} <= {"python", "bash"}, "a block in another language: teach this test to run it"
    assert sum(1 for b in BLOCKS if b.lang == "python" and not b.skip) >= 1
    assert sum(1 for b in BLOCKS if b.lang == "bash" and not b.skip) >= 1
    for b in BLOCKS:
        assert b.skip is None or len(b.skip.split()) >= 2, b


def test_the_readme_gives_the_test_command_ci_runs():
    """.ci/run runs the README's test command after the README's set-up command."""
    text = README.read_text()
    assert f"bash scripts/setup.sh && {TEST_COMMAND}" in text
    assert "bash scripts/setup.sh && .venv/bin/omni-async demo" in text
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert "bash scripts/setup.sh" in ci and TEST_COMMAND in ci


@pytest.fixture(scope="module")
def python_runs(tmp_path_factory) -> dict[int, subprocess.CompletedProcess]:
    """Every python block that runs, started together (each spends most of its time
    importing torch)."""
    folder = tmp_path_factory.mktemp("readme")
    procs = {}
    for b in BLOCKS:
        if b.lang == "python" and not b.skip:
            script = folder / f"readme_{b.line}.py"
            script.write_text(b.code)
            procs[b.line] = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True, env=_env())
    done = {}
    for line, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        done[line] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


@pytest.mark.parametrize("block", _cases("python"))
def test_python_block_runs(block, python_runs):
    run = python_runs[block.line]
    assert run.returncode == 0, f"README.md:{block.line}\n{run.stdout}\n{run.stderr}"
    assert "Traceback" not in run.stderr


def _env() -> dict[str, str]:
    """Run against this checkout's package, whatever is installed."""
    import os

    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def _command(line: str) -> list[str]:
    argv = shlex.split(line, comments=True)
    if argv[:1] == [".venv/bin/omni-async"]:
        return [sys.executable, "-m", "omni_async.cli", *argv[1:]]
    if argv[:1] == [".venv/bin/python"]:
        return [sys.executable, *argv[1:]]
    pytest.fail(f"README bash line not understood by this test (mark its block skip, or teach the test): {line!r}")


@pytest.mark.parametrize("block", _cases("bash"))
def test_bash_block_runs(block):
    for line in block.code.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        run = subprocess.run(_command(line), cwd=REPO, capture_output=True, text=True, timeout=600, env=_env())
        assert run.returncode == 0, f"README.md:{block.line}: {line}\n{run.stdout}\n{run.stderr}"
        assert "Traceback" not in run.stderr and run.stdout.strip(), line


def test_the_tour_prints_each_delta_on_a_line_of_its_own(python_runs):
    """The tour's prints are readable: one line per delta, the last one finished."""
    tour = next(b for b in BLOCKS if b.lang == "python" and not b.skip and "async for delta" in b.code)
    run = python_runs[tour.line]
    deltas = [ln for ln in run.stdout.splitlines() if re.match(r"^\[[\d, ]*\] ('.*'|\".*\"|None) (True|False)$", ln)]
    assert deltas and deltas[-1].endswith(" True"), run.stdout
    assert sum(ln.endswith(" True") for ln in deltas) == 1, run.stdout


def test_the_plugin_recipes_of_docs_testing_run_in_strict_mode(tmp_path):
    """docs/testing.md's examples, as an application's test folder would hold them, pass
    under pytest-asyncio's strict mode (its default)."""
    docs = [b for b in blocks((REPO / "docs" / "testing.md").read_text()) if b.lang == "python"]
    recipe = next(b.code for b in docs if "# conftest.py" in b.code)
    conftest, test_app = recipe.split("# test_app.py", 1)
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "test_app.py").write_text(test_app)
    (tmp_path / "test_marked.py").write_text(next(b.code for b in docs if "@pytest.mark.asyncio" in b.code))
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_mode = strict\nasyncio_default_fixture_loop_scope = function\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600, env=_env())
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout + run.stderr


def _architecture_tree() -> dict[str, set[str]]:
    """docs/ARCHITECTURE.md's tree: folder ("" for the package root) -> the module names it
    lists (words before the first colon or parenthesis of each entry)."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    tree = text.split("```\nomni_async/\n", 1)[1].split("```", 1)[0]
    listed: dict[str, set[str]] = {}
    folder = ""
    for line in tree.splitlines():
        m = re.match(r"^  (\w+)/\s+(.*)$", line)
        if m:
            folder, rest = m.group(1), m.group(2)
        elif re.match(r"^  \S", line):  # the root's lines
            folder, rest = "", line
        else:
            rest = line
        words = re.sub(r"\([^)]*\)", " ", rest.split(":", 1)[0] if folder else rest)
        listed.setdefault(folder, set()).update(re.findall(r"\b[a-z_][a-z0-9_]*\b", words))
    return listed


def test_the_architecture_tree_names_every_module():
    package = REPO / "omni_async"
    listed = _architecture_tree()
    for folder in [""] + sorted(p.name for p in package.iterdir() if p.is_dir() and p.name != "__pycache__"):
        modules = {p.stem for p in (package / folder).glob("*.py")} - {"__init__"}
        modules |= {p.name for p in (package / folder).iterdir() if p.is_dir() and p.name != "__pycache__"} if folder else set()
        missing = modules - listed.get(folder, set())
        if folder == "":
            missing -= set(listed)  # sub-packages are listed by their own lines
        assert not missing, f"docs/ARCHITECTURE.md's tree does not name omni_async/{folder + '/' if folder else ''}{sorted(missing)}"

"""The layer contract, checked on the source: which module may import which, and no
import cycle between modules at import time. Run by the main test command."""

from __future__ import annotations

import ast
from pathlib import Path

import omni_async

ROOT = Path(omni_async.__file__).parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, *, module_level_only: bool) -> set[str]:
    """Absolute names imported by a module, ``if TYPE_CHECKING:`` blocks left out (they
    never run). ``module_level_only`` also skips imports inside functions (they do not run
    at import time)."""
    tree = ast.parse(path.read_text())
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(nodes, top: bool) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if not module_level_only:
                    visit(node.body, False)
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse, top)  # the body never runs: annotations only
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                found.add(mod)
                for a in node.names:
                    found.add(f"{mod}.{a.name}")
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    visit(inner, top)

    visit(tree.body, True)
    return found


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        if "shims" in path.parts:
            continue
        yield _module_name(path), path


def _violations(prefix: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for name, path in _modules():
        if name == prefix or name.startswith(prefix + "."):
            for imp in _imports(path, module_level_only=False):
                if any(imp == f or imp.startswith(f + ".") for f in forbidden):
                    bad.append(f"{name} imports {imp}")
    return bad


P = "omni_async."
# Import directions that must never exist: (importer prefix, forbidden prefixes). Every
# import counts, deferred ones inside functions too; only ``if TYPE_CHECKING:`` blocks are
# exempt (they never run).
FORBIDDEN: list[tuple[str, tuple[str, ...]]] = [
    ("omni_async.core", ("torch", "anyio", "asyncio", P + "stage", P + "scheduler", P + "loops", P + "runners",
                         P + "backends", P + "engine", P + "client")),
    ("omni_async.stage", (P + "runners", P + "models", P + "kv", P + "kernels", P + "backends", P + "engine",
                          P + "server", P + "client")),
    ("omni_async.scheduler", (P + "runners", P + "models", P + "kv", P + "kernels", P + "backends", P + "engine",
                              P + "server", P + "client")),
    ("omni_async.runners", (P + "stage", P + "scheduler", P + "loops", P + "engine", P + "server", P + "backends")),
    ("omni_async.models", (P + "stage", P + "scheduler", P + "loops", P + "engine", P + "server", P + "backends")),
    ("omni_async.kv", (P + "stage", P + "scheduler", P + "loops", P + "engine", P + "server", P + "backends", P + "models")),
    ("omni_async.kernels", (P + "stage", P + "scheduler", P + "loops", P + "engine", P + "server", P + "backends",
                            P + "models", P + "runners")),
    ("omni_async.backends.native", (P + "backends.sglang",)),
    ("omni_async.backends.sglang", (P + "backends.native",)),
    ("omni_async.backends", (P + "engine", P + "client")),
    ("omni_async.client", (P + "stage", P + "core", P + "runners", P + "backends", P + "engine")),
    ("omni_async.text", (P + "stage", P + "core", P + "runners", P + "backends", P + "models", P + "engine",
                         P + "client", "asyncio", "anyio")),
]


def _graph(module_level_only: bool) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (a module's own ancestors left out:
    importing ``omni_async.x`` runs ``omni_async/__init__`` by Python's rules, not by choice)."""
    names = dict(_modules())
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        deps = set()
        for imp in _imports(path, module_level_only=module_level_only):
            while imp and imp not in names:
                imp = imp.rpartition(".")[0]
            if imp and imp != name and not name.startswith(imp + "."):
                deps.add(imp)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    seen: dict[str, int] = {}
    cycles: list[list[str]] = []

    def walk(node: str, stack: list[str]) -> None:
        seen[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if seen.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in seen:
                walk(dep, stack)
        stack.pop()
        seen[node] = 2

    for node in sorted(graph):
        if node not in seen:
            walk(node, [])
    return cycles


def test_no_forbidden_import_direction():
    bad = []
    for prefix, forbidden in FORBIDDEN:
        bad += _violations(prefix, forbidden)
    assert bad == []


def test_the_stage_imports_only_the_stage_internals_of_the_core_and_its_own():
    """The client and the text layer reach the stage through the scheduler's public
    surface (messages, config, errors), never its internals."""
    assert _violations("omni_async.client", (P + "stage", P + "scheduler")) == []


def test_loops_talk_to_the_stepper_only():
    bad = []
    for name, path in _modules():
        if name.startswith("omni_async.loops."):
            for imp in _imports(path, module_level_only=False):
                if imp.startswith("omni_async.") and not imp.startswith(("omni_async.stage.stepper", "omni_async.loops")):
                    bad.append(f"{name} imports {imp}")
    assert bad == []


def test_no_import_cycle_at_all():
    """Deferred imports count: a cycle hidden in a function is still a cycle."""
    assert _cycles(_graph(module_level_only=False)) == []


def test_few_modules_at_the_package_root():
    loose = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(loose) <= 14, loose


def test_the_checks_see_a_planted_violation(tmp_path):
    """The checker itself: an import planted in a copy of a core module is reported, and a
    deferred import back into its importer is reported as a cycle."""
    core_module = ROOT / "core" / "request.py"
    planted = ast.parse(core_module.read_text() + "\ndef _f():\n    import torch\n")
    found = set()
    for node in ast.walk(planted):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    assert "torch" in found
    graph = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert _cycles(graph) == [["a", "b", "a"]]


def test_modules_stay_small():
    """Outside kernels and backends, no module is much longer than 400 lines."""
    long = [f"{name}: {len(path.read_text().splitlines())}" for name, path in _modules()
            if ".kernels" not in name and ".backends" not in name and len(path.read_text().splitlines()) > 420]
    assert long == []

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
    """Absolute names imported by a module. ``module_level_only`` skips imports inside
    functions and ``if TYPE_CHECKING:`` blocks (they do not run at import time)."""
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
                if not module_level_only:
                    visit(node.body, False)
                visit(node.orelse, top)
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


def test_the_batch_core_imports_neither_asyncio_nor_torch():
    assert _violations("omni_async.core", ("asyncio", "anyio", "torch", "omni_async.stage", "omni_async.scheduler")) == []


def test_the_stage_imports_no_backend_and_no_engine():
    forbidden = ("omni_async.backends", "omni_async.engine")
    assert _violations("omni_async.stage", forbidden) + _violations("omni_async.scheduler", forbidden) == []


def test_backends_never_import_the_engine():
    assert _violations("omni_async.backends", ("omni_async.engine", "omni_async.handle")) == []


def test_loops_talk_to_the_stepper_only():
    bad = []
    for name, path in _modules():
        if name.startswith("omni_async.loops."):
            for imp in _imports(path, module_level_only=False):
                if imp.startswith("omni_async.") and not imp.startswith(("omni_async.stage.stepper", "omni_async.loops")):
                    bad.append(f"{name} imports {imp}")
    assert bad == []


def test_no_import_cycle_between_modules():
    names = dict(_modules())
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        deps = set()
        for imp in _imports(path, module_level_only=True):
            while imp and imp not in names:
                imp = imp.rpartition(".")[0]
            if imp and imp != name and not name.startswith(imp + "."):
                deps.add(imp)
        graph[name] = deps
    seen: dict[str, int] = {}
    cycles: list[list[str]] = []

    def walk(node: str, stack: list[str]) -> None:
        seen[node] = 1
        stack.append(node)
        for dep in graph.get(node, ()):
            if seen.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in seen:
                walk(dep, stack)
        stack.pop()
        seen[node] = 2

    for node in graph:
        if node not in seen:
            walk(node, [])
    assert cycles == []


def test_modules_stay_small():
    """Outside kernels and backends, no module is much longer than 400 lines."""
    long = [f"{name}: {len(path.read_text().splitlines())}" for name, path in _modules()
            if ".kernels" not in name and ".backends" not in name and len(path.read_text().splitlines()) > 420]
    assert long == []

"""The layer contract, checked on the source: which module may import which, and no
import cycle between modules at import time. Run by the main test command."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import omni_async

ROOT = Path(omni_async.__file__).parent


def _module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules(root: Path = ROOT) -> dict[str, Path]:
    return {_module_name(path, root): path for path in sorted(root.rglob("*.py")) if "shims" not in path.parts}


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``, exactly (not ``not TYPE_CHECKING``)."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _dynamic_import(node: ast.AST) -> str | None:
    """The module a ``importlib.import_module("x")`` / ``__import__("x")`` call names."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return None
    fn = node.func
    named = (isinstance(fn, ast.Name) and fn.id in ("__import__", "import_module")) or (
        isinstance(fn, ast.Attribute) and fn.attr == "import_module"
    )
    value = node.args[0].value
    return value if named and isinstance(value, str) and not value.startswith(".") else None


class _Imports:
    """Absolute names the modules under ``root`` import, names taken from a package
    resolved to the module that defines them (``from omni_async import Engine`` is an
    import of ``omni_async.engine``)."""

    def __init__(self, root: Path = ROOT) -> None:
        self.root = root
        self.names = _modules(root)
        self._exports: dict[str, dict[str, tuple[str, str]]] = {}
        self._seen: dict[tuple[Path, bool, bool], list[tuple[str, list[str]]]] = {}

    def _raw(self, path: Path, *, module_level_only: bool, type_level: bool = False) -> list[tuple[str, list[str]]]:
        """``(module, imported names)`` per import statement that can run: ``if
        TYPE_CHECKING:`` bodies left out (their ``else`` kept, ``if not TYPE_CHECKING:``
        bodies kept) unless ``type_level`` (a reader follows those imports too); every
        other statement visited, ``match`` arms, ``try``, ``with`` and class bodies
        included; functions too unless ``module_level_only``."""
        key = (path, module_level_only, type_level)
        if key in self._seen:
            return self._seen[key]
        tree = ast.parse(path.read_text())
        name = _module_name(path, self.root)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: list[tuple[str, list[str]]] = []

        def visit(node: ast.AST) -> None:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and module_level_only:
                return
            if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_level:
                for child in node.orelse:  # the body never runs: annotations only
                    visit(child)
                return
            if isinstance(node, ast.Import):
                found.extend((a.name, []) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                found.append((mod, [a.name for a in node.names]))
            else:
                dynamic = _dynamic_import(node)
                if dynamic is not None:
                    found.append((dynamic, []))
            for child in ast.iter_child_nodes(node):
                visit(child)

        visit(tree)
        self._seen[key] = found
        return found

    def _exports_of(self, package: str) -> dict[str, tuple[str, str]]:
        """What a package's ``__init__`` imports and so re-exports: name -> (module, name)."""
        if package not in self._exports:
            self._exports[package] = {}
            path = self.names.get(package)
            if path is not None and path.name == "__init__.py":
                for mod, names in self._raw(path, module_level_only=True):
                    for n in names:
                        self._exports[package][n] = (mod, n)
        return self._exports[package]

    def _resolve(self, mod: str, name: str, depth: int = 0) -> str:
        """The module that ``from mod import name`` runs: a submodule, the module a
        package re-exports the name from, or ``mod`` itself."""
        if f"{mod}.{name}" in self.names:
            return f"{mod}.{name}"
        source = self._exports_of(mod).get(name)
        if source is not None and depth < 10 and source[0] != mod:
            return self._resolve(*source, depth=depth + 1) if source[0] in self.names else source[0]
        return mod

    def of(self, path: Path, *, module_level_only: bool, type_level: bool = False) -> set[str]:
        found: set[str] = set()
        for mod, names in self._raw(path, module_level_only=module_level_only, type_level=type_level):
            if not names or mod not in self.names:
                found.add(mod)
                found.update(f"{mod}.{n}" for n in names)
                continue
            for n in names:
                target = self._resolve(mod, n)
                found.add(target)
                found.add(f"{target}.{n}" if target != f"{mod}.{n}" else target)
        return found


_DEFAULT = _Imports()


def _imports(path: Path, *, module_level_only: bool, checker: _Imports = _DEFAULT, type_level: bool = False) -> set[str]:
    return checker.of(path, module_level_only=module_level_only, type_level=type_level)


def _violations(prefix: str, forbidden: tuple[str, ...], checker: _Imports = _DEFAULT) -> list[str]:
    bad = []
    for name, path in checker.names.items():
        if name == prefix or name.startswith(prefix + "."):
            for imp in _imports(path, module_level_only=False, checker=checker):
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


# Speech (a pipeline of stages over the native backend) sits above every layer it uses:
# nothing below it imports it; the server and the command line may.
_BELOW_SPEECH = ("core", "stage", "scheduler", "loops", "runners", "models", "kv", "kernels", "backends", "client", "text",
                 "structured", "engine", "pipeline")
FORBIDDEN = [(prefix, banned + ((P + "speech",) if prefix.removeprefix(P).split(".")[0] in _BELOW_SPEECH else ()))
             for prefix, banned in FORBIDDEN]
FORBIDDEN += [(P + layer, (P + "speech",)) for layer in _BELOW_SPEECH if P + layer not in dict(FORBIDDEN)]


def _graph(module_level_only: bool, checker: _Imports = _DEFAULT, type_level: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (``type_level``: the ``if
    TYPE_CHECKING:`` imports too). A package's ``__init__`` counts like any module: a
    submodule that takes a name defined there depends on it."""
    names = checker.names
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        deps = set()
        for imp in _imports(path, module_level_only=module_level_only, checker=checker, type_level=type_level):
            while imp and imp not in names:
                imp = imp.rpartition(".")[0]
            if imp and imp != name:
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
    for name, path in _modules().items():
        if name.startswith("omni_async.loops."):
            for imp in _imports(path, module_level_only=False):
                if imp.startswith("omni_async.") and not imp.startswith(("omni_async.stage.stepper", "omni_async.loops")):
                    bad.append(f"{name} imports {imp}")
    assert bad == []


def test_no_import_cycle_at_all():
    """Deferred imports count: a cycle hidden in a function is still a cycle."""
    assert _cycles(_graph(module_level_only=False)) == []


def test_no_file_circle_type_level_imports_included():
    """A reader follows every import, the ``if TYPE_CHECKING:`` ones too: no module may
    reach itself through them (shared names go where both sides read them)."""
    assert _cycles(_graph(module_level_only=False, type_level=True)) == []


def test_few_modules_at_the_package_root():
    loose = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(loose) <= 14, loose


# A package with one planted violation of each kind the checker must see, and the
# imports it must not count. Module -> source.
_PLANTED = {
    "__init__.py": "from .engine import Engine\nfrom . import core\n",
    "engine.py": "class Engine: ...\n",
    "core/__init__.py": "",
    "core/deferred.py": "def f():\n    import torch\n",
    "core/through_root.py": "def f():\n    from omni_async import Engine\n",
    "core/not_type_checking.py": "from typing import TYPE_CHECKING\nif not TYPE_CHECKING:\n    import anyio\n",
    "core/type_checking_else.py": "import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    import asyncio\n",
    "core/match_arm.py": "def f(x):\n    match x:\n        case 1:\n            from omni_async.stage import intake\n",
    "core/dynamic.py": "import importlib\ndef f():\n    return importlib.import_module('omni_async.runners.native')\n",
    "core/annotations_only.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
    "stage/__init__.py": "LIMIT = 3\ndef f():\n    from .intake import g\n",
    "stage/intake.py": "from . import LIMIT\ndef g(): ...\n",
    "runners/__init__.py": "",
    "runners/native.py": "",
    # a circle only a reader sees: each names the other under TYPE_CHECKING
    "kv/__init__.py": "",
    "kv/pages.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .table import Table\n",
    "kv/table.py": "import typing\nif typing.TYPE_CHECKING:\n    from omni_async.kv.pages import Page\nclass Table: ...\n",
}


def _planted(tmp_path: Path) -> _Imports:
    root = tmp_path / "omni_async"
    for rel, text in _PLANTED.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return _Imports(root)


def test_the_checker_sees_a_planted_violation_of_each_kind(tmp_path):
    """The checker itself, run on a package with violations planted: each is reported
    (a broken checker fails here, not silently on the real package)."""
    checker = _planted(tmp_path)
    core_rule = dict(FORBIDDEN)["omni_async.core"]
    bad = {line.split(" imports ")[0] for line in _violations("omni_async.core", core_rule, checker)}
    assert bad == {f"omni_async.core.{m}" for m in (
        "deferred", "through_root", "not_type_checking", "type_checking_else", "match_arm", "dynamic")}
    assert "omni_async.engine" in _imports(checker.names["omni_async.core.through_root"], module_level_only=False, checker=checker)
    cycles = _cycles(_graph(module_level_only=False, checker=checker))
    assert [set(c) for c in cycles] == [{"omni_async.stage", "omni_async.stage.intake"}]  # an __init__ and its submodule
    assert _cycles(_graph(module_level_only=True, checker=checker)) == []  # that cycle is deferred
    typed = [set(c) for c in _cycles(_graph(module_level_only=False, checker=checker, type_level=True))]
    assert {"omni_async.kv.pages", "omni_async.kv.table"} in typed  # the type-level circle, seen only so
    assert {"omni_async.stage", "omni_async.stage.intake"} in typed
    assert len(typed) == 2
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b", "a"]]


def test_modules_stay_small():
    """Outside kernels and backends, no module is much longer than 400 lines."""
    long = [f"{name}: {len(path.read_text().splitlines())}" for name, path in _modules().items()
            if ".kernels" not in name and ".backends" not in name and len(path.read_text().splitlines()) > 420]
    assert long == []

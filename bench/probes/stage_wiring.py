"""How the stage is wired, counted on the source (docs/ARCHITECTURE.md, "The stage wired
by construction"): constructor parameters typed as callables, one-statement properties
that read or write an attribute of another object (forwarding), and ``weak_method``
calls, over the scheduler, the engine, ``stage/``, ``loops/``, the grammar gate and the
SGLang core and builder.

    python bench/probes/stage_wiring.py [REPO]          # this checkout by default
    git worktree add /tmp/old <commit> && python bench/probes/stage_wiring.py /tmp/old
"""

from __future__ import annotations

import ast
import pathlib
import sys

CALLABLE_TYPES = ("Callable", "RequestBuilder", "ResultAdapter", "StreamOutputBuilder", "OutputSink")


def modules(root: pathlib.Path) -> list[pathlib.Path]:
    pkg = root / "omni_async"
    return [pkg / "scheduler.py", pkg / "engine.py", *sorted((pkg / "stage").glob("*.py")), *sorted((pkg / "loops").glob("*.py")),
            pkg / "structured/gate.py", pkg / "backends/sglang/core.py", pkg / "backends/sglang/builder.py"]


def _forwarded(fn: ast.FunctionDef) -> str | None:
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1:
        return None
    s = body[0]
    target = s.value if isinstance(s, ast.Return) else s.targets[0] if isinstance(s, ast.Assign) else None
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute):
        return ast.unparse(target) + (" (setter)" if isinstance(s, ast.Assign) else "")
    return None


def count(root: pathlib.Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {"constructor callbacks": [], "forwarding properties": [], "weak-callback hops": []}
    for path in modules(root):
        if not path.exists():
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for fn in node.body:
                    if not isinstance(fn, ast.FunctionDef):
                        continue
                    if fn.name == "__init__":
                        for arg in fn.args.args + fn.args.kwonlyargs:
                            if arg.annotation is not None and any(t in ast.unparse(arg.annotation) for t in CALLABLE_TYPES):
                                found["constructor callbacks"].append(f"{path.name}: {node.name}({arg.arg})")
                    decorators = [ast.unparse(d) for d in fn.decorator_list]
                    if any(d == "property" or d.endswith(".setter") for d in decorators):
                        target = _forwarded(fn)
                        if target is not None:
                            found["forwarding properties"].append(f"{path.name}: {node.name}.{fn.name} -> {target}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "weak_method":
                found["weak-callback hops"].append(f"{path.name}: {ast.unparse(node)}")
    return found


def main() -> None:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[2])
    for kind, where in count(root).items():
        print(f"{kind}: {len(where)}")
        for w in where:
            print(f"    {w}")


if __name__ == "__main__":
    main()

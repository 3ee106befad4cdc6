"""Run a benchmark with module-level launch settings changed, in the same process.

Why: several kernels keep their launch settings at module level so a probe can sweep them
(``omni_async.kernels.grouped_experts.GATE_UP_TILE`` / ``DOWN_TILE``,
``omni_async.kernels.paged_decode.DECODE_*``, ``omni_async.speech.predictor.SPAN_BLOCK``);
this applies settings a probe found best to a whole benchmark, before anything is built
(graphs capture the settings in force when they are captured), so a setting is measured
end to end before it becomes a default.

    python tools/with_knobs.py --set omni_async.kernels.grouped_experts.GATE_UP_TILE=64,128,4,4 \\
        --set omni_async.kernels.grouped_experts.DOWN_TILE=64,128,4,4 -- bench/nv256.py --shape qwen3moe ...
    python tools/with_knobs.py --set omni_async.speech.predictor.SPAN_BLOCK=0 -- bench/tts_serving.py ...

A value with commas becomes a tuple of ints; ``0`` / ``1`` stay ints (Python's truth);
anything else is tried as an int, a float, then kept as a string.
"""

from __future__ import annotations

import importlib
import runpy
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's omni_async


def parse_value(text: str) -> Any:
    if "," in text:
        return tuple(int(x) for x in text.split(","))
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def apply(setting: str) -> None:
    """``package.module.NAME=value``: the module imported and its attribute replaced (it
    must exist: a misspelt name fails here, not silently)."""
    target, _, text = setting.partition("=")
    module_name, _, attr = target.rpartition(".")
    module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise SystemExit(f"{module_name} has no setting {attr}")
    setattr(module, attr, parse_value(text))
    print(f"set {target} = {getattr(module, attr)!r}", flush=True)


def main(argv: list[str]) -> None:
    if "--" not in argv:
        raise SystemExit(__doc__)
    split = argv.index("--")
    own, script = argv[:split], argv[split + 1:]
    for i, arg in enumerate(own):
        if arg == "--set":
            apply(own[i + 1])
    sys.argv = script
    runpy.run_path(script[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])

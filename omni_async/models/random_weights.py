"""Checkpoint folders whose weights are drawn on the device, not read: ``config.json``
beside ``random_weights.json`` (``{"seed": 0, "std": 0.02}``, both optional) and no
safetensors.

Why: benchmarks at a real model's shape with random weights (Qwen3-30B-A3B, Qwen3-Omni).
Such a checkpoint written to disk is as large as the real one (61 GB for 30B-A3B in
bf16), more than the GPU machine's disk holds beside anything else; drawing the weights
where they are used costs nothing on disk and seconds of device time. The file is the
opt-in: a folder without weights and without it is still a load error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from ..errors import ModelLoadError

RANDOM_WEIGHTS_FILE = "random_weights.json"
DEFAULT_STD = 0.02  # transformers' initializer_range default


@dataclass(frozen=True)
class RandomWeights:
    """How a folder's weights are drawn: normal(0, ``std``) from ``seed``, norms at 1."""

    seed: int = 0
    std: float = DEFAULT_STD


def random_weights_of(folder: Path, raw_config: Mapping[str, Any]) -> RandomWeights | None:
    """The folder's :class:`RandomWeights` when it has the file, else None; ``std``
    defaults to the config's ``initializer_range``."""
    path = folder / RANDOM_WEIGHTS_FILE
    if not path.is_file():
        return None
    try:
        spec = json.loads(path.read_text() or "{}")
    except ValueError as exc:
        raise ModelLoadError(f"{path}: not JSON ({exc})") from None
    if not isinstance(spec, dict) or set(spec) - {"seed", "std"}:
        raise ModelLoadError(f"{path}: expected an object with 'seed' and 'std' at most, got {spec!r}")
    seed, std = spec.get("seed", 0), spec.get("std", raw_config.get("initializer_range", DEFAULT_STD))
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ModelLoadError(f"{path}: seed must be an integer, got {seed!r}")
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not std > 0:
        raise ModelLoadError(f"{path}: std must be a positive number, got {std!r}")
    return RandomWeights(seed, float(std))


@torch.no_grad()
def fill_random(model: nn.Module, spec: RandomWeights) -> None:
    """Every parameter drawn on its own device from one seeded generator (RMSNorm
    weights set to 1, as a freshly initialised model has them)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        gen = generators.get(p.device)
        if gen is None:
            gen = generators[p.device] = torch.Generator(device=p.device).manual_seed(spec.seed)
        p.normal_(0.0, spec.std, generator=gen)

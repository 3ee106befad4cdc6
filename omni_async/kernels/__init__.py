"""GPU kernels (Triton), used on CUDA when Triton is importable."""

from __future__ import annotations

import importlib.util

import torch


def triton_available(device: torch.device | str | None = None) -> bool:
    if device is not None and torch.device(device).type != "cuda":
        return False
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None

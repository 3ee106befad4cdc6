"""Kernels: Triton on CUDA when Triton is importable, C++ on CPU when built, the torch
reference ops everywhere."""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_available(device: torch.device | str | None = None) -> bool:
    """CUDA with Triton importable (asked per call by eager paths: the import lookup is
    made once)."""
    if device is not None and torch.device(device).type != "cuda":
        return False
    return torch.cuda.is_available() and _triton_installed()


def model_ops(*, triton: bool, cpu: bool):
    """The ops a decoder calls between its GEMMs: the fused Triton kernels, the C++ CPU
    kernels (loaded by the builder), or the torch reference. Imported only where used."""
    if triton:
        from .fused import FusedOps

        return FusedOps()
    if cpu:
        from .cpu_fused import CpuFusedOps

        return CpuFusedOps()
    from .reference import ReferenceOps

    return ReferenceOps()


def cpu_decode_stack(model):
    """A CPU decode step's layers in one C++ call (:mod:`.cpu_stack`) for ``model``, or
    None where it would not compute what the per-op path computes."""
    from .cpu_stack import CpuDecodeStack

    return CpuDecodeStack.for_model(model)

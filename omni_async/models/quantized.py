"""Opt-in int8 linear layers for CPU decoding (``SchedulerConfig.quantization="int8"``).

Why: on a small CPU a decode step of a ~100M-parameter model is bound by its GEMMs, and
int8 x int8 GEMMs (VNNI) run about twice as fast as bfloat16 ones at 16-64 rows and
read a quarter of float32's bytes at one row. Each projection (and the output head)
keeps its float32 weight as the model's parameter (checkpoint names, weight updates and
checksums are unchanged) and gains a packed int8 copy, quantised per output channel;
activations are quantised per call over the whole tensor (torch's dynamic quantised
linear, fbgemm). The activation scale is shared by the step's rows, so a request's
tokens can depend on what else is batched with it: the exact path is the default
(``quantization=None``), and this mode trades accuracy for speed (see
bench/RESULTS.md for greedy agreement with float32).

Everything between the GEMMs (norms, rotary, attention, KV) stays float32.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn import functional as F

from ..config import QUANTIZATION_MODES
from ..errors import ConfigError


class Linear(nn.Linear):
    """``nn.Linear`` that runs through a packed int8 weight once one is attached."""

    packed_int8: object | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_int8 is None:
            return F.linear(x, self.weight, self.bias)
        shape = x.shape
        out = torch.ops.quantized.linear_dynamic(x.reshape(-1, shape[-1]), self.packed_int8, False)
        return out.view(*shape[:-1], out.shape[-1])


def check_quantization(mode: str | None, device: torch.device, dtype: torch.dtype | None, tensor_parallel: int) -> None:
    """A clear :class:`ConfigError` for a mode this build cannot run."""
    if mode is None:
        return
    if mode not in QUANTIZATION_MODES:
        raise ConfigError(f"unknown quantization {mode!r}; choose None or one of {', '.join(QUANTIZATION_MODES)}")
    if device.type != "cpu":
        raise ConfigError(f"quantization={mode!r} runs on CPU only (torch's fbgemm kernels), not {device.type}")
    if dtype is not None and dtype != torch.float32:
        raise ConfigError(f"quantization={mode!r} computes between its GEMMs in float32; leave dtype unset or float32")
    if tensor_parallel > 1:
        raise ConfigError(f"quantization={mode!r} is not supported with tensor_parallel_size > 1")
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ConfigError(f"quantization={mode!r} needs torch built with fbgemm (x86 CPUs)")


def _pack(layer: Linear) -> object:
    """Per-output-channel symmetric int8 of the float weight, packed for fbgemm."""
    w = layer.weight.detach().to(torch.float32)
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(torch.float64)
    zeros = torch.zeros(w.shape[0], dtype=torch.int64)
    with warnings.catch_warnings():  # torch marks quantised tensors deprecated; fbgemm still takes them
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch.quantize_per_channel(w, scales, zeros, 0, torch.qint8)
    bias = None if layer.bias is None else layer.bias.detach().to(torch.float32)
    return torch.ops.quantized.linear_prepack(qweight, bias)


def quantize_linears(model: nn.Module, mode: str | None) -> int:
    """Attach packed int8 weights to every :class:`Linear` of ``model`` (the output head
    included); returns how many. ``None`` leaves the model as it is."""
    if mode is None:
        return 0
    count = 0
    with _fbgemm_engine():
        for module in model.modules():
            if isinstance(module, Linear):
                module.packed_int8 = _pack(module)
                count += 1
    return count


def refresh_quantized(model: nn.Module) -> None:
    """Re-pack the layers that run in int8 after their float weights changed (weight updates)."""
    with _fbgemm_engine():
        for module in model.modules():
            if isinstance(module, Linear) and module.packed_int8 is not None:
                module.packed_int8 = _pack(module)


def quantization_of(model: nn.Module) -> str | None:
    """``"int8"`` when the model's projections run through packed int8 weights."""
    return "int8" if any(isinstance(m, Linear) and m.packed_int8 is not None for m in model.modules()) else None


class _fbgemm_engine:
    """Pack with fbgemm (the x86 kernels) and restore the process's engine afterwards."""

    def __enter__(self) -> None:
        self.previous = torch.backends.quantized.engine
        if self.previous not in ("fbgemm", "x86"):
            torch.backends.quantized.engine = "fbgemm"

    def __exit__(self, *exc: object) -> None:
        torch.backends.quantized.engine = self.previous

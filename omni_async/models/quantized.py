"""Quantised linear layers for CPU decoding (``SchedulerConfig.quantization``).

``"q4"`` and ``"q8"``: the weights in blocks of 32 read directly by C++ kernels
(:mod:`omni_async.kernels.cpu_quant`): projections in 4-bit (q4) or 8-bit (q8) blocks, the
output head in 8-bit blocks, activations quantised per row and block. A GGUF file stored
in Q4_1/Q8_0 loads back into the same blocks, so ``q4`` is the file's own precision; it is
the CPU default for GGUF files (see core/plan.py default_quantization).

``"int8"``, the older mode, described below:

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

A prompt that is scored (``prompt_logprobs``, the server's ``echo``) is computed in float32
on the float weights in every mode (:func:`float_rows`, set by the runner around a prefill
with such rows): scores are what evaluations compare against the model's own, and the
activations' quantisation moved SmolLM2's log-likelihoods by up to a nat (lm-eval through
``/v1/completions``), where a prefill, bound by compute rather than by reading the weights,
gains little from it. Only those rows: a request beside them runs the quantised GEMMs
as it would alone.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from typing import Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from ..config import QUANTIZATION_MODES
from ..errors import ConfigError
from ..kernels.cpu_quant import BLOCK, BlockWeights, quantize as quantize_blocks

# Which block format each mode gives the projections and the output head.
BLOCK_FORMATS = {"q4": ("q4", "q8"), "q8": ("q8", "q8")}


class Linear(nn.Linear):
    """``nn.Linear`` that runs through a packed int8 weight once one is attached."""

    packed_int8: object | None = None
    blocks: BlockWeights | None = None

    @property
    def plain_gemm(self) -> bool:
        """Whether ``forward`` is exactly ``F.linear(x, weight, bias)`` (no packed copy
        attached): what lets a fused kernel read ``weight`` and ``bias`` in its place
        (:func:`omni_async.kernels.small_m.small_m_weights`)."""
        return self.blocks is None and self.packed_int8 is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks is None and self.packed_int8 is None:
            return F.linear(x, self.weight, self.bias)
        rows = getattr(_FLOAT, "rows", None)
        if rows is not None and x.numel() == rows.mask.shape[0] * x.shape[-1]:
            return rows.apply(x, self)
        return self.quantised(x)

    def quantised(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s product through the packed weight (blocks or int8)."""
        if self.blocks is not None:
            return self.blocks(x)
        shape = x.shape
        out = torch.ops.quantized.linear_dynamic(x.reshape(-1, shape[-1]), self.packed_int8, _reduce_range())
        return out.view(*shape[:-1], out.shape[-1])


class FloatRows:
    """Which token rows of a forward take the float path (a bool mask over them)."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask
        self.every = bool(mask.all())
        self.index = mask.nonzero().squeeze(1)
        self.rest = (~mask).nonzero().squeeze(1)

    def apply(self, x: torch.Tensor, layer: Linear) -> torch.Tensor:
        if self.every:
            return F.linear(x, layer.weight, layer.bias)
        flat = x.reshape(-1, x.shape[-1])
        out = flat.new_empty(flat.shape[0], layer.out_features)
        out[self.index] = F.linear(flat[self.index], layer.weight, layer.bias)
        out[self.rest] = layer.quantised(flat[self.rest])
        return out.view(*x.shape[:-1], layer.out_features)


_FLOAT = threading.local()  # the forward's FloatRows (the thread that runs the forward sets it)


@contextlib.contextmanager
def float_rows(mask: torch.Tensor | None) -> Iterator[None]:
    """Within: the quantised layers compute the token rows where ``mask`` is True (a bool
    tensor over a forward's flattened token rows) in float32 on their float weight; a layer
    called on another number of rows (the head over each sequence's last row) is computed
    as usual. ``None`` changes nothing."""
    if mask is None or not bool(mask.any()):
        yield
        return
    previous = getattr(_FLOAT, "rows", None)
    _FLOAT.rows = FloatRows(mask)
    try:
        yield
    finally:
        _FLOAT.rows = previous


def float_head(layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``layer`` as a float32 product (the head that scores a prompt's positions)."""
    if isinstance(layer, Linear) and not layer.plain_gemm:
        return lambda x: F.linear(x, layer.weight, layer.bias)
    return layer


@functools.lru_cache(maxsize=1)
def _reduce_range() -> bool:
    """Quantise activations to 7 bits on x86 CPUs without VNNI: fbgemm's kernels there
    add pairs of u8 x s8 products in 16 bits, which saturate with 8-bit activations
    (SmolLM2 answered garbage; with 7 bits it answers as float32 does, within
    quantization's error). With VNNI the products add in 32 bits and all 8 bits are kept."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return True
    return not ("avx512_vnni" in flags or "avx_vnni" in flags)


def check_quantization(mode: str | None, device: torch.device, dtype: torch.dtype | None, tensor_parallel: int) -> None:
    """A clear :class:`ConfigError` for a mode this build cannot run."""
    if mode is None:
        return
    if mode not in QUANTIZATION_MODES:
        raise ConfigError(f"unknown quantization {mode!r}; choose None or one of {', '.join(QUANTIZATION_MODES)}")
    if device.type != "cpu":
        raise ConfigError(f"quantization={mode!r} runs on CPU only (C++ CPU kernels), not {device.type}")
    if dtype is not None and dtype != torch.float32:
        raise ConfigError(f"quantization={mode!r} computes between its GEMMs in float32; leave dtype unset or float32")
    if tensor_parallel > 1:
        raise ConfigError(f"quantization={mode!r} is not supported with tensor_parallel_size > 1")
    if mode == "int8" and "fbgemm" not in torch.backends.quantized.supported_engines:
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
    if mode in BLOCK_FORMATS:
        return _attach_blocks(model, mode)
    count = 0
    with _fbgemm_engine():
        for module in model.modules():
            if isinstance(module, Linear):
                module.packed_int8 = _pack(module)
                count += 1
    return count


def _attach_blocks(model: nn.Module, mode: str) -> int:
    projection, head = BLOCK_FORMATS[mode]
    lm_head = getattr(model, "lm_head", None)
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.in_features % BLOCK == 0:  # others stay float32
            module.blocks = quantize_blocks(module.weight, head if module is lm_head else projection, module.bias)
            count += 1
    model.quantization_mode = mode
    return count


def refresh_quantized(model: nn.Module) -> None:
    """Re-pack the layers that run quantised after their float weights changed (weight updates)."""
    for module in model.modules():
        if isinstance(module, Linear) and module.blocks is not None:
            module.blocks = quantize_blocks(module.weight, module.blocks.format, module.bias)
    with _fbgemm_engine():
        for module in model.modules():
            if isinstance(module, Linear) and module.packed_int8 is not None:
                module.packed_int8 = _pack(module)
    if getattr(model, "cpu_stack", None) is not None:  # it holds the blocks replaced above
        from ..kernels import cpu_decode_stack

        model.cpu_stack = cpu_decode_stack(model)


_GENERATION = {
    "q4": "4-bit weights (blocks of 32, 8-bit output head) with 8-bit activations (per row and block), float32 between the GEMMs",
    "q8": "8-bit weights (blocks of 32) with 8-bit activations (per row and block), float32 between the GEMMs",
    "int8": "8-bit weights (per output channel) with 8-bit activations (per step's tensor), float32 between the GEMMs",
}


def arithmetic(mode: str | None, dtype: str) -> dict[str, str | None]:
    """What computes a model's tokens and its prompt scores, in words (the stage's model
    info, ``/get_server_info``): a quantised mode generates in its arithmetic and scores
    prompts in float32 (:func:`float_rows`)."""
    if mode is None:
        return {"quantization": None, "generation": dtype, "prompt_scoring": dtype}
    return {"quantization": mode, "generation": _GENERATION.get(mode, mode),
            "prompt_scoring": "float32 on the dequantised weights (prompt_logprobs, echo)"}


def quantization_of(model: nn.Module) -> str | None:
    """The mode the model's projections run in (``"q4"``, ``"q8"``, ``"int8"``), or None."""
    if any(isinstance(m, Linear) and m.blocks is not None for m in model.modules()):
        return getattr(model, "quantization_mode", None)
    return "int8" if any(isinstance(m, Linear) and m.packed_int8 is not None for m in model.modules()) else None


class _fbgemm_engine:
    """Pack with fbgemm (the x86 kernels) and restore the process's engine afterwards."""

    def __enter__(self) -> None:
        self.previous = torch.backends.quantized.engine
        if self.previous not in ("fbgemm", "x86"):
            torch.backends.quantized.engine = "fbgemm"

    def __exit__(self, *exc: object) -> None:
        torch.backends.quantized.engine = self.previous


def stored_bytes(layer: Linear) -> int:
    """Bytes of ``layer``'s weight as its forward reads them (a batch-1 step streams them all)."""
    if layer.blocks is not None:
        return layer.blocks.nbytes
    if layer.packed_int8 is not None:
        return layer.weight.numel()
    return layer.weight.numel() * layer.weight.element_size()

"""A CPU decode step's whole layer stack in one call into C++ (:class:`CpuDecodeStack`).

Why: a batch-1 decode step of SmolLM2-135M on a 2-core CPU streams ~110 MB of q4 weights
(a few ms), yet the per-op path made about 55 torch or extension calls per layer, 1,650 a
token, each with its Python frame, argument parsing, tensor allocation and view
bookkeeping. Here one call runs every layer: residual add + RMSNorm, the merged q/k/v
projection, rotary and the KV write, attention over the paged cache, the output
projection, the MLP, and the final norm; the GIL is released for its length, so the
event loop's thread runs while the step computes. Buffers are allocated once per call.
Threads: torch's OpenMP pool (``info()["cpu_threads"]``; the extension links the same
libgomp). By default every GEMM and attention is split by columns and heads, ~150
parallel regions a step, each waiting for the slowest thread: on a loaded 2-core machine
a step then takes 4-9x as long as one thread's (bench/RESULTS.md).
With 2 threads, a step of 4 or more rows per thread is split by rows instead
(``OMNI_ASYNC_CPU_ROW_SPLIT=N``: from N rows per thread, 0 off): each thread takes whole
rows through every layer, one region a step with no barrier inside it (3-4x faster at 16
rows on that loaded machine, +3% to +26% in three of four quieter pairs). Off with more
threads by default: each thread streams all the weights, bytes that grow with the
threads and the model.

Exactly what the per-op path computes: the stack calls the same C++ functions (compiled
in the same extension, :mod:`.cpu_kernels`) on the same inputs in the same order, so the
hidden states are bit-identical and greedy tokens equal (tests/test_cpu_stack.py). It
serves what that path serves with the C++ kernels on: float32 activations over q4/q8
block weights (:mod:`.cpu_quant`), ``cpu_attention_kernel`` and ``cpu_fused_ops`` both
on, no per-head q/k norm (Qwen3 keeps the per-op path); everything else keeps the
per-op path, unchanged.
"""

from __future__ import annotations

import os
from typing import Any

import torch

# Rows per thread from which a step's rows are split across threads (see the module's
# docstring); 0 keeps every step split by columns and heads. Unset: ROW_SPLIT_DEFAULT
# rows up to ROW_SPLIT_MAX_THREADS threads, off above.
ROW_SPLIT_ENV = "OMNI_ASYNC_CPU_ROW_SPLIT"
ROW_SPLIT_DEFAULT = 4
ROW_SPLIT_MAX_THREADS = 2


def row_split_rows(threads: int) -> int:
    """The rows per thread of the row split: the variable where given, else on where it
    was measured (2 threads: 16 concurrent requests +3% to +26% on a quiet-ish 2-core
    machine, 3-6x on a loaded one) and off with more threads, where every thread streaming
    all the weights multiplies the bytes a step reads (not measured)."""
    value = os.environ.get(ROW_SPLIT_ENV, "").strip()
    if value:
        return max(0, int(value))
    return ROW_SPLIT_DEFAULT if threads <= ROW_SPLIT_MAX_THREADS else 0


def apply_row_split(stack: Any) -> None:
    """Set ``stack``'s row split (:func:`row_split_rows` for torch's threads)."""
    stack.set_rows_per_thread(row_split_rows(torch.get_num_threads()))


def _linear_entries(linear: Any) -> list[torch.Tensor | None] | None:
    blocks = getattr(linear, "blocks", None)
    if blocks is None:
        return None
    return [blocks.codes, blocks.scale, blocks.minimum, blocks.bias]


def stack_layers(model: torch.nn.Module) -> list[list[torch.Tensor | None]] | None:
    """The per-layer entries :class:`DecodeStack` takes, or None when the model is not one
    the stack computes exactly as the per-op path does (a layer in float weights, a
    per-head q/k norm, activations other than float32, routed experts)."""
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.q_norm is not None:
            return None
        norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        if any(w.dtype != torch.float32 for w in norms):
            return None
        # A layer of routed experts (no gate_up_proj) is not one the stack computes.
        ffn = (getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
        linears = [_linear_entries(m) for m in (attn.qkv_proj, attn.o_proj, *ffn)]
        if any(e is None for e in linears):
            return None
        layers.append([w.detach() for w in norms] + [t for e in linears for t in e])
    return layers or None


class CpuDecodeStack:
    """The decode step's layers and final norm of ``model`` in one C++ call (see the
    module's docstring); :meth:`for_model` says whether the model can run on it."""

    def __init__(self, model: torch.nn.Module, layers: list[list[torch.Tensor | None]]) -> None:
        from .cpu_kernels import load

        cfg = model.config
        attn = model.model.layers[0].self_attn
        self.stack = load().DecodeStack(layers, model.model.norm.weight.detach(), float(model.model.norm.eps), attn.num_heads,
                                        attn.num_kv_heads, attn.head_dim, float(attn.scale))
        apply_row_split(self.stack)
        self.num_layers = cfg.num_layers

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> "CpuDecodeStack | None":
        layers = stack_layers(model)
        return None if layers is None else cls(model, layers)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: Any, pages: torch.Tensor, kv_lens: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:
        """The final hidden states of a decode step's rows (the final norm applied)."""
        return self.stack.forward(x, cos, sin, kv.k, kv.v, pages, kv.page_size, kv_lens, slots)

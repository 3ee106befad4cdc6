"""The decoder's work between the GEMMs as fused C++ CPU kernels (``cpu_fused_ops=True``).

Why: on a small CPU a decode step at 16-64 rows spends as much time between the GEMMs
as in them. Each torch op of residual add + RMSNorm (about six), rotary + KV write (about
ten) and SiLU-and-multiply (two) that is over ATen's grain size (32,768 elements) opens an
OpenMP parallel region, and a region costs far more than its arithmetic here: once the
process holds more OpenMP threads than cores (the loop thread's team plus the step
thread's, e.g. after any parallel torch op on the loop thread) libgomp stops spinning
between regions and every region wakes a sleeping thread (measured on a 2-core VM:
add + RMSNorm of 64 x 576 floats took 0.25 ms through torch in the step thread, 0.02 ms
with no second team). Each op below is one call, one pass over its rows, no temporaries,
and runs on the calling thread unless it has enough rows to pay for a parallel region
(prefill). The attention of an extend step (prefill, with or without a cached prefix) is
one call per layer too, instead of an SDPA call (and its regions) per sequence.

Rounding follows :class:`~omni_async.kernels.reference.ReferenceOps` step by step (the
residual sum, the normalised value, SiLU and the rotary products are rounded to the
activation dtype where the reference rounds them; float32 arithmetic in between, FMA
contraction off), so float32 results differ from the reference only by the summation
order of the RMSNorm mean and of the attention, and by exp (a polynomial, about 1 ulp):
close, not bit-equal, hence opt-in. Float32 and bfloat16 activations. Compiled from the
C++ below with the system compiler on first use (``torch.utils.cpp_extension``, about
20 s once; cached by torch).
"""

from __future__ import annotations

from typing import Any

import torch

from .reference import ReferenceOps





def load() -> Any:
    """The compiled CPU kernels (:mod:`.cpu_kernels`; built on first call); ConfigError
    when they cannot be built."""
    from .cpu_kernels import load as load_all

    return load_all()


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, rmsnorm(x + delta) * weight)`` over the last dimension in one pass;
    with ``delta`` None, ``(x, rmsnorm(x) * weight)``. All three share one dtype."""
    d = None if delta is None else delta.contiguous()
    total, out = load().add_rms_norm(x.contiguous(), d, weight.contiguous(), eps)
    return (x if delta is None else total), out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for rows laid out ``[gate | up]`` (the merged GEMM's output)."""
    return load().silu_mul(gate_up.contiguous())


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` ``[T, H, D]`` and ``k`` ``[T, KVH, D]`` into new contiguous tensors
    and write the rotated k and ``v`` into the caches (``[slots, KVH, D]``) at ``slots``."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return tuple(load().rope_store(q, k, v, cos.contiguous(), sin.contiguous(), k_cache, v_cache, slots.to(torch.long).contiguous()))


def extend_tables(seq_slices: list[tuple[int, int, int]], seq_kv_slots: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`extend_attention` reads: every sequence's KV slots end to end, and per
    sequence ``(q_start, q_len, prefix_len, offset of its first slot)``; built once per
    forward (the layers share them)."""
    offsets = [0]
    for slots in seq_kv_slots[:-1]:
        offsets.append(offsets[-1] + int(slots.shape[0]))
    seqs = torch.tensor([(*sl, off) for sl, off in zip(seq_slices, offsets)], dtype=torch.long)
    return torch.cat([s.to(torch.long) for s in seq_kv_slots]), seqs


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor],
                     scale: float) -> torch.Tensor:
    """Causal attention of an extend step's ``q`` ``[T, H, D]`` over each sequence's
    cached prefix and new tokens (their K/V already in the caches ``[slots, KVH, D]``),
    in one call; ``tables`` from :func:`extend_tables`."""
    return load().extend_attention(q.contiguous(), k_cache, v_cache, tables[0], tables[1], scale)


class CpuFusedOps(ReferenceOps):
    """The decoder's elementwise ops through the kernels above (the interface of
    :class:`~omni_async.kernels.reference.ReferenceOps`, whose GEMM pairs it keeps); shapes or dtypes they do not
    take (mixed dtypes, a non-contiguous cache) go to the reference ops."""

    name = "cpu_fused"

    def __init__(self) -> None:
        self.reference = ReferenceOps()

    def add_norm(self, x, delta, norm):
        if norm.weight.dtype != x.dtype or (delta is not None and delta.dtype != x.dtype):
            return self.reference.add_norm(x, delta, norm)
        return add_rms_norm(x, delta, norm.weight, norm.eps)

    def silu_mul(self, gate_up):
        return silu_mul(gate_up)

    def rope_store(self, q, k, v, cos, sin, kv, layer, slots, q_norm=None, k_norm=None):
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        kc, vc = kv.k[layer], kv.v[layer]
        if not (kc.is_contiguous() and vc.is_contiguous() and kc.dtype == vc.dtype == q.dtype == k.dtype == v.dtype == cos.dtype):
            return self.reference.rope_store(q, k, v, cos, sin, kv, layer, slots)
        return rope_store(q, k, v, cos, sin, kc, vc, slots)

"""The plain torch path between the GEMMs: what every fused path is checked against.

It sits with the kernels, below the models, so a fused kernel set can fall back to it
for shapes it does not cover without reaching up into the decoder."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class ReferenceOps:
    """Residual add + norm, SiLU-and-multiply and rotary + KV write, in torch; and the
    layer's GEMMs with the op before each (``add_norm_linear``, ``silu_mul_linear``,
    ``linear``), composed here from the ops and the module's own forward, so that a fused
    set (:class:`~omni_async.kernels.fused.FusedOps`) can make each pair one kernel."""

    name = "reference"

    def add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, norm: Callable[[torch.Tensor], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, norm(x + delta))``; ``delta`` None means nothing to add."""
        if delta is not None:
            x = x + delta
        return x, norm(x)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_table(self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary ``(cos, sin)`` rows ``[T, D]`` of ``positions`` in ``dtype``: the
        angles in float32, each half of a row the same (``D`` is twice ``inv_freq``'s)."""
        freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def rope_store(
        self, q, k, v, cos, sin, kv: Any, layer: int, slots: torch.Tensor,
        q_norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
        k_norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        """Rotate q and k (``[T, heads, D]``), write k and v into the cache (a
        ``PagedKVCache``); returns the rotated q and k. ``q_norm`` / ``k_norm``: a
        per-head RMSNorm (Qwen3's) applied to q and k before the rotation, taken here so
        that a fused set can do norm, rotary and the KV write in one kernel."""
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        cos, sin = cos[:, None, :], sin[:, None, :]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        kv.write(layer, slots, k, v)
        return q, k

    def add_norm_linear(
        self, x: torch.Tensor, delta: torch.Tensor | None, norm: Callable[[torch.Tensor], torch.Tensor],
        linear: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, linear(norm(x + delta)))``."""
        x, h = self.add_norm(x, delta, norm)
        return x, linear(h)

    def silu_mul_linear(self, gate_up: torch.Tensor, linear: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``linear(silu(gate) * up)``."""
        return linear(self.silu_mul(gate_up))

    def linear(self, x: torch.Tensor, linear: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return linear(x)

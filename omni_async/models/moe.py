"""The sparse mixture-of-experts block of Qwen3-MoE decoders (Qwen3-30B-A3B, the
Qwen3-Omni thinker and talker) and Qwen2-MoE ones (whose blocks, like the Omni talker's,
add a shared expert gated per token: :class:`SharedExpert`).

Routing is transformers' ``Qwen3MoeTopKRouter`` exactly: router logits in the model's
dtype, softmax in float32, the top ``k`` probabilities, renormalised to sum to 1 when the
checkpoint sets ``norm_topk_prob``, then cast back to the model's dtype. The experts'
weights are stacked, ``gate_up_proj`` ``[E, 2I, H]`` (gate rows first) and ``down_proj``
``[E, H, I]``, the layout transformers builds in memory; checkpoints keep their
per-expert names (``mlp.experts.{e}.gate_proj.weight`` ...), mapped onto the stacks by
:meth:`Experts.hf_slots`.

Three expert paths compute the same sum: on CUDA with Triton the grouped kernel
(:mod:`omni_async.kernels.grouped_experts`: no host sync, a launch shape fixed by the
batch, so it runs inside CUDA graphs and multi-step decode); on CUDA with
``EXPERT_PATH = "grouped_mm"``, :func:`experts_grouped_mm` (torch's grouped GEMM, also
without a host sync: a candidate measured against the Triton kernel before it may become
the default); elsewhere :func:`experts_torch`, one GEMM pair per expert hit, in
transformers' order.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import triton_available
from ..kernels.reference import ReferenceOps
from .config import ModelConfig
from .merged import MergedLinear, ParamSlot
from .quantized import Linear


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, experts)``, each ``[T, top_k]``: the chosen experts of each row and
    their routing weights in ``logits``' dtype."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def experts_torch(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
    ops: ReferenceOps,
) -> torch.Tensor:
    """The routed experts' weighted sum per row, expert by expert in ascending order (as
    transformers accumulates it). Asks the host which experts were hit: not for CUDA
    graphs."""
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        rows, choice = torch.where(experts == e)
        h = ops.silu_mul(F.linear(x[rows], gate_up[e]))
        h = F.linear(h, down[e]) * weights[rows, choice, None]
        out.index_add_(0, rows, h.to(out.dtype))
    return out


def experts_grouped_mm(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
    ops: ReferenceOps,
) -> torch.Tensor:
    """The same sum as :func:`experts_torch` through two grouped GEMMs
    (``torch._grouped_mm``) over the (token, choice) pairs sorted by expert. Nothing asks
    the host which experts were hit (the group offsets are a device tensor), so it runs
    inside CUDA graphs. Each pair's row is scaled by its routing weight in float32 and a
    token's ``top_k`` rows summed in choice order (deterministic, no atomics)."""
    t, hidden = x.shape
    top_k = experts.shape[1]
    if t == 0:
        return x.new_zeros(0, hidden)
    flat = experts.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # (bincount would read its length on the host)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = order // top_k
    h = torch._grouped_mm(x.index_select(0, rows), gate_up.transpose(1, 2), offs=offs)
    y = torch._grouped_mm(ops.silu_mul(h), down.transpose(1, 2), offs=offs)
    scaled = y.float() * weights.reshape(-1).index_select(0, order).float()[:, None]
    pairs = torch.empty_like(scaled)
    pairs[order] = scaled
    return pairs.view(t, top_k, hidden).sum(1).to(x.dtype)


# Which path CUDA takes: "triton" (the grouped kernel) or "grouped_mm" (torch's grouped
# GEMM, in bfloat16 only: the dtype its CUDA kernel serves without a per-group fallback).
# Module-level so a probe can compare them (tools/moe_layer.py, tools/with_knobs.py).
EXPERT_PATH = "triton"


@functools.lru_cache(maxsize=None)
def _grouped_kernel_on(device: torch.device) -> bool:
    return triton_available(device)


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts with their weights stacked (see the module's
    docstring)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def hf_slots(self, prefix: str) -> dict[str, ParamSlot]:
        """Each expert's checkpoint tensors (``{prefix}.{e}.gate_proj.weight``, ``up_proj``,
        ``down_proj``) as views of the stacks."""
        inter = self.intermediate_size
        gate_up, down = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
        slots: dict[str, ParamSlot] = {}
        for e in range(self.num_experts):
            slots[f"{prefix}.{e}.gate_proj.weight"] = ParamSlot(gate_up, self.gate_up_proj, 0, inter, index=e)
            slots[f"{prefix}.{e}.up_proj.weight"] = ParamSlot(gate_up, self.gate_up_proj, inter, inter, index=e)
        for e in range(self.num_experts):
            slots[f"{prefix}.{e}.down_proj.weight"] = ParamSlot(down, self.down_proj, index=e)
        return slots

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, ops: ReferenceOps) -> torch.Tensor:
        if x.device.type == "cuda" and EXPERT_PATH == "grouped_mm" and x.dtype == torch.bfloat16:
            return experts_grouped_mm(x, self.gate_up_proj, self.down_proj, experts, weights, ops)
        if x.device.type == "cuda" and _grouped_kernel_on(x.device):
            from ..kernels.grouped_experts import grouped_experts

            return grouped_experts(x, self.gate_up_proj, self.down_proj, experts, weights)
        return experts_torch(x, self.gate_up_proj, self.down_proj, experts, weights, ops)


class SharedExpert(nn.Module):
    """The expert every token goes through (Qwen2-MoE, Qwen3-Omni's talker): a SwiGLU MLP,
    gate and up merged as the decoder's are (checkpoint names ``shared_expert.gate_proj``
    ...), scaled per token by ``sigmoid(shared_expert_gate(x))`` in the block."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size}, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: ReferenceOps) -> torch.Tensor:
        return ops.silu_mul_linear(ops.linear(x, self.gate_up_proj), self.down_proj)


class SparseMoeBlock(nn.Module):
    """A decoder layer's FFN as routed experts (and a shared one where the checkpoint has
    it); parameter names follow transformers' ``Qwen3MoeSparseMoeBlock`` /
    ``Qwen2MoeSparseMoeBlock`` (``gate.weight`` is the router)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None, "a sparse block needs the checkpoint's expert settings"
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        # torch's Linear, not the quantizable one: int8 routing could pick other experts.
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.intermediate_size)
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_intermediate_size:
            self.shared_expert = SharedExpert(cfg.hidden_size, moe.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, ops: ReferenceOps) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.norm_topk_prob)
        out = self.experts(x, experts, weights, ops)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, ops)
        return out

    def add_norm_forward(self, x: torch.Tensor, delta: torch.Tensor | None, norm: nn.Module, ops: ReferenceOps
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, block(norm(x + delta)))``: the layer's second half (see
        :meth:`omni_async.models.decoder.MLP.add_norm_forward`)."""
        x, h = ops.add_norm(x, delta, norm)
        return x, self(h, ops)

"""Merged projections: q/k/v in one GEMM and gate/up in another, addressed by Hugging Face names.

Why: a decode step at small batch is bound by launches and weight reads, not arithmetic;
one ``[q; k; v]`` GEMM and one ``[gate; up]`` GEMM read the same bytes as three and two
separate ones with fewer launches, on CUDA and on CPU.

Checkpoints, weight updates and checksums keep speaking Hugging Face names: each such
name maps to a parameter and a row range of it (:func:`hf_parameter_slots`). The ranges
come from the module's own part sizes, so a model built with local (per-rank) head
counts maps a per-rank slice of an HF tensor to the right rows. A module whose
parameters stack several HF tensors (the experts of :mod:`.moe`) names its own slots
through ``hf_slots(prefix)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from .quantized import Linear


class MergedLinear(Linear):
    """One ``nn.Linear`` whose output rows are named parts laid end to end, e.g.
    ``{"q_proj": 896, "k_proj": 128, "v_proj": 128}``."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = dict(parts)
        self.sizes = list(parts.values())

    def part_range(self, part: str) -> tuple[int, int]:
        """``(first row, row count)`` of a part within the merged weight."""
        start = 0
        for name, size in self.parts.items():
            if name == part:
                return start, size
            start += size
        raise KeyError(part)


@dataclass(frozen=True)
class ParamSlot:
    """Where a Hugging Face tensor lives: rows ``[start, start + rows)`` of ``param``
    (the whole parameter when ``start`` is None), within ``param[index]`` when ``index``
    is given (one expert of a stack)."""

    param_name: str
    param: torch.Tensor
    start: int | None = None
    rows: int = 0
    index: int | None = None

    def view(self) -> torch.Tensor:
        """The writable view of the model's storage that this name addresses."""
        base = self.param if self.index is None else self.param[self.index]
        return base if self.start is None else base.narrow(0, self.start, self.rows)


def _merged_owners(model: nn.Module) -> dict[str, tuple[str, MergedLinear]]:
    """Merged parameter name -> (its module's parent prefix, module)."""
    owners: dict[str, tuple[str, MergedLinear]] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, MergedLinear):
            parent = prefix.rsplit(".", 1)[0] if "." in prefix else ""
            for attr, _ in module.named_parameters(recurse=False):
                owners[f"{prefix}.{attr}"] = (parent, module)
    return owners


def _stacked_slots(model: nn.Module) -> dict[str, dict[str, ParamSlot]]:
    """Parameter name -> its HF slots, for the modules that name their own (``hf_slots``)."""
    stacked: dict[str, dict[str, ParamSlot]] = {}
    for prefix, module in model.named_modules():
        named = getattr(type(module), "hf_slots", None)
        if named is None:
            continue
        for slot_name, slot in module.hf_slots(prefix).items():
            stacked.setdefault(slot.param_name, {})[slot_name] = slot
    return stacked


def hf_parameter_slots(model: nn.Module) -> dict[str, ParamSlot]:
    """Every parameter under its Hugging Face name(s), in the model's parameter order
    with merged parameters expanded into their parts in order (q, k, v; gate, up), and
    stacked ones into theirs (expert 0's gate, up, down, then expert 1's ...)."""
    owners = _merged_owners(model)
    stacked = _stacked_slots(model)
    slots: dict[str, ParamSlot] = {}
    for name, param in model.named_parameters():
        if name in stacked:
            slots.update(stacked[name])
            continue
        if name not in owners:
            slots[name] = ParamSlot(name, param)
            continue
        parent, module = owners[name]
        attr = name.rsplit(".", 1)[1]
        for part in module.parts:
            start, rows = module.part_range(part)
            hf = f"{parent}.{part}.{attr}" if parent else f"{part}.{attr}"
            slots[hf] = ParamSlot(name, param, start, rows)
    return slots


def hf_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(Hugging Face name, view of the model's weights)`` for every tensor a checkpoint holds."""
    for name, slot in hf_parameter_slots(model).items():
        yield name, slot.view()

"""One checksum of a model's weights, comparable across backends and with a trainer's
Hugging Face model."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from .merged import hf_named_tensors


def weights_checksum(model: torch.nn.Module) -> dict[str, Any]:
    """SHA-256 over every tensor under its Hugging Face name (name, dtype, shape, bytes)
    in name order, so a trainer holding an HF model can compute the same sum."""
    digest = hashlib.sha256()
    count = 0
    for name, p in sorted(hf_named_tensors(model), key=lambda kv: kv[0]):
        t = p.detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes())
        count += t.numel()
    return {"checksum": digest.hexdigest(), "num_parameters": count}

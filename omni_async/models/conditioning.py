"""The talker's projection of conditioning rows (a thinker's hidden states) into its own
embedding space: ``thinker_to_talker_proj``, a ``Linear(Hc, H)`` with bias.

Why here and not in the decoder's constructor: whether a decoder takes conditioning is
a property of the stage (a talker), not of the checkpoint's architecture, and the size of
the rows (``Hc``) is the thinker's. So the projection is attached to a loaded model, before
its stage captures CUDA graphs. A checkpoint that holds ``thinker_to_talker_proj.weight``
and ``.bias`` (an omni talker trained with one) supplies it, shapes checked; otherwise it
is drawn from a seed, which gives a talker whose tokens depend on the rows (what the
pipeline's tests and benchmark need) without a trained one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from .quantized import Linear

__all__ = ["PROJECTION", "attach_projection", "projection_names"]

# The module's name on the decoder and the prefix of its tensors in a checkpoint.
from .decoder import PROJECTION  # noqa: E402  (re-exported)


def projection_names() -> tuple[str, str]:
    return f"{PROJECTION}.weight", f"{PROJECTION}.bias"


def attach_projection(loaded: Any, conditioning_size: int, *, seed: int = 0) -> Linear:
    """Give ``loaded.model`` (a :class:`~omni_async.models.loader.LoadedModel`'s decoder)
    a ``thinker_to_talker_proj`` taking rows of ``conditioning_size``, in the model's dtype
    and on its device: the checkpoint's when its folder holds one (a ConfigError naming
    both shapes when they do not fit), random from ``seed`` otherwise."""
    if not isinstance(conditioning_size, int) or isinstance(conditioning_size, bool) or conditioning_size < 1:
        raise ConfigError(f"conditioning_size must be a positive int (the thinker's hidden size), got {conditioning_size!r}")
    model = loaded.model
    ref = model.model.embed_tokens.weight
    hidden = int(ref.shape[1])
    proj = Linear(conditioning_size, hidden, bias=True, device="cpu", dtype=torch.float32)
    stored = _from_checkpoint(loaded.path)
    with torch.no_grad():
        if stored is not None:
            weight, bias = stored
            want_w, want_b = (hidden, conditioning_size), (hidden,)
            if tuple(weight.shape) != want_w or tuple(bias.shape) != want_b:
                raise ConfigError(
                    f"{loaded.path}: {PROJECTION} has weight {tuple(weight.shape)} and bias {tuple(bias.shape)}; "
                    f"a talker of hidden size {hidden} fed rows of size {conditioning_size} needs "
                    f"weight {want_w} and bias {want_b}"
                )
            proj.weight.copy_(weight)
            proj.bias.copy_(bias)
        else:
            gen = torch.Generator().manual_seed(seed)
            proj.weight.copy_(torch.randn(proj.weight.shape, generator=gen) / conditioning_size**0.5)
            proj.bias.copy_(torch.randn(proj.bias.shape, generator=gen) * 0.02)
    proj = proj.to(device=ref.device, dtype=ref.dtype).eval()
    model.thinker_to_talker_proj = proj
    return proj


def _from_checkpoint(path: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The projection's tensors from a safetensors folder, or None (no folder, or none
    stored). Only those two tensors are read."""
    folder = Path(path)
    if not folder.is_dir():
        return None
    from safetensors import safe_open

    from .loader import safetensors_files

    found: dict[str, torch.Tensor] = {}
    names = projection_names()
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                if name in f.keys():
                    found[name] = f.get_tensor(name)
    if not found:
        return None
    missing = [n for n in names if n not in found]
    if missing:
        raise ConfigError(f"{path}: the checkpoint holds part of {PROJECTION} but not {missing}")
    return found[names[0]], found[names[1]]

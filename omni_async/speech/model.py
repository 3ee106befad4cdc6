"""The Qwen3-TTS talker side as our modules: the talker decoder (our native Qwen3 decoder
over the paged KV cache, its token embedding being the codec embedding and its head the
codec head), the text embedding with its projection, and the code predictor.

Loaded from a checkpoint folder by the names the ``qwen-tts`` package saves
(``talker.model.*``, ``talker.text_projection.*``, ``talker.codec_head``,
``talker.code_predictor.*``), or drawn at random from a config (tests, the built-in
``tiny`` model, speed runs at a released size's shapes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelLoadError
from ..models.decoder import DecoderModel, rope_inv_freq
from ..models.loader import copy_named_tensors, empty_model, iter_checkpoint, resolve_dtype
from ..models.merged import hf_named_tensors
from .config import TTSConfig
from .predictor import CodePredictor, decoder_config

__all__ = ["SpeechModel", "ResizeMLP", "ids_on", "load_speech_model", "random_speech_model"]


class ResizeMLP(nn.Module):
    """``fc2(SiLU(fc1(x)))``: rows of another width into the talker's (Qwen3-TTS's text
    projection; Qwen3-Omni's text and hidden projections). Checkpoint names ``linear_fc1``
    / ``linear_fc2``."""

    def __init__(self, in_size: int, inner: int, out_size: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(in_size, inner, bias=True)
        self.linear_fc2 = nn.Linear(inner, out_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TextSide(nn.Module):
    def __init__(self, cfg: TTSConfig) -> None:
        super().__init__()
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)
        self.text_projection = ResizeMLP(cfg.text_hidden_size, cfg.text_hidden_size, cfg.talker.hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.text_projection(self.text_embedding(ids))


@dataclass
class SpeechModel:
    """The three parts and the one row every generated position adds (``tts_pad``'s
    projected text embedding)."""

    config: TTSConfig
    talker: DecoderModel
    text: TextSide
    predictor: CodePredictor
    pad_row: torch.Tensor  # [H]: T(tts_pad)

    @property
    def device(self) -> torch.device:
        return self.pad_row.device

    @property
    def dtype(self) -> torch.dtype:
        return self.pad_row.dtype

    @torch.inference_mode()
    def text_rows(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """``T(ids)``: projected text embeddings ``[n, H]``."""
        return self.text(ids_on(ids, self.device))

    @torch.inference_mode()
    def codec_rows(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """``C(ids)``: rows of the talker's codec embedding ``[n, H]``."""
        return self.talker.model.embed_tokens(ids_on(ids, self.device))

    def frame_input(self, codes: torch.Tensor, text: torch.Tensor | None = None) -> torch.Tensor:
        """The talker's next input after a frame ``codes`` [B, 16]: the sum of its 16 codes'
        embeddings (codebook 0 from the talker's table, the others from the predictor's)
        plus ``tts_pad`` (plus ``text`` [B, H] in its place when given: a talker whose
        text arrives as the frames go, as Qwen3-Omni's does)."""
        x = self.talker.model.embed_tokens(codes[:, 0])
        for g in range(1, codes.shape[1]):
            x = x + self.predictor.embed(g, codes[:, g])
        return x + (self.pad_row if text is None else text)

    def modules(self) -> Iterator[nn.Module]:
        yield from (self.talker, self.text, self.predictor)

    def num_parameters(self) -> int:
        return sum(p.numel() for m in self.modules() for p in m.parameters())


def _finish(cfg: TTSConfig, talker: DecoderModel, text: TextSide, predictor: CodePredictor, device: torch.device,
            dtype: torch.dtype) -> SpeechModel:
    text = text.to(device=device, dtype=dtype).eval()
    predictor = predictor.to(device=device, dtype=dtype).eval()
    predictor.inv_freq = rope_inv_freq(decoder_config(cfg.predictor)).to(device)
    talker.inv_freq = rope_inv_freq(cfg.talker).to(device)
    with torch.inference_mode():
        pad = text(torch.tensor([cfg.tts_pad_token_id], device=device))[0]
    return SpeechModel(cfg, talker.eval(), text, predictor, pad)


_TALKER_PREFIX = "talker.model."
_RENAMES = {"talker.model.codec_embedding.weight": "model.embed_tokens.weight", "talker.codec_head.weight": "lm_head.weight",
            "talker.model.norm.weight": "model.norm.weight"}


def load_speech_model(folder: str | Path, cfg: TTSConfig, *, device: torch.device, dtype: str | torch.dtype | None = None) -> SpeechModel:
    """The talker, text side and predictor of a checkpoint folder, every tensor checked by
    name and shape (a ModelLoadError names the first that does not fit)."""
    folder = Path(folder)
    torch_dtype = resolve_dtype(dtype, cfg.talker.dtype, device)
    talker = empty_model(cfg.talker, device, torch_dtype)
    text, predictor = TextSide(cfg), CodePredictor(cfg.predictor, cfg.talker.hidden_size)
    parts = {"text": dict(text.named_parameters()), "predictor": dict(hf_named_tensors(predictor))}
    talker_tensors: list[tuple[str, torch.Tensor]] = []
    seen: set[str] = set()
    for name, tensor in iter_checkpoint(folder):
        if name in _RENAMES:
            talker_tensors.append((_RENAMES[name], tensor))
        elif name.startswith("talker.model.layers."):
            talker_tensors.append(("model." + name[len(_TALKER_PREFIX):], tensor))
        elif name.startswith(("talker.model.text_embedding.", "talker.text_projection.")):
            key = name[len("talker."):].replace("model.text_embedding", "text_embedding")
            _copy(parts["text"], key, tensor, name)
            seen.add("text:" + key)
        elif name.startswith("talker.code_predictor."):
            key = name[len("talker.code_predictor."):]
            _copy(parts["predictor"], key, tensor, name)
            seen.add("predictor:" + key)
        elif name.startswith("speaker_encoder."):
            continue  # a Base checkpoint's speaker encoder: voice cloning is not served
        else:
            raise ModelLoadError(f"{folder}: unexpected tensor {name!r} in a Qwen3-TTS checkpoint")
    missing = [f"{part}:{k}" for part, named in parts.items() for k in named if f"{part}:{k}" not in seen]
    if missing:
        raise ModelLoadError(f"{folder}: the checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:6])}")
    copy_named_tensors(talker, talker_tensors, require_all=True)
    return _finish(cfg, talker, text, predictor, device, torch_dtype)


def _copy(params: dict[str, nn.Parameter], key: str, tensor: torch.Tensor, name: str) -> None:
    target = params.get(key)
    if target is None:
        raise ModelLoadError(f"unexpected tensor {name!r}: the model has no such parameter")
    if tuple(target.shape) != tuple(tensor.shape):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor.to(target.dtype))


@torch.no_grad()
def random_speech_model(cfg: TTSConfig, *, device: torch.device, dtype: str | torch.dtype | None = None, seed: int = 0) -> SpeechModel:
    """Random weights from ``seed``, drawn on ``device`` in its dtype (a 1.7B model's
    weights are made where they run, not read from a file). Output heads are scaled so
    greedy picks are well separated; the codec EOS row of the talker's head is damped so
    random models speak for their frame budget."""
    torch_dtype = resolve_dtype(dtype, cfg.talker.dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    talker = empty_model(cfg.talker, device, torch_dtype)
    text = TextSide(cfg).to(device=device, dtype=torch_dtype)
    predictor = CodePredictor(cfg.predictor, cfg.talker.hidden_size).to(device=device, dtype=torch_dtype)
    named = [*hf_named_tensors(talker), *text.named_parameters(), *hf_named_tensors(predictor)]
    for name, p in named:
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.ndim == 1:
            p.normal_(0.0, 0.02, generator=gen)
        elif "embed" in name:
            p.normal_(0.0, 1.0, generator=gen)
        else:
            gain = 4.0 if ("lm_head" in name or name == "lm_head.weight") else 1.0
            p.normal_(0.0, gain / p.shape[-1] ** 0.5, generator=gen)
    talker.lm_head.weight[cfg.codec_eos_id].mul_(0.1)
    return _finish(cfg, talker, text, predictor, device, torch_dtype)


def ids_on(ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Token ids on ``device`` by an asynchronous copy (a prompt is built on the event
    loop's thread: ``as_tensor(..., device=cuda)`` copies blocking, after the stream's queue)."""
    return torch.as_tensor(ids, dtype=torch.long).to(device, non_blocking=True)

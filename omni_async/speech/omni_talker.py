"""The Qwen3-Omni talker: a mixture-of-experts decoder that writes codebook 0 of each
speech frame from the thinker's stream, and a code predictor that writes the frame's
other codebooks.

Parts, loaded from a ``Qwen3OmniMoeForConditionalGeneration`` folder (``talker.*`` and
three rows of ``thinker.model.embed_tokens``; the thinker, its encoders and code2wav are
not read):

- the talker decoder: our native decoder with routed and shared experts in every layer
  (:mod:`omni_async.models.moe`), its token embedding the codec embedding and its head
  the codec head;
- ``text_projection`` (thinker input embeddings -> talker width) and
  ``hidden_projection`` (the thinker's ``accept_hidden_layer`` rows -> talker width, for
  audio/image/video positions only), both ``fc2(SiLU(fc1(x)))``;
- the code predictor (:class:`~omni_async.speech.predictor.CodePredictor`, the
  Qwen3-TTS frame step; here the talker and predictor share a width, so its projection
  is the identity).

How the talker's input is built (:func:`talker_prompt`, as the reference's ``generate``
builds it): the prompt's user turns (text positions through ``text_projection`` of the
thinker's embeddings, multimodal ones through ``hidden_projection`` of its layer rows),
then nine assistant rows: ``<|im_start|>assistant\\n`` projected, four ``T(tts_pad)``,
``T(tts_bos)``, the first reply token projected, each added to a codec row (zeros, then
nothink, think_bos, think_eos, the speaker, codec pad, codec bos). Each generated frame's
next input is the sum of its codes' embeddings plus one "trailing" text row: the next
reply token projected, then ``T(tts_eos)`` once the thinker's reply is complete, then
``T(tts_pad)``.

:func:`generate_codes` runs one request greedily over a cache of its own (the oracle the
tests compare with transformers, and the behaviour the served stage must keep); the
stage that serves it batched, in any loop, is :mod:`.omni_stage` (docs/speech.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from ..errors import InvalidRequestError, ModelLoadError
from ..kv.attention import AttentionContext
from ..kv.cache import PagedKVCache
from ..models.decoder import DecoderModel, rope_inv_freq
from ..models.loader import copy_named_tensors, empty_model, iter_checkpoint, resolve_dtype
from ..models.merged import hf_named_tensors
from ..models.random_weights import RandomWeights, fill_random
from .model import ResizeMLP, ids_on
from .omni_config import OmniTalkerConfig
from .predictor import CodePredictor, decoder_config

__all__ = ["OmniTalker", "TalkerPrompt", "TalkerCodes", "load_omni_talker", "random_omni_talker",
           "talker_prompt", "generate_codes"]


class _Projections(nn.Module):
    def __init__(self, cfg: OmniTalkerConfig) -> None:
        super().__init__()
        size = (cfg.thinker_hidden_size, cfg.projection_size, cfg.talker.hidden_size)
        self.text_projection = ResizeMLP(*size)
        self.hidden_projection = ResizeMLP(*size)


@dataclass
class OmniTalker:
    """The loaded parts and the three projected text rows every request uses."""

    config: OmniTalkerConfig
    talker: DecoderModel
    projections: _Projections
    predictor: CodePredictor
    tts_bos: torch.Tensor  # [H]: T(tts_bos)
    tts_eos: torch.Tensor
    tts_pad: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.tts_pad.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tts_pad.dtype

    @torch.inference_mode()
    def text_rows(self, embeds: torch.Tensor) -> torch.Tensor:
        """``T(x)``: thinker input embeddings ``[n, Ht]`` projected to the talker's width."""
        return self.projections.text_projection(embeds.to(self.device, self.dtype))

    @torch.inference_mode()
    def hidden_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """The thinker's ``accept_hidden_layer`` rows ``[n, Ht]`` projected."""
        return self.projections.hidden_projection(hidden.to(self.device, self.dtype))

    @torch.inference_mode()
    def codec_rows(self, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """``C(ids)``: rows of the talker's codec embedding ``[n, H]``."""
        return self.talker.model.embed_tokens(ids_on(ids, self.device))

    def frame_input(self, codes: torch.Tensor, text: torch.Tensor | None = None) -> torch.Tensor:
        """The talker's next input after frames ``codes`` [B, G]: their embedding sum plus
        each row's text row ``text`` [B, H] (``T(tts_pad)`` when None)."""
        return self.frame_embedding(codes) + (self.tts_pad if text is None else text)

    def frame_embedding(self, codes: torch.Tensor) -> torch.Tensor:
        """The sum of a frame's code embeddings ``[B, H]`` (codebook 0 from the talker's
        table, the others from the predictor's)."""
        x = self.talker.model.embed_tokens(codes[:, 0])
        for g in range(1, codes.shape[1]):
            x = x + self.predictor.embed(g, codes[:, g])
        return x


# Checkpoint names of the talker decoder that differ from our decoder's.
_TALKER_RENAMES = {"talker.model.codec_embedding.weight": "model.embed_tokens.weight",
                   "talker.codec_head.weight": "lm_head.weight", "talker.model.norm.weight": "model.norm.weight"}
_THINKER_EMBEDDING = "thinker.model.embed_tokens.weight"


def load_omni_talker(folder: str | Path, *, device: torch.device | str = "cpu",
                     dtype: str | torch.dtype | None = None) -> OmniTalker:
    """The talker, its projections and code predictor from a Qwen3-Omni folder, every
    tensor checked by name and shape (a ModelLoadError names the first that does not
    fit, or the first missing)."""
    folder, device = Path(folder), torch.device(device)
    cfg = OmniTalkerConfig.from_folder(folder)
    if cfg.predictor.hidden_size != cfg.talker.hidden_size:
        raise ModelLoadError(f"{folder}: the code predictor's width ({cfg.predictor.hidden_size}) differs from the "
                             f"talker's ({cfg.talker.hidden_size}); Qwen3-Omni's predictor reads the talker's rows as they are")
    torch_dtype = resolve_dtype(dtype, cfg.talker.dtype, device)
    talker = empty_model(cfg.talker, device, torch_dtype)
    projections = _Projections(cfg).to(device=device, dtype=torch_dtype)
    predictor = CodePredictor(cfg.predictor, cfg.talker.hidden_size).to(device=device, dtype=torch_dtype)
    parts = {"talker.": dict(projections.named_parameters()),
             "talker.code_predictor.": dict(hf_named_tensors(predictor))}
    talker_tensors: list[tuple[str, torch.Tensor]] = []
    special: torch.Tensor | None = None
    seen: set[str] = set()
    for name, tensor in iter_checkpoint(folder):
        if name in _TALKER_RENAMES:
            talker_tensors.append((_TALKER_RENAMES[name], tensor))
        elif name.startswith("talker.model.layers."):
            talker_tensors.append((name[len("talker."):], tensor))
        elif name.startswith(("talker.text_projection.", "talker.hidden_projection.")):
            _copy(parts["talker."], name[len("talker."):], tensor, name)
            seen.add(name)
        elif name.startswith("talker.code_predictor."):
            _copy(parts["talker.code_predictor."], name[len("talker.code_predictor."):], tensor, name)
            seen.add(name)
        elif name == _THINKER_EMBEDDING:
            ids = [cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id]
            if max(ids) >= tensor.shape[0]:
                raise ModelLoadError(f"{folder}: a tts special id ({max(ids)}) is outside the thinker's vocabulary")
            special = tensor[ids].clone()
        elif name.startswith("talker."):
            raise ModelLoadError(f"{folder}: unexpected tensor {name!r} in a Qwen3-Omni talker")
    missing = [prefix + key for prefix, named in parts.items() for key in named if prefix + key not in seen]
    if special is None:
        missing.append(_THINKER_EMBEDDING)
    if missing:
        raise ModelLoadError(f"{folder}: the checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:6])}")
    copy_named_tensors(talker, talker_tensors, require_all=True)
    return _finish(cfg, talker, projections, predictor, special)


def _finish(cfg: OmniTalkerConfig, talker: DecoderModel, projections: _Projections, predictor: CodePredictor,
            special: torch.Tensor) -> OmniTalker:
    """The parts in eval mode, their rotary tables (on the CPU after a meta build, and
    exact in float32), and ``T(tts_bos / tts_eos / tts_pad)`` from the thinker's
    embedding rows ``special`` ``[3, Ht]``."""
    device = talker.lm_head.weight.device
    talker.inv_freq = rope_inv_freq(cfg.talker).to(device)
    predictor.inv_freq = rope_inv_freq(decoder_config(cfg.predictor)).to(device)
    with torch.inference_mode():
        bos, eos, pad = projections.text_projection(special.to(device, talker.lm_head.weight.dtype))
    return OmniTalker(cfg, talker.eval(), projections.eval(), predictor.eval(), bos, eos, pad)


@torch.no_grad()
def random_omni_talker(cfg: OmniTalkerConfig, *, device: torch.device | str = "cpu", dtype: str | torch.dtype | None = None,
                       seed: int = 0, std: float = 0.02) -> OmniTalker:
    """Random weights drawn on ``device`` (speed runs at a released size's shapes: the
    weights are made where they run, not read). The codec EOS row of the head is damped
    so random talkers speak for their frame budget."""
    if cfg.predictor.hidden_size != cfg.talker.hidden_size:
        raise ModelLoadError("the code predictor's width must equal the talker's (Qwen3-Omni's layout)")
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, cfg.talker.dtype, device)
    spec = RandomWeights(seed=seed, std=std)
    talker = empty_model(cfg.talker, device, torch_dtype)
    projections = _Projections(cfg).to(device=device, dtype=torch_dtype)
    predictor = CodePredictor(cfg.predictor, cfg.talker.hidden_size).to(device=device, dtype=torch_dtype)
    for part in (talker, projections, predictor):
        fill_random(part, spec)
    talker.lm_head.weight[cfg.codec_eos_id].mul_(0.1)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    special = torch.randn((3, cfg.thinker_hidden_size), generator=gen, device=device, dtype=torch_dtype)
    return _finish(cfg, talker, projections, predictor, special)


def _copy(params: dict[str, nn.Parameter], key: str, tensor: torch.Tensor, name: str) -> None:
    target = params.get(key)
    if target is None:
        raise ModelLoadError(f"unexpected tensor {name!r}: the model has no such parameter")
    if tuple(target.shape) != tuple(tensor.shape):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor.to(target.dtype))


# ---------------------------------------------------------------- the talker's input


@dataclass
class TalkerPrompt:
    """A request's talker input: ``prefill`` ``[P, H]`` (the user turns and the nine
    assistant rows) and ``trailing`` ``[n, H]``, the text row added to frame ``k``'s
    input for ``k < n`` (``T(tts_pad)`` after)."""

    prefill: torch.Tensor
    trailing: torch.Tensor


def _user_positions(ids: list[int], cfg: OmniTalkerConfig) -> list[int]:
    """Prompt positions in a user turn: those whose latest ``<|im_start|>`` (the first
    position when there is none yet) is followed by the user role token."""
    positions, start = [], 0
    for p, tok in enumerate(ids):
        if tok == cfg.im_start_token_id:
            start = p
        if ids[min(start + 1, len(ids) - 1)] == cfg.user_token_id:
            positions.append(p)
    return positions


def _assistant_start(ids: list[int], cfg: OmniTalkerConfig) -> int:
    starts = [p for p in range(len(ids) - 1) if ids[p] == cfg.im_start_token_id and ids[p + 1] == cfg.assistant_token_id]
    if not starts:
        raise InvalidRequestError("the prompt has no '<|im_start|>assistant' turn for the talker to speak")
    return starts[-1]


@torch.inference_mode()
def talker_prompt(model: OmniTalker, prompt_ids: Sequence[int], output_ids: Sequence[int], embeds: torch.Tensor,
                  hidden: torch.Tensor, speaker: str, *, complete: bool = True) -> TalkerPrompt:
    """The talker's input for a finished thinker reply. ``prompt_ids``: the chat prompt
    (ending ``<|im_start|>assistant\\n``); ``output_ids``: the thinker's reply;
    ``embeds`` / ``hidden``: the thinker's input embeddings and ``accept_hidden_layer``
    rows at every position it ran (``len(prompt) + len(output) - 1``: the reply's last
    token is never an input). The trailing rows end with ``T(tts_eos)``; with
    ``complete=False`` (a reply still being written, ``output_ids`` so far) they stop at
    the rows known so far, and ``text_rows`` of each later input row, then
    ``T(tts_eos)``, follow them."""
    cfg = model.config
    prompt, tokens = list(prompt_ids), [*prompt_ids, *output_ids]
    rows = embeds.shape[0]
    if hidden.shape[0] != rows or rows > len(tokens):
        raise InvalidRequestError(f"{rows} embedding and {hidden.shape[0]} hidden rows for {len(tokens)} tokens")
    user = _user_positions(prompt, cfg)
    start = _assistant_start(prompt, cfg)
    if rows < start + 4:
        raise InvalidRequestError("the talker starts after the thinker's first reply token: it needs that token's row")
    # Indices go over by an asynchronous copy: indexing a device tensor with a host index
    # copies it blocking, after everything queued on the stream (beside a busy thinker, a
    # burst's prompts built with such copies took ~15 ms each on an H100 at 64 streams).
    at = ids_on(user, embeds.device)
    user_rows = _user_rows(model, [tokens[p] for p in user], embeds.index_select(0, at), hidden.index_select(0, at))
    assistant = model.text_rows(embeds[start:rows])
    text = torch.cat((assistant[:3], model.tts_pad.expand(4, -1), model.tts_bos[None], assistant[3:4]))
    codec = torch.cat((torch.zeros((3, text.shape[1]), dtype=text.dtype, device=text.device),
                       model.codec_rows([cfg.codec_nothink_id, cfg.codec_think_bos_id, cfg.codec_think_eos_id,
                                         cfg.speaker_id(speaker), cfg.codec_pad_id, cfg.codec_bos_id])))
    trailing = torch.cat((assistant[4:], model.tts_eos[None])) if complete else assistant[4:]
    return TalkerPrompt(prefill=torch.cat((user_rows, text + codec)), trailing=trailing)


def _user_rows(model: OmniTalker, ids: list[int], embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """User positions: multimodal placeholders from the thinker's layer rows, text from
    its input embeddings."""
    multimodal = [i for i, t in enumerate(ids) if t in model.config.multimodal_token_ids]
    out = model.text_rows(embeds)
    if multimodal:
        at = ids_on(multimodal, out.device)
        out.index_copy_(0, at, model.hidden_rows(hidden.index_select(0, ids_on(multimodal, hidden.device))))
    return out


# ---------------------------------------------------------------- greedy codes


@dataclass
class TalkerCodes:
    codes: torch.Tensor  # [frames, num_code_groups], codebook 0 first, on the CPU
    finish_reason: str  # "stop" (codec EOS) or "length"


class _Sequence:
    """One request's positions in a KV cache of its own (contiguous slots from 0)."""

    def __init__(self, model: OmniTalker, capacity: int) -> None:
        cfg = model.config.talker
        self.model, self.page = model, 16
        pages = -(-capacity // self.page)
        self.kv = PagedKVCache(num_layers=cfg.num_layers, num_pages=pages, page_size=self.page,
                               num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=model.dtype, device=model.device)
        self.length = 0

    def forward(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The next positions' inputs ``rows`` ``[n, H]`` in; the last one's float32
        logits ``[V]`` and final-normed hidden state ``[H]`` out."""
        n, dev, start = rows.shape[0], self.model.device, self.length
        slots = torch.arange(start, start + n, device=dev)
        if n == 1 and start > 0:
            ctx = AttentionContext(is_decode=True, slot_mapping=slots, logits_rows=torch.zeros(1, dtype=torch.long, device=dev),
                                   kv_slots=torch.arange(start + 1, device=dev)[None], kv_lens=torch.tensor([start + 1], device=dev))
        else:
            ctx = AttentionContext(is_decode=False, slot_mapping=slots, logits_rows=torch.tensor([n - 1], device=dev),
                                   seq_slices=[(0, n, start)], seq_kv_slots=[torch.arange(start + n, device=dev)])
        ids = torch.zeros(n, dtype=torch.long, device=dev)
        logits, hidden = self.model.talker(ids, slots, self.kv, ctx, return_hidden=True,
                                           input_embeds=(torch.arange(n, device=dev), rows))
        self.length += n
        return logits[0], hidden[0]


def _greedy_codec_token(logits: torch.Tensor, written: list[int], penalty: float, suppressed: torch.Tensor) -> int:
    """Codebook 0 as the reference's greedy pick: the repetition penalty over the codes
    written so far (negative logits times ``penalty``, others divided), the control ids
    suppressed, then the arg max."""
    logits = logits.clone()
    if written and penalty != 1.0:
        seen = torch.tensor(sorted(set(written)), dtype=torch.long, device=logits.device)
        picked = logits[seen]
        logits[seen] = torch.where(picked < 0, picked * penalty, picked / penalty)
    logits[suppressed] = float("-inf")
    return int(logits.argmax())


@torch.inference_mode()
def generate_codes(model: OmniTalker, prompt: TalkerPrompt, *, max_frames: int,
                   repetition_penalty: float = 1.05) -> TalkerCodes:
    """Up to ``max_frames`` frames of one request, greedy for the talker (with the
    reference's repetition penalty and suppression) and for the predictor. Frame ``k``
    is ``[g0(k), predictor codes]``; its embedding sum plus the ``k``-th trailing row is
    the talker's next input. Stops when the talker writes the codec EOS."""
    if max_frames < 1:
        raise InvalidRequestError(f"max_frames must be at least 1, got {max_frames}")
    cfg = model.config
    seq = _Sequence(model, prompt.prefill.shape[0] + max_frames)
    suppressed = torch.tensor(cfg.suppressed_codec_ids(), dtype=torch.long, device=model.device)
    logits, past = seq.forward(prompt.prefill.to(model.device, model.dtype))
    written: list[int] = []
    frames: list[torch.Tensor] = []
    while len(frames) < max_frames:
        g0 = _greedy_codec_token(logits, written, repetition_penalty, suppressed)
        if g0 == cfg.codec_eos_id:
            return TalkerCodes(torch.stack(frames).cpu() if frames else _no_frames(cfg), "stop")
        written.append(g0)
        first = model.codec_rows([g0])
        rest = model.predictor.frame(past[None], first, lambda lg, group: lg.argmax(dim=-1), ops=model.talker.ops)
        frame = torch.cat((torch.tensor([g0], device=rest.device), rest[0]))
        frames.append(frame)
        k = len(frames) - 1
        text = prompt.trailing[k] if k < prompt.trailing.shape[0] else model.tts_pad
        logits, past = seq.forward(model.frame_input(frame[None], text[None]))
    return TalkerCodes(torch.stack(frames).cpu(), "length")


def _no_frames(cfg: OmniTalkerConfig) -> torch.Tensor:
    return torch.zeros((0, cfg.num_code_groups), dtype=torch.long)

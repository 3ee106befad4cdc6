"""The speech stage's runner: one decode step writes one frame.

A step of the talker stage is the native runner's step with a different decode forward.
Its "tokens" are codebook 0 of each frame (``g0``), sampled by the shared sampler with the
request's talker settings (repetition penalty over the ``g0`` written so far, the codec's
control ids suppressed, EOS banned for the first two, EOS as the stop id), so the batch
core's finish rules, the three loops, lookahead and multi-step decode all apply unchanged.

Decode forward, for each row (all on the device, no host sync):

1. the code predictor writes codebooks 1..15 of the frame whose codebook 0 is the row's
   input token, from the talker's hidden state at the position that produced it;
2. the frame's 16 codes, embedded and summed with ``T(tts_pad)``, are the talker's input
   at the next position; the talker's logits there give the next ``g0``, and its
   final-normed hidden state is kept in the slot for the next frame.

The frame's codes leave the step as the row's output payload (the stage's per-row hidden
state channel: ``[B, 16]`` float rows, exact for ids below 2**24); a prefill row, which
writes no frame, sends a row of -1. Frame ``k`` thus travels with ``g0(k+1)``: the EOS
token carries the last frame, and a request capped at ``max_new_tokens`` has
``max_new_tokens - 1`` frames, as the reference has.

Predictor sampling is counter-based like the talker's: row draws hash the request's seed
with the talker position and the codebook, so codes do not depend on the batch, the loop,
or a retraction.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..runners.native import NativeModelRunner
from ..runners.sampling import derive_seed
from ..runners.streams import HIGH_PRIORITY
from ..runners.types import BatchResult
from .graphs import FrameGraphs
from .model import SpeechModel
from .prefill_graphs import PREFILL_SPAN, PrefillGraphs
from .sampling import TOP_K_CAP, PredictorSampling, draw_codes

if TYPE_CHECKING:
    from .omni_talker import OmniTalker

__all__ = ["SpeechRunner", "PREDICTOR_KEY", "predictor_settings"]

# The request metadata key holding the predictor's sampling settings
# (``{"temperature", "top_k", "top_p"}``), set by the speech pipeline.
PREDICTOR_KEY = "speech_predictor"


def predictor_settings(temperature: float, top_k: int, top_p: float) -> dict[str, Any]:
    return {"temperature": float(temperature), "top_k": int(top_k), "top_p": float(top_p)}


class SpeechRunner(NativeModelRunner):
    # Frames are played as they come and the codec's calls beside them are bulk work
    # with slack (whole chunks a call): the device starts the talker's kernels first.
    stream_priority = HIGH_PRIORITY
    # Whether frame_text gives each row a text row of its own (the frame graphs then take
    # them as an input; Qwen3-TTS adds T(tts_pad) to every frame inside the forward).
    frame_text_rows = False
    # Prefills run as graphs of decode rows (prefill_graphs), in pieces past the largest:
    # an eager prefill of the chunk's size at the start would only leave its working set
    # cached in the allocator.
    warm_prefill = False

    def __init__(self, speech: "SpeechModel | OmniTalker", kv: Any, device: torch.device, *, seed: int = 0,
                 **options: Any) -> None:
        super().__init__(speech.talker, kv, device, capture_hidden=True, seed=seed, **options)
        self.speech = speech
        self.groups = speech.config.num_code_groups
        hidden = speech.config.talker.hidden_size
        self._hidden = torch.zeros((64, hidden), dtype=speech.dtype, device=device)  # per slot, grown
        self._rows: weakref.WeakKeyDictionary[Any, tuple[float, int, float]] = weakref.WeakKeyDictionary()
        self._seeds: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.frame_graphs: FrameGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None  # short prefills as decode rows (CUDA: graphed)
        self._cols: dict[int, torch.Tensor] = {}
        self._last_sampling: tuple[Any, PredictorSampling] | None = None  # (the step's batch, its settings)
        self.frames_written = 0

    # ------------------------------------------------------------ the talker's steps

    def forward(self, forward_batch: Any) -> BatchResult:
        """A prefill (or chunk): the base forward, or a graph of its rows
        (:mod:`.prefill_graphs`), whose last-position hidden states seed the rows' first
        frame."""
        prefill = self.prefill_graphs
        if prefill is not None and prefill.fits(forward_batch):
            logits, hidden = prefill.run(forward_batch)
            result = BatchResult(logits=logits, hidden_states=hidden)
        else:
            result = super().forward(forward_batch)
        rows = forward_batch.rows
        self._store_hidden(rows.slots_dev, result.hidden_states)
        result.hidden_states = torch.full((forward_batch.batch.size, self.groups), -1.0, device=self.device)
        return result

    def custom_decode_forward(self, fb: Any, batch: Any, requests: list) -> BatchResult:
        slots = fb.rows.slots_dev
        g0 = fb.input_ids
        past = self._hidden.index_select(0, slots)
        sampling = self._predictor_sampling(batch)
        graphs = self.frame_graphs
        text = self.frame_text(fb)
        if fb.block_tables is not None and graphs is not None:
            out = graphs.replay(g0, past, fb.positions, fb.ctx, fb.block_tables, sampling, text)
            logits, hidden, codes = out.logits, out.hidden, out.codes.clone()  # the graph's buffers: copied out
        else:
            logits, hidden, codes = self.frame_forward(g0, past, fb.positions, fb.ctx, sampling, text)
        # In a decode step of several forwards, a row that runs fewer than the others (its
        # length limit, or a frame waiting for its text row) repeats its last position,
        # writing its KV to the scratch page: its carried hidden state stays as it was.
        running = fb.ctx.slot_mapping != (self.kv.num_pages - 1) * self.page_size
        self._store_hidden(slots, torch.where(running[:, None], hidden, past))
        self.frames_written += g0.shape[0]
        return BatchResult(logits=logits, hidden_states=codes.to(torch.float32), can_run_cuda_graph=fb.block_tables is not None)

    def frame_text(self, fb: Any) -> torch.Tensor | None:
        """The text rows ``[B, H]`` this decode step's frames add to the talker's next
        input; None: ``tts_pad`` for every row (Qwen3-TTS, whose text is all in the
        prompt). A talker fed text as it speaks overrides this."""
        return None

    def frame_forward(self, g0: torch.Tensor, past: torch.Tensor, positions: torch.Tensor, ctx: Any,
                      sampling: PredictorSampling, text: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One frame for each row: the predictor's codes after ``g0`` (the row's input,
        codebook 0) from ``past`` (the talker's hidden state that produced it), then the
        talker's forward on the frame's summed embedding (plus ``text``, see
        :meth:`frame_text`). Fixed shapes, no host reads (a frame graph captures this).
        Returns float32 logits, the talker's hidden states and the frame's codes
        ``[B, 16]``."""
        first = self.speech.talker.model.embed_tokens(g0)
        base = positions * self.groups
        rest = self.speech.predictor.frame(past, first, lambda logits, group: draw_codes(logits, sampling, base, group),
                                           ops=self.model.ops, use_kernel=self.use_kernel)
        codes = torch.cat((g0[:, None], rest), dim=1)
        embeds = self.speech.frame_input(codes, text)
        logits, hidden = self.model(g0, positions, self.kv, ctx, return_hidden=True, input_embeds=(self._arange(g0.shape[0]), embeds))
        return logits.float(), hidden, codes

    def _predictor_sampling(self, batch: Any) -> PredictorSampling:
        """Per-row predictor settings (one host pass over rows, cached per request; the
        forwards of a multi-step decode share their step's)."""
        last = self._last_sampling
        if last is not None and last[0] is batch:
            return last[1]
        rows = np.array([self._settings(r) for r in batch.reqs], dtype=np.float64)
        sampled = rows[:, 0] > 0
        seeds = np.array([self._seed(r) for r in batch.reqs], dtype=np.int64)
        dev = self.device
        self._last_sampling = (batch, sampling := PredictorSampling(
            temperature=torch.from_numpy(rows[:, 0].astype(np.float32)).to(dev, non_blocking=True),
            top_k=torch.from_numpy(rows[:, 1].astype(np.int64)).to(dev, non_blocking=True),
            top_p=torch.from_numpy(rows[:, 2].astype(np.float32)).to(dev, non_blocking=True),
            seeds=torch.from_numpy(seeds).to(dev, non_blocking=True),
            sampled=bool(sampled.any()),
            top_k_cap=TOP_K_CAP if sampled.any() and bool(((rows[sampled, 1] > 0) & (rows[sampled, 1] <= TOP_K_CAP)).all()) else 0,
        ))
        return sampling

    def _settings(self, req: Any) -> tuple[float, int, float]:
        found = self._rows.get(req)
        if found is None:
            payload = getattr(req.data, "payload", None)
            meta = getattr(payload, "metadata", None) or {}
            s = meta.get(PREDICTOR_KEY) or {}
            found = (float(s.get("temperature", 0.0)), int(s.get("top_k", 0)), float(s.get("top_p", 1.0)))
            self._rows[req] = found
        return found

    def _seed(self, req: Any) -> int:
        seed = self._seeds.get(req)
        if seed is None:
            base = req.sampling.seed if req.sampling.seed is not None else self.base_seed(req)
            seed = self._seeds[req] = derive_seed("speech-predictor", base)
        return seed

    def _store_hidden(self, slots: torch.Tensor, hidden: torch.Tensor) -> None:
        need = int(self.inputs.table.shape[0])  # the slots the input batch holds
        if need > self._hidden.shape[0]:
            self._grow(need)
        self._hidden.index_copy_(0, slots, hidden.to(self._hidden.dtype))

    def _grow(self, rows: int) -> None:
        grown = torch.zeros((max(rows, 2 * self._hidden.shape[0]), self._hidden.shape[1]), dtype=self._hidden.dtype, device=self.device)
        grown[: self._hidden.shape[0]] = self._hidden
        self._hidden = grown

    def _arange(self, n: int) -> torch.Tensor:
        col = self._cols.get(n)
        if col is None:
            col = self._cols[n] = torch.arange(n, device=self.device)
        return col

    # ------------------------------------------------------------ what does not apply

    def _graph_tables(self, batch: Any, rows: Any, tables: torch.Tensor) -> torch.Tensor | None:
        """Page tables for a decode step that fits a captured frame graph, else None."""
        graphs = self.frame_graphs
        return tables if graphs is not None and graphs.fits(batch.size, rows.widest) else None

    def enable_cuda_graphs(self, *, scratch_page: int, max_len: int, max_batch: int) -> None:
        """Capture the frame graphs and the short prefills' (CUDA only); unused page-table
        entries point at the scratch page, which padding rows write to."""
        self.inputs.set_pad_page(scratch_page)
        pages = -(-max_len // self.page_size)
        self.frame_graphs = FrameGraphs(self, scratch_page=scratch_page, max_pages_per_seq=pages, max_batch=max_batch)
        self.frame_graphs.capture_all()
        self.prefill_graphs = PrefillGraphs(self, scratch_page=scratch_page, max_pages=min(pages, -(-PREFILL_SPAN // self.page_size)),
                                            pool=self.frame_graphs.pool)
        self.prefill_graphs.capture_all()

    def stats(self) -> dict[str, int]:
        graphs = self.frame_graphs
        prefill = self.prefill_graphs
        return {**super().stats(), "speech_frames": self.frames_written,
                "speech_frame_graph_replays": 0 if graphs is None else graphs.replays,
                "speech_prefill_graph_replays": 0 if prefill is None else prefill.replays}

"""Persistent per-slot batch state on the host and the device.

Why: rebuilding every decode step's inputs from per-request Python lists (page tables,
sampling settings, output tokens) costs microseconds per row per step, which at a few
hundred rows is more host time than the device needs for the step. Here each running
request owns a *slot* whose page-table row, sampling settings, token masks and newest
sampled token live in preallocated arrays: a host mirror in numpy and the same state in
device tensors. They change only when a request joins (its first step of an epoch), grows
a page, or leaves; a step then only gathers the rows it needs by slot index, on the
device.

Host-to-device updates go through fresh small pageable tensors, which the driver stages
at once, so the host mirror can change again right away while earlier steps are still
in flight. Every device write is enqueued on the one stream the steps run on, so a step
launched earlier always reads the state as of its own launch.

A slot is keyed by the request object and its epoch (a retraction starts a new epoch and
so a fresh slot). Slots of finished or retracted requests are reclaimed lazily, when a
join finds no free slot, skipping those the current step still names.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from typing import Any, Sequence

import numpy as np
import torch

from .sampling import SamplingBatch, stream_seed
from .slot_controls import SlotControls

# Columns of the float32 and int64 per-slot sampling tables.
TEMP, TOP_P, MIN_P, PENALTY, RAW = range(5)
TOP_K, SEED, MIN_NEW = range(3)
# Steps with more slots than rows between two sweeps for finished requests.
SWEEP_EVERY = 8
# Host-only flags per slot: what its request asks of sampling, set when it joins, so a
# step's sampling mode is one reduction over its rows' flags (fused_sampling.sampling_mode).
WANT_LP, HAS_SUPPRESS, HAS_STOP, SAMPLED, SORTS, MIN_P_ON, PENALISED = range(7)
FLAGS = 7


@dataclass
class SlotRows:
    """Where one step's rows live: slot indices on host and device."""

    slots: np.ndarray  # [B] int64
    slots_dev: torch.Tensor  # [B] int64
    widest: int  # most pages any row has


class InputBatch:
    """Per-slot state: page tables, sampling settings, masks and newest tokens."""

    def __init__(self, page_size: int, vocab: int, device: torch.device, *, slots: int = 64, pages: int = 16) -> None:
        self.page_size = page_size
        self.vocab = vocab
        self.device = device
        self.pad_page = 0  # what unused page-table entries hold (a scratch page under graphs)
        self._slot_of: dict[Any, int] = {}  # req -> its slot (the slot's epoch in slot_epoch)
        # The previous step's rows, epochs, slots (copies: the core reuses its lists) and id.
        self._last: tuple[list[Any], list[int], np.ndarray, int] = ([], [], np.zeros(0, dtype=np.int64), -1)
        self.carried_steps = 0  # steps whose slots were the previous step's by a mask (stats, tests)
        self._free: list[int] = []
        self._idle_sweeps = 0
        self._cap = self._pages_cap = self.grows = 0  # grows: the tables enlarged after they were first made
        self.table = np.zeros((0, 0), dtype=np.int64)
        self.num_pages = np.zeros(0, dtype=np.int64)
        self.slot_epoch = np.zeros(0, dtype=np.int64)  # the epoch of the request holding each slot
        self.fp = np.zeros((0, 5), dtype=np.float32)
        self.ip = np.zeros((0, 3), dtype=np.int64)
        self.flags = np.zeros((0, FLAGS), dtype=bool)
        self.want_hidden = np.zeros(0, dtype=bool)  # the slot's request asked for its hidden states
        self.table_dev = torch.zeros((0, 0), dtype=torch.long, device=device)
        self.fp_dev = torch.zeros((0, 5), dtype=torch.float32, device=device)
        self.ip_dev = torch.zeros((0, 3), dtype=torch.long, device=device)
        self.last_token = torch.zeros(0, dtype=torch.long, device=device)
        self.masks: dict[str, torch.Tensor] = {}  # "seen", "suppress", "stop": [S, V] bool
        self._true = torch.ones((), dtype=torch.bool, device=device)  # mask[r, c] = True would wait for the stream
        self.controls = SlotControls(vocab, device)  # OpenAI penalties and logit bias
        self._grow(slots, pages)
        self._reset_pending()

    # ------------------------------------------------------------ capacity

    def _grow(self, slots: int, pages: int) -> None:
        """Enlarge the tables (doubling), keeping their contents."""
        slots, pages = max(slots, self._cap), max(pages, self._pages_cap)
        if slots == self._cap and pages == self._pages_cap:
            return
        old_s, old_p = self._cap, self._pages_cap
        self.grows += old_s > 0
        table = np.full((slots, pages), self.pad_page, dtype=np.int64)
        table[:old_s, :old_p] = self.table
        self.table = table
        self.num_pages = _grown(self.num_pages, slots)
        self.slot_epoch = _grown(self.slot_epoch, slots)
        self.fp, self.ip, self.flags = _grown(self.fp, slots), _grown(self.ip, slots), _grown(self.flags, slots)
        self.want_hidden = _grown(self.want_hidden, slots)
        table_dev = torch.full((slots, pages), self.pad_page, dtype=torch.long, device=self.device)
        table_dev[:old_s, :old_p] = self.table_dev
        self.table_dev = table_dev
        self.fp_dev = _grown_dev(self.fp_dev, slots)
        self.ip_dev = _grown_dev(self.ip_dev, slots)
        self.last_token = _grown_dev(self.last_token, slots)
        self.masks = {k: _grown_dev(m, slots) for k, m in self.masks.items()}
        self.controls.grow(slots)
        self._free.extend(range(slots - 1, old_s - 1, -1))
        self._cap, self._pages_cap = slots, pages

    def reserve(self, slots: int = 0, pages: int = 0) -> None:
        """Make the tables hold at least ``slots`` slots, ``pages`` pages wide, now."""
        self._grow(slots, pages)

    def set_pad_page(self, page: int) -> None:
        """Unused page-table entries point at ``page`` (before any request joined)."""
        self.pad_page = page
        self.table[:] = page
        self.table_dev.fill_(page)

    def wants_hidden(self, rows: SlotRows) -> bool:
        """Whether a request among ``rows`` asked for its hidden states."""
        return bool(self.want_hidden[rows.slots].any())

    @property
    def slots_in_use(self) -> int:
        return self._cap - len(self._free)

    # ------------------------------------------------------------ per step

    def _reset_pending(self) -> None:
        self._dirty_params: list[int] = []
        self._table_writes: tuple[list[int], list[int], list[int]] = ([], [], [])  # joins' pages, entry by entry
        self._table_chunks: list[np.ndarray] = []  # [3, n] rows, columns, pages of one-page growth
        self._row_resets: list[int] = []
        self._mask_sets: dict[str, tuple[list[int], list[int]]] = {}

    def assign(self, reqs: Sequence[Any], epochs: Sequence[int], page_lists: Sequence[list[int]],
               page_counts: Sequence[int], base_seed, step: tuple[int, Any] = (-1, None)) -> SlotRows:
        """Slots of one step's rows: existing ones grow their page rows; new requests
        (or new epochs) join. Pushes the resulting changes to the device. ``step``: the
        step's id and its ``ScheduledBatch.carried`` (its rows as the previous step's
        at an index array, or None)."""
        # No Python per row for a row that keeps its slot: the slots come from one C-level
        # pass over the rows (or are the previous step's when the rows are the same), the
        # epoch and page-count checks are numpy comparisons, and the rows that grew one
        # page (about one in page_size / k per decode step) are patched together.
        slots, joins = self._lookup(reqs, epochs, step[1])
        counts = np.asarray(page_counts, dtype=np.int64)
        widest = int(counts.max()) if len(counts) else 0
        if joins:
            self._join_rows(reqs, epochs, page_lists, page_counts, joins, slots, base_seed)
        elif len(self._slot_of) > len(reqs):
            # More slots than rows: some request may have left. Sweep every few such
            # steps rather than only at a join, so that a finished request (and whatever
            # its data holds) is not kept alive for long; amortised, it costs little.
            self._idle_sweeps += 1
            if self._idle_sweeps >= SWEEP_EVERY:
                self._idle_sweeps = 0
                self._reclaim({id(r) for r in reqs})
        self._grow_rows(slots, counts, page_lists)
        self._flush()
        self._last = (list(reqs), list(epochs), slots, step[0])
        slots_dev = torch.from_numpy(slots).to(self.device, non_blocking=True)
        return SlotRows(slots=slots, slots_dev=slots_dev, widest=max(widest, 1))

    def _lookup(self, reqs: Sequence[Any], epochs: Sequence[int], carried: Any = None) -> tuple[np.ndarray, list[int]]:
        """Each row's slot (0 for a row that joins) and the rows that join (no slot, or
        one of an older epoch). The previous step's slots when its rows and epochs were
        these (two C-level list comparisons), or its rows' at ``carried[1]`` when
        ``carried`` names it (steady decode, rows ending: one numpy gather): no slot
        was taken from them since, as only ``assign`` reclaims, keeping the rows it names."""
        last_reqs, last_epochs, last_slots, last_step = self._last
        if carried is not None and carried[0] == last_step and _carries(carried[1], reqs, last_reqs):
            self.carried_steps += 1
            return last_slots[carried[1]], []
        if len(reqs) == len(last_reqs) and reqs == last_reqs and epochs == last_epochs:
            return last_slots.copy(), []
        slots = np.array(list(map(self._slot_of.get, reqs, repeat(-1))), dtype=np.int64)
        stale = slots < 0
        stale |= self.slot_epoch[slots] != np.asarray(epochs, dtype=np.int64)  # (-1 reads the last slot: already stale)
        if not stale.any():
            return slots, []
        slots[stale] = 0
        return slots, np.flatnonzero(stale).tolist()

    def _join_rows(self, reqs, epochs, page_lists, page_counts, joins, slots, base_seed) -> None:
        if len(joins) > len(self._free):
            self._reclaim({id(r) for r in reqs})
        if len(joins) > len(self._free):
            self._grow(max(2 * self._cap, self.slots_in_use + len(joins)), self._pages_cap)
        for i in joins:
            req = reqs[i]
            old = self._slot_of.get(req)
            if old is not None:
                self._free.append(old)
            slot = self._free.pop()
            slots[i] = slot
            self._slot_of[req] = slot
            self.slot_epoch[slot] = epochs[i]
            self._write_request(slot, req, base_seed(req))
            self.num_pages[slot] = 0
            self._row_resets.append(slot)
            self.table[slot] = self.pad_page
            self._add_pages(slot, page_lists[i], 0, page_counts[i])

    def _reclaim(self, keep: set[int]) -> None:
        """Free the slots of requests that finished or were retracted (their epoch moved
        on), except those the current step names."""
        for req, slot in list(self._slot_of.items()):
            if id(req) in keep:
                continue
            if req.finished() or req.epoch != self.slot_epoch[slot]:
                del self._slot_of[req]
                self._free.append(slot)

    def _grow_rows(self, slots: np.ndarray, counts: np.ndarray, page_lists: Sequence[list[int]]) -> None:
        """Rows whose request grew pages since its slot last saw them (joined rows are
        up to date). Those that grew one page, every decode step's case (k <= page_size),
        take it in one comprehension and three numpy writes; others page by page."""
        grown = np.flatnonzero(counts > self.num_pages[slots])
        if not len(grown):
            return
        at, new = slots[grown], counts[grown]
        old = self.num_pages[at]
        if int(new.max()) > self._pages_cap:
            self._grow(self._cap, max(2 * self._pages_cap, int(new.max())))
        one = new - old == 1
        if not one.all():
            for i in grown[~one].tolist():
                slot = int(slots[i])
                self._add_pages(slot, page_lists[i], int(self.num_pages[slot]), int(counts[i]))
            grown, at, old = grown[one], at[one], old[one]
            if not len(grown):
                return
        vals = np.array([page_lists[i][o] for i, o in zip(grown.tolist(), old.tolist())], dtype=np.int64)
        self.table[at, old] = vals
        self.num_pages[at] = old + 1
        self._table_chunks.append(np.array([at, old, vals]))

    def _add_pages(self, slot: int, pages: list[int], start: int, end: int) -> None:
        if end > self._pages_cap:
            self._grow(self._cap, max(2 * self._pages_cap, end))
        new = pages[start:end]
        self.table[slot, start:end] = new
        self.num_pages[slot] = end
        rows, cols, vals = self._table_writes
        rows.extend([slot] * (end - start))
        cols.extend(range(start, end))
        vals.extend(new)

    def _write_request(self, slot: int, req: Any, unseeded_base: int | None) -> None:
        """A joining request's sampling settings and token masks."""
        sp = req.sampling
        seed = sp.resolved_seed if sp.resolved_seed is not None else unseeded_base
        seed = stream_seed(seed or 0, req.num_rewinds)  # a rewound row's draws (structured.optimistic)
        self.fp[slot] = (sp.temperature, sp.top_p, sp.min_p, sp.repetition_penalty, sp.logprobs_mode == "raw")
        self.ip[slot] = (sp.top_k, seed or 0, sp.min_new_tokens)
        stop = sorted(req.stop_ids()) if sp.min_new_tokens > 0 else []
        f, i = self.fp[slot], self.ip[slot]  # read back as stored (float32), as the device sees them
        sampled = bool(f[TEMP] != 0)
        self.flags[slot] = (sp.return_logprob, bool(sp.suppress_tokens), bool(stop), sampled,
                            sampled and bool(0 < i[TOP_K] < self.vocab or f[TOP_P] < 1), sampled and bool(f[MIN_P] > 0),
                            bool(f[PENALTY] != 1))
        self.want_hidden[slot] = sp.return_hidden_states
        self._dirty_params.append(slot)
        self.controls.join(slot, sp, req.output_ids)
        wanted = {
            "seen": (sp.repetition_penalty != 1.0, list(req.output_ids)),
            "suppress": (bool(sp.suppress_tokens), sp.suppress_tokens),
            "stop": (bool(stop), stop),
        }
        for name, (needed, ids) in wanted.items():
            if needed and name not in self.masks:
                self.masks[name] = torch.zeros(self._cap, self.vocab, dtype=torch.bool, device=self.device)
            if name in self.masks:
                rows, cols = self._mask_sets.setdefault(name, ([], []))
                ids = [t for t in ids if 0 <= t < self.vocab]
                rows.extend([slot] * len(ids))
                cols.extend(ids)

    def _flush(self) -> None:
        """Push this step's joins and page growth to the device."""
        dev = self.device
        if self._row_resets:
            resets = _to_dev(self._row_resets, dev)
            self.table_dev.index_fill_(0, resets, self.pad_page)
            for mask in self.masks.values():
                mask.index_fill_(0, resets, False)
        rows, cols, vals = self._table_writes
        chunks = ([np.array([rows, cols, vals], dtype=np.int64)] if rows else []) + self._table_chunks
        if chunks:
            host = chunks[0] if len(chunks) == 1 else np.concatenate(chunks, axis=1)
            rows_dev, cols_dev, vals_dev = torch.from_numpy(host).to(dev, non_blocking=True)  # (one unbind, not three indexings)
            self.table_dev.index_put_((rows_dev, cols_dev), vals_dev)
        for name, (mrows, mcols) in self._mask_sets.items():
            if mrows:
                rc = torch.from_numpy(np.array([mrows, mcols], dtype=np.int64)).to(dev, non_blocking=True)
                self.masks[name].index_put_((rc[0], rc[1]), self._true)
        self.controls.flush()
        if self._dirty_params:
            idx = np.array(self._dirty_params, dtype=np.int64)
            idx_dev = torch.from_numpy(idx).to(dev, non_blocking=True)
            self.fp_dev.index_copy_(0, idx_dev, torch.from_numpy(self.fp[idx]).to(dev, non_blocking=True))
            self.ip_dev.index_copy_(0, idx_dev, torch.from_numpy(self.ip[idx]).to(dev, non_blocking=True))
        self._reset_pending()

    # ------------------------------------------------------------ reads

    def block_tables(self, rows: SlotRows) -> torch.Tensor:
        """``[B, widest]`` page tables of the step's rows, on the device."""
        return self.table_dev.index_select(0, rows.slots_dev)[:, : rows.widest]

    def host_pages(self, slot: int, count: int) -> np.ndarray:
        return self.table[slot, :count]

    def publish(self, rows_dev: torch.Tensor, tokens: torch.Tensor) -> None:
        """Record each slot's newest sampled token (a decode input still in flight reads
        it) and mark it seen for the repetition penalty."""
        self.last_token.index_copy_(0, rows_dev, tokens)
        if (seen := self.masks.get("seen")) is not None:
            seen.index_put_((rows_dev, tokens), self._true)
        self.controls.publish(rows_dev, tokens)

    def publish_forward(self, rows_dev: torch.Tensor, tokens: torch.Tensor, j: int, steps: Sequence[int]) -> None:
        """``publish`` after forward ``j`` of a multi-step decode's ``[k, B]`` ``tokens``,
        whose rows run ``steps`` forwards each: a row publishes the tokens of its own
        forwards only. One that runs fewer (a row under a grammar's mask, one at its length
        limit) and goes on next step must not count its discarded forwards' samples as
        seen or generated: its penalties would be wrong from then on. Later forwards read
        the tokens before them directly, so without penalties (which read every token as
        it is sampled) one publish at the last forward records each row's last own token."""
        k = tokens.shape[0]
        run = np.asarray(steps)
        if "seen" in self.masks or self.controls.counts is not None:
            live = np.flatnonzero(run > j)
            if len(live) == len(run):
                self.publish(rows_dev, tokens[j])
            elif len(live):
                idx = torch.from_numpy(live).to(self.device, non_blocking=True)
                self.publish(rows_dev.index_select(0, idx), tokens[j].index_select(0, idx))
        elif j == k - 1:
            if run.min() >= k:
                self.publish(rows_dev, tokens[j])
            else:
                last = torch.from_numpy(np.minimum(run, k) - 1).to(self.device, non_blocking=True)
                self.publish(rows_dev, tokens.gather(0, last[None, :]).squeeze(0))

    def publish_steps(self, rows_dev: torch.Tensor, tokens: torch.Tensor) -> None:
        """``publish`` for a multi-step decode's ``[k, B]`` tokens at once: the last
        forward's are the newest, all of them are seen."""
        self.last_token.index_copy_(0, rows_dev, tokens[-1])
        if (seen := self.masks.get("seen")) is not None:
            seen.index_put_((rows_dev.expand(tokens.shape[0], -1).reshape(-1), tokens.reshape(-1)), self._true)

    def sampling_batch(self, rows: SlotRows, sample_indices: np.ndarray, sample_indices_dev: torch.Tensor) -> SamplingBatch:
        """Sampling inputs of a step's rows, gathered on the device by slot. What runs is
        chosen from the host mirror, so nothing waits on the device."""
        s = rows.slots
        fp_h, ip_h, flags = self.fp[s], self.ip[s], self.flags[s]
        fp = self.fp_dev.index_select(0, rows.slots_dev)
        ip = self.ip_dev.index_select(0, rows.slots_dev)
        sampled = np.flatnonzero(fp_h[:, TEMP] != 0)
        n = len(s)
        sb = SamplingBatch(
            temperature=fp[:, TEMP], top_k=ip[:, TOP_K], top_p=fp[:, TOP_P], min_p=fp[:, MIN_P],
            seeds=ip[:, SEED], sample_indices=sample_indices_dev,
            sampled_rows=_to_dev(sampled, self.device) if 0 < len(sampled) < n else None,
            num_sampled=len(sampled),
            use_top_k=bool(((ip_h[sampled, TOP_K] > 0) & (ip_h[sampled, TOP_K] < self.vocab)).any()),
            use_top_p=bool((fp_h[sampled, TOP_P] < 1).any()),
            use_min_p=bool((fp_h[sampled, MIN_P] > 0).any()),
            want_logprobs=bool(flags[:, WANT_LP].any()),
        )
        if (fp_h[:, PENALTY] != 1).any():
            sb.penalty = fp[:, PENALTY]
            sb.seen = self.masks["seen"].index_select(0, rows.slots_dev)
        sb.ban = self._ban(rows, flags, ip_h, sample_indices)
        sb.controls = self.controls.gather(s, rows.slots_dev)
        if sb.want_logprobs and fp_h[:, RAW].any():
            sb.raw_logprobs = fp[:, RAW] > 0
        return sb

    def _ban(self, rows: SlotRows, flags: np.ndarray, ip_h: np.ndarray, sample_indices: np.ndarray) -> torch.Tensor | None:
        ban = None
        if flags[:, HAS_SUPPRESS].any():
            ban = self.masks["suppress"].index_select(0, rows.slots_dev)
        early = flags[:, HAS_STOP] & (sample_indices < ip_h[:, MIN_NEW])
        if early.any():
            stop = self.masks["stop"].index_select(0, rows.slots_dev) & _to_dev(early, self.device)[:, None]
            ban = stop if ban is None else ban | stop
        return ban


def _carries(idx: np.ndarray, reqs: Sequence[Any], last: Sequence[Any]) -> bool:
    """Whether ``reqs`` can be ``last`` at ``idx``: as many, the same ends (``ScheduledBatch.carried`` vouches for the rest)."""
    n, end = len(reqs), int(idx[-1]) if len(idx) else -1
    return n == len(idx) > 0 and end < len(last) and reqs[0] is last[int(idx[0])] and reqs[-1] is last[end]


def _to_dev(values: Any, device: torch.device) -> torch.Tensor:
    arr = np.asarray(values)
    if arr.dtype != np.bool_:
        arr = arr.astype(np.int64, copy=False)
    return torch.from_numpy(np.ascontiguousarray(arr)).to(device, non_blocking=True)


def _grown(a: np.ndarray, rows: int) -> np.ndarray:
    out = np.zeros((rows,) + a.shape[1:], dtype=a.dtype)
    out[: a.shape[0]] = a
    return out


def _grown_dev(t: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.zeros((rows,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out

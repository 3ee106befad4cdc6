"""The model-runner contract, backend-neutral: one launch path and one collect path.

``launch`` runs on the worker thread: it builds the step's inputs, calls the
prefill/decode hooks, runs the forward, samples on the device, enqueues one
non-blocking copy of the step's tokens (and logprobs, and the per-row ``ok`` flags) to
pinned host memory, and records a completion marker. The loop awaits that marker
cooperatively and then calls ``collect`` on its own thread, which reads the host copy
and does the per-request bookkeeping. Splitting the step there is what lets a loop
keep the next step launched while this one's result is processed.

``collect`` always skips rows that are no longer live (finished or retracted after the
step was scheduled): they get no token and their ``generation_steps`` does not
advance, so every loop counts steps the same way.

Every hook of the reference contract is here and called at the same point;
subclasses provide ``build_forward_batch``, ``forward`` and ``sampling_batch``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .sampling import RowSampling, SampleResult, SamplingBatch, SeedSource, batch_from_rows, sample
from ..core.runner_io import ModelRunnerOutput, RequestOutput, SchedulerOutput
from .hooks import RunnerHooks
from .host_copy import copy_to_host, host_values, live_rows, rows_ok
from .pending import PendingStep
from .streams import STREAMS
from .types import BatchResult
from ..structured.batch_mask import GrammarMasks


NO_TOKEN_MESSAGE = (
    "no admissible token: the sampling settings ban every token at this step "
    "(suppress_tokens, stop ids before min_new_tokens) or the logits are not finite"
)


# Hooks whose override turns mixed prefill steps off (ModelRunner.mixed_prefill_allowed).
_MIXED_SENSITIVE_HOOKS = (
    "before_prefill", "before_decode", "custom_prefill_forward", "custom_decode_forward", "post_prefill", "post_decode",
    "sample_before_post_prefill", "sample_before_post_decode", "requested_capture_hidden_mode_prefill",
    "requested_capture_hidden_mode_decode",
)


class ModelRunner(RunnerHooks):
    """Base AR model runner: phase hooks, device sampling, one host copy per step."""

    device: torch.device = torch.device("cpu")
    # Every request's hidden states go out with its step outputs (a thinker feeding a
    # talker), not only those of requests that ask (``SamplingParams.return_hidden_states``).
    capture_hidden: bool = False
    # The CUDA priority of the runner's own stream: 0, the default; a stage whose steps
    # are paced by a listener raises it over bulk work beside it.
    stream_priority: int = 0
    # Whether a CUDA stage's warm-up runs prefills of its chunk's size (kernel_warmup.py).
    warm_prefill: bool = True

    def mixed_prefill_allowed(self) -> bool:
        """Whether running requests' decode rows may ride in a prefill step (the batch
        core's ``mixed_prefill``): not for a runner that overrides a prefill or decode
        hook, which expects a prefill step to hold prompts only and each decode row to
        go through its decode hooks."""
        cls = type(self)
        return all(getattr(cls, name) is getattr(RunnerHooks, name) for name in _MIXED_SENSITIVE_HOOKS)

    def __init__(self, *, seed: int = 0) -> None:
        self._seed_source = SeedSource(seed)
        self.grammar_masks = GrammarMasks()  # constrained rows' bitmasks, filled per step
        # Base seeds of unseeded requests, drawn once per request (kept across
        # retraction) and forgotten with the request.
        self._base_seeds: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        # The CUDA stream every step is launched on (None: the current one). A stage of its
        # own (``use_own_stream``) lets two stages on one GPU queue work independently.
        self.stream: Any = None

    # ------------------------------------------------------------ backend parts

    def build_forward_batch(self, scheduler_output: SchedulerOutput, capture_hidden_mode: Any = None) -> Any:
        """Turn the scheduled step into device inputs; ``capture_hidden_mode`` (from the
        ``requested_capture_hidden_mode_*`` hooks) asks for the step's hidden states."""
        raise NotImplementedError

    def forward(self, forward_batch: Any) -> BatchResult:
        """The standard forward: logits of the rows to sample."""
        raise NotImplementedError

    def sampling_batch(self, forward_batch: Any, schedule_batch: Any, requests: list, vocab: int) -> SamplingBatch:
        """Per-row sampling inputs on the device. The default builds them from each
        row's request (Python per row); runners with persistent slot state override."""
        want = any(sr.data.return_logprob for sr in requests)
        rows = [
            RowSampling(
                params=sr.data.req.sampling,
                request_id=sr.request_id,
                sample_index=schedule_batch.sample_indices[i],
                output_ids=self.row_output_ids(forward_batch, schedule_batch, i)
                if sr.data.req.sampling.repetition_penalty != 1.0 or sr.data.req.sampling.has_logit_controls
                else (),
                stop_ids=sorted(sr.data.req.stop_ids()),
                base_seed=self.base_seed(sr.data.req),
                rewinds=sr.data.req.num_rewinds,
            )
            for i, sr in enumerate(requests)
        ]
        return batch_from_rows(rows, vocab, self.device, want)

    def row_output_ids(self, forward_batch: Any, schedule_batch: Any, row: int) -> list[int]:
        """Tokens a row's request generated before this step (repetition penalty), for
        the default ``sampling_batch``; a runner adds a decode input still in flight."""
        return list(schedule_batch.reqs[row].output_ids)

    def publish_tokens(self, result: BatchResult, forward_batch: Any, schedule_batch: Any) -> None:
        """Make this step's tokens available on the device to the next step's inputs,
        before the host has seen them."""

    def base_seed(self, req: Any) -> int | None:
        """The base seed of an unseeded request (None for a seeded one)."""
        if req.sampling.seed is not None:
            return None
        seed = self._base_seeds.get(req)
        if seed is None:
            seed = self._base_seeds[req] = self._seed_source.draw()
        return seed

    def stats(self) -> dict[str, Any]:
        return self.grammar_masks.stats()  # runner counters for the stage's info()

    def record_completion(self) -> Any:
        """A marker that is done once the device finished the work enqueued so far:
        a CUDA event on CUDA, None on CPU (where the launch ran to completion)."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(blocking=True)
            event.record()
            return event
        return None

    # ------------------------------------------------------------ the two paths

    def use_own_stream(self, device: torch.device) -> None:
        """Launch every step on a CUDA stream of this runner's own.

        Two stages that share a GPU on one stream serialise: each step of one waits
        behind whatever the other queued before it, so a lookahead loop's step in flight
        holds the other stage's next step back; and the small kernels of a small model
        cannot run beside the other stage's. Own streams queue independently. Work on the
        default stream (weights loaded or updated, caches filled) is waited for at each
        launch, an event wait on the device. The stream has ``stream_priority``
        (see :mod:`~omni_async.runners.streams`)."""
        self.stream = STREAMS.take(device, self.stream_priority)

    def release_stream(self) -> None:
        """Hand the stream back for a later stage (closing): the libraries key per-stream
        state to it (cuBLAS keeps a 32 MiB workspace for each stream it has run on), so a
        stream made per engine grew the device's memory by that much with every engine."""
        stream, self.stream = self.stream, None
        if stream is not None:
            STREAMS.give_back(stream)

    def launch(self, scheduler_output: SchedulerOutput, *, lookahead: bool = False) -> PendingStep | None:
        """Build, hooks, forward, sample, one host copy, completion marker; no wait.
        ``lookahead`` launches a decode step whose host half runs
        ``post_decode_resolve`` at collect. None for an empty batch. A batch sampling
        under late masks (``late_masks``) enqueues its forward only: its ``PendingStep``
        has ``masks_due``, and :meth:`sample_pending` finishes it."""
        stream = self.stream
        if stream is None:
            return self._launch(scheduler_output, lookahead)
        stream.wait_stream(torch.cuda.default_stream(stream.device))
        with torch.cuda.stream(stream):
            return self._launch(scheduler_output, lookahead)

    def sample_pending(self, pending: PendingStep) -> PendingStep:
        """The second half of a launch whose masks were due, called (on the thread that
        launched it) once the host has processed the step before: by then its constrained
        rows' matchers have accepted their last tokens and the mask worker has (or is
        computing) their masks, which the forward did not need. Fills the masks, samples,
        runs the post hook, publishes the tokens, one host copy, the completion marker."""
        if self.stream is None:
            return self._sample_pending(pending)
        with torch.cuda.stream(self.stream):
            return self._sample_pending(pending)

    @torch.inference_mode()
    def _sample_pending(self, pending: PendingStep) -> PendingStep:
        started, pending.started, pending.masks_due = pending.started, None, False
        pending.batch_result, pending.launch_buf = self._sample_started(
            started, pending.forward_batch, pending.schedule_batch, pending.scheduler_output.requests, pending.lookahead)
        return self._finish_launch(pending)

    def _enqueue_forward(self, fb: Any, batch: Any, requests: list, lookahead: bool) -> Any:
        """A late-mask launch's device work before its masks (:meth:`sample_pending`
        continues it with :meth:`_sample_started`): the forward. A runner that runs a
        multi-step decode forward by forward enqueues its first forward."""
        return self._forward(fb, batch, requests, False, lookahead)

    def _sample_started(self, started: Any, fb: Any, batch: Any, requests: list, lookahead: bool) -> tuple[BatchResult, Any]:
        """The rest of a launch :meth:`_enqueue_forward` began: the result and launch buffer."""
        return started, self._after_forward(started, fb, batch, requests, False, lookahead)

    @torch.inference_mode()
    def _launch(self, scheduler_output: SchedulerOutput, lookahead: bool) -> PendingStep | None:
        batch = scheduler_output.batch_data
        if batch is None or not batch.reqs:
            return None
        is_prefill = batch.mode.is_extend()
        if lookahead and is_prefill:
            raise ValueError("a lookahead launch is for decode steps only")
        requests = scheduler_output.requests
        capture = (
            self.requested_capture_hidden_mode_prefill(batch, requests)
            if is_prefill
            else self.requested_capture_hidden_mode_decode(batch, requests)
        )
        fb = self.build_forward_batch(scheduler_output, capture_hidden_mode=capture)
        if getattr(batch, "late_masks", False):  # (core.multi_step.late_mask_rows)
            started = self._enqueue_forward(fb, batch, requests, lookahead)
            return PendingStep(None, scheduler_output, fb, None, lookahead, masks_due=True, started=started)
        result, launch_buf = self._forward_and_sample(fb, batch, requests, is_prefill, lookahead)
        return self._finish_launch(PendingStep(None, scheduler_output, fb, result, lookahead, launch_buf))

    def _finish_launch(self, pending: PendingStep) -> PendingStep:
        """The sampled step's tokens published to the next step's inputs, copied to the
        host, and the completion marker recorded after that copy."""
        result = pending.batch_result
        self.publish_tokens(result, pending.forward_batch, pending.schedule_batch)
        pending.host, pending.copied = copy_to_host(result), result.next_token_ids
        pending.event = self.record_completion()
        return pending

    def _forward_and_sample(self, fb: Any, batch: Any, requests: list, is_prefill: bool, lookahead: bool):
        """The hooks around the forward, in the reference's order, and sampling at the
        point they choose (before the post hook when asked, and always under lookahead,
        whose post hook publishes the sampled ids)."""
        result = self._forward(fb, batch, requests, is_prefill, lookahead)
        return result, self._after_forward(result, fb, batch, requests, is_prefill, lookahead)

    def _forward(self, fb: Any, batch: Any, requests: list, is_prefill: bool, lookahead: bool) -> BatchResult:
        """The pre hook and the forward (a hook's custom forward when it gives one)."""
        if is_prefill:
            self.before_prefill(fb, batch, requests)
            result = self.custom_prefill_forward(fb, batch, requests)
        else:
            self.before_decode(fb, batch, requests, is_lookahead=lookahead)
            result = self.custom_decode_forward(fb, batch, requests)
        return self.forward(fb) if result is None else result

    def _after_forward(self, result: BatchResult, fb: Any, batch: Any, requests: list, is_prefill: bool, lookahead: bool) -> Any:
        """Sampling and the post hook, in the reference's order; the lookahead's launch
        buffer (None without lookahead)."""
        early = (
            self.sample_before_post_prefill(fb, batch, requests)
            if is_prefill
            else self.sample_before_post_decode(fb, batch, requests)
        )
        if result.next_token_ids is None and (early or lookahead):
            self._sample_into(result, fb, batch, requests)
        launch_buf = None
        if lookahead:
            launch_buf = self.post_decode_launch(result, fb, requests)
        elif is_prefill:
            self.post_prefill(result, fb, batch, requests)
        else:
            self.post_decode(result, fb, batch, requests)
        if result.next_token_ids is None:
            self._sample_into(result, fb, batch, requests)
        return launch_buf

    def collect(self, pending: PendingStep) -> ModelRunnerOutput:
        """After the step's marker completed: ``post_decode_resolve`` for a lookahead
        step, the host values, per-request outputs and bookkeeping for live rows."""
        if self.stream is None:
            return self._collect(pending)
        with torch.cuda.stream(self.stream):
            return self._collect(pending)

    @torch.inference_mode()
    def _collect(self, pending: PendingStep) -> ModelRunnerOutput:
        so, batch, result = pending.scheduler_output, pending.schedule_batch, pending.batch_result
        if pending.masks_due:
            raise RuntimeError("a step launched without its sampling was collected (sample_pending was not called)")
        requests = so.requests
        if pending.lookahead:
            self.post_decode_resolve(pending.launch_buf, result, pending.forward_batch, batch, requests)
        host = pending.host
        if host is None or result.next_token_ids is not pending.copied:
            host = copy_to_host(result, wait=True)  # a hook replaced the tokens
        token_ids, ok, logprobs = host_values(host, batch.size)  # ok: None when every row sampled
        steps = getattr(batch, "row_steps", None)  # a multi-step decode: tokens forward-major
        if steps is not None and ok is not None:
            ok = rows_ok(ok, steps)
        live = live_rows(batch.samples_kept, batch.reqs, batch.epochs)  # not finished or retracted since scheduled
        taken = live if ok is None else [i for i in live if ok[i]]
        row_errors = {} if ok is None else {i: NO_TOKEN_MESSAGE for i in live if not ok[i]}
        hidden = result.hidden_states
        if hidden is not None and (hidden.dim() < 2 or hidden.shape[-2] != batch.size):
            hidden = None  # not one row per sampled row (e.g. a hook's capture of every position)
        out = ModelRunnerOutput(
            requests=requests, token_ids=token_ids, logprobs=logprobs, row_errors=row_errors, taken=taken,
            can_run_cuda_graph=result.can_run_cuda_graph, row_steps=steps,
            hidden_states=hidden, hidden_for_all=self.capture_hidden,
            prompt_hidden=result.prompt_hidden, prompt_logprobs=result.prompt_logprobs,
        )
        if result.top_ids is not None or self.wants_request_outputs(result):
            outputs = out.outputs
            if result.top_ids is not None:
                self._attach_top_logprobs(result, requests, taken, outputs)
            self.post_process_outputs(result, so, outputs)
        self._advance(so, pending.forward_batch, taken, out.built_outputs or {}, steps)
        return out

    def wants_request_outputs(self, result: BatchResult) -> bool:
        """Whether this step needs a ``RequestOutput`` per request: for a subclass's own
        ``post_process_outputs`` (one marked :func:`hidden_states_only` only on a step
        with hidden states) or a step hook. Plain steps skip them."""
        hook = type(self).post_process_outputs
        if hook is ModelRunner.post_process_outputs:
            custom = False
        elif getattr(hook, "hidden_states_only", False):
            custom = result.hidden_states is not None and self.capture_hooked()
        else:
            custom = True
        return custom or self._step_hooked()

    def capture_hooked(self) -> bool:
        """Whether a subclass's capture hook (``requested_capture_hidden_mode_*``) decides
        which steps capture hidden states (the reference's ``extra["hidden_state"]``)."""
        cls = type(self)
        return (cls.requested_capture_hidden_mode_decode is not RunnerHooks.requested_capture_hidden_mode_decode
                or cls.requested_capture_hidden_mode_prefill is not RunnerHooks.requested_capture_hidden_mode_prefill)

    def _step_hooked(self) -> bool:
        cls, own = type(self), self.__dict__
        return (
            cls.on_generation_steps_advanced is not ModelRunner.on_generation_steps_advanced
            or cls.on_generation_step_advanced is not ModelRunner.on_generation_step_advanced
            or "on_generation_steps_advanced" in own  # a hook set on the instance
            or "on_generation_step_advanced" in own
        )

    @staticmethod
    def _attach_top_logprobs(result: BatchResult, requests: list, rows: list[int], outputs: dict[str, RequestOutput]) -> None:
        """``extra["top_logprobs"]``: each row's asked-for most likely (token, logprob)
        pairs. Read once the step completed (a small copy, only when a row asked)."""
        ids, lps = result.top_ids.tolist(), result.top_logprobs.tolist()
        for i in rows:
            k = requests[i].data.req.sampling.top_logprobs
            if k:
                outputs[requests[i].request_id].extra["top_logprobs"] = list(zip(ids[i][:k], lps[i][:k]))

    def _advance(self, so: SchedulerOutput, forward_batch: Any, rows: list[int], outputs: dict[str, RequestOutput], steps: list[int] | None = None) -> None:
        """Commit ``generation_steps`` for the rows that got a token."""
        skip = self.finalize_skip_rids(so)
        requests = so.requests
        if not outputs and not skip and steps is not None:  # a plain multi-step decode: one pass
            for sr, k in zip(requests, steps) if len(rows) == len(requests) else ((requests[i], steps[i]) for i in rows):
                sr.data.generation_steps += k
            return
        if steps is not None:  # a multi-step decode: each row advanced by its forwards
            for i in rows:
                if not (skip and requests[i].request_id in skip):
                    requests[i].data.generation_steps += steps[i] - 1
        if not outputs and not skip:  # a plain step: only the counters move
            for i in rows:
                requests[i].data.generation_steps += 1
            return
        hooked = self._step_hooked()
        advanced = []
        for i in rows:
            sr = requests[i]
            rid = sr.request_id
            if skip and rid in skip:
                continue
            data = sr.data
            data.generation_steps += 1
            if hooked:
                advanced.append((sr, data.generation_steps))
            out = outputs.get(rid)
            if out is not None and out.extra:
                data.extra_model_outputs.update(out.extra)
        if advanced:  # only a runner that overrides a hook pays for the list
            self.on_generation_steps_advanced(advanced, forward_batch)

    # ------------------------------------------------------------ sampling

    def _sample_into(self, result: BatchResult, forward_batch: Any, schedule_batch: Any, requests: list) -> None:
        sb = self.sampling_batch(forward_batch, schedule_batch, requests, result.logits.shape[-1])
        sb.allowed = self.grammar_masks.fill(schedule_batch, result.logits.shape[-1], self.device)
        top_k = max((sr.data.req.sampling.top_logprobs for sr in requests), default=0) if sb.want_logprobs else 0
        res = self.sample_logits(result, sb, top_k)
        result.next_token_ids, result.next_token_logprobs, result.sample_ok = res.tokens, res.logprobs, res.ok
        result.top_ids, result.top_logprobs = res.top_ids, res.top_logprobs

    def sample_logits(self, result: BatchResult, sb: SamplingBatch, top_k_logprobs: int) -> SampleResult:
        """Sample the step's logits; a runner may answer from work its graph already did."""
        return sample(result.logits, sb, top_k_logprobs)

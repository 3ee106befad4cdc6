"""Prometheus metrics for an Engine (prometheus-client, in the ``serve`` extra).

Two sources, so neither the stage nor the request path pays for the other:

- stage figures (running and waiting requests, KV pages, steps, tokens out) are read from
  ``engine.scheduler.info()`` when the registry is scraped, not on every step;
- per-request figures (requests by finish reason, prompt, prefix-cached and generated
  tokens, time to first token, inter-token latency, end-to-end latency), each labelled
  with the served ``model`` name, are recorded where a request's
  output passes: :meth:`EngineMetrics.observe` wraps the iteration of a handle. The HTTP
  server does this for every request; an application embedding the engine does the same.

``registry`` is an ordinary ``CollectorRegistry``: mount it in your own app with
``prometheus_client.make_asgi_app(registry=metrics.registry)`` or render it with
:meth:`EngineMetrics.render`.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from .. import errors
from .errors import status_of
from .prompt_list import prompt_cached_tokens
from ..messages import GenerationResult, StreamDelta

if TYPE_CHECKING:
    from ..engine import Engine
    from ..client.handle import RequestHandle

__all__ = ["CONTENT_TYPE_LATEST", "EngineMetrics", "stage_load"]

PREFIX = "omni_async"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0, 2.0)


def stage_load(info: dict[str, Any]) -> dict[str, Any]:
    """The stage's load from one ``info()`` snapshot: the one place the gauges and the
    router endpoints (``/get_load``, ``/get_server_info``) take it from."""
    total = int(info.get("kv_total_pages", 0))
    free = int(info.get("kv_free_pages", total))
    page = int(info.get("page_size", 1) or 1)
    return {
        "num_requests_running": int(info.get("running_batch_size", 0)),
        "num_requests_waiting": int(info.get("waiting_queue_size", 0)),
        "kv_pages_used": total - free,
        "kv_pages_total": total,
        "kv_tokens_used": (total - free) * page,
        "kv_cache_usage_perc": (total - free) / total if total else 0.0,
    }


class StageCollector:
    """Reads the stages' counters at scrape time (a custom collector: no per-step cost).

    One engine: its figures unlabelled (the text server's). Several, by name
    (``{"thinker": ..., "talker": ...}``, the Omni chat server's): each figure once, with
    a ``stage`` label per engine, so a family is never written twice."""

    def __init__(self, engines: "Engine | Mapping[str, Engine]") -> None:
        self._stages: list[tuple[str | None, Engine]] = (
            [(None, engines)] if not isinstance(engines, Mapping) else list(engines.items()))

    def describe(self) -> list[Any]:
        return []  # unchecked: the figures depend on what info() reports

    def _family(self, kind: type, name: str, doc: str, values: list[tuple[str | None, float]]) -> Any:
        if values and values[0][0] is None:
            return kind(f"{PREFIX}_{name}", doc, value=float(values[0][1]))
        family = kind(f"{PREFIX}_{name}", doc, labels=["stage"])
        for stage, value in values:
            family.add_metric([stage], float(value))
        return family

    def collect(self) -> Iterator[Any]:
        infos = [(stage, engine.scheduler.info()) for stage, engine in self._stages]
        loads = [(stage, stage_load(info)) for stage, info in infos]
        for name, (doc, key) in _STAGE_GAUGES.items():
            yield self._family(GaugeMetricFamily, name, doc, [(stage, load[key]) for stage, load in loads])
        for name, (doc, key) in _STAGE_COUNTERS.items():
            yield self._family(CounterMetricFamily, name, doc, [(stage, info.get(key, 0)) for stage, info in infos])


# name: (help, the key of stage_load's figures)
_STAGE_GAUGES = {
    # The names vLLM's and SGLang's schedulers (llm-d, the router's load monitors) read,
    # under this project's prefix ...
    "num_requests_running": ("Requests in the running batch", "num_requests_running"),
    "num_requests_waiting": ("Requests waiting for admission or a first step", "num_requests_waiting"),
    "kv_cache_usage_perc": ("Fraction of KV cache pages in use (0 to 1)", "kv_cache_usage_perc"),
    # ... and the names this project exported first.
    "requests_running": ("Requests in the running batch", "num_requests_running"),
    "requests_waiting": ("Requests waiting for admission or a first step", "num_requests_waiting"),
    "kv_pages_used": ("KV cache pages in use", "kv_pages_used"),
    "kv_pages_total": ("KV cache pages in all", "kv_pages_total"),
    "kv_cache_usage_ratio": ("Fraction of KV cache pages in use", "kv_cache_usage_perc"),
}
# name: (help, the key of info())
_STAGE_COUNTERS = {
    "steps": ("Model steps run by the stage", "steps"),
    "stage_tokens": ("Tokens produced by the stage (all requests)", "tokens_out"),
    "failed_steps": ("Model steps that raised", "failed_steps"),
    "retractions": ("Requests retracted under KV pressure", "num_retractions"),
    "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache", "prefix_cache_lookup_tokens"),
    "prefix_cache_hits": ("Prompt tokens found in the prefix cache", "prefix_cache_hit_tokens"),
}


class TokenHistogram:
    """A histogram observed once per streamed token (inter-token latency), exported at
    scrape time as an ordinary Prometheus histogram with a ``model`` label.

    prometheus_client's ``Histogram.observe`` walks its buckets in Python and takes a
    lock per bucket touched: several microseconds a token on the loop the engine shares.
    Here an observation is a bisect and two additions (the loop is the only writer and
    scrapes run on it too)."""

    def __init__(self, name: str, documentation: str, model: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.model = model
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """``count`` observations of ``value`` (a merged delta's tokens share its gap)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model"])
        cumulative, buckets = 0, []
        for bound, count in zip(self.bounds, self.counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        buckets.append(("+Inf", cumulative + self.counts[-1]))
        family.add_metric([self.model], buckets, self.sum)
        yield family


class RequestTimer:
    """One request's timings; fed by :meth:`EngineMetrics.observe`."""

    def __init__(self, metrics: "EngineMetrics") -> None:
        self._m = metrics
        self._ttft = metrics.ttft_child
        self._itl = metrics.inter_token_latency
        self.start = time.perf_counter()
        self.first_token_at: float | None = None
        self._last: dict[int, float] = {}
        self.done = False

    def on_delta(self, delta: StreamDelta) -> None:
        self.on_tokens(len(delta.token_ids), delta.index)

    def on_tokens(self, n: int, index: int = 0) -> None:
        """``n`` tokens of completion ``index`` reached the client now."""
        if n == 0:
            return
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
            self._ttft.observe(now - self.start)
        prev = self._last.get(index)
        if prev is not None:
            self._itl.observe((now - prev) / n, n)  # a merged delta spreads its interval over its tokens
        self._last[index] = now

    def finish(self, result: Any) -> None:
        if isinstance(result, GenerationResult):
            outputs = result.outputs or []
            generated = sum(len(o.output_ids) for o in outputs) if outputs else len(result.output_ids)
            self.ended(result.finish_reason or "unknown", prompt_tokens=len(result.prompt_ids),
                       cached_tokens=prompt_cached_tokens(result), generated_tokens=generated)
        else:
            self.ended("unknown")

    def ended(self, reason: str, *, prompt_tokens: int = 0, cached_tokens: int = 0, generated_tokens: int = 0) -> None:
        """The request ended by ``reason`` with these counts: recorded once (the one rule
        for a finished request, whatever carried its tokens)."""
        if self.done:
            return
        self.done = True
        m = self._m
        m.e2e_latency.labels(model=m.model_name).observe(time.perf_counter() - self.start)
        m.prompt_tokens.labels(model=m.model_name).inc(prompt_tokens)
        m.cached_prompt_tokens.labels(model=m.model_name).inc(cached_tokens)
        m.generation_tokens.labels(model=m.model_name).inc(generated_tokens)
        m.requests.labels(finish_reason=reason, model=m.model_name).inc()

    def fail(self, exc: BaseException | None) -> None:
        if self.done:
            return
        self.done = True
        self._m.e2e_latency.labels(model=self._m.model_name).observe(time.perf_counter() - self.start)
        status = refused_status(exc)
        if status is not None:  # refused, not a request that ran and failed
            self._m.refused.labels(status=status, model=self._m.model_name).inc()
            return
        reason = "abort" if exc is None or isinstance(exc, errors.RequestAbortedError) else "error"
        self._m.requests.labels(finish_reason=reason, model=self._m.model_name).inc()


def refused_status(exc: BaseException | None) -> str | None:
    """The HTTP status (as the server answers it) of a request the engine refused: invalid
    (400) or over a limit (429); None for one that failed while being served."""
    if isinstance(exc, (errors.InvalidRequestError, errors.RequestRejectedError)):
        return str(status_of(exc))
    return None


def _model_name(engine: "Engine | None") -> str:
    if engine is None:
        return "model"
    info = engine.scheduler.info()
    path = str(info.get("model_name") or info.get("model_path", "model"))
    return os.path.basename(os.path.normpath(path)) or path


class EngineMetrics:
    """The metrics of one engine in a registry of their own (or one you pass)."""

    def __init__(self, engine: "Engine | None" = None, *, registry: CollectorRegistry | None = None, model_name: str | None = None) -> None:
        """``model_name`` labels the request figures (default: the last component of the
        engine's model path, as the server names the model)."""
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name or _model_name(engine)
        r = self.registry
        m = ["model"]
        self.requests = Counter(f"{PREFIX}_requests", "Finished requests by finish reason (abort and error included)", ["finish_reason", "model"], registry=r)
        self.refused = Counter(
            f"{PREFIX}_requests_refused", "Requests refused after submission (400 invalid, 429 over a limit); not in requests_total",
            ["status", "model"], registry=r,
        )
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests", m, registry=r)
        self.cached_prompt_tokens = Counter(
            f"{PREFIX}_prompt_cached_tokens", "Prompt tokens of finished requests whose KV came from the prefix cache", m, registry=r
        )
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens of finished requests", m, registry=r)
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Submit to first streamed token", m, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.inter_token_latency = TokenHistogram(
            f"{PREFIX}_inter_token_latency_seconds", "Time between a completion's streamed tokens", self.model_name, _LATENCY_BUCKETS
        )
        r.register(self.inter_token_latency)
        self.e2e_latency = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds", "Submit to the request's end", m, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.step_time = Histogram(
            f"{PREFIX}_step_duration_seconds", "One model step, from launch to processed", buckets=_STEP_BUCKETS, registry=r
        )
        # Looked up once: ``labels()`` per streamed delta cost more than the observation.
        self.ttft_child = self.time_to_first_token.labels(model=self.model_name)
        if engine is not None:
            self.attach(engine)

    def attach(self, engine: "Engine") -> None:
        """Export ``engine``'s stage figures from this registry, and time its steps."""
        self.registry.register(StageCollector(engine))
        engine.scheduler.add_step_observer(self.observe_step)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def observe_step(self, seconds: float) -> None:
        """Record one step's duration (the stage calls it after each step)."""
        self.step_time.observe(seconds)

    async def observe(self, handle: "RequestHandle") -> AsyncIterator[StreamDelta]:
        """Iterate ``handle`` (its deltas, unchanged) and record the request's figures.
        Leaving early aborts the request, as leaving the handle's own stream does."""
        timer = self.timer()
        try:
            async with contextlib.aclosing(handle.__aiter__()) as deltas:
                async for delta in deltas:
                    timer.on_delta(delta)
                    yield delta
        except BaseException as exc:
            timer.fail(exc if isinstance(exc, Exception) else None)
            raise
        timer.finish(await handle.result())

    async def result(self, handle: "RequestHandle") -> Any:
        """Await ``handle``'s result, recording its figures on the way."""
        async for _ in self.observe(handle):
            pass
        return await handle.result()

    def render(self) -> bytes:
        """The registry in Prometheus' text format (``CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry)

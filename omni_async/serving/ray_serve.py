"""omni-async on Ray Serve: one deployment, one Engine per replica, the OpenAI server's own
routes as the ingress (extra ``[ray]``).

Ray Serve does the distributed part: it places replicas (one GPU each when the engine runs
on CUDA), restarts a replica that dies, routes each HTTP request to a replica (power of two
choices over queue lengths), scales the replica count on load when autoscaling is on, and
streams responses through its proxy. Each replica is the single-process server, unchanged:
:func:`omni_async.server.create_app` over the replica's engine, built at replica start
through Serve's late-bound ingress (``__serve_build_asgi_app__``), so every route, typed
error, streamed response and abort-on-disconnect behaves as under ``omni-async serve``
(the proxy cancels a replica's request when its client goes away, which aborts it).

Each replica keeps its own metrics registry: ``/metrics`` through the proxy answers from
whichever replica took the request (its id is in the ``x-omni-async-replica`` header of
every response), and :func:`replica_stats` asks every replica at once (Serve's broadcast).

>>> from omni_async.serving.ray_serve import build_app, run
>>> app = build_app("tiny", replicas=2)           # an Application for serve.run
>>> handle = run(app, host="127.0.0.1", port=8000)  # starts Ray and Serve if needed
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from ..engine import Engine

__all__ = ["APP_NAME", "REPLICA_HEADER", "OmniAsyncReplica", "ReplicaOptions", "build_app", "replica_stats", "run"]

APP_NAME = "omni-async"
REPLICA_HEADER = "x-omni-async-replica"


class ReplicaHeader:
    """ASGI middleware: names the replica that answered in each HTTP response's headers,
    so a client (or a test) can see how requests spread and whose /metrics it read."""

    def __init__(self, app: Any, replica_id: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica_id.encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named)


@serve.ingress()
class OmniAsyncReplica:
    """One Serve replica: an Engine loaded at replica start, served by the OpenAI app.

    The engine starts and closes with the app's lifespan, which Serve runs at replica
    start and stop."""

    async def __init__(self, model: str, engine_kwargs: dict[str, Any], model_name: str | None = None) -> None:
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.model_name = model_name
        self.engine = await Engine.load(model, **engine_kwargs)

    def __serve_build_asgi_app__(self) -> Any:
        from ..server import create_app

        app = create_app(self.engine, model_name=self.model_name)
        app.add_middleware(ReplicaHeader, replica_id=self.replica_id)
        self.app_state = app.state
        return app

    async def stats(self) -> dict[str, Any]:
        """This replica's id, stage info and metrics text (Prometheus' format)."""
        metrics = self.app_state.metrics
        return {"replica": self.replica_id, "info": self.engine.scheduler.info(), "metrics": metrics.render().decode()}


@dataclass
class ReplicaOptions:
    """How many replicas and what each one holds.

    ``replicas`` is a fixed count; ``autoscaling`` (Serve's AutoscalingConfig fields, e.g.
    ``{"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 64}``) replaces
    it. A CUDA engine takes one GPU per replica; a CPU one ``cpus`` logical CPUs.
    ``max_ongoing_requests`` is what Serve lets in flight at one replica (the engine's own
    admission limits still apply behind it)."""

    replicas: int = 1
    autoscaling: dict[str, Any] | None = None
    cpus: float = 1.0
    max_ongoing_requests: int = 1024
    extra_actor_options: dict[str, Any] = field(default_factory=dict)

    def deployment_options(self, device: str) -> dict[str, Any]:
        gpu = str(device).startswith("cuda")
        actor = {"num_gpus": 1, "num_cpus": self.cpus} if gpu else {"num_cpus": self.cpus}
        out: dict[str, Any] = {
            "ray_actor_options": {**actor, **self.extra_actor_options},
            "max_ongoing_requests": self.max_ongoing_requests,
        }
        if self.autoscaling is not None:
            out["autoscaling_config"] = dict(self.autoscaling)
        else:
            out["num_replicas"] = self.replicas
        return out


def build_app(
    model: str,
    *,
    replicas: int = 1,
    options: ReplicaOptions | None = None,
    model_name: str | None = None,
    **engine_kwargs: Any,
) -> Any:
    """The Serve application: ``replicas`` copies of an engine of ``model`` (``options``
    overrides the count, e.g. for autoscaling). ``engine_kwargs`` go to
    :meth:`Engine.from_pretrained` in each replica (device, loop, limits ...); a CUDA
    device is the replica's own GPU (``cuda`` or ``cuda:0``: Ray sets
    ``CUDA_VISIBLE_DEVICES`` per replica)."""
    from ..server.app import default_model_name

    opts = options or ReplicaOptions(replicas=replicas)
    device = str(engine_kwargs.get("device", "cpu"))
    if device.startswith("cuda"):
        engine_kwargs["device"] = "cuda"  # the one GPU Ray gave this replica
    name = model_name or default_model_name(model)
    deployment = serve.deployment(OmniAsyncReplica, name="OmniAsyncReplica").options(**opts.deployment_options(device))
    return deployment.bind(model, engine_kwargs, name)


def run(app: Any, *, host: str = "127.0.0.1", port: int = 8000, blocking: bool = False) -> DeploymentHandle:
    """Deploy ``app`` under :data:`APP_NAME` at route ``/`` with Serve's HTTP proxy on
    ``host:port`` (Ray is started locally unless ``ray.init`` was called first)."""
    serve.start(http_options={"host": host, "port": port})
    return serve.run(app, name=APP_NAME, route_prefix="/", blocking=blocking)


def replica_stats(handle: DeploymentHandle | None = None) -> list[dict[str, Any]]:
    """Every running replica's :meth:`OmniAsyncReplica.stats`: per-replica metrics."""
    handle = handle or serve.get_app_handle(APP_NAME)
    return list(handle.broadcast("stats").results())

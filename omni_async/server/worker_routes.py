"""The endpoints a router or a cluster scheduler reads from a worker.

SGLang's router (``sglang-router``) and llm-d's scheduler discover and balance workers
through SGLang's native endpoints; serving them lets ``omni-async serve`` sit behind
either one, unchanged:

- ``GET /get_model_info`` (or ``/model_info``): what the worker serves (model path, served
  name, weight version);
- ``GET /get_server_info`` (or ``/server_info``): its settings and its load (``dp_size`` is
  1: one engine);
- ``GET /get_load``: the load per data-parallel rank, as a list of one entry (the router's
  power-of-two policy reads ``num_tokens``);
- ``GET|POST /flush_cache``: empty the prefix cache (400 while requests are active);
- ``GET /health_generate``: healthy only if the engine still produces a token.

The load figures come from :func:`omni_async.server.metrics.stage_load`, the same place
the Prometheus gauges read them.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from .. import errors
from ..config import SamplingParams
from ..version import __version__
from .metrics import stage_load
from .served import ServedModel

__all__ = ["add_worker_routes"]


def model_info(server: ServedModel) -> dict[str, Any]:
    """SGLang's ``/get_model_info`` fields, filled from the stage's model info."""
    info = server.engine.scheduler.info()
    path = str(info.get("model_path", server.model_name))
    return {
        "model_path": path,
        "tokenizer_path": path,
        "served_model_name": server.model_name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": info.get("weight_version"),
        "model_type": info.get("model_family"),
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }


def server_info(server: ServedModel) -> dict[str, Any]:
    """Settings a router probes (``dp_size``, context, limits) and the load right now."""
    engine = server.engine
    info = engine.scheduler.info()
    limits = engine.scheduler.limits
    load = stage_load(info)
    return {
        **model_info(server),
        "version": __version__,
        "engine": "omni-async",
        "dp_size": 1,
        "tp_size": int(info.get("tensor_parallel_size", 1) or 1),
        "context_length": limits.context_length,
        "max_total_num_tokens": limits.kv_capacity_tokens,
        "page_size": info.get("page_size"),
        "device": info.get("device"),
        "loop": info.get("loop"),
        "arithmetic": info.get("arithmetic"),  # what computes tokens and prompt scores (quantised or not)
        "load": load,
        "internal_states": [load],
        "plan": info.get("plan"),  # every configuration decision of the stage (core/plan.py)
    }


def load_entries(server: ServedModel) -> list[dict[str, Any]]:
    """``/get_load``: one entry per data-parallel rank (one here)."""
    load = stage_load(server.engine.scheduler.info())
    return [
        {
            "dp_rank": 0,
            "num_reqs": load["num_requests_running"] + load["num_requests_waiting"],
            "num_waiting_reqs": load["num_requests_waiting"],
            "num_tokens": load["kv_tokens_used"],
        }
    ]


async def flush(server: ServedModel) -> Response:
    reply = await server.engine.flush_cache()
    ok = bool(reply.get("success"))
    return JSONResponse({"success": ok, "message": reply.get("message", "")}, status_code=200 if ok else 400)


async def health_generate(server: ServedModel) -> Response:
    """One greedy token from a one-token prompt: the whole request path, end to end."""
    eos = server.engine.scheduler.limits.eos_token_ids
    first = 1 if 1 not in eos else 2
    try:
        await server.engine.generate(input_ids=[first], sampling=SamplingParams(max_new_tokens=1, ignore_eos=True))
    except errors.OmniAsyncError as exc:
        return JSONResponse({"status": "unavailable", "error": f"{type(exc).__name__}: {exc}"}, status_code=503)
    return JSONResponse({"status": "ok"})


def add_worker_routes(app: FastAPI, server: ServedModel) -> None:
    """Mount the router-facing endpoints on ``app`` (handlers run on the engine's loop:
    the stage's figures are read where they are written)."""

    async def get_model_info() -> dict[str, Any]:
        return model_info(server)

    async def get_server_info() -> dict[str, Any]:
        return server_info(server)

    async def get_load() -> list[dict[str, Any]]:
        return load_entries(server)

    async def flush_cache() -> Response:
        return await flush(server)

    async def health_gen() -> Response:
        return await health_generate(server)

    for path in ("/get_model_info", "/model_info"):  # SGLang's older and newer names
        app.get(path)(get_model_info)
    for path in ("/get_server_info", "/server_info"):
        app.get(path)(get_server_info)
    app.get("/get_load")(get_load)
    app.api_route("/flush_cache", methods=["GET", "POST"], response_model=None)(flush_cache)
    app.get("/health_generate", response_model=None)(health_gen)

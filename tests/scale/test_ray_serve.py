"""omni-async on Ray Serve: a local Ray instance, two CPU replicas of ``tiny`` behind Serve's
HTTP proxy on 127.0.0.1, driven by the openai client.

Runs only with the ``[ray]`` extra (``bash scripts/install_scale.sh``); collected when asked
for by path: ``pytest tests/scale``. One Ray instance serves the whole module; the last
test shuts it down and checks that no process is left.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

from ray import serve  # noqa: E402

from omni_async.serving.ray_serve import REPLICA_HEADER, build_app, replica_stats, run  # noqa: E402

ROOT = str(Path(__file__).resolve().parents[2])
EXTRA = {"ignore_eos": True}
STARTUP_S = 600  # a deadline for starting up on a loaded 2-core machine, not a speed claim


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


class Cluster:
    """Ray, Serve and the app for this module; :meth:`shutdown` is idempotent."""

    def __init__(self) -> None:
        # The replicas import this checkout (a CI clone's editable install does too).
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.handle = run(build_app("tiny", replicas=2, loop="normal"), host="127.0.0.1", port=self.port)
        self.pids = _descendants()
        self.closed = False

    def client(self) -> "openai.AsyncOpenAI":
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=STARTUP_S)

    def shutdown(self) -> None:
        if not self.closed:
            self.closed = True
            serve.shutdown()
            ray.shutdown()


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    try:
        yield c
    finally:
        c.shutdown()


async def _complete(client: "openai.AsyncOpenAI", prompt: str, max_tokens: int = 8) -> tuple[str, object]:
    raw = await client.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=EXTRA)
    return raw.headers[REPLICA_HEADER], raw.parse()


async def _stats(cluster: Cluster) -> list[dict]:
    """Every replica's stats (a blocking handle call: off the event loop, as Serve asks)."""
    return await asyncio.to_thread(replica_stats, cluster.handle)


def _abort_count(metrics_text: str) -> float:
    found = re.search(r'^omni_async_requests_total\{finish_reason="abort",model="tiny"\} (\S+)$', metrics_text, re.M)
    return float(found.group(1)) if found else 0.0


async def test_64_concurrent_requests_spread_over_both_replicas(cluster):
    async with cluster.client() as client:
        answers = await asyncio.gather(*(_complete(client, f"request {i}:") for i in range(64)))
    assert all(res.usage.completion_tokens == 8 and res.choices[0].finish_reason == "length" for _, res in answers)
    replicas = {replica for replica, _ in answers}
    assert len(replicas) == 2, replicas
    stats = await _stats(cluster)
    assert {s["replica"] for s in stats} == replicas
    # Per-replica metrics: each replica counted the requests it answered.
    counted = sum(float(m) for s in stats for m in re.findall(r'^omni_async_requests_total\{finish_reason="length",model="tiny"\} (\S+)$', s["metrics"], re.M))
    assert counted >= 64


async def test_streamed_request_and_typed_error(cluster):
    async with cluster.client() as client:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=12, temperature=0, stream=True, extra_body=EXTRA
        )
        chunks = [c async for c in stream]
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model="tiny", prompt=[99999], max_tokens=4)
        assert "vocabulary" in str(bad.value) or bad.value.status_code == 400
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="not-served", prompt="hi", max_tokens=4)


async def test_a_client_that_goes_away_aborts_its_request(cluster):
    before = sum(_abort_count(s["metrics"]) for s in await _stats(cluster))
    body = json.dumps({"model": "tiny", "prompt": "a long one", "max_tokens": 3000, "stream": True, "ignore_eos": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", cluster.port)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    writer.write(head.encode() + body)
    assert (await reader.readline()).startswith(b"HTTP/1.1 200")
    while not (await reader.readline()).startswith(b"data: "):
        pass  # headers, then the first chunk: the request is running
    writer.close()  # the client goes away
    deadline = time.monotonic() + STARTUP_S
    while True:
        stats = await _stats(cluster)
        aborted = sum(_abort_count(s["metrics"]) for s in stats)
        if aborted > before and all(s["info"]["active_requests"] == 0 for s in stats):
            break
        assert time.monotonic() < deadline, "the request was not aborted"
        await asyncio.sleep(0.2)
    assert aborted == before + 1


async def test_a_killed_replica_does_not_stop_the_service(cluster):
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "OmniAsyncReplica" in a["name"]]
    assert len(names) == 2, names
    async with cluster.client() as client:
        in_flight = [asyncio.ensure_future(_complete(client, f"in flight {i}", max_tokens=64)) for i in range(8)]
        await asyncio.sleep(0)
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        await asyncio.gather(*in_flight, return_exceptions=True)  # those on the killed replica may fail
        answers = await asyncio.gather(*(_complete(client, f"after the kill {i}") for i in range(16)))
    assert all(res.usage.completion_tokens == 8 for _, res in answers)


def test_shutdown_leaves_no_process(cluster):
    assert cluster.pids, "Ray started no process?"
    cluster.shutdown()
    deadline = time.monotonic() + STARTUP_S
    while True:
        alive = [pid for pid in cluster.pids if _running(pid)]
        if not alive:
            break
        assert time.monotonic() < deadline, f"processes left after shutdown: {alive}"
        time.sleep(0.2)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False

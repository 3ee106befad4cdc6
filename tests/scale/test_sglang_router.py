"""``omni-async serve`` as a worker of SGLang's router (``sglang-router`` from PyPI): two
workers of ``tiny`` and the router on 127.0.0.1, as docs/scaling.md starts them, driven by
the openai client through the router.

Runs only with ``sglang_router`` installed (``bash scripts/install_scale.sh``); collected
when asked for by path: ``pytest tests/scale``. The last test stops a worker.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("sglang_router")
openai = pytest.importorskip("openai")

ROOT = str(Path(__file__).resolve().parents[2])
EXTRA = {"ignore_eos": True}
STARTUP_S = 600  # a deadline for starting up on a loaded 2-core machine, not a speed claim


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def _wait_until(check, what: str) -> None:
    deadline = time.monotonic() + STARTUP_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def _answered(worker: str) -> float:
    """Requests this worker finished (its own /metrics)."""
    _, text = _get(f"{worker}/metrics")
    return sum(float(v) for v in re.findall(r'^omni_async_requests_total\{finish_reason="\w+",model="tiny"\} (\S+)$', text, re.M))


def _healthy_workers(router: str) -> set[str]:
    status, text = _get(f"{router}/workers")
    if status != 200:
        return set()
    return {w["url"] for w in json.loads(text).get("workers", []) if w.get("is_healthy")}


class Fleet:
    """Two workers and the router, as processes of this test module."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.workers: list[str] = []
        try:
            self.start()
        except BaseException:
            self.close()
            raise

    def start(self) -> None:
        for _ in range(2):
            port = _free_port()
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "omni_async.cli", "serve", "--model", "tiny", "--host", "127.0.0.1", "--port", str(port), "--log-level", "ERROR"],
                    cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
            )
            self.workers.append(f"http://127.0.0.1:{port}")
        for worker in self.workers:
            _wait_until(lambda: _get(f"{worker}/health")[0] == 200, f"{worker} to start")
        port = _free_port()
        self.router = f"http://127.0.0.1:{port}"
        self.router_log = tempfile.TemporaryFile()
        self.procs.append(
            subprocess.Popen(
                [
                    sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                    "--worker-urls", *self.workers, "--policy", "cache_aware",
                    "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--log-level", "warn",
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()),
                ],
                stdout=self.router_log, stderr=subprocess.STDOUT,
            )
        )
        _wait_until(lambda: self.router_died() or _healthy_workers(self.router) == set(self.workers), "the router to take both workers")
        assert not self.router_died(), f"the router exited: {self.router_output()}"

    def router_died(self) -> bool:
        return self.procs[-1].poll() is not None

    def router_output(self) -> str:
        self.router_log.seek(0)
        return self.router_log.read().decode(errors="replace")[-3000:]

    def client(self) -> "openai.AsyncOpenAI":
        return openai.AsyncOpenAI(base_url=f"{self.router}/v1", api_key="unused", max_retries=0, timeout=STARTUP_S)

    def stop(self, i: int) -> None:
        self.procs[i].terminate()
        self.procs[i].wait(timeout=STARTUP_S)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            proc.wait(timeout=STARTUP_S)


@pytest.fixture(scope="module")
def fleet():
    f = Fleet()
    try:
        yield f
    finally:
        f.close()


async def _complete(client: "openai.AsyncOpenAI", prompt: str):
    return await client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body=EXTRA)


async def test_64_requests_through_the_router_use_both_workers(fleet):
    before = [_answered(w) for w in fleet.workers]
    async with fleet.client() as client:
        answers = await asyncio.gather(*(_complete(client, f"{i} distinct prompt number {i}") for i in range(64)))
    assert all(res.usage.completion_tokens == 8 and res.choices[0].finish_reason == "length" for res in answers)
    gained = [_answered(w) - b for w, b in zip(fleet.workers, before)]
    assert sum(gained) == 64 and all(g > 0 for g in gained), gained


async def test_cache_aware_policy_keeps_a_prefix_on_one_worker(fleet):
    prefix = "A long shared system prompt that both requests begin with, word for word. " * 4
    before = [_answered(w) for w in fleet.workers]
    async with fleet.client() as client:
        for i in range(8):  # one after another: the load stays balanced, the prefix decides
            await _complete(client, f"{prefix}Question {i}?")
    gained = [_answered(w) - b for w, b in zip(fleet.workers, before)]
    assert sorted(gained) == [0, 8], gained


async def test_a_stopped_worker_is_dropped_and_requests_keep_succeeding(fleet):
    fleet.stop(1)
    _wait_until(lambda: _healthy_workers(fleet.router) == {fleet.workers[0]}, "the router's health check to drop the stopped worker")
    before = _answered(fleet.workers[0])
    async with fleet.client() as client:
        answers = await asyncio.gather(*(_complete(client, f"after the stop {i}") for i in range(16)))
    assert all(res.usage.completion_tokens == 8 for res in answers)
    assert _answered(fleet.workers[0]) - before == 16

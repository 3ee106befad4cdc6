"""``omni-async serve`` as an operator runs it, in a real subprocess: it says where it
listens once it is ready, refuses a port in use before it loads anything, and on SIGINT
or SIGTERM (Ctrl-C, docker, systemd) ends every open request with a terminal message
(a stream's error event and ``[DONE]``, a whole response's error body), closes the engine
and exits within seconds with one line, however many times it is interrupted."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

REPO = Path(__file__).resolve().parents[1]
READY = re.compile(r"^serving tiny at http://127\.0\.0\.1:(\d+)/v1 \(Ctrl-C to stop\)$")
LONG = {"model": "tiny", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 1800, "ignore_eos": True, "temperature": 0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A ``serve`` subprocess whose output is collected line by line as it comes."""

    def __init__(self, *args: str) -> None:
        self.port = _free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, "-m", "omni_async.cli", "serve", "--model", "tiny", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.readers = [threading.Thread(target=self._read, args=(pipe,), daemon=True) for pipe in (self.proc.stdout, self.proc.stderr)]
        for reader in self.readers:
            reader.start()

    def _read(self, pipe) -> None:
        for line in pipe:
            self.lines.append(line.rstrip("\n"))

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not any(READY.match(line) for line in self.lines):
            assert self.proc.poll() is None, "\n".join(self.lines)
            assert time.monotonic() < deadline, "serve did not say it was ready:\n" + "\n".join(self.lines)
            time.sleep(0.05)
        assert int(READY.match(next(line for line in self.lines if READY.match(line))).group(1)) == self.port

    def wait_exit(self, timeout: float) -> float:
        """Seconds until the process exited (killed, and the test failed, past ``timeout``)."""
        start = time.monotonic()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"serve still running {timeout} s after the signal:\n" + "\n".join(self.lines))
        for reader in self.readers:
            reader.join(timeout=5)
        return time.monotonic() - start

    def output(self) -> str:
        return "\n".join(self.lines)


class Reader(threading.Thread):
    """One chat request on its own connection: the SSE events of a stream as they come,
    or the status and body of a whole response."""

    def __init__(self, port: int, stream: bool) -> None:
        super().__init__(daemon=True)
        self.port, self.stream = port, stream
        self.events: list[str] = []
        self.status: int | None = None
        self.body: dict | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            conn.request("POST", "/v1/chat/completions", json.dumps({**LONG, "stream": self.stream}), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.status = resp.status
            if not self.stream:
                self.body = json.loads(resp.read())
                return
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    self.events.append(line[len("data: ") :])
        except BaseException as exc:  # the test reports it
            self.error = exc

    def wait_streaming(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.events) < 3:
            assert self.error is None and self.is_alive(), (self.error, self.events)
            assert time.monotonic() < deadline, "the stream did not start"
            time.sleep(0.02)


def _wait_for_requests(port: int, n: int, timeout: float = 60) -> None:
    """Until the engine holds ``n`` requests (``/get_load``)."""
    deadline = time.monotonic() + timeout
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/get_load")
        held = json.loads(conn.getresponse().read())[0]["num_reqs"]
        conn.close()
        if held >= n:
            return
        assert time.monotonic() < deadline, f"the engine never held {n} requests"
        time.sleep(0.05)


def _assert_ended_cleanly(served: Served, reader: Reader) -> None:
    reader.join(timeout=10)
    assert reader.error is None, reader.error
    assert reader.events[-1] == "[DONE]", reader.events[-3:]
    last = json.loads(reader.events[-2])
    # the terminal event: an error (the server stopped) or the choice's finish
    assert "error" in last or any(c.get("finish_reason") for c in last.get("choices", [])), last
    out = served.output()
    assert "Traceback" not in out and "CancelledError" not in out, out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_a_stream_ends_it_and_the_server(sig):
    served = Served()
    served.wait_ready()
    reader = Reader(served.port, stream=True)
    reader.start()
    reader.wait_streaming()
    served.proc.send_signal(sig)
    took = served.wait_exit(timeout=5)
    _assert_ended_cleanly(served, reader)
    assert took < 5
    assert served.proc.returncode == 0, served.output()
    error = json.loads(reader.events[-2])["error"]
    assert "shutting down" in error["message"] or "closed" in error["message"], error
    assert served.lines[-1] == "stopped: 1 open requests aborted", served.output()


def test_repeated_ctrl_c_while_stopping_a_stream_and_a_whole_request():
    served = Served()
    served.wait_ready()
    stream, whole = Reader(served.port, stream=True), Reader(served.port, stream=False)
    stream.start()
    stream.wait_streaming()
    whole.start()
    _wait_for_requests(served.port, 2)  # the whole request is running beside the stream
    for _ in range(3):
        served.proc.send_signal(signal.SIGINT)
        time.sleep(0.02)
    took = served.wait_exit(timeout=5)
    _assert_ended_cleanly(served, stream)
    whole.join(timeout=10)
    assert whole.error is None, whole.error
    assert whole.status == 503 and "error" in whole.body, (whole.status, whole.body)
    assert took < 5 and served.proc.returncode == 0
    assert served.lines[-1] == "stopped: 2 open requests aborted", served.output()


def test_a_signal_while_the_model_loads_stops_after_the_load():
    """asyncio's own Ctrl-C handling cancels the task that waits for the load's thread,
    and that cancellation was lost: the server started anyway."""
    served = Served("--log-level", "INFO")
    deadline = time.monotonic() + 120
    while not any("cli_model_loading" in line for line in served.lines):
        assert served.proc.poll() is None and time.monotonic() < deadline, served.output()
        time.sleep(0.005)
    served.proc.send_signal(signal.SIGINT)
    served.proc.send_signal(signal.SIGINT)
    served.wait_exit(timeout=15)
    out = served.output()
    assert served.proc.returncode == 0 and "Traceback" not in out, out
    assert served.lines[-1] == "stopped: interrupted while loading", out
    assert not any(READY.match(line) for line in served.lines), out


def test_idle_stop_and_a_port_in_use():
    served = Served()
    served.wait_ready()
    served.proc.send_signal(signal.SIGINT)
    served.wait_exit(timeout=5)
    assert served.proc.returncode == 0 and served.lines[-1] == "stopped: 0 open requests aborted", served.output()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "omni_async.cli", "serve", "--model", "tiny", "--port", str(port)]
        run = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ConfigError: ") and str(port) in lines[0], run.stderr
    assert "load" not in run.stderr  # refused before the model loads


def test_serve_ray_refuses_a_port_in_use_before_ray_starts():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "omni_async.cli", "serve-ray", "--model", "tiny", "--port", str(port)]
        run = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ConfigError: cannot listen on 127.0.0.1:") and str(port) in lines[0], run.stderr

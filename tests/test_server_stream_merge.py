"""A streamed response whose client reads slowly: the tokens it has not taken yet are
merged into one event per completion (as the engine merges a lagging handle's deltas), so
a slow client costs fewer events, not a backlog of one event per token; the events still
add up to exactly the whole response (text, and with logprobs every token's entry in
order). A real server on 127.0.0.1 whose socket buffers are small, and a client that
reads nothing until the engine has finished."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
from typing import Any

import anyio
import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from omni_async import Engine  # noqa: E402
from omni_async.server import create_app  # noqa: E402
from omni_async.server.run import http_protocol  # noqa: E402

BUFFER = 4096  # bytes: the kernel's socket buffers, so that the server's writes back up soon


def _listener() -> socket.socket:
    """A listening socket whose connections inherit a small send buffer."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)
    sock.bind(("127.0.0.1", 0))
    return sock


def _post(port: int, body: dict[str, Any], *, rcvbuf: int | None = None) -> http.client.HTTPResponse:
    """POST /v1/completions on a blocking socket (a small receive buffer when asked); the
    response's headers are read, its body is left in the socket."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.sock = sock
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    return conn.getresponse()


def _events(raw: bytes) -> list[dict[str, Any]]:
    datas = [part[6:] for part in raw.decode().split("\n\n") if part.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]]


@pytest.fixture
async def server():
    engine = Engine.from_pretrained("tiny", loop="normal")
    sock = _listener()
    app = create_app(engine, model_name="tiny")
    config = uvicorn.Config(app, log_config=None, log_level="warning", lifespan="on", http=http_protocol())
    srv = uvicorn.Server(config)
    task = asyncio.create_task(srv.serve(sockets=[sock]))
    try:
        with anyio.fail_after(60):
            while not srv.started:
                assert not task.done(), "the server stopped during startup"
                await anyio.sleep(0.01)
        yield engine, sock.getsockname()[1]
    finally:
        srv.should_exit = True
        await task
        sock.close()


@pytest.mark.parametrize(
    "prompt, n",
    [([[5, 6, 7], [8, 9], [10, 11, 12], [13]], 2), ([5, 6, 7], 8)],
    ids=["prompt-list", "one-prompt-n8"],
)
async def test_a_slow_reader_gets_merged_events_that_add_up_to_the_whole_response(server, prompt, n):
    engine, port = server
    body = {"model": "tiny", "prompt": prompt, "n": n, "max_tokens": 100, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    whole = await anyio.to_thread.run_sync(lambda: json.loads(_post(port, body).read()))
    want = {c["index"]: c for c in whole["choices"]}
    total_tokens = sum(len(c["logprobs"]["tokens"]) for c in want.values())
    assert total_tokens == len(want) * 100

    resp = await anyio.to_thread.run_sync(lambda: _post(port, {**body, "stream": True}, rcvbuf=BUFFER))
    assert resp.status == 200
    with anyio.fail_after(120):  # the engine runs to the end while nothing is read
        while engine.open_requests:
            await anyio.sleep(0.02)
    events = _events(await anyio.to_thread.run_sync(resp.read))

    text: dict[int, str] = {}
    lps: dict[int, dict[str, list[Any]]] = {}
    token_events = 0
    for ev in events:
        for choice in ev["choices"]:
            i = choice["index"]
            text[i] = text.get(i, "") + choice["text"]
            lp = choice["logprobs"]
            if lp and lp["tokens"]:
                token_events += 1
                mine = lps.setdefault(i, {"tokens": [], "token_logprobs": []})
                for key in mine:
                    mine[key].extend(lp[key])
    assert text == {i: c["text"] for i, c in want.items()}
    for i, c in want.items():
        assert lps[i]["tokens"] == c["logprobs"]["tokens"]
        assert lps[i]["token_logprobs"] == pytest.approx(c["logprobs"]["token_logprobs"], abs=1e-4)
    # The writes backed up long before the end, and what came after was merged.
    assert token_events < total_tokens
    info = engine.scheduler.info()
    assert info["kv_free_pages"] == info["kv_total_pages"]

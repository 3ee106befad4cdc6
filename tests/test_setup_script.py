"""scripts/setup.sh picks the torch build for the machine: the CUDA build where a GPU is,
the CPU index's build where none is and that index answers, pip's configured index when it
does not. Checked through its dry run (the steps and pip commands, nothing installed), with
a stand-in nvidia-smi and a real HTTP server on 127.0.0.1 as the CPU index."""

from __future__ import annotations

import http.server
import os
import socket
import stat
import subprocess
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "setup.sh"


def _fake_nvidia_smi(folder: Path, listing: str) -> None:
    tool = folder / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\nprintf '%s' '{listing}'\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)


def _dry_run(tmp_path: Path, *, gpu: bool, cpu_index: str, **env: str) -> str:
    _fake_nvidia_smi(tmp_path, "GPU 0: NVIDIA H100 (UUID: GPU-0)\\n" if gpu else "")
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_TORCH_")}
    full = {**inherited, "PATH": f"{tmp_path}:{os.environ['PATH']}", "OMNI_TORCH_CPU_INDEX": cpu_index, **env}
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=full, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _torch_line(out: str) -> str:
    return next(line for line in out.splitlines() if "pip install" in line and "torch" in line)


@pytest.fixture
def cpu_index(tmp_path_factory):
    """A package index on 127.0.0.1 with a torch/ page."""
    root = tmp_path_factory.mktemp("index")
    (root / "torch").mkdir()
    (root / "torch" / "index.html").write_text("<html></html>")
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(root), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.RequestHandlerClass.log_message = lambda *a: None
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def closed_port_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_every_step_has_a_header_and_pip_is_not_quiet(tmp_path, closed_port_url):
    out = _dry_run(tmp_path, gpu=False, cpu_index=closed_port_url)
    headers = [line for line in out.splitlines() if line.startswith("==> [")]
    assert [h[:9] for h in headers] == [f"==> [{i}/5]" for i in range(1, 6)], out
    assert "MB" in out
    assert " -q" not in out


@pytest.mark.skipif(os.uname().sysname != "Linux", reason="the CPU index is used on Linux")
def test_no_gpu_and_the_cpu_index_answers_installs_the_cpu_build(tmp_path, cpu_index):
    out = _dry_run(tmp_path, gpu=False, cpu_index=cpu_index)
    assert _torch_line(out).endswith(f"pip install --index-url {cpu_index} torch==2.13.0"), out
    assert "CPU build" in out


def test_no_gpu_and_no_cpu_index_falls_back_to_the_configured_index(tmp_path, closed_port_url):
    out = _dry_run(tmp_path, gpu=False, cpu_index=closed_port_url)
    assert _torch_line(out).endswith("pip install torch==2.13.0"), out
    assert "does not answer" in out


def test_a_gpu_gets_the_default_cuda_build(tmp_path, cpu_index):
    out = _dry_run(tmp_path, gpu=True, cpu_index=cpu_index)
    assert _torch_line(out).endswith("pip install torch==2.13.0"), out
    assert "CUDA build" in out and "a GPU was found" in out


def test_the_build_can_be_named(tmp_path, cpu_index):
    out = _dry_run(tmp_path, gpu=True, cpu_index=cpu_index, OMNI_TORCH_BUILD="cpu")
    assert "--index-url" in _torch_line(out)
    bad = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=60, env={**os.environ, "OMNI_TORCH_BUILD": "rocm"}
    )
    assert bad.returncode == 2 and "OMNI_TORCH_BUILD must be cpu or cuda" in bad.stderr

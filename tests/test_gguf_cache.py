"""The on-disk cache of converted GGUF weights (omni_async/models/gguf_cache.py): a second
load reads it and gives the same tokens, a damaged entry is detected and rebuilt, a changed
file gets a new entry, two processes loading at once both succeed, and it can be turned
off. Each test has a cache folder of its own (``OMNI_ASYNC_CACHE_DIR``)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from omni_async import Engine, SamplingParams

from .conftest import assert_kv_free
from .gguf_files import write_gguf

pytest.importorskip("gguf")

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 5, 9, 33, 7], list(range(40, 70))]
TEXT = "the quick brown fox, what is the capital of france?"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("OMNI_ASYNC_CACHE_DIR", str(folder))
    return folder


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "llama-Q8_0.gguf", "llama", "Q8_0", seed=3)


def run_greedy(path: Path) -> tuple[list[list[int]], list[int], str | None]:
    """Greedy tokens of PROMPTS, the encoding of TEXT and the chat template of one load."""

    async def go():
        engine = Engine.from_pretrained(str(path), loop="normal", dtype="float32", kv_capacity_tokens=1024)
        async with engine:
            outs = [await engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in PROMPTS]
        assert_kv_free(engine)
        return [o.output_ids for o in outs], engine.tokenizer.encode(TEXT), engine.tokenizer.chat_template

    return asyncio.run(go())


def entries(cache: Path) -> list[Path]:
    return sorted((cache / "gguf").glob("*.safetensors"))


def test_second_load_reads_the_cache_and_gives_the_same_tokens(cache, gguf_file, capfd):
    first = run_greedy(gguf_file)
    assert "converting llama-Q8_0.gguf" in capfd.readouterr().err
    (entry,) = entries(cache)
    stamp = entry.stat().st_mtime_ns
    second = run_greedy(gguf_file)
    assert "converting" not in capfd.readouterr().err  # read, not converted again
    assert second == first
    assert entries(cache) == [entry] and entry.stat().st_mtime_ns == stamp


def _flip_byte(entry: Path) -> None:
    with open(entry, "r+b") as f:
        f.seek(entry.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


def _truncate(entry: Path) -> None:
    os.truncate(entry, entry.stat().st_size - 1000)


def _bad_header(entry: Path) -> None:
    with open(entry, "r+b") as f:
        f.seek(8)
        f.write(b"}}}}")


def _edit_header(entry: Path, edit) -> None:
    """Rewrite the header's JSON in place (same length): valid JSON that lies."""
    with open(entry, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = f.read(n).decode()
        new = edit(raw)
        assert new != raw and len(new) == len(raw)
        f.seek(8)
        f.write(new.encode())


def _wrong_shape(entry: Path) -> None:
    """One tensor's first size changed (same digit count): the data's checksum still holds."""
    def edit(raw: str) -> str:
        m = re.search(r'"shape":\[(\d+)', raw)
        assert m, "no tensor in the header"
        first = m.group(1)
        other = str(int(first) + 1) if len(str(int(first) + 1)) == len(first) else str(int(first) - 1)
        return raw[: m.start(1)] + other + raw[m.end(1) :]
    _edit_header(entry, edit)


def _wrong_config(entry: Path) -> None:
    """A model config value changed (still valid JSON): the head count off by one digit."""
    def edit(raw: str) -> str:
        m = re.search(r'(\\"num_heads\\": ?)(\d)', raw)
        assert m, "no num_heads in the header"
        return raw[: m.start(2)] + str((int(m.group(2)) + 1) % 10) + raw[m.end(2) :]
    _edit_header(entry, edit)


@pytest.mark.parametrize("damage", [_flip_byte, _truncate, _bad_header, _wrong_shape, _wrong_config],
                         ids=["flipped-byte", "torn", "header", "wrong-shape", "wrong-config"])
def test_damaged_entry_is_detected_and_rebuilt(cache, gguf_file, capfd, damage):
    reference = run_greedy(gguf_file)
    (entry,) = entries(cache)
    damage(entry)
    capfd.readouterr()
    assert run_greedy(gguf_file) == reference
    err = capfd.readouterr().err
    assert "damaged" in err and "converting" in err
    assert entries(cache) == [entry]
    assert run_greedy(gguf_file) == reference  # the rebuilt entry is sound: read as is
    assert "converting" not in capfd.readouterr().err


def test_a_changed_file_gets_a_new_entry_and_the_old_one_goes(cache, tmp_path, capfd):
    path = write_gguf(tmp_path / "m.gguf", "llama", "Q8_0", seed=1)
    before = run_greedy(path)
    (old,) = entries(cache)
    write_gguf(path, "llama", "Q8_0", seed=2)  # same path, new weights
    os.utime(path, ns=(old.stat().st_mtime_ns + 10**9, old.stat().st_mtime_ns + 10**9))
    after = run_greedy(path)
    assert after[0] != before[0]
    (new,) = entries(cache)
    assert new != old
    capfd.readouterr()
    assert run_greedy(path) == after and "converting" not in capfd.readouterr().err


_LOAD_SCRIPT = """
import asyncio, json, sys
from omni_async import Engine, SamplingParams
async def main():
    async with Engine.from_pretrained(sys.argv[1], loop="normal", dtype="float32", kv_capacity_tokens=1024) as engine:
        outs = [await engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in json.loads(sys.argv[2])]
    print(json.dumps([o.output_ids for o in outs]))
asyncio.run(main())
"""


def test_two_processes_loading_at_once_both_succeed(cache, gguf_file):
    env = dict(os.environ, OMNI_ASYNC_CACHE_DIR=str(cache), PYTHONPATH=str(REPO))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _LOAD_SCRIPT, str(gguf_file), json.dumps(PROMPTS)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
    tokens = [json.loads(out) for out, _err in results]
    reference = run_greedy(gguf_file)[0]  # read from the entry they left
    assert tokens == [reference, reference]
    assert len(entries(cache)) == 1
    assert not list((cache / "gguf").glob(".*.tmp"))  # no temporary file left behind
    assert sum("converting" in err for _out, err in results) == 1  # the other waited on the lock, then read


def test_cache_turned_off_writes_nothing(tmp_path, monkeypatch, gguf_file, capfd):
    monkeypatch.setenv("OMNI_ASYNC_CACHE_DIR", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    tokens = run_greedy(gguf_file)
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "home").exists()
    assert tokens[0] and "converting" not in capfd.readouterr().err


def test_default_folder_is_the_users_cache(tmp_path, monkeypatch, gguf_file):
    monkeypatch.delenv("OMNI_ASYNC_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    run_greedy(gguf_file)
    assert len(entries(tmp_path / "xdg" / "omni-async")) == 1


def test_copies_of_one_file_share_one_entry(cache, gguf_file, tmp_path, capfd):
    """The key is the file's content: a second clone's copy converts nothing."""
    import shutil

    reference = run_greedy(gguf_file)
    copy = tmp_path / "another-clone" / gguf_file.name
    copy.parent.mkdir()
    shutil.copyfile(gguf_file, copy)
    capfd.readouterr()
    assert run_greedy(copy) == reference
    assert "converting" not in capfd.readouterr().err
    assert len(entries(cache)) == 1


def test_a_path_keyed_entry_of_before_is_removed(cache, tmp_path):
    """Entries keyed by path (this cache's layout before content keys) are removed when
    their file is first loaded by content."""
    import hashlib

    path = write_gguf(tmp_path / "old.gguf", "llama", "Q8_0", seed=4)
    old = cache / "gguf" / f"old-{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]}.f32.0123456789abcdef0123.safetensors"
    old.parent.mkdir(parents=True)
    old.write_bytes(b"\0" * 1024)
    run_greedy(path)
    assert not old.exists()
    assert len(entries(cache)) == 1 and "-c" in entries(cache)[0].name


def test_kernels_and_gguf_entries_share_the_users_cache_folder(tmp_path, monkeypatch):
    from omni_async.kernels import cpu_build
    from omni_async.models import gguf_cache

    monkeypatch.delenv("OMNI_ASYNC_CACHE_DIR", raising=False)
    monkeypatch.delenv(cpu_build.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_cache.cache_root() == tmp_path / "xdg" / "omni-async"
    assert cpu_build.cache_root() == tmp_path / "xdg" / "omni-async" / "kernels"


def test_a_kernel_build_of_before_is_copied_not_rebuilt(tmp_path, monkeypatch):
    from omni_async.kernels import cpu_build
    from omni_async.kernels.cpu_build import CppKernels

    monkeypatch.delenv(cpu_build.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    kernels = CppKernels("omni_async_legacy_probe", "int f() { return 1; }", ["f"], "test")
    legacy = tmp_path / "home" / ".cache" / "omni_async" / "kernels" / kernels.folder.name
    legacy.mkdir(parents=True)
    (legacy / kernels.library.name).write_bytes(b"built before")
    assert not kernels.library.is_file()
    assert kernels.is_built()
    assert kernels.library.read_bytes() == b"built before"
    assert str(kernels.library).startswith(str(tmp_path / "xdg" / "omni-async" / "kernels"))

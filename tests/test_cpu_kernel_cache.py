"""The C++ CPU kernels are built once per torch build, not per environment: their cache
folder's key follows the torch version, commit and C++ ABI (and the source), never the
path torch or the environment is installed at; a start that finds them missing says so
on stderr and does not wait (see also test_cpu_defaults' fallback test)."""

from __future__ import annotations

import sys

import torch

from omni_async.kernels import cpu_build, cpu_kernels
from omni_async.kernels.cpu_build import CppKernels

KERNELS = CppKernels("omni_async_test_key", "int f() { return 1; }", ["f"], "test")


def test_the_key_changes_with_the_torch_build(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))
    before = KERNELS.folder
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert KERNELS.folder != before
    monkeypatch.undo()
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", not torch._C._GLIBCXX_USE_CXX11_ABI)
    assert KERNELS.folder != before
    monkeypatch.undo()
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(torch.version, "git_version", "0" * 40)
    assert KERNELS.folder != before


def test_the_key_does_not_change_with_the_environments_path(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))
    before = KERNELS.folder
    for module, name in ((sys, "prefix"), (sys, "exec_prefix"), (sys, "executable"), (torch, "__file__")):
        monkeypatch.setattr(module, name, f"/elsewhere/venv-2/{name}")
    monkeypatch.setenv("VIRTUAL_ENV", "/elsewhere/venv-2")
    assert KERNELS.folder == before
    assert str(tmp_path) in str(before) and "venv" not in before.name


def test_the_source_and_flags_are_in_the_key(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))
    other = CppKernels("omni_async_test_key", "int f() { return 2; }", ["f"], "test")
    flagged = CppKernels("omni_async_test_key", KERNELS.source, ["f"], "test", extra_cflags=["-DX"])
    assert len({KERNELS.folder, other.folder, flagged.folder}) == 3


def test_a_missing_build_is_announced_and_not_waited_for(monkeypatch, tmp_path, capsys):
    """An empty cache: the start says so with an estimate, starts one detached build
    (recorded here instead of run) and answers False at once."""
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_background", None)
    monkeypatch.setattr(cpu_kernels, "all_kernels", lambda: [KERNELS])  # not loaded in this process
    started = []
    monkeypatch.setattr(cpu_kernels.subprocess, "Popen", lambda cmd, **kw: started.append(cmd) or object())
    assert cpu_kernels.ensure_built_in_background() is False
    assert cpu_kernels.ensure_built_in_background() is False
    err = capsys.readouterr().err
    assert "building them in the background" in err and " s, once" in err
    assert len(started) == 1 and started[0][1:3] == ["-m", "omni_async.kernels.cpu_kernels"]


def test_the_cpus_instruction_sets_are_in_the_key(monkeypatch, tmp_path):
    """Cloud VMs name Zen 3 (AVX2) and Zen 4 (AVX-512) alike ("AMD EPYC"): a build made with
    -march=native on the one must not be loaded on the other."""
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path))
    folders = []
    for flags in ("fpu avx2 fma f16c", "fpu avx2 fma f16c avx512f avx512_vnni"):
        info = tmp_path / f"cpuinfo-{len(folders)}"
        info.write_text(f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: {flags}\n\nprocessor\t: 1\nmodel name\t: AMD EPYC\n")
        monkeypatch.setattr(cpu_build, "CPUINFO", info)
        folders.append(KERNELS.folder)
    assert folders[0] != folders[1]

"""Running a test script under Triton's CPU interpreter: in a process of its own, because
``TRITON_INTERPRET`` is read when Triton is first imported, with this checkout first on
the path (and the caller's path kept after it)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# A kernel's test pair: the interpreter's run where no GPU is, the compiled kernel's where one is.
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernel's test runs instead")


def interpreted_result(script: str, timeout: float = 600) -> str:
    """What ``script``, run under the interpreter, printed after ``RESULT`` (it must exit 0)."""
    done = run_interpreted(script, timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split("RESULT")[1]


def run_interpreted(script: str, timeout: float) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# Triton 3.5's interpreter hands a kernel's loop bounds to ``range`` as its own 0-d
# tensors, which NumPy 2.4 no longer converts to integers ("only 0-dimensional arrays can
# be converted to Python scalars"): a script prepends this to give the named kernel
# modules a ``range`` that reads them (the compiled kernels never see it).
RANGE_SHIM = r"""
import builtins as _builtins
import importlib as _importlib

import numpy as _np


def _bound(x):
    handle = getattr(x, "handle", None)
    return int(_np.asarray(handle.data).reshape(-1)[0]) if hasattr(handle, "data") else x


def _range(*bounds):
    return _builtins.range(*[_bound(b) for b in bounds])


for _name in ("omni_async.kernels.sample",):
    _importlib.import_module(_name).range = _range
"""

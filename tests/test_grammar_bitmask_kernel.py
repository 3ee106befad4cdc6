"""The grammar bitmask's Triton kernel (what CUDA runs) gives the torch path's logits,
checked on the CPU through Triton's interpreter in a process of its own (the interpreter
is chosen when kernels are defined)."""

from __future__ import annotations


import pytest

pytest.importorskip("triton")

from .triton_interpreter import run_interpreted  # noqa: E402

SCRIPT = r"""
import torch
from omni_async.kernels.token_bitmask import token_bitmask
from omni_async.runners.logit_controls import apply_token_bitmask

g = torch.Generator().manual_seed(0)
for rows, vocab in ((5, 3000), (3, 2048), (1, 70)):
    x = torch.randn(rows, vocab, generator=g)
    mask = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    mask[0] = -1  # a free row: every token allowed
    got, want = token_bitmask(x, mask), apply_token_bitmask(x, mask)
    assert torch.equal(got, want), (rows, vocab)
    assert torch.equal(got[0], x[0]) and (rows == 1 or not torch.equal(got, x))
print("ok")
"""


def test_kernel_equals_the_torch_path_in_the_interpreter():
    done = run_interpreted(SCRIPT, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]

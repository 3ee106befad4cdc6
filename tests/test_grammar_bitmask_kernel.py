"""The grammar bitmask on CUDA: its Triton kernel gives the torch path's logits, and the
sampling kernel reading the bitmask beside the logits samples what it samples from the
masked logits (and what the torch path samples); checked on the CPU through Triton's
interpreter in a process of its own (the interpreter is chosen when kernels are defined)."""

from __future__ import annotations


import pytest

pytest.importorskip("triton")

from .test_sample_kernel import COMPARE  # noqa: E402
from .triton_interpreter import RANGE_SHIM, run_interpreted  # noqa: E402

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


SAMPLING = COMPARE + r"""
from omni_async.runners.logit_controls import apply_token_bitmask

g = torch.Generator().manual_seed(3)
checked = near_rows = 0
for rows, vocab, parts in ((24, 3000, None), (9, 49152, None), (4, 41000, 3), (1, 70, None)):
    x = torch.randn(rows, vocab, generator=g) * 3
    temp = torch.rand(rows, generator=g) + 0.3
    temp[::4] = 0  # greedy rows under the mask too
    mask = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    if rows > 4:
        mask[1] = -1  # a free row
        mask[2] = 0  # nothing admissible: ok False, token 0
        mask[3] = 0
        mask[3, 5] = 1 << 7  # one token: taken whatever the logits
        x[5, :64] = float("nan")  # NaN only where masked: still sampled
        mask[5, :2] = 0
        x[6, 100] = float("nan")  # NaN at an admitted token: ok False
        mask[6, 100 // 32] |= 1 << (100 % 32)
    seeds = torch.randint(0, 2**62, (rows,), generator=g)
    idx = torch.randint(0, 2**40, (rows,), generator=g)
    got = sample_temperature(x, temp, seeds, idx, parts=parts, allowed=mask)
    masked = apply_token_bitmask(x, mask)
    want = sample_temperature(masked, temp, seeds, idx, parts=parts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (rows, vocab)
    b = rows
    sb = SamplingBatch(temperature=temp, top_k=torch.zeros(b, dtype=torch.long), top_p=torch.ones(b),
                       min_p=torch.zeros(b), seeds=seeds, sample_indices=idx, allowed=mask,
                       sampled_rows=torch.nonzero(temp != 0).flatten(), num_sampled=int((temp != 0).sum()))
    ref = sample(x, sb)  # the torch path (CPU tensors)
    assert torch.equal(got[1], ref.ok)
    near = near_boundary(masked, temp, seeds, idx, ref.tokens) & ref.ok & (temp != 0)
    assert not ((got[0] != ref.tokens) & ~near).any()
    bits = ((mask[torch.arange(rows), got[0] // 32] >> (got[0] % 32)) & 1).bool()
    assert bits[got[1]].all()  # every admissible row's token is one its mask admits
    if rows > 4:
        assert not got[1][2] and got[0][2] == 0 and got[0][3] == 5 * 32 + 7 and got[1][5] and not got[1][6]
    checked, near_rows = checked + rows, near_rows + int(near.sum())
assert near_rows == 0
print("ok", checked)
"""


def test_sampling_kernel_reads_the_bitmask_as_the_masked_logits_in_the_interpreter():
    done = run_interpreted(RANGE_SHIM + SAMPLING, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().startswith("ok"), done.stderr[-3000:]

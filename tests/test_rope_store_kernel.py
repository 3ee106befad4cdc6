"""The fused norm + rotary + KV-write kernel (:func:`omni_async.kernels.fused.rope_store`),
and the rotary table kernel below, against the reference ops: on the CPU through Triton's interpreter (a process of its own,
the interpreter being chosen when Triton is first imported), with and without Qwen3's
per-head q/k RMSNorm, on the head layouts the engine's models use.

Tolerance: the kernel rounds the norm where :class:`~omni_async.models.decoder.RMSNorm`
does (the normalised value, then its product with the weight), but keeps the rotary's two
products in float32 where torch rounds each to the activation dtype, so a bfloat16 output
may differ from the reference by a step or two of bfloat16: at most 2^-6 of the largest
|x| of its head, 4e-3 in norm over the tensor (the interpreter's own bfloat16 rounding,
a truncation, is replaced by the GPU's round-to-nearest-even, as in
:mod:`omni_async.kernels.small_m`). Float32 outputs differ by float32 noise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton")

from .triton_interpreter import run_interpreted  # noqa: E402

COMPARE = r'''
import torch
from omni_async.kernels.fused import FusedOps
from omni_async.kernels.reference import ReferenceOps
from omni_async.kv.cache import PagedKVCache
from omni_async.models.decoder import RMSNorm

torch.set_grad_enabled(False)


def close(got, want, dtype, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    got, want = got.double(), want.double()
    scale = want.abs().amax(dim=-1, keepdim=True)  # per head
    step = 2.0 ** -6 if dtype == torch.bfloat16 else 1e-5
    err = (got - want).abs()
    worst = float((err / scale.clamp_min(1e-30)).max())
    assert worst <= step, (what, worst)
    rel = float((got - want).norm() / want.norm())
    assert rel <= (4e-3 if dtype == torch.bfloat16 else 1e-6), (what, rel)
    print(what, dtype, tuple(got.shape), f"{worst:.2e} {rel:.2e}")


def trial(dtype, tokens, heads, kv_heads, dim, with_norm, norm_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 3).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    angles = torch.rand(tokens, dim // 2, generator=gen) * 100
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    slots = torch.randperm(64, generator=gen)[:tokens]
    norms = (None, None)
    if with_norm:
        norms = tuple(RMSNorm(dim, 1e-6).to(norm_dtype) for _ in range(2))
        for n in norms:
            n.weight.copy_(torch.randn(dim, generator=gen) * 0.5 + 1)
    caches = []
    for _ in range(2):
        kv = PagedKVCache(num_layers=2, num_pages=4, page_size=16, num_kv_heads=kv_heads, head_dim=dim, dtype=dtype,
                          device=torch.device("cpu"))
        for t in kv.k + kv.v:
            t.fill_(float("nan"))  # poisoned: slots not written stay NaN
        caches.append(kv)
    ref_q, ref_k = ReferenceOps().rope_store(q, k, v, cos, sin, caches[0], 1, slots, *norms)
    got_q, got_k = FusedOps().rope_store(q, k, v, cos, sin, caches[1], 1, slots, *norms)
    assert got_k is None  # the rotated k lives in the cache only
    close(got_q, ref_q, dtype, "q")
    close(caches[1].k[1][slots], ref_k, dtype, "k")
    assert torch.equal(caches[1].v[1][slots], v)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert caches[1].k[1][untouched].isnan().all() and caches[1].v[1][untouched].isnan().all()
    assert caches[1].k[0].isnan().all() and caches[1].v[0].isnan().all()


runs = 0
for dtype in (torch.bfloat16, torch.float32):
    # Qwen2-0.5B's heads, Qwen3-0.6B's (16 q, 8 kv, 128), a head count not a power of two,
    # Llama's 8 kv heads of 128.
    for tokens, heads, kv_heads, dim in [(1, 14, 2, 64), (5, 16, 8, 128), (3, 6, 2, 32), (2, 32, 8, 128)]:
        for with_norm in (False, True):
            trial(dtype, tokens, heads, kv_heads, dim, with_norm, dtype, tokens * heads + dim)
            runs += 1
print("OK", runs)
'''


def test_norm_rope_store_matches_reference_interpreted():
    proc = run_interpreted(COMPARE, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK 16" in proc.stdout, proc.stdout + proc.stderr


# The rotary table kernel (:func:`omni_async.kernels.fused.rope_table`) against
# ``ReferenceOps.rope_table``: the same float32 angles; the interpreter's cosine and sine
# are numpy's (the GPU's are CUDA's cosf and sinf, as torch's there), so float32 values may
# differ by an ulp here and a bfloat16 table by a rounding step where such an ulp crosses
# a rounding boundary (rare: none on these positions).
TABLE = r'''
import torch
from omni_async.kernels.fused import FusedOps
from omni_async.kernels.reference import ReferenceOps
from omni_async.models.config import ModelConfig
from omni_async.models.decoder import rope_inv_freq

checked = 0
for d, theta, scaling in ((64, 1e6, None), (128, 5e5, {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}),
                          (16, 1e4, None)):
    cfg = ModelConfig(family="llama", vocab_size=10, hidden_size=2 * d, intermediate_size=8, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=d, rope_theta=theta, rope_scaling=scaling)
    inv = rope_inv_freq(cfg)
    gen = torch.Generator().manual_seed(d)
    pos = torch.cat([torch.tensor([0, 1, 2, 31, 32767]), torch.randint(0, 40000, (60,), generator=gen)])
    stacked = torch.stack([pos + 3, pos, pos + 1])
    for dtype in (torch.float32, torch.bfloat16):
        for p in (pos, stacked.unbind(0)[1], pos[:1], pos[:0]):  # a row of stacked inputs, as an extend passes them
            want = ReferenceOps().rope_table(p, inv, dtype)
            got = FusedOps().rope_table(p, inv, dtype)
            for g, w in zip(got, want):
                assert g.dtype == w.dtype == dtype and g.shape == w.shape == (p.shape[0], d), (g.shape, w.shape)
                if not p.numel():
                    continue
                err = float((g.double() - w.double()).abs().max())
                equal = float((g == w).double().mean())
                if dtype == torch.float32:
                    assert err <= 1.2e-7, (d, err)
                else:
                    assert err <= 2.0 ** -8 and equal >= 0.999, (d, err, equal)
                checked += 1
print("OK", checked)
'''


def test_rope_table_matches_reference_interpreted():
    proc = run_interpreted(TABLE, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK 36" in proc.stdout, proc.stdout + proc.stderr


def _ptxas_present() -> bool:
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").is_file()


@pytest.mark.skipif(not _ptxas_present(), reason="needs Triton's NVIDIA backend (ptxas) to compile offline")
def test_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter runs what the GPU compiler may refuse: the norm + rotary + KV-write
    kernel with and without the norm on the engine's head layouts, and the rotary table
    kernel (libdevice's cosf and sinf), compile for sm_90 through ptxas."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from omni_async.kernels import fused

    def compile_sm90(fn, types: dict, const: dict) -> str:
        sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in fn.arg_names}
        kernel = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        return kernel.asm["ptx"]

    bf16 = {n: "*bf16" for n in ("Q", "K", "V", "COS", "SIN", "QOUT", "KC", "VC", "QW", "KW")}
    for nh, nkv, d in [(14, 2, 64), (16, 8, 128), (32, 8, 128)]:
        for norm in (False, True):
            const = dict(NH=nh, NKV=nkv, HALF=d // 2, BLOCK=d // 2, QHEADS=triton.next_power_of_2(nh),
                         KVHEADS=triton.next_power_of_2(nkv), HAS_NORM=norm, EMULATE=False)
            ptx = compile_sm90(fused._rope_store_kernel, {**bf16, "SLOTS": "*i64", "eps": "fp32"}, const)
            assert ("rsqrt" in ptx) == norm, (nh, nkv, d, norm)
    for half, dtype in [(32, "*bf16"), (64, "*bf16"), (64, "*fp32")]:
        ptx = compile_sm90(fused._rope_table_kernel, {"POS": "*i64", "INV": "*fp32", "COS": dtype, "SIN": dtype},
                           dict(HALF=half, BLOCK=half, EMULATE=False))
        assert "cos.approx" not in ptx and "sin.approx" not in ptx  # libdevice's, not the approximations

"""The fused small-M GEMMs (:mod:`omni_async.kernels.small_m`) against the torch reference
ops and ``F.linear``: on the CPU through Triton's interpreter, in a process of its own (the
interpreter is chosen when Triton is first imported), on small shapes; on CUDA compiled, on
the Qwen2-0.5B shapes, and the whole decoder's greedy tokens with them.

Tolerance (bfloat16): the kernel rounds at the reference's points (tested exactly through
``x_sum`` and through outputs that match bit for bit on most elements), but sums the
products in another order than torch's GEMM; two float32 sums that differ by ~1e-6
relative can round to neighbouring bfloat16 values, so an output may differ by one
bfloat16 step (2^-7 of its magnitude) plus float32 noise of the order of K * 2^-24 of the
largest |a| * |w| sum, bounded here by 1e-3 of the largest output. Float32: 1e-5 of the
largest output (the same accumulation-order noise, K <= 4864).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from omni_async.backends.native.parallel.sharding import RowParallelLinear  # noqa: E402
from omni_async.kernels import small_m, triton_available  # noqa: E402
from omni_async.models.merged import MergedLinear  # noqa: E402
from omni_async.models.quantized import Linear  # noqa: E402

from .triton_interpreter import run_interpreted  # noqa: E402

# Shared by the interpreter's script and the CUDA test: every fused op against the
# reference ops over real modules (RMSNorm, MergedLinear, Linear), for each combination.
COMPARE = r'''
import itertools
import torch
from omni_async.kernels import small_m
from omni_async.kernels.fused import FusedOps
from omni_async.kernels.reference import ReferenceOps
from omni_async.models.decoder import RMSNorm
from omni_async.models.merged import MergedLinear
from omni_async.models.quantized import Linear

torch.set_grad_enabled(False)
small_m.SMALL_M_MAX = 16  # the kernels at every row count they serve, above today's threshold too


def close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    got, want = got.double(), want.double()
    scale = float(want.abs().max())
    if dtype == torch.bfloat16:
        bound = want.abs() * 2.0 ** -7 + 1e-3 * scale
    else:
        bound = torch.full_like(want, 1e-5 * scale)
    err = (got - want).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    return int((err > 0).sum())


def trial(device, dtype, m, hidden, inter, bias, with_delta, config, gen):
    ref, fused = ReferenceOps(), FusedOps()
    norm = RMSNorm(hidden, 1e-6).to(device, dtype)
    qkv = MergedLinear(hidden, {"q_proj": hidden, "k_proj": hidden // 4, "v_proj": hidden // 4}, bias=bias).to(device, dtype)
    down = Linear(inter, hidden, bias=bias).to(device, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen, device=device) * 0.5 + 1)
        for mod in (qkv, down):
            mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen, device=device) * mod.in_features ** -0.5)
            if bias:
                mod.bias.copy_(torch.randn(mod.out_features, generator=gen, device=device) * 0.1)
    x = (torch.randn(m, hidden, generator=gen, device=device) * 2).to(dtype)
    delta = torch.randn(m, hidden, generator=gen, device=device).to(dtype) if with_delta else None
    gate_up = (torch.randn(m, 2 * inter, generator=gen, device=device) * 3).to(dtype)
    assert small_m.small_m_weights(x, qkv, delta, norm.weight) is not None  # the fused path is taken
    want_sum, want_y = ref.add_norm_linear(x, delta, norm, qkv)
    if config is None:
        got_sum, got_y = fused.add_norm_linear(x, delta, norm, qkv)
        got_down = fused.silu_mul_linear(gate_up, down)
        got_o = fused.linear(x, qkv)
    else:
        got_sum, got_y = small_m.add_norm_linear(x, delta, norm.weight, norm.eps, qkv.weight, qkv.bias, config)
        got_down = small_m.silu_mul_linear(gate_up, down.weight, down.bias, config)
        got_o = small_m.linear(x, qkv.weight, qkv.bias, config)
    assert torch.equal(got_sum, want_sum)  # the residual sum: exactly the reference's
    differ = close(got_y, want_y, dtype)
    differ += close(got_down, ref.silu_mul_linear(gate_up, down), dtype)
    differ += close(got_o, ref.linear(x, qkv), dtype)
    return differ


def trials(device, cases, configs):
    """Every case with and without bias and delta at the default tiling (``configs[0]``),
    and with both at each other tiling (the prologues do not depend on the tiling)."""
    gen = torch.Generator(device=device).manual_seed(0)
    count = differ = 0
    for case in cases:
        runs = [(bias, delta, configs[0]) for bias, delta in itertools.product((False, True), (False, True))]
        runs += [(True, True, config) for config in configs[1:]]
        for bias, with_delta, config in runs:
            differ += trial(device, *case, bias, with_delta, config, gen)
            count += 1
    return count, differ
'''

INTERPRETED = COMPARE + r'''
cases = [(dtype, m, hidden, inter) for dtype in (torch.bfloat16, torch.float32)
         for m, hidden, inter in ((1, 64, 96), (3, 128, 64), (16, 64, 128))]
# The default tiling, a split K with the dot, and the broadcast product with and without
# the weight prefetch (split, several K steps a program).
configs = (None, small_m.SmallMConfig(16, 32, 2, 4, True), small_m.SmallMConfig(8, 64, 1, 4, False),
           small_m.SmallMConfig(8, 16, 2, 4, False, 3, True))
count, differ = trials("cpu", cases, configs)


def layer_outputs(ops, m):
    """A real DecoderLayer (Qwen2-like: q/k/v bias) decoding m rows of 20 cached tokens."""
    from omni_async.kv.attention import AttentionContext
    from omni_async.kv.cache import PagedKVCache
    from omni_async.models.config import ModelConfig
    from omni_async.models.decoder import DecoderLayer

    cfg = ModelConfig(family="qwen2", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True)
    gen = torch.Generator().manual_seed(m)
    layer = DecoderLayer(cfg, 0)
    for name, p in layer.named_parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if "layernorm" in name else p.shape[-1] ** -0.5) + ("layernorm" in name))
    kv = PagedKVCache(num_layers=1, num_pages=2 * m, page_size=16, num_kv_heads=2, head_dim=16,
                      dtype=torch.float32, device=torch.device("cpu"))
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=gen))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=gen))
    tables = torch.arange(2 * m).view(m, 2)
    ctx = AttentionContext(is_decode=True, slot_mapping=tables[:, 1] * 16 + 3, logits_rows=torch.arange(m),
                           kv_lens=torch.full((m,), 20), block_tables=tables, page_size=16)
    x, delta = torch.randn(m, 64, generator=gen), torch.randn(m, 64, generator=gen)
    emb = torch.rand(m, 8, generator=gen).repeat(1, 2) * 20
    return (*layer(x, delta, emb.cos(), emb.sin(), kv, ctx, ops), kv.k[0], kv.v[0])


for m in (1, 3):
    for got, want in zip(layer_outputs(FusedOps(), m), layer_outputs(ReferenceOps(), m)):
        close(got, want, torch.float32)
print("ok", count, differ)
'''


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernel's test below runs instead")
def test_fused_small_m_ops_match_reference_interpreted():
    proc = run_interpreted(INTERPRETED, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    words = proc.stdout.split()
    assert words[0] == "ok" and int(words[1]) == 6 * 7, proc.stdout


def _modules(rows: int, dtype: torch.dtype = torch.float32):
    x = torch.randn(rows, 32, dtype=dtype)
    return x, Linear(32, 48, bias=True).to(dtype), MergedLinear(32, {"gate_proj": 16, "up_proj": 16}, bias=False).to(dtype)


def test_threshold_selects_the_fused_path_for_few_rows_only():
    """At most ``SMALL_M_MAX`` rows and a plain linear of the same dtype: fused; one row
    more, a tensor-parallel layer (its all-reduce comes after the GEMM), a quantised one
    or a dtype mismatch: the old path."""
    limit = small_m.SMALL_M_MAX
    for rows in sorted({1, limit}):
        x, lin, merged = _modules(rows)
        assert small_m.small_m_weights(x, lin) == (lin.weight, lin.bias)
        assert small_m.small_m_weights(x, merged, x, torch.ones(32)) == (merged.weight, None)
    x, lin, merged = _modules(limit + 1)
    assert small_m.small_m_weights(x, lin) is None and small_m.small_m_weights(x, merged) is None
    x, lin, _ = _modules(1)
    assert small_m.small_m_weights(x, RowParallelLinear(32, 48, True, lambda t: t)) is None
    lin.packed_int8 = object()  # what quantize_linears attaches
    assert small_m.small_m_weights(x, lin) is None
    x, lin, _ = _modules(1)
    big = lin.weight.numel() * lin.weight.element_size()
    old_limit, small_m.SMALL_M_MAX_WEIGHT_BYTES = small_m.SMALL_M_MAX_WEIGHT_BYTES, big - 1
    try:  # a larger matrix than the limit: cuBLAS
        assert small_m.small_m_weights(x, lin) is None
    finally:
        small_m.SMALL_M_MAX_WEIGHT_BYTES = old_limit
    assert small_m.small_m_weights(x, lin) == (lin.weight, lin.bias)
    assert small_m.small_m_weights(x.to(torch.bfloat16), lin) is None
    assert small_m.small_m_weights(x, lin, torch.ones(32, dtype=torch.bfloat16)) is None


def test_config_splits_k_only_where_n_gives_too_few_programs():
    """A narrow matrix with a long K (256 rows of 4864: 64 programs of 4 rows) splits K;
    the 0.5B shape's ``down`` (896 rows: 224 programs) and ``gate_up`` do not; one row
    uses the broadcast product, 16 rows the dot."""
    assert small_m.pick_config(1, 256, 4864).split_k > 1
    assert small_m.pick_config(1, 896, 4864).split_k == 1
    assert small_m.pick_config(1, 9728, 896).split_k == 1
    assert not small_m.pick_config(1, 1152, 896).dot and small_m.pick_config(16, 1152, 896).dot


@pytest.mark.skipif(not triton_available("cuda"), reason="the compiled kernel needs a GPU")
def test_fused_small_m_ops_match_reference_cuda():
    scope: dict = {}
    limit = small_m.SMALL_M_MAX
    try:
        exec(COMPARE, scope)  # (raises SMALL_M_MAX for its own checks)
        cases = [(dtype, m, 896, 4864) for dtype in (torch.bfloat16, torch.float32) for m in (1, 2, 5, 16)]
        configs = (None, small_m.SmallMConfig(16, 128, 4, 4, True), small_m.SmallMConfig(8, 256, 2, 4, False),
                   small_m.SmallMConfig(8, 1024, 2, 8, False, 3, True))
        count, _ = scope["trials"]("cuda", cases, configs)
    finally:
        small_m.SMALL_M_MAX = limit
    assert count == len(cases) * 7


@pytest.mark.skipif(not triton_available("cuda"), reason="needs CUDA and Triton")
def test_decoder_greedy_tokens_with_small_m_path_equal_reference():
    """A small random model in float32, one and three requests (a decode graph of one row
    on the fused small-M path, of four rows on today's), 32 greedy tokens each: equal to
    the CPU reference ops', and the small-M kernel did run."""
    import asyncio

    from omni_async import Engine, SamplingParams

    def tokens(device: str, prompts) -> list[list[int]]:
        async def run():
            engine = Engine.from_pretrained("tiny", device=device, dtype="float32", kv_capacity_tokens=4096)
            async with engine:
                res = await asyncio.gather(*[engine.generate(input_ids=p, sampling=SamplingParams(max_new_tokens=32, ignore_eos=True))
                                             for p in prompts])
            return [r.output_ids for r in res]

        return asyncio.run(run())

    launches = lambda: small_m._SMALL_M_LAUNCH.direct_launches + len(small_m._SMALL_M_LAUNCH._compiled)  # noqa: E731
    for prompts in ([[5, 6, 7, 8]], [[1, 2, 3], [9, 10, 11, 12, 13], [42] * 20]):
        before = launches()
        got = tokens("cuda", prompts)
        assert launches() > before  # the engine's forwards (graph captures included) ran the kernel
        assert got == tokens("cpu", prompts)


def _ptxas_present() -> bool:
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").is_file()


@pytest.mark.skipif(not _ptxas_present(), reason="needs Triton's NVIDIA backend (ptxas) to compile offline")
def test_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter runs what the GPU compiler may refuse: every prologue at the
    default tilings of the 0.5B shape's GEMMs (one row, 16 rows, a split K) compiles for
    sm_90 through ptxas, and so does the split-K sum. With the integers and pointers
    16-aligned (as Triton specialises the real shapes), the weights load in 16-byte
    vectors: one row's loop as plain loads, the dot's through asynchronous copies."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def ptx_for_sm90(fn, const: dict, warps: int, stages: int = 3) -> str:
        sig = {n: ("constexpr" if n in const else "*fp32" if n == "PART" else "fp32" if n == "eps"
                   else "*bf16" if n in ("A", "DELTA", "G", "W", "BIAS", "SUM", "Y") else "i32") for n in fn.arg_names}
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                   if n not in const and n not in ("M", "eps")}
        kernel = triton.compile(ASTSource(fn, sig, const, aligned), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": warps, "num_stages": stages})
        return kernel.asm["ptx"]

    for m, (prologue, n, k) in [(1, (1, 1152, 896)), (16, (1, 1152, 896)), (1, (2, 896, 4864)), (16, (2, 896, 4864)), (1, (0, 896, 896))]:
        c = small_m.pick_config(m, n, k)
        const = dict(PROLOGUE=prologue, HAS_DELTA=prologue == 1, HAS_BIAS=prologue != 2, SPLIT_K=c.split_k,
                     BLOCK_M=max(16 if c.dot else 1, m), BLOCK_N=c.block_n, BLOCK_K=c.block_k, DOT=c.dot,
                     PREFETCH=c.prefetch, EMULATE=False, IEEE=False)
        ptx = ptx_for_sm90(small_m._small_m_kernel, const, c.warps, c.stages)
        wide = r"cp\.async\.cg\.shared\.global" if c.dot else r"ld\.global(\.\w+)*\.v4\.b32"
        assert len(re.findall(wide, ptx)) >= 4, (m, prologue, c)
    ptx_for_sm90(small_m._split_sum_kernel, dict(HAS_BIAS=True, SPLIT_K=2, BLOCK=1024, EMULATE=False), 4)

"""A decoder layer's GEMMs at few rows, each fused with the elementwise op before it (Triton, CUDA).

Why: at batch 1 a decode layer on the H200 is ~34 us of kernels (the 2026-12-04 profile,
``bench/results/nv256_profile_h200/b1_torch.txt``, Qwen2-0.5B shape) for weights it could
read in ~6 us: it is bound by kernel count and the latency floor of small cuBLAS GEMMs
(4.4-6.8 us each, plus a split-K reduce on ``down``), not bytes. Here each GEMM takes its
input op into the load of its A tile, so a layer's add + RMSNorm + qkv, add + RMSNorm +
gate_up and SiLU*mul + down are one kernel each (the o projection a plain one), and the
residual deltas of o and down are left to the next ``add_norm_linear``:

- ``add_norm_linear``: ``x_sum = x + delta`` (stored by one program), ``y = (rmsnorm(x_sum)
  * g) @ W.T (+ bias)``. Every program computes its rows' inverse RMS itself in a first pass
  over K (K is the hidden size: a few KB per row, read from L2), then scales the A tile as
  it loads it;
- ``silu_mul_linear``: ``y = (silu(gate) * up) @ W.T (+ bias)``, SiLU*mul while loading;
- ``linear``: ``y = x @ W.T (+ bias)``.

Rounding follows :class:`~omni_async.kernels.reference.ReferenceOps` then ``F.linear``: the
residual sum, the normalised value, its product with the norm weight and the SiLU*mul
product are each rounded to the model dtype before the next step; the GEMM accumulates in
float32 (the order differs from cuBLAS's, so results agree within bf16 rounding, not bit
for bit). The weights are read where they are (no folding of the norm weight into W):
weight updates through the admin API keep working unchanged.

The product is GEMV-shaped: programs split N finely (and K, with a deterministic second
pass summing the splits in order, where N alone gives too few programs), each either a
``tl.dot`` with M padded to 16 or a broadcast product summed over K (``dot=False``, for one
or two rows). :func:`pick_config` chooses; ``tools/small_m_layer.py`` sweeps the
alternatives on the GPU.

Imported only when Triton is present (through :mod:`.fused`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from .launch import launcher

SMALL_M_MAX = 1
"""The most rows a step may have for the fused small-M path; above it the layer runs as
before (the elementwise kernels of :mod:`.fused` and cuBLAS). Measured on the H200
(``tools/small_m_layer.py``, bench/results/small_m_layer_h200.json, 2026-12-04): at
one row the 0.5B shape's layer went from 38.4 to 33.2 us with the best tilings (qkv 5.6 ->
3.3 us with its norm, o 4.6 -> 2.5, down 9.4 -> 8.0 with its SiLU-and-multiply); from two
rows on every fused GEMM was slower than today's path (the layer 1.4-2x at M = 2-64)."""

SMALL_M_MAX_WEIGHT_BYTES = 16 << 20
"""The largest weight matrix the fused path takes. Where a matrix is small, cuBLAS sits at
its latency floor and the fused kernel wins; on large ones cuBLAS streams the weights
faster (same probe, one row: the 0.5B gate_up, 17 MB, 9.2 us today against 10.2 fused;
every GEMM of the Llama-8B shape, 33-235 MB, 0.84x at its best tiling)."""

# The prologue applied to the A tile as it loads (constexpr values of the kernel).
PLAIN, ADD_NORM, SILU_MUL = 0, 1, 2

# Triton 3.9's interpreter computes ``tl.dot`` of bfloat16 tiles wrongly (garbage of
# ~1e10 on 16x16 ones; float32 tiles are right) and rounds to bfloat16 by truncation:
# interpreted, the dot's operands go up to float32 first (the same exact products as the
# GPU's bf16 MMA) and roundings are done on the bits (see ``_rne``).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class SmallMConfig:
    """Tiling of one small-M GEMM: N per program, K per step, programs along K (their
    float32 partial sums added in order by a second kernel), warps, whether the product
    is a ``tl.dot`` (M padded to 16) or a broadcast product, pipeline stages (Triton's, for
    the dot), and whether each K step's weight tile is loaded one step ahead by hand."""

    block_n: int
    block_k: int
    split_k: int = 1
    warps: int = 4
    dot: bool = True
    stages: int = 3
    prefetch: bool = False


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    if not torch.cuda.is_available():
        return 132  # the H200's, for the interpreter: only the tiling changes
    return torch.cuda.get_device_properties(index).multi_processor_count


def pick_config(m: int, n: int, k: int, device: torch.device | None = None) -> SmallMConfig:
    """The tiling of one small-M GEMM. Enough programs to keep every SM reading weights:
    4 rows of N a program for the broadcast product (one or two rows: no padding to 16),
    1024 columns a K step, 4 warps, weight tiles loaded a step ahead (the first before the
    norm's pass): the H200 probe's fastest at one row for the 0.5B shape's qkv and down,
    and within 0.1% of it for o (bench/results/small_m_layer_h200.json); each step of the
    loop is a round trip to memory that nothing overlaps, so fewer steps is less latency.
    The dot (M padded to 16; above SMALL_M_MAX today, kept for larger M once it measures
    faster): N tiles as wide as still give two programs per SM, its K loop pipelined by
    Triton (``stages``). K is split in two (or four) where N alone gives fewer programs
    than SMs and each split still walks >= 1024 columns."""
    on_cuda = device is not None and device.type == "cuda"
    sms = _sm_count((device.index or 0) if on_cuda else 0)
    dot = m > 2
    block_n = 16 if dot else 4  # 4: the probe's best at one row (0.5B qkv, down; o within 0.1%)
    while dot and block_n < 128 and triton.cdiv(n, block_n * 2) >= 2 * sms:
        block_n *= 2
    split = 1
    while triton.cdiv(n, block_n) * split < sms and k // (split * 2) >= 1024 and split < 4:
        split *= 2
    if dot:  # 96-167 registers a thread for sm_90 (ptxas; 228-255 with 256-column steps)
        return SmallMConfig(block_n=block_n, block_k=min(128, triton.next_power_of_2(k)), split_k=split, warps=4, dot=True)
    block_k = min(triton.next_power_of_2(k), 1024)
    return SmallMConfig(block_n=block_n, block_k=block_k, split_k=split, warps=4, dot=False, prefetch=True)


# Roundings to the model dtype are round-to-nearest-even, the GPU's default. Triton 3.9's
# interpreter truncates float32 to bfloat16 instead (and adds bfloat16 values as raw 16-bit
# integers): interpreted on bfloat16 (``EMULATE``), a float32 value is first rounded on its
# bits to the bfloat16 value it must become, so the CPU tests check the GPU's rounding.
# Compiled, ``EMULATE`` is False and this is the identity.
@triton.jit
def _rne(x, EMULATE: tl.constexpr):
    if EMULATE:
        bits = x.to(tl.uint32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x


@triton.jit
def _residual(A, DELTA, offs_a, offs_d, mask, HAS_DELTA: tl.constexpr, EMULATE: tl.constexpr):
    """The tile of ``x`` (``+ delta``, rounded to the model dtype as torch's add rounds)."""
    s = tl.load(A + offs_a, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(DELTA + offs_d, mask=mask, other=0.0)
        s = _rne(s.to(tl.float32) + d.to(tl.float32), EMULATE).to(s.dtype)
    return s


@triton.jit
def _small_m_kernel(
    A, DELTA, G, W, BIAS, SUM, Y, PART,
    M, N, K, stride_a, stride_d, stride_s, stride_w, stride_y, eps,
    PROLOGUE: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT: tl.constexpr, PREFETCH: tl.constexpr, EMULATE: tl.constexpr, IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < N
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per
    k_end = tl.minimum(k_start + k_per, K)
    w_rows = W + rn[:, None] * stride_w
    if PREFETCH:
        # The first weight tile is asked for before anything else (the norm's first pass
        # included), and each step asks for the next before using its own: a K loop of one
        # or two rows is otherwise a chain of round trips to memory.
        rk = k_start + tl.arange(0, BLOCK_K)
        w_next = tl.load(w_rows + rk[None, :], mask=nmask[:, None] & (rk < k_end)[None, :], other=0.0)
    inv = tl.zeros([BLOCK_M], tl.float32)
    if PROLOGUE == 1:
        # First pass: each row's inverse RMS over the whole of K (program (0, 0) also stores
        # the residual sum); the second pass reads the same rows again, from L1/L2.
        sum_rows = tl.where(pid_n + pid_k == 0, M, 0)  # rows this program stores x_sum for
        ssq = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            msk = mmask[:, None] & (rk < K)[None, :]
            s = _residual(A, DELTA, rm[:, None] * stride_a + rk[None, :], rm[:, None] * stride_d + rk[None, :], msk,
                          HAS_DELTA, EMULATE)
            if HAS_DELTA:
                tl.store(SUM + rm[:, None] * stride_s + rk[None, :], s, mask=(rm < sum_rows)[:, None] & (rk < K)[None, :])
            s32 = s.to(tl.float32)
            ssq += tl.sum(s32 * s32, axis=1)
        inv = tl.math.rsqrt(ssq / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_start + k_per, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < k_end
        if PREFETCH:
            w = w_next
            w_next = tl.load(w_rows + BLOCK_K + rk[None, :], mask=nmask[:, None] & (rk + BLOCK_K < k_end)[None, :], other=0.0)
        else:
            w = tl.load(w_rows + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        msk = mmask[:, None] & kmask[None, :]
        src = A + rm[:, None] * stride_a + rk[None, :]
        if PROLOGUE == 1:
            s = _residual(A, DELTA, rm[:, None] * stride_a + rk[None, :], rm[:, None] * stride_d + rk[None, :], msk,
                          HAS_DELTA, EMULATE)
            normed = _rne(s.to(tl.float32) * inv[:, None], EMULATE).to(s.dtype)
            g = tl.load(G + rk, mask=kmask, other=0.0)
            a = _rne(g.to(tl.float32)[None, :] * normed.to(tl.float32), EMULATE).to(W.dtype.element_ty)
        elif PROLOGUE == 2:
            gate = tl.load(src, mask=msk, other=0.0)
            up = tl.load(src + K, mask=msk, other=0.0)
            g32 = gate.to(tl.float32)
            silu = _rne(g32 / (1.0 + tl.exp(-g32)), EMULATE).to(gate.dtype)
            a = _rne(silu.to(tl.float32) * up.to(tl.float32), EMULATE).to(W.dtype.element_ty)
        else:
            a = tl.load(src, mask=msk, other=0.0)
        if DOT:
            if EMULATE:
                acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            elif IEEE:
                acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w), acc)
        else:
            acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    out = mmask[:, None] & nmask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(BIAS + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rm[:, None] * stride_y + rn[None, :], _rne(acc, EMULATE).to(Y.dtype.element_ty), mask=out)
    else:
        tl.store(PART + (pid_k * M + rm[:, None]) * N + rn[None, :], acc, mask=out)


@triton.jit
def _split_sum_kernel(
    PART, BIAS, Y, M, N, stride_y,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, EMULATE: tl.constexpr,
):
    # The splits' partial sums added in a fixed order: the same bits on every run.
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(PART + (s * M + row) * N + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, _rne(acc, EMULATE).to(Y.dtype.element_ty), mask=mask)


_SMALL_M_LAUNCH = launcher(_small_m_kernel)
_SPLIT_SUM_LAUNCH = launcher(_split_sum_kernel)


def _gemm(
    prologue: int, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, k: int,
    delta: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
    config: SmallMConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused launch (two with a split K): ``(x_sum, y)``, ``x_sum`` being ``a`` itself
    unless a delta was added."""
    m = a.shape[0]
    n = weight.shape[0]
    cfg = config or pick_config(m, n, k, a.device)
    y = torch.empty(m, n, dtype=weight.dtype, device=a.device)
    total = torch.empty_like(a) if delta is not None else a
    if m == 0:
        return total, y
    block_m = max(16 if cfg.dot else 1, triton.next_power_of_2(m))
    emulate = _INTERPRETED and weight.dtype == torch.bfloat16
    part = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=a.device) if cfg.split_k > 1 else y
    _SMALL_M_LAUNCH[(triton.cdiv(n, cfg.block_n), cfg.split_k)](
        a, delta if delta is not None else a, norm_weight if norm_weight is not None else weight,
        weight, bias if bias is not None else weight, total, y, part,
        m, n, k, a.stride(0), delta.stride(0) if delta is not None else 0, total.stride(0), weight.stride(0), y.stride(0), eps,
        PROLOGUE=prologue, HAS_DELTA=delta is not None, HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT=cfg.dot, PREFETCH=cfg.prefetch,
        EMULATE=emulate, IEEE=weight.dtype == torch.float32, num_warps=cfg.warps, num_stages=cfg.stages,
    )
    if cfg.split_k > 1:
        block = min(1024, triton.next_power_of_2(n))
        _SPLIT_SUM_LAUNCH[(m, triton.cdiv(n, block))](
            part, bias if bias is not None else weight, y, m, n, y.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k, BLOCK=block, EMULATE=emulate,
        )
    return total, y


def add_norm_linear(
    x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None, config: SmallMConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, (rmsnorm(x + delta) * norm_weight) @ weight.T + bias)`` over ``[M, K]``
    rows; ``delta`` None adds nothing (and ``x`` itself comes back)."""
    return _gemm(ADD_NORM, x, weight, bias, k=x.shape[1], delta=delta, norm_weight=norm_weight, eps=eps, config=config)


def silu_mul_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: SmallMConfig | None = None
) -> torch.Tensor:
    """``(silu(gate) * up) @ weight.T + bias`` for ``[M, 2I]`` rows laid out ``[gate | up]``."""
    return _gemm(SILU_MUL, gate_up, weight, bias, k=gate_up.shape[1] // 2, config=config)[1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: SmallMConfig | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` over ``[M, K]`` rows."""
    return _gemm(PLAIN, x, weight, bias, k=x.shape[1], config=config)[1]


def small_m_weights(x: torch.Tensor, module: Any, *others: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The one decision: ``(weight, bias)`` of ``module`` when its GEMM over ``x`` takes the
    fused small-M path, else None. It does when ``x`` has at most :data:`SMALL_M_MAX` rows,
    the weight is at most :data:`SMALL_M_MAX_WEIGHT_BYTES`,
    the module declares that its forward is exactly ``F.linear(x, weight, bias)``
    (``plain_gemm``: not quantised, not a tensor-parallel layer that all-reduces after its
    GEMM), and every tensor involved (``others``: the delta, the norm weight) shares
    ``x``'s dtype, with unit stride along the row."""
    if x.dim() != 2 or x.shape[0] > SMALL_M_MAX or not getattr(module, "plain_gemm", False):
        return None
    weight, bias = module.weight, module.bias
    if weight.numel() * weight.element_size() > SMALL_M_MAX_WEIGHT_BYTES:
        return None
    if weight.device != x.device:
        return None
    for t in (x, weight, bias, *others):  # called per GEMM in eager forwards: no lists built
        if t is not None and (t.dtype != x.dtype or t.stride(-1) != 1):
            return None
    return weight, bias

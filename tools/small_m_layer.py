"""One decoder layer at few rows: today's ops (the fused elementwise kernels and cuBLAS)
against the small-M fused GEMMs (:mod:`omni_async.kernels.small_m`), layer and kernels alone.

Why: issue 42's batch-1 goals (0.5B <= 0.9 ms a token, 8B <= 4.2 ms) hinge on the layer's
kernel count and the small-GEMM latency floor (H200 profile: ~34 us a 0.5B layer for
~6 us of weight reads). This says, for M = 1..64 rows, how long a layer takes each way,
how long each of its four GEMMs (with the op fused before it) takes each way, and which
tiling of the fused kernel is fastest: what ``SMALL_M_MAX`` and ``pick_config`` should be.

Each variant is a CUDA graph of ``--layers`` real ``DecoderLayer`` modules walked in
sequence (each with its own weights, so they come from HBM as in a decode step: 8 layers of
the 0.5B shape are 232 MB, past the 50 MB L2), decoding ``M`` rows of ``--context`` tokens
through the paged attention kernel; timed with CUDA events over replays, repeats
interleaved across variants, the median quoted with the spread. Today's path is the same
modules with ``SMALL_M_MAX`` set to 0 while its graph is captured. Kernels alone: each of
the four GEMMs (qkv with add+norm, o, gate_up with add+norm, down with SiLU*mul) over the
same layers, today's (the elementwise kernel, then cuBLAS) against the fused one at its
default tiling and at each tiling of a small sweep. ``fused_tuned`` is the layer with the
best tiling found for each GEMM. Stops sweeping at ``--budget-s`` and saves what it has.

    python tools/small_m_layer.py --out bench/results/small_m_layer_h200.json
        # meant to take < 3 min on the H200 (not yet run there): mostly Triton compiles
        # (~200 variants), bounded by --budget-s; a second run hits Triton's cache
    python tools/small_m_layer.py --smoke     # CPU, Triton's interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter is chosen when Triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # _common and the benchmarks
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's omni_async

from _common import machine_facts, save_json  # noqa: E402
from graph_timer import graph_timer  # noqa: E402

from omni_async.kernels import small_m  # noqa: E402
from omni_async.kernels.fused import FusedOps  # noqa: E402
from omni_async.kernels.small_m import SmallMConfig  # noqa: E402
from omni_async.kv.attention import AttentionContext  # noqa: E402
from omni_async.kv.cache import PagedKVCache  # noqa: E402
from omni_async.models.config import ModelConfig  # noqa: E402
from omni_async.models.decoder import DecoderLayer  # noqa: E402

# name -> (hidden, intermediate, heads, kv heads, head dim, q/k/v bias, layers per graph)
SHAPES = {
    "qwen2_0.5b": (896, 4864, 14, 2, 64, True, 8),
    "llama_8b": (4096, 14336, 32, 8, 128, False, 2),
}
SMOKE_SHAPES = {"tiny": (64, 128, 4, 2, 16, True, 2)}
# Tilings swept for each GEMM (block_n, block_k, split_k, warps, dot, stages, prefetch);
# the broadcast product (dot=False) only at one or two rows (its registers grow with M).
SWEEP = (
    SmallMConfig(8, 1024, 1, 8, False, 3, True), SmallMConfig(8, 1024, 1, 8, False), SmallMConfig(8, 512, 1, 4, False, 3, True),
    SmallMConfig(16, 512, 1, 8, False, 3, True), SmallMConfig(8, 1024, 2, 8, False, 3, True), SmallMConfig(4, 1024, 1, 4, False, 3, True),
    SmallMConfig(16, 128, 1, 4, True), SmallMConfig(32, 128, 1, 4, True), SmallMConfig(16, 256, 1, 8, True),
    SmallMConfig(16, 128, 2, 4, True), SmallMConfig(64, 64, 1, 4, True),
)
SMOKE_SWEEP = (SmallMConfig(8, 32, 1, 4, False, 3, True), SmallMConfig(16, 32, 2, 4, True))
KERNELS = ("qkv", "o", "gate_up", "down")


def config_name(c: SmallMConfig) -> str:
    return f"bn{c.block_n}_bk{c.block_k}_sk{c.split_k}_w{c.warps}_{'dot' if c.dot else 'sum'}{'_pf' if c.prefetch else ''}"


def model_config(shape: tuple) -> ModelConfig:
    hidden, inter, heads, kv_heads, head_dim, qkv_bias, layers = shape
    return ModelConfig(family="llama", vocab_size=1024, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, qkv_bias=qkv_bias)


@contextmanager
def small_m_limit(limit: int, configs: dict | None = None):
    """Capture with the fused path on (limit 64) or off (0); ``configs``: a tiling per
    (M, N, K) to use instead of ``pick_config``'s."""
    old_limit, old_pick = small_m.SMALL_M_MAX, small_m.pick_config
    small_m.SMALL_M_MAX = limit
    if configs:
        small_m.pick_config = lambda m, n, k, device=None: configs.get((m, n, k)) or old_pick(m, n, k, device)
    try:
        yield
    finally:
        small_m.SMALL_M_MAX, small_m.pick_config = old_limit, old_pick


def build_layers(cfg: ModelConfig, device: str, dtype: torch.dtype) -> list:
    """``cfg.num_layers`` real decoder layers with random weights (norm weights near 1),
    made on the device (the 8B shape's 436 MB a layer is slow to draw on the CPU)."""
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.device("meta"):
        layers = [DecoderLayer(cfg, i) for i in range(cfg.num_layers)]
    out = []
    for layer in layers:
        layer = layer.to_empty(device=device).to(dtype).eval()
        with torch.no_grad():
            for name, p in layer.named_parameters():
                norm = "layernorm" in name
                p.copy_(torch.randn(p.shape, generator=gen, device=device) * (0.1 if norm else p.shape[-1] ** -0.5) + norm)
        out.append(layer)
    return out


class Setup:
    """The KV cache and decode inputs of one row count, over one shape's layers."""

    def __init__(self, cfg: ModelConfig, layers: list, m: int, context: int, device: str, dtype: torch.dtype) -> None:
        gen = torch.Generator(device="cpu").manual_seed(m)
        self.layers = layers
        page = 16
        pages = -(-context // page)
        self.kv = PagedKVCache(num_layers=cfg.num_layers, num_pages=m * pages + 1, page_size=page,
                               num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype, device=torch.device(device))
        for t in self.kv.k + self.kv.v:
            t.normal_(0, 1, generator=None)
        tables = torch.arange(m * pages, device=device).view(m, pages)
        self.ctx = AttentionContext(
            is_decode=True, slot_mapping=tables[:, -1] * page + (context - 1) % page, logits_rows=torch.arange(m, device=device),
            kv_lens=torch.full((m,), context, device=device), block_tables=tables, page_size=page,
            use_kernel=device == "cuda",
        )
        self.x = torch.randn(m, cfg.hidden_size, generator=gen).to(device, dtype)
        self.delta = torch.randn(m, cfg.hidden_size, generator=gen).to(device, dtype) * 0.1
        angles = torch.rand(m, cfg.head_dim // 2, generator=gen) * 100
        emb = torch.cat((angles, angles), dim=-1)
        self.cos, self.sin = emb.cos().to(device, dtype), emb.sin().to(device, dtype)
        self.gate_up = (torch.randn(m, 2 * cfg.intermediate_size, generator=gen) * 2).to(device, dtype)
        self.attn_out = torch.randn(m, cfg.num_heads * cfg.head_dim, generator=gen).to(device, dtype)
        self.ops = FusedOps()

    def layer_pass(self):
        x, delta = self.x, self.delta
        for layer in self.layers:
            x, delta = layer(x, delta, self.cos, self.sin, self.kv, self.ctx, self.ops)
        return x, delta

    def kernel_pass(self, kernel: str, config: SmallMConfig | None):
        """One GEMM over every layer: through the ops (today's path or the fused default,
        as the limit says) or, given a tiling, the fused kernel with it."""
        out = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if kernel in ("qkv", "gate_up"):
                norm = layer.input_layernorm if kernel == "qkv" else layer.post_attention_layernorm
                lin = attn.qkv_proj if kernel == "qkv" else mlp.gate_up_proj
                if config is None:
                    out.append(self.ops.add_norm_linear(self.x, self.delta, norm, lin))
                else:
                    out.append(small_m.add_norm_linear(self.x, self.delta, norm.weight, norm.eps, lin.weight, lin.bias, config))
            elif kernel == "o":
                out.append(self.ops.linear(self.attn_out, attn.o_proj) if config is None
                           else small_m.linear(self.attn_out, attn.o_proj.weight, attn.o_proj.bias, config))
            else:
                out.append(self.ops.silu_mul_linear(self.gate_up, mlp.down_proj) if config is None
                           else small_m.silu_mul_linear(self.gate_up, mlp.down_proj.weight, mlp.down_proj.bias, config))
        return out

    def gemm_shape(self, kernel: str) -> tuple[int, int]:
        """(N, K) of the kernel's GEMM: the key of a tiling."""
        a, m = self.layers[0].self_attn, self.layers[0].mlp
        lin = {"qkv": a.qkv_proj, "o": a.o_proj, "gate_up": m.gate_up_proj, "down": m.down_proj}[kernel]
        return lin.out_features, lin.in_features


def make_timer(fn, device: str):
    """A callable timing ``replays`` runs of ``fn`` (a captured graph on CUDA), in ms."""
    return graph_timer(fn, device)[0]


def measure(timers: dict, args, per: int) -> dict:
    """Repeats interleaved across the variants; us per layer (``per`` layers a replay)."""
    ms: dict = {name: [] for name in timers}
    for _ in range(args.repeats):
        for name, t in timers.items():
            ms[name].append(t(args.replays))
    out = {}
    for name, runs in ms.items():
        med = statistics.median(runs)
        out[name] = {"us": med * 1e3 / (args.replays * per), "spread_pct": 100 * (max(runs) - min(runs)) / med}
    return out


def timer_or_error(make, device: str):
    try:
        return make_timer(make, device), None
    except Exception as exc:  # a tiling the compiler refuses (registers, shared memory)
        return None, repr(exc)[:300]


def run_m(cfg: ModelConfig, layers: list, m: int, args, device: str, dtype, deadline: float, best: dict) -> dict:
    s = Setup(cfg, layers, m, args.context, device, dtype)
    row: dict = {"M": m, "layers_per_graph": cfg.num_layers, "kernels": {}, "errors": {}}
    # Kernels alone: today's against the fused default, then the sweep (time allowing).
    for kernel in KERNELS:
        timers = {}
        for variant, limit in (("today", 0), ("fused", 64)):
            with small_m_limit(limit):
                t, err = timer_or_error(lambda k=kernel: s.kernel_pass(k, None), device)
            if t:
                timers[variant] = t
            else:
                row["errors"][f"{kernel}/{variant}"] = err
        n, k = s.gemm_shape(kernel)
        if m in args.sweep_m and time.monotonic() < deadline:
            for c in args.sweep:
                if (not c.dot and m > 2) or time.monotonic() > deadline:
                    continue
                key = config_name(c)
                t, err = timer_or_error(lambda k=kernel, c=c: s.kernel_pass(k, c), device)
                if t:
                    timers[key] = t
                else:
                    row["errors"][f"{kernel}/{key}"] = err
        res = measure(timers, args, cfg.num_layers)
        swept = {v: r for v, r in res.items() if v not in ("today", "fused")}
        if swept:
            top = min(swept, key=lambda v: swept[v]["us"])
            res["best"] = top
            best[(m, n, k)] = next(c for c in args.sweep if config_name(c) == top)
        row["kernels"][kernel] = res
        del timers
    # The whole layer: first its outputs each way (a check, not a test: bf16 rounding of
    # differently ordered sums, compounded over the layers), then today's, the fused
    # default, and with the best tilings found.
    with torch.no_grad(), small_m_limit(0):
        want = s.layer_pass()
    with torch.no_grad(), small_m_limit(64):
        got = s.layer_pass()
    row["layer_rel_err"] = max(float((g.double() - w.double()).norm() / w.double().norm()) for g, w in zip(got, want))
    timers = {}
    variants = [("today", 0, None), ("fused", 64, None)]
    if any(key[0] == m for key in best):
        variants.append(("fused_tuned", 64, best))
    for variant, limit, configs in variants:
        with small_m_limit(limit, configs):
            t, err = timer_or_error(s.layer_pass, device)
        if t:
            timers[variant] = t
        else:
            row["errors"][f"layer/{variant}"] = err
    row["layer"] = measure(timers, args, cfg.num_layers)
    del timers, s
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def report(name: str, row: dict) -> None:
    lay = row["layer"]
    line = f"{name:11s} M={row['M']:<3d} rel err {row['layer_rel_err']:.1e}  layer today {lay.get('today', {}).get('us', float('nan')):7.2f} us"
    for v in ("fused", "fused_tuned"):
        if v in lay:
            line += f"  {v} {lay[v]['us']:7.2f} us ({lay['today']['us'] / lay[v]['us']:4.2f}x, spread {lay[v]['spread_pct']:.1f}%)"
    print(line, flush=True)
    for kernel, res in row["kernels"].items():
        today, fused = res.get("today", {}).get("us", float("nan")), res.get("fused", {}).get("us", float("nan"))
        best = res.get("best")
        extra = f"  best {best} {res[best]['us']:6.2f} us" if best else ""
        print(f"    {kernel:8s} today {today:6.2f} us  fused {fused:6.2f} us{extra}", flush=True)
    for key, err in row["errors"].items():
        print(f"    error {key}: {err[:100]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,2,4,8,16,32,64", help="rows (decode batch sizes)")
    ap.add_argument("--sweep-m", default="1,16", help="rows at which the tilings are swept ('' for none)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--context", type=int, default=512, help="tokens each row attends to")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=100.0, help="no new sweep after this many seconds")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/small_m_layer.json)")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes: checks the script runs")
    args = ap.parse_args()
    device, dtype = "cuda", torch.bfloat16
    shapes = {k: v for k, v in SHAPES.items() if k in args.shapes.split(",")}
    args.sweep = SWEEP
    if args.smoke:
        device, dtype, shapes, args.sweep = "cpu", torch.float32, SMOKE_SHAPES, SMOKE_SWEEP
        args.m, args.sweep_m, args.replays, args.repeats, args.context = "1,16", "1", 1, 1, 40
    args.sweep_m = [int(v) for v in args.sweep_m.split(",") if v]  # "" sweeps nothing
    deadline = time.monotonic() + args.budget_s
    results: dict = {
        "probe": "small_m_layer", "machine": machine_facts(), "argv": sys.argv[1:],
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (interpreter smoke test)",
        "dtype": str(dtype), "context": args.context, "replays": args.replays, "repeats": args.repeats,
        "small_m_max": small_m.SMALL_M_MAX, "units": "us per layer (graph time / layers / replays)", "rows": {},
        "best_tilings": {},  # the sweep's fastest tiling per (shape, M, N, K): what pick_config should return
    }
    out = Path(args.out) if args.out else Path("small_m_layer_smoke.json" if args.smoke else "small_m_layer.json")
    t0 = time.monotonic()
    for name, shape in shapes.items():
        cfg, best = model_config(shape), {}
        layers = build_layers(cfg, device, dtype)
        for m in map(int, args.m.split(",")):
            results["rows"][f"{name}_M{m}"] = row = run_m(cfg, layers, m, args, device, dtype, deadline, best)
            report(name, row)
            results["best_tilings"].update({f"{name}_M{bm}_N{n}_K{k}": dataclasses.asdict(c) for (bm, n, k), c in best.items()})
            results["elapsed_s"] = round(time.monotonic() - t0, 1)
            path = save_json(out, results)  # after each row: a partial run keeps what it measured
        del layers
    print("saved", path, f"in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()

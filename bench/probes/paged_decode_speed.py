"""The paged decode attention kernel's speed: one program per (sequence, KV head), as it
was, against the split-KV kernel (flash decoding) over a sweep of its launch settings.

The Qwen2-0.5B attention shape (14 query heads, 2 KV heads, head dim 64, bf16, 16-token
pages scattered over the cache) at batches x contexts; ``mix`` is a context drawn per
row from 100-2,000 tokens (NV256's spread). Each variant is checked against a float32
torch reference, then timed as a CUDA graph of ``--calls`` launches (a layer stack's
worth, each over its own layer's cache, as in a decode step) with CUDA events, warmed,
repeats interleaved across variants. Printed: us per call and the achieved bandwidth
(the KV bytes the call must read / its time). Small cases fit in L2 (50 MB on the
H200) across a replay, so their GB/s can pass HBM's.

    python bench/probes/paged_decode_speed.py --device cuda --out bench/results/paged_decode_speed_h200.json \
        [--batches 1,16,64,180,256] [--contexts 128,1024,4096,mix] [--splits auto,1,2,4,8] [--block 64,128]
        [--warps 4] [--stages 3] [--prefetch 0,1] [--repeats 5]

``--device cpu`` (with TRITON_INTERPRET=1, tiny shapes) runs the same code paths with
plain launches and wall-clock timing: a smoke test of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from graph_timer import graph_timer  # noqa: E402

from omni_async.kernels import paged_decode as pd  # noqa: E402
from omni_async.kernels.attention_block import attend_block  # noqa: E402

HEADS, KV_HEADS, DIM, PS = 14, 2, 64, 16


@triton.jit
def _baseline_kernel(
    Q, K, V, O, TABLES, LENS, scale,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ob, stride_oh, stride_tb,
    R: tl.constexpr, PS: tl.constexpr, D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):
    """The kernel before splitting (commit fcdfc29): one program per (sequence, KV head)."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    seq_len = tl.load(LENS + b).to(tl.int32)
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    h = g * R + r
    rmask = r < R
    dmask = d < D
    q = tl.load(Q + b * stride_qb + h[:, None] * stride_qh + d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    q_pos = tl.zeros([BLOCK_R], tl.int32) + (seq_len - 1)
    for start in range(0, seq_len, BLOCK_N):
        m, l, acc = attend_block(
            q, K, V, TABLES, b * stride_tb, start, seq_len, g * stride_kh, g * stride_vh, stride_ks, stride_vs,
            d, dmask, q_pos, m, l, acc, scale, PS, BLOCK_N, IEEE, True,
        )
    out = acc / l[:, None]
    tl.store(O + b * stride_ob + h[:, None] * stride_oh + d[None, :], out.to(O.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def baseline(q, k_cache, v_cache, tables, lens, page_size, scale):
    bsz, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    out = torch.empty_like(q)
    _baseline_kernel[(bsz, kv_heads)](
        q, k_cache, v_cache, out, tables, lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), tables.stride(0),
        R=heads // kv_heads, PS=page_size, D=dim, BLOCK_R=16, BLOCK_N=128, BLOCK_D=64, IEEE=q.dtype == torch.float32,
    )
    return out


def make_case(bsz: int, context: str, layers: int, device: str, dtype: torch.dtype, gen: torch.Generator) -> dict:
    """One page table and length per row, shared by ``layers`` caches (each layer reads
    its own KV, as a decoder's layers do)."""
    if context == "mix":
        lens = torch.randint(100, 2001, (bsz,), generator=gen)
    else:
        lens = torch.full((bsz,), int(context))
    need = (lens + PS - 1) // PS
    total = int(need.sum()) + 4
    perm = torch.randperm(total, generator=gen)
    tables = torch.zeros(bsz, int(need.max()), dtype=torch.long)
    at = 0
    for i, n in enumerate(need.tolist()):
        tables[i, :n] = perm[at:at + n]
        at += n
    # Drawn on the device: the largest case holds ~13 GB of caches.
    dgen = torch.Generator(device=device).manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
    kc = torch.randn(layers, total * PS, KV_HEADS, DIM, generator=dgen, device=device, dtype=dtype)
    vc = torch.randn(layers, total * PS, KV_HEADS, DIM, generator=dgen, device=device, dtype=dtype)
    q = torch.randn(layers, bsz, HEADS, DIM, generator=dgen, device=device, dtype=dtype)
    kv_bytes = int(lens.sum()) * KV_HEADS * DIM * 2 * kc.element_size()
    return {"q": q, "k": kc, "v": vc, "tables": tables.to(device), "lens": lens.to(device), "kv_bytes": kv_bytes}


def reference(c: dict, rows: int = 2) -> torch.Tensor:
    """float32 attention of the first layer's first ``rows`` rows, gathered from the pages."""
    out = []
    for i in range(min(rows, c["lens"].shape[0])):
        n = int(c["lens"][i])
        pos = torch.arange(n, device=c["tables"].device)
        slots = c["tables"][i][pos // PS] * PS + pos % PS
        k = c["k"][0][slots].float().repeat_interleave(HEADS // KV_HEADS, 1)
        v = c["v"][0][slots].float().repeat_interleave(HEADS // KV_HEADS, 1)
        att = torch.einsum("hd,nhd->hn", c["q"][0, i].float(), k) * DIM**-0.5
        out.append(torch.einsum("hn,nhd->hd", att.softmax(-1), v))
    return torch.stack(out)


def apply(variant: dict) -> None:
    """Set the kernel module's knobs (graphs capture whatever they are at capture)."""
    pd.DECODE_SPLITS = variant.get("splits")
    pd.DECODE_BLOCK_N = variant.get("block", 128)
    pd.DECODE_MAX_TILE = pd.DECODE_BLOCK_N * DIM  # the block asked for, not capped
    pd.DECODE_NUM_WARPS = variant.get("warps", 4)
    pd.DECODE_NUM_STAGES = variant.get("stages", 3)
    pd.DECODE_PREFETCH = variant.get("prefetch", False)


def stack_fn(c: dict, variant: dict):
    """A layer stack's worth of calls, each on its own layer's q and cache."""
    fn = baseline if variant["name"] == "baseline" else pd.paged_decode_attention
    layers = c["q"].shape[0]

    def run():
        return [fn(c["q"][i], c["k"][i], c["v"][i], c["tables"], c["lens"], PS, DIM**-0.5) for i in range(layers)]

    return run


def timer(c: dict, variant: dict, device: str):
    """A callable timing ``replays`` runs of the stack: a captured graph on CUDA."""
    apply(variant)
    timed, outs = graph_timer(stack_fn(c, variant), device)
    return timed, outs[0]


def variants(args) -> list[dict]:
    out = [{"name": "baseline"}]
    for splits, block, warps, stages, prefetch in itertools.product(
        args.splits.split(","), map(int, args.block.split(",")), map(int, args.warps.split(",")),
        map(int, args.stages.split(",")), map(int, args.prefetch.split(",")),
    ):
        v = {"splits": None if splits == "auto" else int(splits), "block": block, "warps": warps, "stages": stages,
             "prefetch": bool(prefetch)}
        v["name"] = f"s{splits}_b{block}_w{warps}_st{stages}" + ("_pf" if prefetch else "")
        out.append(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/paged_decode_speed.json)")
    ap.add_argument("--batches", default="1,16,64,180,256")
    ap.add_argument("--contexts", default="128,1024,4096,mix")
    ap.add_argument("--splits", default="auto,1,2,4,8", help="split counts; auto = the module's choice")
    ap.add_argument("--block", default="64,128")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--stages", default="3")
    ap.add_argument("--prefetch", default="0", help="0,1: the hand-pipelined whole-block loop off / on")
    ap.add_argument("--calls", type=int, default=24, help="launches per graph (one per layer)")
    ap.add_argument("--replays", type=int, default=20, help="graph replays per timed sample")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    out_path = Path(args.out or Path(__file__).resolve().parents[1] / "results" / "paged_decode_speed.json")
    gen = torch.Generator().manual_seed(0)
    vs = variants(args)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 1
    results: dict = {
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (interpreter smoke test)",
        "torch": torch.__version__, "triton": triton.__version__, "sms": sms,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "shape": [HEADS, KV_HEADS, DIM, PS],
        "calls_per_graph": args.calls, "replays": args.replays, "argv": sys.argv[1:],
        "defaults": {"programs_per_sm": pd.DECODE_PROGRAMS_PER_SM, "max_splits": pd.DECODE_MAX_SPLITS}, "cases": {},
    }
    for bsz, context in itertools.product(map(int, args.batches.split(",")), args.contexts.split(",")):
        key = f"B{bsz}_ctx{context}"
        c = make_case(bsz, context, args.calls, device, dtype, gen)
        want = reference(c)
        case: dict = {"kv_bytes_per_call": c["kv_bytes"], "auto_splits": None, "variants": {}}
        apply({"splits": None})
        case["auto_splits"] = pd.decode_splits(bsz, KV_HEADS, sms)
        timers = {}
        for v in vs:
            try:
                fn, got = timer(c, v, device)
            except Exception as exc:  # a setting the compiler refuses
                case["variants"][v["name"]] = {"error": repr(exc)[:300]}
                print(key, v["name"], "failed:", repr(exc)[:120], flush=True)
                continue
            err = float((got[:2].float() - want).abs().max())
            case["variants"][v["name"]] = {"max_abs_err": err, "ms": []}
            if err < 0.05:
                timers[v["name"]] = fn
            else:
                print(key, v["name"], "WRONG", err, flush=True)
        for _ in range(args.repeats):  # interleaved: each repeat times every variant once
            for name, fn in timers.items():
                case["variants"][name]["ms"].append(fn(args.replays))
        for name in timers:
            r = case["variants"][name]
            med = statistics.median(r["ms"])
            r["us_per_call"] = med * 1e3 / (args.replays * args.calls)
            r["gb_per_s"] = c["kv_bytes"] / (r["us_per_call"] * 1e-6) / 1e9
            r["spread_pct"] = 100 * (max(r["ms"]) - min(r["ms"])) / med
        results["cases"][key] = case
        del timers, c
        if device == "cuda":
            torch.cuda.empty_cache()
        report(key, case)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(results, indent=1))  # after each case: a partial run keeps what it measured
    summary(results)
    out_path.write_text(json.dumps(results, indent=1))
    print("saved", out_path)


def report(key: str, case: dict) -> None:
    rows = [(n, r) for n, r in case["variants"].items() if "us_per_call" in r]
    base = case["variants"].get("baseline", {}).get("us_per_call")
    print(f"\n{key}: {case['kv_bytes_per_call'] / 1e6:.2f} MB of KV per call, auto splits {case['auto_splits']}")
    print(f"  {'variant':24s} {'us/call':>9s} {'GB/s':>8s} {'vs old':>7s} {'spread':>7s} {'err':>9s}")
    for name, r in sorted(rows, key=lambda nr: nr[1]["us_per_call"]):
        speed = f"{base / r['us_per_call']:.2f}x" if base else "-"
        print(f"  {name:24s} {r['us_per_call']:9.2f} {r['gb_per_s']:8.0f} {speed:>7s} {r['spread_pct']:6.1f}% {r['max_abs_err']:9.2e}")


def summary(results: dict) -> None:
    """One line per case: the old kernel, the default settings (auto splits, the module's
    block), and the best variant measured."""
    default = None
    for name in next(iter(results["cases"].values()))["variants"]:
        if name == "sauto_b128_w4_st3":
            default = name
    print(f"\n{'case':16s} {'old us':>8s} {'old GB/s':>9s} {'default us':>11s} {'GB/s':>6s} {'best':>24s} {'us':>7s} {'GB/s':>6s} {'x old':>6s}")
    for key, case in results["cases"].items():
        v = case["variants"]
        timed = {n: r for n, r in v.items() if "us_per_call" in r}
        if "baseline" not in timed:
            continue
        best = min((n for n in timed if n != "baseline"), key=lambda n: timed[n]["us_per_call"], default=None)
        old = timed["baseline"]
        d = timed.get(default) if default else None
        line = f"{key:16s} {old['us_per_call']:8.2f} {old['gb_per_s']:9.0f}"
        line += f" {d['us_per_call']:11.2f} {d['gb_per_s']:6.0f}" if d else f" {'-':>11s} {'-':>6s}"
        if best:
            b = timed[best]
            line += f" {best:>24s} {b['us_per_call']:7.2f} {b['gb_per_s']:6.0f} {old['us_per_call'] / b['us_per_call']:5.2f}x"
        print(line)


if __name__ == "__main__":
    main()

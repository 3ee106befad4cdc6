"""The limits an engine gets when only its device is given: on CUDA derived from the KV
capacity and the decode graphs' buckets (a pure function, tested as one); CPU keeps 64."""

from __future__ import annotations

import pytest

from omni_async import Engine, errors
from omni_async.core.plan import resolve_decode_steps
from omni_async.core.plan import CPU_MAX_RUNNING, cuda_defaults, cuda_running_limit, running_limit
from omni_async.runners.cuda_graphs import DEFAULT_BUCKETS

QWEN2_05B_KV_BYTES_PER_TOKEN = 24 * 2 * 2 * 64 * 2  # layers * (K, V) * KV heads * head dim * bf16


@pytest.mark.parametrize("kv_tokens,expected", [
    (110 * 2**30 // QWEN2_05B_KV_BYTES_PER_TOKEN, 512),  # an H200's KV for Qwen2-0.5B: the largest bucket
    (600_000, 512),
    (512 * 1024, 512),
    (512 * 1024 - 1, 448),  # one token short of 512 requests of 1,024: the next bucket down
    (256 * 1024, 256),
    (100_000, 96),
    (30_000, 64),  # a small KV: no fewer than the old default (retraction shares the room)
    (0, 64),
])
def test_cuda_running_limit_from_kv_capacity(kv_tokens, expected):
    assert cuda_running_limit(kv_tokens, DEFAULT_BUCKETS) == expected


def test_cuda_running_limit_stays_within_the_graph_buckets():
    assert cuda_running_limit(10**9, (1, 2, 4, 8, 16, 32, 64, 128)) == 128  # cuda_graph_max_batch=128
    assert cuda_running_limit(10**9, (1, 2, 4, 8, 16, 32)) == 32  # below the floor: the largest bucket
    assert cuda_running_limit(64 * 300, DEFAULT_BUCKETS, tokens_per_request=300) == 64
    assert cuda_running_limit(160 * 300, DEFAULT_BUCKETS, tokens_per_request=300) == 160
    with pytest.raises(ValueError):
        cuda_running_limit(10**6, ())


def test_cuda_defaults_gather_the_device_limits():
    d = cuda_defaults(1 << 20, DEFAULT_BUCKETS)
    assert d.max_running_requests == 512
    assert (d.max_prefill_tokens, d.chunked_prefill_size) == (16384, 8192)
    steps = resolve_decode_steps(None, "cuda")
    assert [steps.for_batch(n) for n in (1, 64, 256, 512)] == [4, 8, 8, 8]
    assert tuple(steps.tiers) == d.decode_tiers


def test_cpu_keeps_its_default_and_a_given_limit_is_kept():
    assert running_limit("cpu", 10**9, DEFAULT_BUCKETS) == CPU_MAX_RUNNING == 64
    assert running_limit("cuda", 10**9, DEFAULT_BUCKETS) == 512
    assert Engine.from_pretrained("tiny").scheduler.config.max_running_requests == 64
    assert Engine.from_pretrained("tiny", max_running_requests=7).scheduler.config.max_running_requests == 7
    for bad in (0, -3, 2.5, "64"):
        with pytest.raises(errors.ConfigError, match="max_running_requests"):
            Engine.from_pretrained("tiny", max_running_requests=bad)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_a_cuda_engine_derives_its_running_limit():
    eng = Engine.from_pretrained("tiny", device="cuda", kv_capacity_tokens=256 * 1024)
    assert eng.scheduler.config.max_running_requests == 256
    assert Engine.from_pretrained("tiny", device="cuda", kv_capacity_tokens=1 << 21).scheduler.config.max_running_requests == 512

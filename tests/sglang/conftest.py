"""Fixtures for the SGLang backend tests (CPU, torch_native attention, tiny random
checkpoints written with transformers' save_pretrained).

These run only when SGLang is installed (``bash scripts/install_sglang.sh``) and are
collected only when asked for by path: ``pytest tests/sglang``.
"""

from __future__ import annotations

import pytest

from omni_async import Engine

from ..conftest import LOOPS, hf_greedy, random_prompts, save_random_checkpoint  # noqa: F401

try:
    from omni_async.backends.sglang import SGLangUnavailableError, require_sglang

    require_sglang()
except SGLangUnavailableError as exc:  # pragma: no cover - exercised without the install
    pytest.skip(f"SGLang backend not installed: {exc}", allow_module_level=True)


@pytest.fixture(scope="session")
def sg_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("sg_ckpt")
    return {
        "llama": save_random_checkpoint("llama", root / "llama", seed=0),
        "llama_b": save_random_checkpoint("llama", root / "llama_b", seed=5),
        "qwen2": save_random_checkpoint("qwen2", root / "qwen2", seed=2),
    }


def sglang_engine(folder, **kw) -> Engine:
    kw.setdefault("loop", "normal")
    return Engine.from_pretrained(str(folder), backend="sglang", **kw)


def assert_sglang_pools_free(engine: Engine) -> None:
    """Nothing leaked: no request holds KV or a req_to_token row, and once the radix
    cache is dropped the token allocator is full again."""
    stack = engine.stack
    core = stack.core
    assert core.kv_is_fully_free(), f"KV held after the engine closed: {stack.kv_leak_report()}"
    assert core.flush_cache(), f"radix cache not flushable: {stack.kv_leak_report()}"
    report = stack.kv_leak_report()
    assert report["kv_available"] == report["kv_total"], f"KV slots leaked: {report}"
    assert report["req_slots_available"] == report["req_slots_total"], f"req_to_token rows leaked: {report}"
    assert report["tree_protected"] == 0 and report["tree_evictable"] == 0, report
    assert report["deferred_releases"] == 0, report

"""The CPU configuration chosen when the caller leaves dtype and the kernel options open
(omni_async/core/plan.py, backends/native/facts.py): bfloat16 and the C++ kernels for a 16-bit or quantised
checkpoint on a CPU with native bfloat16, the float32 reference path otherwise, explicit
choices kept, and a clean fallback where the kernels cannot be built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omni_async import Engine
from omni_async.backends.native.facts import cpu_has_native_bf16

from .gguf_files import write_gguf

pytest.importorskip("gguf")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "qwen2-Q8_0.gguf", "qwen2", "Q8_0", seed=5)


async def _chosen(path: str, with_quantization: bool = False, **kw) -> tuple:
    async with Engine.from_pretrained(path, loop="normal", kv_capacity_tokens=1024, **kw) as engine:
        info = (await engine.model_info())["data"]
    chosen = (info["dtype"], info["cpu_attention_kernel"], info["cpu_fused_ops"])
    return (*chosen, info["quantization"]) if with_quantization else chosen


async def test_tiny_and_float32_folders_keep_the_exact_path(hf_checkpoints):
    assert await _chosen("tiny") == ("float32", False, False)
    assert await _chosen(str(hf_checkpoints["llama"])) == ("float32", False, False)


async def test_a_gguf_file_runs_in_its_blocks_when_the_kernels_are_built(gguf_file):
    from omni_async.backends.native.facts import kernels_build

    if not kernels_build():
        pytest.skip("the C++ kernels are not built here")
    assert await _chosen(str(gguf_file), with_quantization=True) == ("float32", True, True, "q4")


async def test_a_quantised_checkpoint_follows_the_cpu(gguf_file):
    """Without the kernels (no q4): bfloat16 on a CPU with native bfloat16, else float32."""
    from omni_async.backends.native.facts import kernels_build

    if kernels_build():
        pytest.skip("the kernels are built here, so a GGUF file runs in q4 (the test above)")
    fast = cpu_has_native_bf16()
    dtype, attention, fused = await _chosen(str(gguf_file))
    assert dtype == ("bfloat16" if fast else "float32")
    if not fast:
        assert (attention, fused) == (False, False)
    else:
        from omni_async.backends.native.facts import kernels_build

        assert attention == fused == kernels_build()


async def test_explicit_choices_are_kept(gguf_file):
    assert await _chosen(str(gguf_file), dtype="float32") == ("float32", False, False)
    assert await _chosen(str(gguf_file), dtype="float32", cpu_fused_ops=True) == ("float32", False, True)
    assert await _chosen(str(gguf_file), dtype="bfloat16", cpu_attention_kernel=False, cpu_fused_ops=False) == ("bfloat16", False, False)


_SCRIPT = """
import asyncio, json, sys
from omni_async import Engine, SamplingParams
from omni_async.errors import ConfigError
async def main():
    async with Engine.from_pretrained(sys.argv[1], loop="normal", dtype="bfloat16", kv_capacity_tokens=1024) as engine:
        info = (await engine.model_info())["data"]
        out = await engine.generate(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=4, ignore_eos=True))
    try:
        Engine.from_pretrained(sys.argv[1], loop="normal", cpu_fused_ops=True, kv_capacity_tokens=1024)
        asked = "built"
    except ConfigError as exc:
        asked = "ConfigError"
    print(json.dumps([info["cpu_attention_kernel"], info["cpu_fused_ops"], len(out.output_ids), asked]))
asyncio.run(main())
"""


def test_without_a_compiler_the_default_falls_back_to_torch_ops(gguf_file, tmp_path):
    """A machine where the kernels cannot be built (here: no C++ compiler, an empty
    extension cache) still runs the default; asking for a kernel explicitly is an error."""
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), OMNI_ASYNC_KERNEL_CACHE=str(tmp_path / "ext"), PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-c", _SCRIPT, str(gguf_file)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1]) == [False, False, 4, "ConfigError"]
    assert "building them in the background" in run.stderr  # the default said so and did not wait
    assert "could not be built" in run.stderr  # the explicit request: a clear error

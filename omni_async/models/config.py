"""Model configuration parsed from a Hugging Face ``config.json``.

Anything the native decoder cannot reproduce exactly (another architecture, a rope
scaling type, sliding-window attention, another activation) is refused here with a
:class:`~omni_async.errors.ModelLoadError`, so a checkpoint never loads into a silently
wrong model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import ModelLoadError

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "qwen3_omni_moe_text": "qwen3_moe",
               "qwen2_moe": "qwen2_moe"}
# Families with routed experts (their MoeConfig read from config.json).
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")
# Families whose attention normalises q and k per head before RoPE.
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")
# Composite checkpoints whose text decoder the native backend serves: architecture ->
# (where its config sits in config.json, the prefix of its tensors). Qwen3-Omni's thinker
# is a Qwen3-MoE decoder whose rotary (M-RoPE) equals plain RoPE on text positions.
COMPOSITES = {"Qwen3OmniMoeForConditionalGeneration": (("thinker_config", "text_config"), "thinker.")}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class MoeConfig:
    """A Qwen3-MoE checkpoint's expert settings: ``num_experts`` experts of
    ``intermediate_size`` channels each, ``top_k`` routed per token, the chosen weights
    renormalised to sum to 1 when ``norm_topk_prob``; layer ``i`` is sparse when
    ``(i + 1) % sparse_step == 0`` and ``i`` is not in ``dense_layers``. With
    ``shared_intermediate_size`` every sparse block also has a shared expert of that
    width, gated per token by a sigmoid (Qwen2-MoE, Qwen3-Omni's talker)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()
    shared_intermediate_size: int = 0

    def is_sparse(self, layer_idx: int) -> bool:
        return layer_idx not in self.dense_layers and (layer_idx + 1) % self.sparse_step == 0

    def activation_width(self, hidden_size: int) -> int:
        """Activation channels per token of a sparse block, in the model dtype's
        units: each of its ``top_k`` rows holds an expert's intermediate channels and a
        float32 output row (what memory planning reserves in place of a dense MLP's)."""
        return self.top_k * (self.intermediate_size + 2 * hidden_size) + 2 * self.shared_intermediate_size

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], family: str) -> "MoeConfig | None":
        """None when the checkpoint has no experts (``num_experts`` 0), as transformers
        then builds every layer dense. transformers 5 writes ``num_local_experts``."""
        experts = raw.get("num_experts", raw.get("num_local_experts"))
        if not experts:
            return None
        top_k = _required_int(raw, "num_experts_per_tok", family)
        if top_k > int(experts):
            raise ModelLoadError(f"num_experts_per_tok ({top_k}) exceeds num_experts ({experts})")
        return cls(
            num_experts=int(experts),
            top_k=top_k,
            intermediate_size=_required_int(raw, "moe_intermediate_size", family),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            sparse_step=int(raw.get("decoder_sparse_step", 1) or 1),
            dense_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
            shared_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
        )


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    dtype: str = "float32"
    # Mixture of experts (Qwen3-MoE); num_experts 0 is a dense decoder.
    moe: MoeConfig | None = None
    # Where the decoder's tensors sit in its checkpoint ("thinker." in a Qwen3-Omni
    # folder: ``thinker.model.*`` and ``thinker.lm_head.*``; the rest is not ours).
    checkpoint_prefix: str = ""

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has a sparse expert block (else a dense MLP of
        ``intermediate_size``), as transformers' Qwen3-MoE decides it."""
        return self.moe is not None and self.moe.is_sparse(layer_idx)

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type") or self.rope_scaling.get("type") or "default")

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> "ModelConfig":
        raw, prefix = _decoder_part(raw)
        family = _family_of(raw)
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"unsupported hidden_act {act!r}: only 'silu' (SwiGLU) is implemented")
        if raw.get("use_sliding_window"):
            raise ModelLoadError(
                "sliding-window attention (use_sliding_window=true) is not supported by the native backend"
            )
        layer_types = raw.get("layer_types")
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise ModelLoadError(f"unsupported layer_types {sorted(set(layer_types))}: only full_attention")

        rope_theta, rope_scaling = _rope_of(raw)
        num_heads = _required_int(raw, "num_attention_heads", family)
        hidden = _required_int(raw, "hidden_size", family)
        head_dim = raw.get("head_dim") or hidden // num_heads
        eos = raw.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (
            (int(eos),) if eos is not None else ()
        )
        if family in ("qwen2", "qwen2_moe"):
            qkv_bias, o_bias = bool(raw.get("qkv_bias", True)), False
        else:
            qkv_bias = o_bias = bool(raw.get("attention_bias", False))
        return cls(
            family=family,
            vocab_size=_required_int(raw, "vocab_size", family),
            hidden_size=hidden,
            intermediate_size=_required_int(raw, "intermediate_size", family),
            num_layers=_required_int(raw, "num_hidden_layers", family),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=family in QK_NORM_FAMILIES,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            moe=MoeConfig.from_hf(raw, family) if family in MOE_FAMILIES else None,
            checkpoint_prefix=prefix,
        )


def _required_int(raw: Mapping[str, Any], name: str, family: str) -> int:
    """A field the decoder cannot be built without, as an int; ModelLoadError naming it
    when config.json lacks it or holds something else."""
    if raw.get(name) is None:
        raise ModelLoadError(f"config.json has no {name!r}: a {family} checkpoint's config needs it")
    value = raw[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"config.json's {name!r} must be a positive integer, got {value!r}")
    return int(value)


def _decoder_part(raw: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """The text decoder's config in a composite checkpoint (:data:`COMPOSITES`) and its
    tensors' prefix; ``(raw, "")`` for a plain one."""
    for arch in raw.get("architectures") or []:
        if arch in COMPOSITES:
            path, prefix = COMPOSITES[arch]
            part: Any = raw
            for key in path:
                part = part.get(key) if isinstance(part, Mapping) else None
            if not isinstance(part, Mapping):
                raise ModelLoadError(f"config.json of {arch} has no {'.'.join(path)}")
            return {**part, "architectures": None}, prefix
    return raw, ""


def _family_of(raw: Mapping[str, Any]) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if archs:
        raise ModelLoadError(
            f"unsupported architecture {archs}: the native backend runs "
            f"{', '.join([*ARCHITECTURES, *COMPOSITES])} (the last for its text decoder)"
        )
    model_type = raw.get("model_type")
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise ModelLoadError(
        f"unsupported model_type {model_type!r}: the native backend runs "
        f"{', '.join(MODEL_TYPES)}"
    )


def _rope_of(raw: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Read rope settings from either layout: transformers 5 writes ``rope_parameters``,
    older checkpoints ``rope_theta`` and ``rope_scaling``."""
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:
        params = params["full_attention"]
    legacy = raw.get("rope_scaling")
    if legacy:  # the legacy key wins, as in transformers
        legacy = dict(legacy)
        legacy.setdefault("rope_type", legacy.get("type", "default"))
        params = {**dict(params or {}), **legacy}
    if isinstance(params, Mapping):
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling: dict[str, Any] | None = dict(params)
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = dict(raw["rope_scaling"]) if raw.get("rope_scaling") else None
    if scaling is not None:
        rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type not in ROPE_TYPES:
            raise ModelLoadError(
                f"unsupported rope scaling type {rope_type!r}: supported are {', '.join(ROPE_TYPES)}"
            )
        scaling.pop("rope_theta", None)
        scaling["rope_type"] = rope_type
        if rope_type == "default":
            scaling = None
    return theta, scaling


def read_folder_json(folder: str | Path, name: str, holder: str) -> tuple[dict[str, Any], Path]:
    """A checkpoint folder's JSON file ``name`` and its path; ModelLoadError when the folder
    has none (``holder``: what holds one, for the message) or it is not valid JSON."""
    path = Path(folder) / name
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{folder}: no {name} ({holder})") from None
    except ValueError as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
    return raw, path

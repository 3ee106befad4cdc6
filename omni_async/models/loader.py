"""Load a decoder from a Hugging Face style folder, or build the built-in ``tiny``.

A folder holds ``config.json`` and ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Every parameter must be present with its exact shape
(``lm_head.weight`` may be absent when embeddings are tied); anything else is a
:class:`~omni_async.errors.ModelLoadError`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from safetensors import safe_open

from ..errors import ModelLoadError
from ..text.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from .config import ModelConfig
from .decoder import PROJECTION, DecoderModel, rope_inv_freq
from .generation_config import with_generation_eos
from .merged import hf_named_tensors, hf_parameter_slots
from .quantized import refresh_quantized
from .random_weights import fill_random, random_weights_of
from .gguf import SMOLLM2_NAME, is_gguf_path, smollm2_path

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
TINY_NAME = "tiny"


@dataclass
class LoadedModel:
    model: DecoderModel
    config: ModelConfig
    tokenizer: Tokenizer | None
    path: str
    load_format: str
    name: str | None = None  # what the caller named when that was not a path ("smollm2")


def resolve_dtype(dtype: str | torch.dtype | None, config_dtype: str, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ModelLoadError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if dtype is None:
        # float32 on CPU: the reference-exact default; the checkpoint's own dtype elsewhere.
        dtype = "float32" if device.type == "cpu" else config_dtype
    key = str(dtype).replace("torch.", "")
    if key not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")
    return DTYPES[key]


def tiny_config() -> ModelConfig:
    """The built-in model: Llama-shaped, byte vocabulary, 4096-token context."""
    return ModelConfig(
        family="llama",
        vocab_size=ByteTokenizer.VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=ByteTokenizer.BOS,
        eos_token_ids=(ByteTokenizer.EOS,),
    )


def build_tiny(seed: int = 0) -> DecoderModel:
    """Random weights from a fixed seed, scaled so that logits are well separated
    (greedy results then do not hinge on float rounding)."""
    cfg = tiny_config()
    gen = torch.Generator().manual_seed(seed)
    model = DecoderModel(cfg)
    with torch.no_grad():
        for name, p in hf_named_tensors(model):  # HF order and shapes: the same draws as before merging
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.25)
            else:
                fan_in = p.shape[-1] if p.ndim > 1 else p.shape[0]
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
    return model


def load_model(
    path_or_name: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
    shard: Any = None,
) -> LoadedModel:
    """``shard`` (tensor parallelism, see :mod:`omni_async.backends.native.parallel.sharding`) builds the
    decoder with this rank's local shapes and slices every checkpoint tensor by name
    before it is copied; ``LoadedModel.config`` stays the full model's."""
    device = torch.device(device)
    if str(path_or_name) == TINY_NAME:
        model = build_tiny(seed)
        cfg = model.config
        torch_dtype = resolve_dtype(dtype, cfg.dtype, device)
        if shard is not None:
            full = [(n, p.detach()) for n, p in model.named_parameters()]
            model = empty_model(cfg, device, torch_dtype, shard)
            copy_named_tensors(model, sharded(shard, full), require_all=True)
        model = model.to(device=device, dtype=torch_dtype).eval()
        model.inv_freq = rope_inv_freq(cfg).to(device)  # keep RoPE frequencies in float32
        return LoadedModel(model, cfg, ByteTokenizer(), TINY_NAME, "builtin")

    if str(path_or_name) == SMOLLM2_NAME:
        return replace(load_gguf(smollm2_path(), dtype=dtype, device=device, shard=shard), name=SMOLLM2_NAME)
    if is_gguf_path(path_or_name):
        return load_gguf(Path(path_or_name), dtype=dtype, device=device, shard=shard)
    folder = Path(path_or_name)
    config_path = folder / "config.json"
    if not config_path.is_file():
        what = "no config.json in that folder" if folder.is_dir() else "no config.json (no such folder or .gguf file)"
        raise ModelLoadError(
            f"{folder}: {what}; give {TINY_NAME!r}, {SMOLLM2_NAME!r}, a Hugging Face style folder "
            "(config.json + safetensors) or a .gguf file"
        )
    raw = json.loads(config_path.read_text())
    cfg = with_generation_eos(ModelConfig.from_hf(raw), folder)
    torch_dtype = resolve_dtype(dtype, cfg.dtype, device)
    model = empty_model(cfg, device, torch_dtype, shard)
    drawn = random_weights_of(folder, raw)
    if drawn is not None:  # a benchmark's folder: weights drawn on the device (models/random_weights.py)
        fill_random(model, drawn)
    else:
        copy_named_tensors(model, sharded(shard, decoder_tensors(folder, cfg)), require_all=True)
    model.inv_freq = rope_inv_freq(cfg).to(device)  # buffers are not in checkpoints
    load_format = "random" if drawn is not None else "safetensors"
    return LoadedModel(model.eval(), cfg, load_tokenizer(folder, cfg), str(folder), load_format)


def load_gguf(path: Path, *, dtype: str | torch.dtype | None, device: torch.device, shard: Any = None) -> LoadedModel:
    """A GGUF file: config and tokenizer from its metadata, weights dequantised to ``dtype``.
    After the first start the built parameters come from the on-disk cache (gguf_cache)."""
    from .gguf_cache import load_converted

    torch_dtype = resolve_dtype(dtype, "float32", device)  # a GGUF's config dtype is float32
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    if shard is not None:  # a rank's slices: built from the file
        return convert_gguf(path, torch_dtype, device, shard)[0]

    def build(progress: Any) -> tuple[LoadedModel, Any]:
        loaded = convert_gguf(path, torch_dtype, torch.device("cpu"), None, progress)[0]
        entry = gguf_entry(loaded)
        return _to_device(loaded, device), entry

    return load_converted(path, torch_dtype, build, lambda entry: _to_device(model_from_entry(entry, str(path)), device))


def convert_gguf(path: Path, dtype: torch.dtype, device: torch.device, shard: Any = None, progress: Any = None) -> tuple[LoadedModel, Any]:
    """Read and dequantise a GGUF file into a decoder; ``progress(done, total)`` is called
    after each tensor."""
    from .gguf import GGUFFile, config_from_gguf, load_gguf_tokenizer, named_tensors

    f = GGUFFile(path)
    cfg = config_from_gguf(f)
    model = empty_model(cfg, device, dtype, shard)

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        for i, named in enumerate(named_tensors(f, cfg)):
            yield named
            if progress is not None:
                progress(i + 1, f.tensor_count)

    weights = dict(counted())
    rope_divisors = weights.pop("rope_freqs.weight", None)
    copy_named_tensors(model, sharded(shard, weights.items()), require_all=True)
    inv_freq = rope_inv_freq(cfg)
    if rope_divisors is not None:  # llama3-style per-frequency factors stored as a tensor
        inv_freq = inv_freq / rope_divisors.to(torch.float32)
    model.inv_freq = inv_freq.to(device)
    return LoadedModel(model.eval(), cfg, load_gguf_tokenizer(f, cfg), str(path), "gguf"), None


def gguf_entry(loaded: LoadedModel) -> Any:
    """What the cache keeps of a built model: its own parameters (tied ones once) and
    rotary frequencies, config and tokenizer."""
    from .gguf_cache import ConvertedGGUF

    tensors = [(name, p.detach()) for name, p in loaded.model.named_parameters()]
    return ConvertedGGUF(loaded.config, loaded.tokenizer, [*tensors, ("inv_freq", loaded.model.inv_freq)])


def model_from_entry(entry: Any, path: str) -> LoadedModel:
    """A decoder whose parameters are the entry's tensors, as they are (no copy); an entry
    that does not fit the decoder's parameters raises CorruptCacheEntry."""
    from .gguf_cache import CorruptCacheEntry

    tensors = dict(entry.tensors)
    inv_freq = tensors.pop("inv_freq", None)
    with torch.device("meta"):
        model = DecoderModel(entry.config)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    if inv_freq is None or expected != got:
        raise CorruptCacheEntry("its tensors do not fit the decoder's parameters")
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    model.inv_freq = inv_freq
    return LoadedModel(model.eval(), entry.config, entry.tokenizer, path, "gguf")


def _to_device(loaded: LoadedModel, device: torch.device) -> LoadedModel:
    if device.type != "cpu":
        loaded.model.to(device)
        loaded.model.tie_weights()
    return loaded


def empty_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, shard: Any = None) -> DecoderModel:
    """The decoder with uninitialised weights on ``device`` (a shard's local shapes and
    communicating layers when given), allocated in ``dtype`` at once: a float32 copy
    first would need twice a bf16 model's memory (Qwen3-30B-A3B: 122 GB)."""
    with torch.device("meta"):
        model = DecoderModel(shard.local_config(cfg) if shard is not None else cfg)
        if shard is not None:
            shard.prepare(model)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    return model


def sharded(shard: Any, named: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """Checkpoint tensors as this rank holds them (all of each without a shard)."""
    return named if shard is None else shard.slice_named(named)


def check_tensors(expected: Any, state: Any, folder: Path | str, what: str, prefix: str) -> None:
    """A submodule's checkpoint tensors ``state`` (names without ``prefix``) against the
    ``expected`` state dict its config makes: a ModelLoadError naming the missing,
    unexpected or misshapen ones, with their names in the checkpoint."""
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ModelLoadError(f"{folder}: {what} do not match its config: missing "
                             f"{[prefix + k for k in missing[:5]]}, unexpected {[prefix + k for k in unexpected[:5]]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ModelLoadError(f"{folder}: {prefix}{name} has shape {tuple(tensor.shape)}, "
                                 f"its config makes {tuple(expected[name].shape)}")


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights found")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{folder}: shard(s) listed in the index are missing: {missing}")
    return files


def iter_checkpoint(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def decoder_tensors(folder: Path, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The decoder's checkpoint tensors under the decoder's names: all of a plain
    checkpoint's; of a composite one (Qwen3-Omni) those under ``cfg.checkpoint_prefix``
    with it stripped, the other parts (encoders, talker, codec) not read."""
    prefix = cfg.checkpoint_prefix
    if not prefix:
        yield from iter_checkpoint(folder)
        return
    ours = (f"{prefix}model.", f"{prefix}lm_head.")
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.startswith(ours):
                    yield name[len(prefix):], f.get_tensor(name)


def load_weights(model: DecoderModel, folder: Path) -> None:
    copy_named_tensors(model, decoder_tensors(folder, model.config), require_all=True)


def copy_named_tensors(
    model: DecoderModel,
    named: "Iterator[tuple[str, torch.Tensor]] | list[tuple[str, torch.Tensor]]",
    *,
    require_all: bool,
) -> list[str]:
    """Copy checkpoint tensors into the model's parameters by Hugging Face name (merged
    projections take each part into its rows). Every name and shape is checked before
    anything is written, so a failed load leaves the model untouched."""
    params = {name: slot.view() for name, slot in hf_parameter_slots(model).items()}
    tied = model.config.tie_word_embeddings
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen: set[str] = set()
    for name, tensor in named:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if tied and name == "lm_head.weight":
            continue  # the same tensor as model.embed_tokens.weight
        if name not in params and name.startswith(PROJECTION):
            continue  # a talker's projection, attached to the stage that asks (models.conditioning)
        if name not in params:
            raise ModelLoadError(f"unexpected tensor {name!r}: the model has no such parameter")
        target = params[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
            )
        staged.append((target, tensor))
        seen.add(name)
    if require_all:
        expected = {n for n in params if not n.startswith(PROJECTION)} - ({"lm_head.weight"} if tied else set())
        missing = sorted(expected - seen)
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
    with torch.no_grad():
        for target, tensor in staged:
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
    refresh_quantized(model)  # int8 copies follow their float weights
    return sorted(seen)

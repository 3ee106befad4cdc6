"""Weight lifecycle of the native backend: updates from disk, from tensors, from a
trainer through torch.distributed, and a checksum a trainer can compare.

Every update checks all names and shapes before writing anything, so a failed update
leaves the old weights serving. Methods return ``(success, message)`` as the
reference's model worker does; they are blocking and run off the event loop.
"""

from __future__ import annotations

import io
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ...errors import ModelLoadError
from ...models.config import ModelConfig
from ...models.decoder import DecoderModel
from ...models.loader import copy_named_tensors, decoder_tensors, sharded
from ...models.checksum import weights_checksum
from ...models.merged import hf_named_tensors, hf_parameter_slots
from ..weight_groups import GroupPayloadError, group_name, parse_broadcast, parse_join

_DTYPES = {str(d).replace("torch.", ""): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


class NativeModelWorker:
    def __init__(self, model: DecoderModel, *, model_path: str, load_format: str, device: torch.device, shard: Any = None) -> None:
        self.model = model
        # Under tensor parallelism this rank's slice of each incoming tensor is copied,
        # and a new checkpoint is compared with the full model's config.
        self.shard = shard
        self.full_config: ModelConfig = shard.full_config if shard is not None else model.config
        self.model_path = model_path
        self.load_format = load_format
        self.device = device
        self._groups: dict[str, Any] = {}

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "load_format": self.load_format}

    # ------------------------------------------------------------ from disk

    def update_weights_from_disk(self, payload: dict[str, Any]) -> tuple[bool, str]:
        path = payload.get("model_path")
        if not path:
            return False, "update_weights_from_disk needs model_path"
        folder = Path(path)
        try:
            raw = json.loads((folder / "config.json").read_text())
            new_cfg = ModelConfig.from_hf(raw)
            _check_same_architecture(self.full_config, new_cfg)
            copy_named_tensors(self.model, sharded(self.shard, decoder_tensors(folder, new_cfg)), require_all=True)
        except (OSError, ValueError, ModelLoadError) as exc:
            return False, f"failed to update weights from {folder}: {exc}"
        self.model_path = str(folder)
        return True, f"loaded weights from {folder}"

    # ------------------------------------------------------------ from tensors

    def update_weights_from_tensor(self, payload: dict[str, Any]) -> tuple[bool, str]:
        named = payload.get("named_tensors")
        if named is None and payload.get("serialized_named_tensors") is not None:
            blob = payload["serialized_named_tensors"]
            named = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        if named is None:
            return False, "update_weights_from_tensor needs named_tensors (or serialized_named_tensors)"
        pairs = list(named.items()) if isinstance(named, dict) else [(str(n), t) for n, t in named]
        try:
            names = copy_named_tensors(self.model, list(sharded(self.shard, pairs)), require_all=False)
        except ModelLoadError as exc:
            return False, f"failed to update weights from tensors: {exc}"
        return True, f"updated {len(names)} tensor(s)"

    # ------------------------------------------------------------ distributed

    def init_weights_update_group(self, payload: dict[str, Any]) -> tuple[bool, str]:
        """Join a process group with a trainer (rank 0). Blocks until the trainer joins
        (or ``timeout_s`` passes): call it off the event loop."""
        import torch.distributed as dist

        try:
            join = parse_join(payload, device_type=self.device.type)
        except GroupPayloadError as exc:
            return False, str(exc)
        name, addr, port, world, rank, backend = join.name, join.master_address, join.master_port, join.world_size, join.rank_offset, join.backend
        timeout = timedelta(seconds=join.timeout_s)
        if name in self._groups:
            return False, f"weights update group {name!r} already exists"
        try:
            store = dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
            prefixed = dist.PrefixStore(name, store)
            if backend == "gloo":
                group = dist.ProcessGroupGloo(prefixed, rank, world, timeout)
            elif backend == "nccl":
                group = dist.ProcessGroupNCCL(prefixed, rank, world)
            else:
                return False, f"unsupported backend {backend!r}"
            group.barrier().wait()
        except Exception as exc:  # a missing trainer, a refused connection, a timeout
            return False, f"failed to join weights update group {name!r}: {exc}"
        self._groups[name] = (group, store, rank)
        return True, f"joined weights update group {name!r} as rank {rank} of {world} ({backend})"

    def update_weights_from_distributed(self, payload: dict[str, Any]) -> tuple[bool, str]:
        import torch.distributed as dist

        name = group_name(payload)
        if name not in self._groups:
            return False, f"no weights update group {name!r}; call init_weights_update_group first"
        group = self._groups[name][0]
        try:
            sent = parse_broadcast(payload)
        except GroupPayloadError as exc:
            return False, str(exc)
        names, dtypes, shapes = sent.names, sent.dtypes, sent.shapes
        params = {n: slot.view() for n, slot in hf_parameter_slots(self.model).items()}
        for n, shape in zip(names, shapes):
            if n not in params or self._full_shape(n, params[n]) != tuple(shape):
                return False, f"tensor {n!r} with shape {tuple(shape)} does not match the model"
        received: list[tuple[str, torch.Tensor]] = []
        try:
            for n, dt, shape in zip(names, dtypes, shapes):
                dtype = _DTYPES[dt]
                buf = torch.empty(tuple(shape), dtype=dtype, device=self.device if self.device.type == "cuda" else "cpu")
                opts = dist.BroadcastOptions()
                opts.rootRank = 0
                group.broadcast([buf], opts).wait()
                received.append((n, buf))
        except Exception as exc:
            return False, f"broadcast failed: {exc}"
        copy_named_tensors(self.model, list(sharded(self.shard, received)), require_all=False)
        return True, f"received {len(received)} tensor(s) from the trainer"

    def _full_shape(self, name: str, param: torch.Tensor) -> tuple[int, ...]:
        """The shape a trainer sends: the whole tensor (this rank keeps its slice)."""
        local = tuple(param.shape)
        return self.shard.full_shape(name, local) if self.shard is not None else local

    def destroy_weights_update_group(self, payload: dict[str, Any]) -> tuple[bool, str]:
        name = group_name(payload)
        if self._groups.pop(name, None) is None:
            return False, f"no weights update group {name!r}"
        return True, f"destroyed weights update group {name!r}"

    # ------------------------------------------------------------ checksum

    def weights_checker(self, action: str = "checksum") -> dict[str, Any]:
        if action != "checksum":
            raise ValueError(f"unsupported weights_checker action {action!r}; use 'checksum'")
        return weights_checksum(self.model)


def _check_same_architecture(old: ModelConfig, new: ModelConfig) -> None:
    fields = ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "tie_word_embeddings", "qkv_bias", "qk_norm", "moe")
    diffs = [f"{f}: {getattr(old, f)} -> {getattr(new, f)}" for f in fields if getattr(old, f) != getattr(new, f)]
    if diffs:
        raise ModelLoadError("new weights have a different architecture: " + "; ".join(diffs))

"""The SGLang stage's model worker for admin actions (the reference's ``model_worker``):
weight updates from disk, from tensors and from a trainer through a torch.distributed
group, all through SGLang's own weight updater (``ModelRunner.weight_updater``), and a
checksum a trainer can compare.

Methods return ``(success, message)`` and block; the admin layer (omni_async.stage.admin)
runs them on the forward thread between two steps. Disk and distributed updates go
through the admin lifecycle (pause, drain, refusal while requests run, radix-cache
flush); a tensor update is applied directly, as the reference does.

Checkpoint names and shapes. SGLang's models load Hugging Face checkpoint names
(``q_proj`` into a fused ``qkv_proj`` and so on), and a bad name or shape there can
fail half-way through a load. So every tensor and distributed update is first checked
against the names and shapes of the serving checkpoint (read from its safetensors
headers, no tensor data), and nothing is written unless all match: a refused update
leaves the old weights serving, as on the native backend.

Distributed group. ``init_weights_update_group`` joins the trainer through SGLang's
``init_custom_process_group`` (a ``tcp://`` rendezvous at the trainer, rank 0, then a
group named ``group_name``), so a trainer that speaks SGLang's protocol works
unchanged. SGLang 0.5.23 takes no timeout there: the join waits up to torch's default
process-group timeout, on the admin's own thread, while generation goes on.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from ..weight_groups import GroupPayloadError, group_name, parse_broadcast, parse_join


def checkpoint_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a safetensors checkpoint, from the headers."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    # A tied lm_head is absent from the checkpoint; a trainer may still send it.
    if "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    return shapes


def _named_pairs(payload: dict[str, Any]) -> list[tuple[str, torch.Tensor]] | None:
    named = payload.get("named_tensors")
    if named is None and payload.get("serialized_named_tensors") is not None:
        blob = payload["serialized_named_tensors"]
        named = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    if named is None:
        return None
    return list(named.items()) if isinstance(named, dict) else [(str(n), t) for n, t in named]


class SGLangModelWorker:
    def __init__(self, tp_worker: Any, *, model_path: str, load_format: str = "safetensors") -> None:
        self.tp_worker = tp_worker
        self.model_path = model_path
        self.load_format = load_format
        self._shapes: dict[str, tuple[int, ...]] | None = None
        self._groups: set[str] = set()

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "load_format": self.load_format}

    @property
    def _updater(self) -> Any:
        """The target model runner's weight updater (the one that joins a group)."""
        return self.tp_worker.model_runner.weight_updater

    def _runners(self) -> list[Any]:
        return [runner for _role, runner in self.tp_worker.weight_update_runners()]

    def _check(self, named: list[tuple[str, tuple[int, ...]]]) -> str | None:
        """Why these (name, shape) pairs do not fit the serving checkpoint, or None."""
        if self._shapes is None:
            self._shapes = checkpoint_shapes(self.model_path)
        if not self._shapes:  # no safetensors headers to check against: SGLang decides
            return None
        for name, shape in named:
            expected = self._shapes.get(name)
            if expected is None:
                return f"unexpected tensor {name!r}: the checkpoint has no such tensor"
            if tuple(shape) != expected:
                return f"tensor {name!r} has shape {tuple(shape)}, the model expects {expected}"
        return None

    def _load(self, load: Any) -> tuple[bool, str]:
        """One SGLang weight-update session per runner: begin, load, end."""
        success, message = True, "Success"
        for runner in self._runners():
            updater = runner.weight_updater
            updater.begin_weight_update()
            try:
                success, message = load(updater)
            finally:
                updater.end_weight_update(run_post_load=False)
            if not success:
                break
        return bool(success), str(message)

    # ------------------------------------------------------------ from disk

    def update_weights_from_disk(self, payload: dict[str, Any] | str) -> tuple[bool, str]:
        """``payload``: the admin payload (``model_path``, optional ``load_format``) or a
        path. A failed update leaves the old weights serving (SGLang rolls back)."""
        if isinstance(payload, dict):
            path, load_format = payload.get("model_path"), payload.get("load_format")
        else:
            path, load_format = payload, None
        if not path:
            return False, "update_weights_from_disk needs model_path"
        load_format = load_format or self.load_format
        success, message = True, "Succeeded to update model weights."
        try:
            for runner in self._runners():
                success, message = runner.weight_updater.update_weights_from_disk(str(path), load_format)
                if not success:
                    break
        except Exception as exc:  # a bad path or checkpoint must not take the stage down
            return False, f"update_weights_from_disk failed: {exc!r}"
        if success:
            self.model_path = str(path)
            self._shapes = None
        return bool(success), str(message)

    # ------------------------------------------------------------ from tensors

    def update_weights_from_tensor(self, payload: dict[str, Any]) -> tuple[bool, str]:
        """``named_tensors`` (pairs or a dict, checkpoint names) or
        ``serialized_named_tensors`` (``torch.save`` bytes of them); ``load_format``
        is SGLang's (None, ``"direct"``, ``"flattened_bucket"``)."""
        try:
            pairs = _named_pairs(payload)
        except Exception as exc:
            return False, f"update_weights_from_tensor: cannot read the serialized tensors: {exc!r}"
        if pairs is None:
            return False, "update_weights_from_tensor needs named_tensors (or serialized_named_tensors)"
        load_format = payload.get("load_format")
        if load_format != "flattened_bucket":
            error = self._check([(n, tuple(t.shape)) for n, t in pairs])
            if error is not None:
                return False, f"failed to update weights from tensors: {error}"
        try:
            success, message = self._load(
                lambda updater: updater.update_weights_from_tensor(named_tensors=pairs, load_format=load_format)
            )
        except Exception as exc:
            return False, f"update_weights_from_tensor failed: {exc!r}"
        return success, message if not success else f"updated {len(pairs)} tensor(s)"

    # ------------------------------------------------------------ distributed

    def init_weights_update_group(self, payload: dict[str, Any]) -> tuple[bool, str]:
        """Join the trainer's group (the trainer is rank 0). Blocks until it joins."""
        try:
            join = parse_join(payload, device_type=torch.device(self.tp_worker.device).type)
        except GroupPayloadError as exc:
            return False, str(exc)
        name = join.name
        if name in self._groups:
            return False, f"weights update group {name!r} already exists"
        success, message = self._updater.init_weights_update_group(
            join.master_address, join.master_port, join.rank_offset, join.world_size, name, backend=join.backend
        )
        if success:
            self._groups.add(name)
        return bool(success), str(message)

    def update_weights_from_distributed(self, payload: dict[str, Any]) -> tuple[bool, str]:
        """Receive the named tensors the trainer broadcasts (in ``names`` order), then
        load them through SGLang's updater."""
        name = group_name(payload)
        if name not in self._groups:
            return False, f"no weights update group {name!r}; call init_weights_update_group first"
        try:
            sent = parse_broadcast(payload)
        except GroupPayloadError as exc:
            return False, str(exc)
        names, dtypes, shapes = sent.names, sent.dtypes, sent.shapes
        if any(not isinstance(getattr(torch, d, None), torch.dtype) for d in dtypes):
            return False, f"unknown dtype in {dtypes}"
        error = self._check(list(zip(names, shapes)))
        if error is not None:
            return False, f"failed to update weights from the trainer: {error}"
        try:
            received = self._updater.receive_weights_from_distributed(
                names=names, dtypes=dtypes, shapes=[list(s) for s in shapes], group_name=name,
                load_format=payload.get("load_format"),
            )
        except Exception as exc:
            return False, f"broadcast failed: {exc!r}"
        try:
            success, message = self._load(lambda updater: updater.load_weights_from_distributed(received))
        except Exception as exc:
            return False, f"update_weights_from_distributed failed: {exc!r}"
        return success, message if not success else f"received {len(received)} tensor(s) from the trainer"

    def destroy_weights_update_group(self, payload: dict[str, Any]) -> tuple[bool, str]:
        name = group_name(payload)
        if name not in self._groups:
            return False, f"no weights update group {name!r}"
        self._groups.discard(name)
        success, message = self._updater.destroy_weights_update_group(name)
        return bool(success), str(message)

    # ------------------------------------------------------------ checksum

    def weights_checker(self, action: str = "checksum") -> dict[str, Any]:
        from ...models.checksum import weights_checksum

        if action != "checksum":
            raise ValueError(f"unsupported weights_checker action {action!r}; use 'checksum'")
        return weights_checksum(self.tp_worker.model_runner.model)

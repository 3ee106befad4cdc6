"""The admin payloads of a weight-update group (``init_weights_update_group``,
``update_weights_from_distributed``, ``destroy_weights_update_group``), read once for
both backends: the same fields, defaults and messages whichever joins the group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_GROUP = "weight_update_group"


class GroupPayloadError(ValueError):
    """A payload the action cannot run with; its message is the admin reply's."""


def group_name(payload: dict[str, Any]) -> str:
    return str(payload.get("group_name") or DEFAULT_GROUP)


@dataclass(frozen=True)
class GroupJoin:
    """Where the trainer (rank 0) waits, and this worker's place in its group."""

    name: str
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int
    backend: str
    timeout_s: float


def parse_join(payload: dict[str, Any], *, device_type: str) -> GroupJoin:
    """``init_weights_update_group``'s payload; the backend defaults to NCCL on CUDA and
    gloo elsewhere."""
    try:
        addr = str(payload["master_address"])
        port = int(payload["master_port"])
        world = int(payload["world_size"])
        rank = int(payload.get("rank_offset", 1))
    except (KeyError, TypeError, ValueError) as exc:
        raise GroupPayloadError(f"init_weights_update_group needs master_address, master_port, world_size: {exc!r}") from None
    backend = str(payload.get("backend") or ("nccl" if device_type == "cuda" else "gloo"))
    return GroupJoin(group_name(payload), addr, port, world, rank, backend, float(payload.get("timeout_s", 300)))


@dataclass(frozen=True)
class Broadcast:
    """The tensors the trainer broadcasts, in order: names, dtype names (``float32``,
    without ``torch.``) and shapes."""

    name: str
    names: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]


def parse_broadcast(payload: dict[str, Any]) -> Broadcast:
    """``update_weights_from_distributed``'s payload (names, dtypes and shapes of equal
    length, at least one)."""
    names = list(payload.get("names") or [])
    dtypes = [str(d).replace("torch.", "") for d in payload.get("dtypes") or []]
    try:
        shapes = [tuple(int(x) for x in s) for s in payload.get("shapes") or []]
    except (TypeError, ValueError):
        shapes = []
    if not names or not (len(names) == len(dtypes) == len(shapes)):
        raise GroupPayloadError("update_weights_from_distributed needs names, dtypes and shapes of equal length")
    return Broadcast(group_name(payload), names, dtypes, shapes)

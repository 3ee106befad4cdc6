"""``generation_config.json``: the end-of-sequence ids a checkpoint generates with.

Chat checkpoints often list their turn-end token there (and only there), so a model that
ignored it would run past the end of its answer.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from .config import ModelConfig


def generation_eos_ids(folder: Path) -> tuple[int, ...]:
    """``eos_token_id`` of the folder's generation_config.json (int or list), or ()."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        raw: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ()
    eos = raw.get("eos_token_id") if isinstance(raw, dict) else None
    values = eos if isinstance(eos, (list, tuple)) else [eos]
    return tuple(int(e) for e in values if isinstance(e, int) and not isinstance(e, bool))


def with_generation_eos(cfg: ModelConfig, folder: Path) -> ModelConfig:
    """config.json's EOS ids, then generation_config.json's that are not already there."""
    extra = [e for e in generation_eos_ids(folder) if e not in cfg.eos_token_ids]
    if not extra:
        return cfg
    return dataclasses.replace(cfg, eos_token_ids=(*cfg.eos_token_ids, *extra))

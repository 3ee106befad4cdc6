"""The stage's shared state: one object the stage's parts read, instead of each holding
a callback into the scheduler (the stepper asking whether generation is paused, emission
asking for the weight version)."""

from __future__ import annotations

from dataclasses import dataclass

LIFECYCLE = ("new", "running", "closing", "closed")


@dataclass
class StageState:
    """``lifecycle`` moves new -> running -> closing -> closed (the scheduler moves it);
    ``paused`` and ``pause_mode`` are set by the control API; ``weight_version`` names the
    weights results are stamped with (the admin actions update it)."""

    lifecycle: str = "new"
    paused: bool = False
    pause_mode: str | None = None
    weight_version: str | None = None

    @property
    def serving(self) -> bool:
        return self.lifecycle == "running"

    @property
    def closed(self) -> bool:
        return self.lifecycle in ("closing", "closed")

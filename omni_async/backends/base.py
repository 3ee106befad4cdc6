"""What every backend hands the engine. It sits below the registry and the backends,
so a backend never imports the dispatcher that names it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..core.plan import StagePlan
    from ..scheduler import AsyncOmniScheduler


@dataclass
class BuiltStage:
    """A backend's product: the scheduler (closing it releases everything the backend
    holds), the tokenizer if the checkpoint has one, and the backend's own stack for
    introspection, and the plan it was built to."""

    scheduler: "AsyncOmniScheduler"
    tokenizer: Any
    stack: Any
    plan: "StagePlan | None" = None

"""What the route modules need of the OpenAI server (``app.OpenAIServer``): its engine,
the name it serves, the model check and the chat renderer. The tokenize and worker
routes type against this, so they never import the app that mounts them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from fastapi.responses import JSONResponse

if TYPE_CHECKING:
    from ..engine import Engine
    from .chat_messages import ChatMessage


class ServedModel(Protocol):
    """The server as a route module sees it."""

    engine: Engine
    model_name: str

    def check_model(self, model: str) -> JSONResponse | None:
        """A 404 body when ``model`` is not the one served, else None."""
        ...

    def render(
        self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None, *, add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt ids of a conversation (tools included)."""
        ...

"""The OpenAI-compatible HTTP server (the serve extra: ``pip install -e '.[serve]'`` in the checkout,
or ``bash scripts/setup.sh``).

``create_app(engine)`` gives the ASGI app; ``serve(engine, host=..., port=...)`` runs it
on uvicorn; ``running_server(engine)`` serves for the length of an ``async with`` block.
The command line is ``omni-async serve``.
"""

from __future__ import annotations

from .app import OpenAIServer, create_app, default_model_name
from ..serving.listen import listening_socket
from .run import running_server, serve

__all__ = ["OpenAIServer", "create_app", "default_model_name", "listening_socket", "running_server", "serve"]

"""The pytest plugin (entry point ``pytest11``: loaded wherever omni-async is installed).

Fixtures:

- ``omni_engine``: a started Engine on the built-in ``tiny`` model, closed after the
  test (an async fixture: it runs in the loop pytest-asyncio gives the test).
- ``omni_engine_factory``: ``await make(model="tiny", **engine_kwargs)`` for engines with
  other settings or on a checkpoint; each is closed after the test.
- ``omni_checkpoint``: a folder (session scope) holding a small random Llama checkpoint
  written with safetensors, with a byte-level ``tokenizer.json`` and a chat template.
- ``omni_session_engine``: one engine for the whole session, serving on an event loop of
  its own in a background thread, so tests on any loop (function, module or session
  scoped) can use it: calls from another running loop are marshalled onto its loop.

Nothing heavy is imported until a fixture is used, so the plugin costs nothing in
projects that do not use it. Async fixtures need pytest-asyncio.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Iterator

import pytest

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["BackgroundEngine", "assert_kv_free", "write_random_checkpoint"]


def assert_kv_free(engine: "Engine") -> None:
    """Fail if ``engine`` still holds KV pages (call when no request is open)."""
    info = engine.scheduler.info()
    used = info["kv_total_pages"] - info["kv_free_pages"]
    assert used == 0, f"KV leak: {used} pages still in use (open requests: {engine.open_requests})"


# ---------------------------------------------------------------- random checkpoint


def _write_tokenizer(folder: Path, bos: int, eos: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    from .text.byte_level import byte_alphabet
    from .text.tokenizer import BYTE_CHAT_TEMPLATE

    vocab = {ch: b for b, ch in byte_alphabet().items()}
    vocab.update({"<s>": bos, "</s>": eos})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": BYTE_CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def write_random_checkpoint(folder: str | Path, *, seed: int = 0, tokenizer: bool = True) -> Path:
    """A Hugging Face style Llama folder (``config.json``, ``model.safetensors``, and with
    ``tokenizer`` a byte-level ``tokenizer.json``) with the shapes of ``tiny`` and random
    weights from ``seed``. Loadable by ``Engine.from_pretrained`` and by transformers."""
    from safetensors.torch import save_file

    from .models.loader import build_tiny, tiny_config
    from .models.merged import hf_named_tensors

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config()
    model = build_tiny(seed)
    tensors = {n: p.detach().contiguous() for n, p in hf_named_tensors(model) if n != "lm_head.weight"}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids),
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer:
        _write_tokenizer(folder, cfg.bos_token_id, cfg.eos_token_ids[0])
    return folder


# ---------------------------------------------------------------- an engine on its own loop


class BackgroundEngine:
    """An Engine serving on an event loop in a daemon thread: usable from any other
    loop (each call is marshalled onto the engine's loop), and so from tests whatever
    their loop scope. ``close()`` ends it."""

    def __init__(self, model: str = "tiny", **engine_kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="omni-async-test-engine", daemon=True)
        self._thread.start()
        self.engine: "Engine" = self._call(self._start(model, engine_kwargs))

    @staticmethod
    async def _start(model: str, kwargs: dict[str, Any]) -> "Engine":
        from .engine import Engine

        kwargs.setdefault("loop", "normal")
        engine = await Engine.load(model, **kwargs)
        await engine.start()
        return engine

    def _call(self, coro: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()  # type: ignore[arg-type]

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._call(self.engine.aclose())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._loop.close()


@pytest.fixture(scope="session")
def omni_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama checkpoint folder, written once per session."""
    return write_random_checkpoint(tmp_path_factory.mktemp("omni-checkpoint") / "tiny-llama")


@pytest.fixture(scope="session")
def omni_session_engine() -> Iterator["Engine"]:
    """One ``tiny`` engine for the session, on its own loop (see BackgroundEngine)."""
    background = BackgroundEngine("tiny")
    try:
        yield background.engine
    finally:
        background.close()


try:
    import pytest_asyncio
except ImportError:  # pragma: no cover - the async fixtures need pytest-asyncio
    pytest_asyncio = None

if pytest_asyncio is not None:

    @pytest_asyncio.fixture
    async def omni_engine_factory() -> AsyncIterator[Callable[..., Awaitable["Engine"]]]:
        """``await make(model="tiny", **engine_kwargs)``: started engines, closed after the test."""
        from .engine import Engine

        made: list[Engine] = []

        async def make(model: str = "tiny", **kwargs: Any) -> Engine:
            kwargs.setdefault("loop", "normal")
            engine = await Engine.load(str(model), **kwargs)
            made.append(engine)
            await engine.start()
            return engine

        try:
            yield make
        finally:
            for engine in made:
                await engine.aclose()

    @pytest_asyncio.fixture
    async def omni_engine(omni_engine_factory: Callable[..., Awaitable["Engine"]]) -> "Engine":
        """A started engine on the built-in ``tiny`` model (loop="normal")."""
        return await omni_engine_factory("tiny")

